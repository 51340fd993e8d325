"""A run's output directory, shared by both drivers (the synchronous :mod:`.trainer` and the
parameter server's :mod:`.async_trainer`): its paths, ``run.json``, the resume checks, the
metrics file and the checkpoints, each written so that a crash leaves the old or the new.
"""
from __future__ import annotations

import json

from .. import config
from ..core import checkpoint
from ..core.metrics import json_lines
from . import runinfo
from .hfs import HadoopFS

# a change in any of these makes a resumed run a different experiment
RESUME_KEYS = {"data": None, "model": None, "optim": None, "exchange": None,
               "train": ("mode", "seed", "bptt", "batch", "grad_norm", "local_steps", "tree_depth", "outer",
                         "outer_lr", "outer_momentum", "optim_state", "overlap", "eager")}
# an async run's: its pushes' size and how the server applies them as well
ASYNC_RESUME_KEYS = dict(RESUME_KEYS, train=RESUME_KEYS["train"] + ("push_every",), server=("update", "staleness"))


BEST = "best"      # <out>/best: the checkpoint of the lowest validation loss


class TrainingError(RuntimeError):
    """Training stopped (non-finite loss, incompatible resume); the message is one line."""


def check_resume(cfg: config.Config, saved: config.Config, where: str, keys: dict = RESUME_KEYS) -> None:
    """Refuse to resume the run saved with ``saved`` under ``cfg`` when a key that makes it another
    experiment differs (``keys``: section -> names, None for the whole section)."""
    mine, theirs = cfg.to_dict(), saved.to_dict()
    for sec, names in keys.items():
        for k in (names or mine[sec].keys()):
            if sec == "model" and k == "vocab_size":
                continue
            if mine[sec][k] != theirs[sec][k]:
                raise TrainingError(f"cannot resume: {sec}.{k} is {mine[sec][k]!r} here but "
                                    f"{theirs[sec][k]!r} in {where}")


def best_record(saved) -> dict | None:
    """A checkpoint's record of its run's best round, or None (none yet, or a checkpoint from before
    ``best/``: the next evaluation then starts the record again)."""
    if (isinstance(saved, dict) and type(saved.get("round")) is int
            and isinstance(saved.get("valid_loss"), (int, float))):
        return {"round": saved["round"], "valid_loss": float(saved["valid_loss"])}
    return None


def improves(best: dict | None, valid_loss: float) -> bool:
    """Whether ``valid_loss`` beats the run's best so far (the first evaluation does)."""
    return best is None or valid_loss < best["valid_loss"]


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
    """

    def __init__(self, out: str, sc=None, fs=None, log=print, progress=None):
        self.out, self.log, self.progress = out.rstrip("/"), log, progress
        self.fs = fs or HadoopFS(sc, self.out)
        self.ck_path, self.metrics_path = f"{self.out}/checkpoint", f"{self.out}/metrics.jsonl"
        self.best_path = f"{self.out}/{BEST}"
        self.metrics: list = []           # the lines of this run, those kept from before a resume first

    # ----------------------------------------------------------- starting
    def prepare(self, resume: bool, overwrite: bool = False) -> None:
        """Check ``--out`` against ``--resume`` before anything is read; ``overwrite`` deletes an
        earlier run's metrics, ``run.json``, ``checkpoint/`` and ``best/`` so that the run starts
        again there."""
        if overwrite:
            for p in (self.metrics_path, f"{self.out}/{runinfo.NAME}", self.ck_path, self.best_path):
                self.fs.delete(p)
            return
        for p in (self.ck_path, self.best_path):
            self.fs.restore(p)            # a checkpoint write cut between its two renames
        has_metrics = self.fs.exists(self.metrics_path)
        if resume and not self.fs.exists(f"{self.ck_path}/{checkpoint.MANIFEST}"):
            if has_metrics:
                raise TrainingError(f"--resume: {self.out} holds metrics but no checkpoint (the run stopped "
                                    "before its first one): start it again with --overwrite")
            raise TrainingError(f"--resume: no checkpoint at {self.ck_path}")
        if not resume and has_metrics:
            raise TrainingError(f"{self.out} already holds a run (use --resume to continue it, --overwrite to "
                                "start it again, or another --out)")

    def read_checkpoint(self, cfg: config.Config, keys: dict = RESUME_KEYS) -> checkpoint.Checkpoint:
        """The checkpoint to resume under ``cfg``, refused when one of ``keys`` differs (:func:`check_resume`)."""
        ck = checkpoint.from_files(lambda n: self.fs.read(f"{self.ck_path}/{n}"), self.ck_path, resume=True)
        check_resume(cfg, ck.config, self.ck_path, keys)
        return ck

    def write_info(self, sc, cfg: config.Config, resume: bool) -> None:
        """``run.json`` for the run starting (or resuming) now with the resolved ``cfg``."""
        runinfo.write(self.fs, self.out, sc, cfg, resume)

    def saved_lines(self) -> list | None:
        """The metrics file's lines, or None when it is missing or empty."""
        raw = self.fs.read(self.metrics_path)
        return json_lines(raw) if raw else None

    def keep_lines(self, lines: list) -> None:
        """On resume: the metrics file holds ``lines`` only (the work after the checkpoint runs
        again, and writes its lines again), rewritten once, atomically."""
        self.metrics = list(lines)
        self.fs.write_atomic(self.metrics_path, self._metrics_bytes())

    # ------------------------------------------------------------ running
    def add_line(self, m: dict, total: int, line: str) -> None:
        """Append the metrics line ``m`` to the file, then report it: to the progress bar (with the
        run's length ``total``), or as the log line ``line``."""
        self.metrics.append(m)
        self.fs.append(self.metrics_path, (json.dumps(m) + "\n").encode(), self._metrics_bytes)
        if self.progress is not None:
            self.progress.update(m, total, line)
        else:
            self.log(line)

    def _metrics_bytes(self) -> bytes:
        return "".join(json.dumps(x) + "\n" for x in self.metrics).encode()

    def say_evaluating(self, name: str, tokens: int | None) -> None:
        """A pass over held-out text can take longer than a round: say what the silence is."""
        self.log(f"evaluating {name}" + (f" ({tokens:,} tokens)..." if tokens is not None else "..."))

    def write_checkpoint(self, ck: checkpoint.Checkpoint, best: bool) -> None:
        """Replace ``checkpoint/`` (and, with ``best``, ``best/``) with ``ck``, each atomically.

        ``best/`` first: a crash between the two leaves ``best/`` ahead of ``checkpoint/``, and the
        resumed run, training the same rounds again, writes the same ``best/`` again.
        """
        files = checkpoint.to_files(ck)
        if best:
            self.fs.write_dir_atomic(self.best_path, files)
        self.fs.write_dir_atomic(self.ck_path, files)

    def kept(self) -> str:
        """What a run that stops now leaves to resume from, for its one-line error."""
        if self.fs.exists(f"{self.ck_path}/{checkpoint.MANIFEST}"):
            return f"the last good checkpoint is kept in {self.ck_path}"
        return "no checkpoint was written yet"

    def nothing_to_do(self, at: int, rounds: int) -> dict:
        """A resumed run already at its length (round ``at`` of ``rounds``): say so; the last line."""
        self.log(f"nothing to do: {self.out} is at round {at} of {rounds} (raise train.rounds or "
                 "train.epochs to train on)")
        return self.metrics[-1] if self.metrics else {"round": at}


class Driver:
    """What both drivers (:class:`rnnlm.spark.trainer.Trainer`, the async one) hold: the Spark
    context, the log, the run's directory and the configuration as given (resolved by ``run``)."""

    def __init__(self, spark, cfg: config.Config, out: str, log=print, progress=None, fs=None):
        self.sc, self.log = spark and spark.sparkContext, log
        self.dir = RunDir(out, self.sc, fs, log, progress)
        self.cfg_in = cfg

    @property
    def metrics(self) -> list:
        """The run's metrics lines so far."""
        return self.dir.metrics
