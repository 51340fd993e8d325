"""What the commands check before Spark starts: its JVM takes 13-16 s to come up, and an error
found without it (a missing corpus, a used ``--out``, an unreadable checkpoint, a resume under
another configuration) is reported in well under a second.

Only local paths (as Hadoop would resolve them: :func:`rnnlm.spark.hfs.resolve`), outside
``spark-submit``, are checked here; any other path is checked by the same code once Spark runs.
"""
from __future__ import annotations

import glob
import os
import posixpath
import shutil
import sys
import tempfile
import urllib.parse

from .. import config
from ..core import checkpoint
from ..core.schedule import early_stop
from ..core.files import LocalFS
from ..download import CORPORA
from ..spark import scan
from ..spark.hfs import default_fs, resolve
from ..spark.rundir import (Init, RunDir, TrainingError, async_finished, best_record, check_init, check_kept,
                            check_longer, check_out, check_resume, resume_keys)
from ..spark.session import is_local_master, plain_master

DATA_KEYS = ("train", "valid", "test")
GPU_EXTRA = 'pip install "rnnlm[gpu]"'


def _local(path: str) -> str | None:
    """``path`` on the local disk when Hadoop would read it there (see :func:`resolve`), else None.

    Under ``spark-submit`` the JVM already runs (nothing to gain) and its Hadoop configuration may
    not be the one ``$HADOOP_CONF_DIR`` names here (a YARN container's): every path is left to it
    (the corpus' reader scans the files it finds on the local disk: :func:`rnnlm.spark.reader.paragraphs`).
    """
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        return None
    is_local, local = resolve(path, default_fs())
    return local if is_local else None


def _matches(local: str) -> bool:
    # Hadoop's globs are Python's plus {a,b}: a path using those is left to Hadoop
    if "{" in local:
        return True
    return bool(glob.glob(local)) if glob.has_magic(local) else os.path.exists(local)


def project_root(config_path: str) -> str | None:
    """The checkout a config file belongs to: the parent of the ``conf/`` directory holding it."""
    d = os.path.dirname(os.path.abspath(config_path))
    return os.path.dirname(d) if os.path.basename(d) == "conf" else None


def locate_data(cfg: config.Config, config_path: str | None, log=print, strict: bool = True) -> config.Config:
    """``cfg`` with its relative local data paths that are missing from the working directory
    read from the config's checkout instead (``conf/demo.toml`` names ``rnnlm/data/harbour.txt``),
    saying so; then every local data path must match a file.

    Raises
    ------
    CorpusError
        A local path that matches nothing from either place (unless not ``strict``: then the
        reader reports it).
    """
    root = project_root(config_path) if config_path else None
    changes = {}
    for key in DATA_KEYS:
        path = getattr(cfg.data, key)
        local = _local(path) if path else None
        if local is None or _matches(local):
            continue
        if root and not os.path.isabs(path) and "://" not in path and _matches(os.path.join(root, path)):
            changes[key] = os.path.join(root, path)
            log(f"data.{key}: {changes[key]} ({path} in {root}, the config's checkout; "
                f"not in the working directory)")
            continue
        if strict:
            where = f" (nor in {root}, the config's checkout)" if root and not os.path.isabs(path) else ""
            fetch = next((f": `rnnlm download {name}` fetches it into data/" for name in CORPORA
                          if os.path.basename(local).startswith(name)), "")
            raise scan.CorpusError(f"data.{key}: input path does not exist: {local}{where}{fetch}")
    return config.replace(cfg, "data", **changes) if changes else cfg


def check_train(cfg: config.Config, config_path: str | None, out: str, resume: bool, overwrite: bool,
                dry_run: bool, log=print) -> config.Config:
    """``cfg`` ready to train (see :func:`locate_data`) after the trainer's own checks of the
    configuration and, unless ``dry_run``, of a local ``--out`` against ``--resume``/``--overwrite``:
    a resumed checkpoint must be readable and of the same experiment."""
    config.check_trainable(cfg)
    check_out(out)
    cfg = locate_data(cfg, config_path, log)
    for key in DATA_KEYS:
        check_records(getattr(cfg.data, key), cfg.data, f"data.{key}")
    local_out = _local(out)
    if dry_run or local_out is None:
        return cfg
    _check_writable(out, local_out)
    if overwrite:
        return cfg
    run_dir = _run_dir(out, local_out)
    run_dir.prepare(resume)
    if resume:
        ck = checkpoint.load(local_out, resume=True)
        check_resume(cfg, ck.config, run_dir.ck_path, resume_keys(cfg))
        at = ck.position.get("round")
        if cfg.train.rounds and type(at) is int:        # a longer run's length known without the corpus
            check_longer(cfg, at, cfg.train.rounds, run_dir.saved_lines() or [], best_record(ck.position.get("best")),
                         run_dir.ck_path)
    return cfg


def _check_writable(out: str, local_out: str) -> None:
    """A local ``--out`` the run can write in: a directory, or one its nearest existing parent lets
    it make (found after Spark and the corpus, it was a traceback). Tried, not asked of ``os.access``,
    which says yes to root everywhere (``/proc``, a read-only mount)."""
    path = local_out
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise TrainingError(f"--out {out}: {path} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rnnlm-writable-", dir=path))
    except OSError as e:
        raise TrainingError(f"--out {out}: {path} is not writable ({e.strerror or e})") from None


def check_demo_out(out: str) -> None:
    """``demo --out``: a new path, or a checkpoint (which the demo replaces); anything else there (a run's
    directory, a folder of the user's, a file, a link) is refused, not deleted, before training."""
    if not out.strip():
        raise TrainingError("--out is empty: name the checkpoint directory to write")
    path = os.path.abspath(out)
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(os.path.join(path, checkpoint.MANIFEST))):
        raise TrainingError(f"--out {out}: exists and is not a checkpoint; the demo replaces only a checkpoint "
                            "(name a new directory)")
    run = os.path.dirname(path.rstrip(os.sep))
    if os.path.lexists(path) and any(os.path.lexists(os.path.join(run, f)) for f in ("metrics.jsonl", "run.json")):
        raise TrainingError(f"--out {out}: the checkpoint of the run in {run}, which its --resume reads; the demo "
                            "replaces only a checkpoint of its own (name a new directory)")
    _check_writable(out, path)


def _run_dir(out: str, local_out: str) -> RunDir:
    """The run directory ``out`` on the local disk, named as given (a URI by its local path)."""
    return RunDir(out if "://" not in out and not out.startswith("file:") else local_out, fs=LocalFS())


def finished_run(cfg: config.Config, out: str, resume: bool, overwrite: bool) -> str | None:
    """The run directory of a local ``--out`` being resumed whose run is already at ``train.rounds``, or
    that ``train.patience`` ended early (so ``nothing to do`` is known without Spark), else None; a length
    in ``train.epochs`` needs the corpus' size, counted by Spark."""
    t = cfg.train
    local_out = _local(out) if resume and not overwrite and (t.rounds or t.patience) else None
    if local_out is None:
        return None
    pos = checkpoint.load(local_out).position
    if t.mode == "async":
        return _run_dir(out, local_out).out if t.rounds and async_finished(pos, t.rounds) else None
    at = pos.get("round")
    finished = type(at) is int and ((t.rounds and at >= t.rounds)
                                    or early_stop(t, at, best_record(pos.get("best"))) is not None)
    return _run_dir(out, local_out).out if finished else None


def check_device(cfg: config.Config, master: str | None, what: str = "train.device") -> None:
    """``train.device = "gpu"`` where this machine has no CuPy or no CUDA device fails here when every
    executor runs on it in this Python: a local master (``local``, ``local[N]``, ``local-cluster[...]``)
    outside ``spark-submit``, with ``$PYSPARK_PYTHON`` unset or this interpreter. A cluster's
    executors may have GPUs (and CuPy) the driver lacks: they check for themselves."""
    if cfg.train.device != "gpu" or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    master = plain_master(master)
    worker = os.environ.get("PYSPARK_PYTHON")
    # paths as given, not resolved: two virtual environments link to one interpreter with other packages
    if not is_local_master(master) or (worker and os.path.abspath(shutil.which(worker) or worker)
                                       != os.path.abspath(sys.executable)):
        return
    from ..core import backend
    if not backend.gpu_available():
        flag = what.startswith("--")             # the command line's option, or the configuration's key
        said, instead = ((f"{what} gpu", f"{what} cpu or auto") if flag else
                         (f"{what} = 'gpu'", f"{what} = 'cpu' or 'auto'"))
        raise config.ConfigError(f"{said} but this machine has no CuPy or no CUDA device, and the "
                                 f"master {master} runs every executor here: {GPU_EXTRA} on a machine with an "
                                 f"NVIDIA GPU, or {instead}")


def check_init_from(cfg: config.Config, path: str, keep_optimizer: bool) -> Init | None:
    """``--init-from``'s checkpoint (a run directory: its last; ``RUN/best``; a checkpoint) when it
    is local, loaded, verified and checked against ``cfg`` (:func:`rnnlm.spark.rundir.check_init`);
    None for any other Hadoop path, read once Spark runs."""
    local = _local(path)
    if local is None:
        return None
    return checked_init(checkpoint.load(local), cfg, path, keep_optimizer)


def check_init_outside(init_from: str, out: str) -> None:
    """``--init-from`` in what ``--overwrite`` deletes of ``--out`` (its ``checkpoint/`` and ``best/``; the run
    directory itself names its checkpoint) is refused: the run would delete the checkpoint it starts from, and its
    run.json name that as its origin. The paths are compared as given, on one filesystem (a scheme-less one is
    resolved alike, under spark-submit too); symbolic links on the local disk are followed."""
    def parts(p: str) -> tuple:
        u = urllib.parse.urlsplit(p)
        if u.scheme == "file":                  # file:/x is the plain /x
            return "", "", os.path.realpath(u.path)
        if len(u.scheme) > 1:                   # hdfs://nn/x (a one-letter scheme would be a Windows drive)
            return u.scheme, u.netloc, posixpath.normpath(u.path or "/")
        return "", "", os.path.realpath(p)
    (*src_fs, path), (*dst_fs, run) = parts(init_from), parts(out)
    if src_fs != dst_fs:
        return
    deleted = (run, posixpath.join(run, "checkpoint"), posixpath.join(run, "best"))
    if path == run or any(path == d or path.startswith(d.rstrip("/") + "/") for d in deleted[1:]):
        raise config.ConfigError(f"--init-from {init_from} lies in what --overwrite deletes of --out {out}: copy "
                                 "the checkpoint elsewhere first, or write the new run to another --out")


def checked_init(ck: checkpoint.Checkpoint, cfg: config.Config, path: str, keep_optimizer: bool) -> Init:
    """``--init-from``'s checkpoint ``ck``, read from ``path``, checked against ``cfg`` (its vocabulary's
    level and its shape, and with ``keep_optimizer`` the state the run reads) before the corpus is read."""
    check_init(cfg, ck.config, path, keep_optimizer)
    if keep_optimizer:
        check_kept(cfg, ck, path)
    return Init(ck, path, keep_optimizer)


def load_checkpoint(path: str) -> checkpoint.Checkpoint:
    """A checkpoint or run directory: a local one with plain Python, any other Hadoop path
    (``hdfs://``, or a scheme-less path while Hadoop's configuration names another default
    filesystem) through Hadoop's client in a local Spark JVM."""
    is_local, local = resolve(path, default_fs())
    if is_local:
        return checkpoint.load(local)
    from .session import read_checkpoint, spark_session
    with spark_session("rnnlm-read-checkpoint", "local[1]", ui=False) as spark:
        return read_checkpoint(spark.sparkContext, path)


def check_checkpoint(path: str) -> checkpoint.Checkpoint | None:
    """The checkpoint at a local ``path`` (a checkpoint or run directory), loaded and verified;
    None when ``path`` is not local."""
    local = _local(path)
    return checkpoint.load(local) if local is not None else None


def check_records(path: str, data: config.DataConfig, what: str) -> None:
    """A local corpus must hold text, no subdirectory (:func:`rnnlm.spark.scan.check_local_input`) and
    no record (line or paragraph, as ``data`` reads it) longer than ``data.max_record_mb``
    (:func:`rnnlm.spark.scan.check_local_records`)."""
    local = _local(path) if path else None
    if local is not None:
        scan.check_local_input(local, what)
        scan.check_local_records(local, data.paragraphs, data.max_record_mb, what)


def check_input(path: str, what: str) -> None:
    """A local input path must match a file."""
    local = _local(path)
    if local is not None and not _matches(local):
        raise scan.CorpusError(f"{what}: input path does not exist: {local}")
