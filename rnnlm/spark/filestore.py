"""Error feedback's residuals on the executor's local disk, between one partition's rounds.

A residual is as large as the model (18.6 MB for PTB small) and each round of a partition reads
its own and writes the next. Held in Spark's cache, it crossed the Python/JVM boundary both ways
every round: 0.10 s a round for two partitions on ``local[2]``, against 0.02 s for a file the
task's own process writes and the next round's reads (docs/results.md, "The round's budget").
The cached element keeps a :class:`Stored` reference instead; where the file is not (the task
ran on another executor, the executor was lost, the file was pruned), the caller rebuilds the
residual from its lineage (:mod:`rnnlm.spark.residuals`).

Files live in the directory Spark gives the application's files on each executor
(``SparkFiles.getRootDirectory()``), which Spark deletes when the executor stops. They are
written under a temporary name and renamed, so a reader sees a whole file or none; only numbers
are stored (``allow_pickle=False``).
"""
from __future__ import annotations

import os
import shutil
from typing import NamedTuple

import numpy as np

KEEP = 3        # files kept per partition: the newest rounds, which a retried or recomputed round reads


class Stored(NamedTuple):
    """Where a partition's residual after round ``seq`` of run ``run`` was written."""

    run: str
    seq: int


def root(run: str) -> str:
    from pyspark import SparkFiles
    return os.path.join(SparkFiles.getRootDirectory(), "rnnlm-residuals", run)


def _path(ref: Stored, pid: int) -> str:
    return os.path.join(root(ref.run), f"{pid}.{ref.seq}.npy")


def save(run: str, seq: int, pid: int, residual: np.ndarray) -> Stored:
    """Write ``residual`` and prune this partition's files older than the :data:`KEEP` newest."""
    ref = Stored(run, seq)
    path = _path(ref, pid)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, residual, allow_pickle=False)
    os.replace(tmp, path)
    _prune(root(run), pid, seq - KEEP)
    return ref


def load(ref: Stored, pid: int) -> np.ndarray | None:
    """The residual ``ref`` names, or None where this host has no whole copy of it."""
    try:
        return np.load(_path(ref, pid), allow_pickle=False)
    except (OSError, ValueError):       # absent, pruned, or unreadable: rebuilt by the caller
        return None


def _prune(directory: str, pid: int, upto: int) -> None:
    for name in os.listdir(directory):
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == str(pid) and parts[2] == "npy" and int(parts[1]) <= upto:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:       # another task of the same partition pruned it first
                pass


def remove(run: str) -> None:
    """Delete the run's files where this process can see them (the driver, in local mode; an
    executor's are deleted with it)."""
    shutil.rmtree(root(run), ignore_errors=True)
