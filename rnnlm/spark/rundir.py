"""A run's output directory, shared by both drivers (the synchronous :mod:`.trainer` and the
parameter server's :mod:`.async_trainer`): its paths, ``run.json``, the resume checks, the
metrics file and the checkpoints, each written so that a crash leaves the old or the new.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass

from .. import config
from ..core import checkpoint
from ..core.metrics import MAX_METRICS, json_table, number
from ..core.optim import make_optimizer
from ..exchange.round import StateKeys
from . import runinfo
from .hfs import HadoopFS, default_fs, read_checkpoint, resolve

# a change in any of these makes a resumed run a different experiment (train.results: direct merges in
# partition order, treeAggregate in its tree's); the other keys (the run's length train.rounds or
# train.epochs, train.eval_every, checkpoint_every, checkpoint_s, rebase_every, rebase_fraction, where a
# server listens and when it checkpoints) change when work runs, never the numbers (see resume_keys for
# the exceptions), and train.device the hardware, whose rounding may differ as another machine's may
RESUME_KEYS = {"data": None, "model": None, "optim": None, "exchange": None,
               "train": ("mode", "seed", "bptt", "batch", "grad_norm", "local_steps", "tree_depth", "results",
                         "outer", "outer_lr", "outer_momentum", "optim_state", "overlap", "eager")}
# an async run's: its pushes' size and how the server applies them as well
ASYNC_RESUME_KEYS = dict(RESUME_KEYS, train=RESUME_KEYS["train"] + ("push_every",),
                         server=("update", "staleness", "lock"))
# the model keys that shape its parameters (--init-from needs them equal; ffnn alone reads model.context)
SHAPE_KEYS = ("cell", "context", "embed", "hidden", "layers", "biases", "dtype")


BEST = "best"      # <out>/best: the checkpoint of the lowest validation loss


class TrainingError(RuntimeError):
    """Training stopped (non-finite loss, incompatible resume); the message is one line."""


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # rnnlm's checkout
# never compared: the corpus' choice (data.max_record_mb is compared: a run started before the records Hadoop skips
# were refused may have trained without one, and another limit would read another corpus)
UNCOMPARED = {("model", "vocab_size")}


def same_data(mine: str, theirs: str) -> bool:
    """Two names of a run's ``data.train`` (``valid``, ``test``) that read the same: equal, or local
    paths of one file. A run started in its checkout reads ``rnnlm/data/harbour.txt``; resumed from
    another directory, the command line finds that name in the config's checkout and reads the same
    file by its absolute path, and the other way round. A saved relative name is the file it names
    from here, or where it names none, from this checkout (where ``conf/``'s relative paths are found)."""
    if mine == theirs:
        return True
    fs = default_fs()
    names = [resolve(p, fs) if p else (False, p) for p in (mine, theirs)]
    if not all(local for local, _ in names):
        return False
    (_, here), (_, there) = names
    if not os.path.exists(there) and not os.path.isabs(theirs) and "://" not in theirs:
        there = os.path.join(CHECKOUT, theirs)
    return os.path.exists(here) and os.path.exists(there) and os.path.samefile(here, there)


def _difference(cfg: config.Config, saved: config.Config, keys: dict) -> tuple | None:
    """The first ``(section, key, here, there)`` of ``keys`` (section -> names, None for the whole
    section; never :data:`UNCOMPARED`) that differs between the two (data paths by :func:`same_data`),
    else None."""
    mine, theirs = cfg.to_dict(), saved.to_dict()
    for sec, names in keys.items():
        for k in (names or mine[sec].keys()):
            a, b = mine[sec][k], theirs[sec][k]
            if (sec, k) in UNCOMPARED or a == b or (sec == "data" and k in ("train", "valid", "test")
                                                    and same_data(a, b)):
                continue
            return sec, k, a, b
    return None


def check_resume(cfg: config.Config, saved: config.Config, where: str, keys: dict = RESUME_KEYS) -> None:
    """Refuse to resume the run saved with ``saved`` under ``cfg`` when a key that makes it another
    experiment differs (``keys``: section -> names, None for the whole section; see :func:`resume_keys`)."""
    found = _difference(cfg, saved, keys)
    if found:
        sec, k, mine, theirs = found
        raise TrainingError(f"cannot resume: {sec}.{k} is {mine!r} here but {theirs!r} in {where}")


def resume_keys(cfg: config.Config) -> dict:
    """The keys a resume of ``cfg``'s run must keep (section -> names, None for the whole section):
    :data:`RESUME_KEYS` or :data:`ASYNC_RESUME_KEYS`, and where they change the numbers as well,
    ``train.eval_every`` under a plateau schedule (it steps at each evaluation) and, with AdaGrad on
    the server, its ``lr`` and ``eps``."""
    keys = dict(ASYNC_RESUME_KEYS if cfg.train.mode == "async" else RESUME_KEYS)
    if cfg.optim.schedule == "plateau":
        keys["train"] = keys["train"] + ("eval_every",)
    if cfg.train.mode == "async" and cfg.server.update == "adagrad":
        keys["server"] = keys["server"] + ("lr", "eps")
    return keys


def check_longer(cfg: config.Config, at: int, rounds: int, lines: list, best: dict | None, where: str) -> None:
    """Refuse to train a run checkpointed at round ``at`` on to ``rounds`` when its end changed what
    the longer run computes: a plateau schedule that stepped on the evaluation ending the run off
    ``train.eval_every``'s cadence (the longer run makes no evaluation there). Its metrics line at
    ``at`` (or ``best``, its checkpoint's best round) tells whether it evaluated there; a run
    stopped by a signal or a crash did not."""
    every = cfg.train.eval_every
    if rounds <= at or cfg.optim.schedule != "plateau" or (every and at % every == 0):
        return
    line = next((m for m in lines if m.get("round") == at), {})
    if "valid_loss" in line or (best or {}).get("round") == at:
        cadence = f"every {every} rounds" if every else "only at the end (train.eval_every = 0)"
        raise TrainingError(f"cannot resume to {rounds} rounds: optim.schedule = 'plateau' stepped on the "
                            f"evaluation that ended the run at round {at} in {where}, which a run of {rounds} "
                            f"rounds, evaluating {cadence}, does not make; start a new run from its weights "
                            "with --init-from")


def check_init(cfg: config.Config, saved: config.Config, where: str, keep_optimizer: bool = False) -> None:
    """Refuse to start a run of ``cfg`` from the weights of a checkpoint saved with ``saved``
    (``--init-from``) when its vocabulary's level or its parameters' shape differ (the first key
    that does is named), or, with ``keep_optimizer``, when its optimizer state would not mean
    the same here."""
    shape = SHAPE_KEYS if cfg.model.cell == "ffnn" else tuple(k for k in SHAPE_KEYS if k != "context")
    found = _difference(cfg, saved, {"data": ("level",), "model": shape})
    if found:
        sec, k, mine, theirs = found
        raise TrainingError(f"cannot start from {where}: {sec}.{k} is {mine!r} here but {theirs!r} there")
    if not keep_optimizer:
        return
    keys = {"train": ("mode", "optim_state", "outer"), "optim": ("name",)}
    if cfg.train.optim_state == "local":          # one state per partition
        keys["data"] = ("partitions",)
    if cfg.train.mode == "async":                 # the server's AdaGrad accumulator
        keys["server"] = ("update",)
    found = _difference(cfg, saved, keys)
    if found:
        sec, k, mine, theirs = found
        raise TrainingError(f"--keep-optimizer: {sec}.{k} is {mine!r} here but {theirs!r} in {where}, whose "
                            "optimizer state would not mean the same here (without --keep-optimizer: fresh state)")


def check_kept(cfg: config.Config, ck: checkpoint.Checkpoint, where: str) -> None:
    """With ``--keep-optimizer``: refuse a checkpoint that lacks the optimizer state a run of ``cfg``
    reads (a single-process trainer's holds one state whatever its configuration's
    ``train.optim_state`` says), which the run would otherwise start fresh while saying it kept it,
    or that holds optimizer state the run would not read (the same single-process state under
    ``train.optim_state = "reset"``), which it would drop while saying it kept it."""
    if cfg.train.mode == "async":
        need = ["server.acc"] if cfg.server.update == "adagrad" else []
    else:
        slots = list(make_optimizer(cfg.optim).slots)
        need = ([f"p{pid}/{s}" for pid in range(cfg.data.partitions) for s in slots]
                if cfg.train.optim_state == "local" else slots if cfg.train.optim_state == "average" else [])
        if cfg.train.outer != "average":                       # momentum's velocity ("auto" is resolved)
            need.append("outer.velocity")
    missing = [k for k in need if k not in ck.optim]
    if missing:
        raise TrainingError(f"--keep-optimizer: {where} holds no {missing[0]} ({len(missing)} of the {len(need)} "
                            "arrays of optimizer state this run reads); without --keep-optimizer it starts fresh")
    # what a partition held between rounds and the executors' view are its run's, never a new run's
    unread = sorted(k for k in ck.optim if k not in need and k != StateKeys.VIEW and StateKeys.held(k) is None)
    if unread:
        reads = (f"server.update = {cfg.server.update!r}" if cfg.train.mode == "async"
                 else f"train.optim_state = {cfg.train.optim_state!r}")
        raise TrainingError(f"--keep-optimizer: {where} holds optimizer state {unread[0]!r:.60} that this run would "
                            f"not read ({reads}); without --keep-optimizer it starts fresh")


@dataclass(frozen=True)
class Init:
    """Where a new run's weights come from (``--init-from``): a checkpoint already read (its path
    as given), and whether its optimizer state comes too. Its vocabulary is the new run's."""

    checkpoint: checkpoint.Checkpoint
    path: str
    keep_optimizer: bool = False

    def record(self) -> dict:
        """``run.json``'s ``init_from``."""
        return {"path": self.path, "round": self.checkpoint.position.get("round"),
                "optimizer": "kept" if self.keep_optimizer else "fresh"}

    def line(self) -> str:
        """The log line saying so."""
        r = self.checkpoint.position.get("round")
        return (f"initialised from {self.path} (round {r} of its run; its vocabulary of {len(self.checkpoint.vocab)} "
                f"tokens; optimizer state {'kept' if self.keep_optimizer else 'fresh'})")


def best_record(saved) -> dict | None:
    """A checkpoint's record of its run's best round, or None (none yet, or a checkpoint from before
    ``best/``: the next evaluation then starts the record again)."""
    loss = number(saved.get("valid_loss")) if isinstance(saved, dict) else None      # NaN would beat nothing again
    if loss is not None and type(saved.get("round")) is int:
        return {"round": saved["round"], "valid_loss": loss}
    return None


def async_finished(position: dict, windows: int) -> bool:
    """Whether an async checkpoint's run is over: every partition's ``windows`` applied and its line the run's
    last (a checkpoint by pushes can hold every window with the last line, which evaluates, still to
    write; a checkpoint without a line predates them)."""
    line = position.get("line")
    done = position.get("done")
    return (isinstance(done, list) and bool(done) and all(type(d) is int and d >= windows for d in done)
            and (line is None or "windows_lost" in line))


def devices_line(devices: dict, wanted: str) -> str:
    """Where the partitions compute, as the probe found (``train.device`` is ``wanted``), e.g.
    ``devices: cpu x 2 (Spark assigned gpu 0, 1; no CUDA device: auto runs on the CPU)``; empty for
    ``cpu`` without GPUs assigned (nothing to say)."""
    ran = [d["ran"] for _, d in sorted(devices.items())]
    if wanted == "cpu" and not any(d["assigned"] for d in devices.values()):
        return ""
    line = "devices: " + ", ".join(f"{r} x {ran.count(r)}" for r in sorted(set(ran)))
    assigned = sorted({a for d in devices.values() for a in d["assigned"]}, key=lambda a: (len(a), a))
    notes = [f"Spark assigned gpu {', '.join(assigned)}"] if assigned else []
    if wanted == "auto" and "cpu" in ran:
        notes.append("no CUDA device: auto runs on the CPU")
    return line + (f" ({'; '.join(notes)})" if notes else "")


def arithmetic_notes(devices: dict, before=None) -> list:
    """What a run's numbers rest on besides its seed and configuration, where it matters: partitions
    whose probes found different arithmetic (``arithmetic``: :func:`rnnlm.core.backend.arithmetic`, the
    BLAS with its kernels and threads and NumPy's SIMD code, or the GPU and CUDA), and a resume onto
    other arithmetic than ``before`` (the partitions' devices as ``run.json`` recorded them at the run's
    last start)."""
    now = {str(pid): d["arithmetic"] for pid, d in devices.items() if d.get("arithmetic")}
    notes, kinds = [], sorted(set(now.values()))
    if len(kinds) > 1:
        where = "; ".join(f"{k} on {sum(v == k for v in now.values())}" for k in kinds)
        notes.append(f"note: the partitions compute with different arithmetic ({where}): a task Spark runs again "
                     "on an executor of another kind computes other numbers than its first try (executors of one "
                     "kind reproduce a run: spark.executorEnv.OPENBLAS_CORETYPE and NPY_DISABLE_CPU_FEATURES can "
                     "make them one)")
    before = before if isinstance(before, dict) else {}
    was = {p: d.get("arithmetic") for p, d in before.items() if isinstance(d, dict)}
    changed = [(p, v) for p, v in sorted(now.items(), key=lambda kv: int(kv[0]))
               if isinstance(was.get(p), str) and was[p] != v]
    if changed:
        p, v = changed[0]
        more = f"; {len(changed) - 1} more partition{'s' if len(changed) > 2 else ''}" if len(changed) > 1 else ""
        notes.append(f"note: this run resumes on other arithmetic than it last ran on (partition {p}: {v}, was "
                     f"{_changed_words(was[p], v)}{more}): its numbers from here may differ from an uninterrupted "
                     "run's (the same spark.task.cpus and kind of executor as before reproduce them)")
    return notes


def _changed_words(was: str, now: str) -> str:
    """``x1`` for ``openblas 0.3.31 Haswell x1`` against ``... Haswell x2``: the words that changed, or
    all of ``was`` when its words do not line up with ``now``'s."""
    a, b = was.split(), now.split()
    return " ".join(w.rstrip(",") for w, n in zip(a, b) if w != n) if len(a) == len(b) else was


def check_out(out: str) -> None:
    """An ``--out`` that names a directory below a filesystem's root: an empty one (an unset variable), ``/``
    or ``hdfs://nn:8020/`` put the run's files, and ``--overwrite``'s deletions, in the root itself."""
    if not out.strip():
        raise TrainingError("--out is empty: name the run's directory")
    path = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*:(//[^/]*)?", "", out)         # without a scheme and its host
    if not path or not posixpath.normpath(path).strip("/"):              # "/", "/.", "/tmp/.."
        raise TrainingError(f"--out {out}: a filesystem's root cannot be a run's directory; name one below it")


class RunDir:
    """The output directory of one run, and where its lines are reported.

    Parameters
    ----------
    out : str
        Any Hadoop path: ``run.json`` (written at the start: :mod:`.runinfo`), ``metrics.jsonl``,
        ``checkpoint/`` (the last checkpoint) and ``best/`` (the checkpoint of the lowest
        validation loss so far, when ``data.valid`` is set).
    sc : SparkContext, optional
        Reaches ``out`` through Hadoop (:class:`rnnlm.spark.hfs.HadoopFS`) unless ``fs`` is given.
    fs : optional
        A LocalFS and no Spark let the command line check a local ``--out`` before the JVM starts.
    log : callable
        Receives messages, and one line per metrics line unless ``progress`` is given.
    progress : rnnlm.progress.Progress, optional
        Receives each metrics line instead (a bar on a terminal).
    trackers : list of rnnlm.trackers.Tracker, optional
        Receive each metrics line too (``train --log``).
    """

    def __init__(self, out: str, sc=None, fs=None, log=print, progress=None, trackers=()):
        check_out(out)
        self.out, self.log, self.progress, self.trackers = out.rstrip("/"), log, progress, tuple(trackers)
        self.fs = fs or HadoopFS(sc, self.out)
        self.ck_path, self.metrics_path = f"{self.out}/checkpoint", f"{self.out}/metrics.jsonl"
        self.best_path = f"{self.out}/{BEST}"
        self.metrics: list = []           # the lines of this run, those kept from before a resume first
        self._rewrite = False             # the file holds lines past the resumed checkpoint until the next line
        self._earlier = False             # --overwrite: an earlier run's files, deleted as this run starts

    # ----------------------------------------------------------- starting
    def prepare(self, resume: bool, overwrite: bool = False) -> None:
        """Check ``--out`` against ``--resume`` before anything is read; with ``overwrite`` the run
        starts again there: the earlier run's metrics, ``checkpoint/`` and ``best/`` are deleted when
        this one writes its ``run.json`` (:meth:`write_info`), so a run stopped before it (a corpus
        error, Ctrl-C while the corpus is read) leaves the earlier one as it was."""
        if overwrite:
            if resume:
                raise TrainingError("--overwrite starts the run in --out again; --resume continues it: not both")
            self._earlier = True
            return
        for p in (self.ck_path, self.best_path, self.metrics_path):
            self.fs.restore(p)            # a write cut between its two renames
        has_metrics = self.fs.exists(self.metrics_path)
        has_checkpoint = self.fs.exists(f"{self.ck_path}/{checkpoint.MANIFEST}")
        if resume and not has_checkpoint:
            if has_metrics:
                raise TrainingError(f"--resume: {self.out} holds metrics but no checkpoint (the run stopped "
                                    "before its first one): start it again with --overwrite")
            raise TrainingError(f"--resume: no checkpoint at {self.ck_path}")
        if not resume and (has_metrics or has_checkpoint):
            raise TrainingError(f"{self.out} already holds a run (use --resume to continue it, --overwrite to "
                                "start it again, or another --out)")
        if not resume:      # names a run writes, held by something else: replaced whole by the first checkpoint
            # (a run's own run.json alone: one stopped before its first round ended, started again here)
            info = f"{self.out}/{runinfo.NAME}"
            taken = [p for p in (self.ck_path, self.best_path) if self.fs.exists(p)]
            taken += [info] if self.fs.exists(info) and not runinfo.is_record(self.fs, self.out) else []
            if taken:
                names = ", ".join(p[len(self.out) + 1:] for p in taken)
                raise TrainingError(f"{self.out} holds {names} but no run to resume: this run would replace "
                                    f"{'them' if len(taken) > 1 else 'it'} (--overwrite to replace "
                                    f"{'them' if len(taken) > 1 else 'it'}, or another --out)")

    def read_checkpoint(self, cfg: config.Config, keys: dict = RESUME_KEYS) -> checkpoint.Checkpoint:
        """The checkpoint to resume under ``cfg``, refused when one of ``keys`` differs (:func:`check_resume`)."""
        ck = read_checkpoint(self.fs, self.ck_path, resume=True)
        check_resume(cfg, ck.config, self.ck_path, keys)
        return ck

    def write_info(self, sc, cfg: config.Config, resume: bool, devices: dict, init: Init | None = None,
                   corpus: dict | None = None):
        """``run.json`` for the run starting (or resuming) now with the resolved ``cfg`` on ``devices``
        (partition -> where it computes, :func:`rnnlm.spark.executor.probe_task`), from ``init``'s weights,
        on ``corpus`` (:meth:`rnnlm.spark.corpus.Corpus.record`); under ``--overwrite`` the earlier run's files
        go first. Returns the devices the replaced record held (a resume's; None when there were none). A
        resume whose texts are not the ones its record names is refused (TrainingError), the record left as
        it was."""
        if self._earlier:
            # the checkpoint first: a crash midway leaves metrics without one, which --resume refuses
            # (saying --overwrite), never an earlier checkpoint resumed without its lines
            for p in (self.ck_path, self.best_path, self.metrics_path):
                self.fs.delete(p)
            self._earlier = False
        replaced = self._write(f"{self.out}/{runinfo.NAME}", lambda: runinfo.write(
            self.fs, self.out, sc, cfg, resume, devices, init.record() if init else None, corpus,
            lambda old: self._same_corpus(old.get("corpus"), corpus)))
        return replaced.get("devices")

    def _same_corpus(self, then, now) -> None:
        """Refuse to resume on a ``data.train`` (``valid``, ``test``) that reads other tokens than the run read
        (``then``: its record's; a record from before texts were recorded, or damaged, names none and is not
        compared): another training text gives numbers no run has, another held-out text another best
        checkpoint and plateau schedule, and figures that do not follow the earlier ones."""
        if not isinstance(then, dict) or now is None:
            return
        for key, was, is_ in (("train", then, now), *((k, then.get(k), now.get(k)) for k in ("valid", "test"))):
            if not (isinstance(was, dict) and isinstance(was.get("digest"), str) and isinstance(is_, dict)):
                continue
            if was["digest"] != is_["digest"]:
                tokens = was.get("tokens")
                count = f"{tokens:,} tokens then" if type(tokens) is int else "the tokens then"
                raise TrainingError(f"cannot resume: data.{key} reads other text than this run "
                                    f"{'trained' if key == 'train' else 'was scored'} on ({count}, "
                                    f"{is_['tokens']:,} now; their digests {was['digest']} and {is_['digest']}): "
                                    f"give it its text back, or start a new run from these weights with "
                                    f"--init-from {self.ck_path}")

    def saved_lines(self, keys: tuple = ("round",)) -> list | None:
        """The metrics file's lines, or None when it is missing or empty; a last line cut short by a
        crash is dropped. TrainingError for any other line that is not a JSON table with integers
        ``keys`` >= 0 (what a resume filters the lines on)."""
        try:
            raw = self.fs.read_at_most(self.metrics_path, MAX_METRICS)
        except ValueError as e:
            raise TrainingError(f"{e}: not a run's metrics to resume") from None
        if not raw:
            return None
        text, out = raw.decode("utf-8", errors="replace").splitlines(), []
        for i, line in enumerate(text, 1):
            m = json_table(line)
            if m is None and i == len(text):
                break
            if not (m is not None and all(type(m.get(k)) is int and m[k] >= 0 for k in keys)):
                raise TrainingError(f"{self.metrics_path}: line {i} is not a metrics line (a JSON table with "
                                    f"integers {' and '.join(keys)} >= 0): mend or remove it, or start again "
                                    "with --overwrite")
            out.append(m)
        return out

    def keep_lines(self, lines: list) -> None:
        """On resume: the metrics file is to hold ``lines`` only (the work after the checkpoint runs
        again, and writes its lines again), rewritten atomically with the resumed run's first line or
        checkpoint: a resume that stops before either (a corpus error, Ctrl-C) leaves the file as it was."""
        self.metrics, self._rewrite = list(lines), True

    # ------------------------------------------------------------ running
    def add_line(self, m: dict, total: int, line: str) -> None:
        """Append the metrics line ``m`` to the file, then report it: to the progress bar (with the
        run's length ``total``), or as the log line ``line``."""
        self.metrics.append(m)
        if not self._rewrite_kept():
            line_bytes = (json.dumps(m) + "\n").encode()
            self._write(self.metrics_path, lambda: self.fs.append(self.metrics_path, line_bytes, self._metrics_bytes))
        for t in self.trackers:
            t.line(m)
        if self.progress is not None:
            self.progress.update(m, total, line)
        else:
            self.log(line)

    def _rewrite_kept(self) -> bool:
        """After :meth:`keep_lines`, the first write: the metrics file replaced by the lines held (True)."""
        if not self._rewrite:
            return False
        self._write(self.metrics_path, lambda: self.fs.write_atomic(self.metrics_path, self._metrics_bytes()))
        self._rewrite = False
        return True

    def best_saved(self) -> dict | None:
        """The record of the round ``best/`` holds (:func:`best_record`), or None: none, or one that cannot be read
        (the next evaluation's best then replaces it)."""
        if not self.fs.exists(f"{self.best_path}/{checkpoint.MANIFEST}"):
            return None
        try:
            return best_record(read_checkpoint(self.fs, self.best_path).position.get("best"))
        except (checkpoint.CheckpointError, OSError, ValueError):
            return None

    def _metrics_bytes(self) -> bytes:
        return "".join(json.dumps(x) + "\n" for x in self.metrics).encode()

    def say_start(self, size: str, devices: dict, wanted: str, resumed: str | None, init: Init | None,
                  notes=()) -> None:
        """The run's first lines: its ``size``, where its partitions compute (as the corpus's probe
        found, ``train.device`` being ``wanted``: :func:`devices_line`) and ``notes`` on it, where it
        starts (``resumed`` from a checkpoint, or ``init``'s weights)."""
        self.log(size)
        if devices_line(devices, wanted):
            self.log(devices_line(devices, wanted))
        for note in notes:
            self.log(note)
        if resumed is not None:
            self.log(resumed)
        elif init:
            self.log(init.line())

    def say_evaluating(self, name: str, tokens: int | None) -> None:
        """A pass over held-out text can take longer than a round: say what the silence is."""
        self.log(f"evaluating {name}" + (f" ({tokens:,} tokens)..." if tokens is not None else "..."))

    def write_checkpoint(self, ck: checkpoint.Checkpoint, best: bool) -> None:
        """Replace ``checkpoint/`` (and, with ``best``, ``best/``) with ``ck``, each atomically.

        ``best/`` first: a crash between the two leaves ``best/`` ahead of ``checkpoint/``; a synchronous
        run, training the same rounds again, writes the same ``best/`` again, an async one (whose rounds
        differ) starts its record from :meth:`best_saved`. On resume the metrics file loses the lines past
        the checkpoint resumed from (:meth:`keep_lines`) before the first checkpoint is written: a crash
        after it cannot leave them beside the new checkpoint, as lines of work it does not hold.
        """
        files = checkpoint.to_files(ck)
        self._rewrite_kept()        # a resume's first checkpoint: the lines past the one it resumed from go first
        if best:
            self._write(self.best_path, lambda: self.fs.write_dir_atomic(self.best_path, files))
        self._write(self.ck_path, lambda: self.fs.write_dir_atomic(self.ck_path, files))

    def _write(self, path: str, write):
        """``write()``'s value; its OSError (a full disk, a lost mount) one line naming ``path`` and what is kept (every
        write replaces or appends whole: what was written before is as it was)."""
        try:
            return write()
        except OSError as e:
            raise TrainingError(f"cannot write {path}: {e.strerror or e}; {self.kept()}") from None

    def kept(self) -> str:
        """What a run that stops now leaves to resume from, for its one-line error."""
        if self.fs.exists(f"{self.ck_path}/{checkpoint.MANIFEST}"):
            return f"the last good checkpoint is kept in {self.ck_path}"
        return "no checkpoint was written yet"

    def nothing_to_do(self, at: int, rounds: int | None, stopped: str | None = None) -> dict:
        """A resumed run already at its length (round ``at`` of ``rounds``), or ``stopped`` early there
        (:func:`rnnlm.core.schedule.early_stop`): say so; the last line."""
        if stopped is not None:
            self.log(f"nothing to do: {self.out} stopped early at round {at}: {stopped}; raise train.patience to "
                     "train on")
        else:
            self.log(f"nothing to do: {self.out} is at round {at} of {rounds} (raise train.rounds or "
                     "train.epochs to train on)")
        # the metrics' last line, when it is the checkpoint's round (a file cut short ends earlier)
        return self.metrics[-1] if self.metrics and self.metrics[-1]["round"] == at else {"round": at}


class Driver:
    """What both drivers (:class:`rnnlm.spark.trainer.Trainer`, the async one) hold: the Spark
    context, the log (``status``: start-up phases, transient on a terminal), the run's directory and
    the configuration as given (resolved by ``run``)."""

    def __init__(self, spark, cfg: config.Config, out: str, log=print, progress=None, fs=None, sinks=()):
        self.sc, self.log = spark and spark.sparkContext, log
        self.status = getattr(progress, "status", None) or log      # a progress report may say no phases
        self.dir = RunDir(out, self.sc, fs, log, progress, sinks)
        self.cfg_in = cfg

    def _prepare(self, resume: bool, overwrite: bool, init: Init | None) -> None:
        """Check ``--out`` against ``--resume`` (:meth:`RunDir.prepare`) and a new run's ``init``
        against the configuration (:func:`check_init`), before anything is read."""
        if init is not None:
            if resume:
                raise TrainingError("--init-from starts a new run; --resume continues the one in --out: not both")
            check_init(self.cfg_in, init.checkpoint.config, init.path, init.keep_optimizer)
            if init.keep_optimizer:
                check_kept(self.cfg_in, init.checkpoint, init.path)
        self.dir.prepare(resume, overwrite)

    @property
    def metrics(self) -> list:
        """The run's metrics lines so far."""
        return self.dir.metrics
