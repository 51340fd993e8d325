"""What the commands check before Spark starts: its JVM takes 13-16 s to come up, and an error
found without it (a missing corpus, a used ``--out``, an unreadable checkpoint, a resume under
another configuration) is reported in well under a second.

Only local paths (as Hadoop would resolve them: :func:`rnnlm.spark.hfs.resolve`), outside
``spark-submit``, are checked here; any other path is checked by the same code once Spark runs.
"""
from __future__ import annotations

import glob
import os

from .. import config
from ..core import checkpoint
from ..core.files import LocalFS
from ..spark import corpus
from ..spark.hfs import default_fs, resolve
from ..spark.rundir import RunDir, check_resume
from ..spark.trainer import check_config

DATA_KEYS = ("train", "valid", "test")


def _local(path: str) -> str | None:
    """``path`` on the local disk when Hadoop would read it there (see :func:`resolve`), else None.

    Under ``spark-submit`` the JVM already runs (nothing to gain) and its Hadoop configuration may
    not be the one ``$HADOOP_CONF_DIR`` names here (a YARN container's): every path is left to it.
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
            raise corpus.CorpusError(f"input path does not exist: {local}")
    return config.replace(cfg, "data", **changes) if changes else cfg


def check_train(cfg: config.Config, config_path: str | None, out: str, resume: bool = False,
                overwrite: bool = False, dry_run: bool = False, log=print) -> config.Config:
    """``cfg`` ready to train (see :func:`locate_data`) after the trainer's own checks of the
    configuration and, unless ``dry_run``, of a local ``--out`` against ``--resume``/``--overwrite``:
    a resumed checkpoint must be readable and of the same experiment."""
    check_config(cfg)
    cfg = locate_data(cfg, config_path, log)
    for key in DATA_KEYS:
        check_records(getattr(cfg.data, key), cfg.data, f"data.{key}")
    local_out = _local(out)
    if dry_run or local_out is None or overwrite:
        return cfg
    run_dir = RunDir(out if "://" not in out and not out.startswith("file:") else local_out, fs=LocalFS())
    run_dir.prepare(resume)
    if resume:
        check_resume(cfg, checkpoint.load(local_out, resume=True).config, run_dir.ck_path)
    return cfg


def check_checkpoint(path: str) -> checkpoint.Checkpoint | None:
    """The checkpoint at a local ``path`` (a checkpoint or run directory), loaded and verified;
    None when ``path`` is not local."""
    local = _local(path)
    return checkpoint.load(local) if local is not None else None


def check_records(path: str, data: config.DataConfig, what: str) -> None:
    """A local corpus must hold no record (line or paragraph, as ``data`` reads it) longer than
    ``data.max_record_mb`` (:func:`rnnlm.spark.corpus.check_local_records`)."""
    local = _local(path) if path else None
    if local is not None:
        corpus.check_local_records(local, data.paragraphs, data.max_record_mb, what)


def check_input(path: str, what: str) -> None:
    """A local input path must match a file."""
    local = _local(path)
    if local is not None and not _matches(local):
        raise corpus.CorpusError(f"{what}: input path does not exist: {local}")
