"""What a partition holds between its rounds (error feedback's residual, ``train.eager``'s last
change), on the executor's local disk.

Each is as large as the model (18.6 MB for PTB small) and each round of a partition reads its
own and writes the next. Held in Spark's cache, it crossed the Python/JVM boundary both ways
every round: with tasks that sleep, 2 x 18.6 MB cost a round 0.133 s beyond the sleep on
``local[2]``, against 0.053 s in files the tasks' own processes write and read, and 0.056 s
carrying nothing (``benchmarks/carry_cost.py``).
The cached element keeps a :class:`Stored` reference instead; where the file is not (the task
ran on another executor, the executor was lost, the file was pruned), the caller rebuilds the
residual from its lineage (:mod:`rnnlm.spark.residuals`).

Files live in the executor's block manager directory (``SPARK_LOCAL_DIRS``, which Spark sets
for its Python workers), which Spark deletes when the context stops, a standalone worker when
the application ends, YARN with the container. (An earlier version used
``SparkFiles.getRootDirectory()``, an executor's working directory, which standalone workers
keep after the application: 1.1 GB of residuals stayed behind after a day of benchmarks.) The
run's last files are removed when it closes, by a job over the corpus partitions, which run
where the rounds ran. Files are written under a temporary name and renamed, so a reader sees a
whole file or none; only numbers are stored (``allow_pickle=False``).
"""
from __future__ import annotations

import os
import shutil
from typing import NamedTuple

import numpy as np

KEEP = 3        # files kept per partition: the newest rounds, which a retried or recomputed round reads


class Stored(NamedTuple):
    """Where a partition's arrays after round ``seq`` of run ``run`` were written, by name."""

    run: str
    seq: int
    names: tuple


def root(run: str, local_dirs: str | None = None) -> str:
    """The run's directory on this host (``local_dirs``: the executors' ``SPARK_LOCAL_DIRS``, by
    default this process's; a process that has none, such as the driver, uses Spark's files
    directory)."""
    local_dirs = local_dirs or os.environ.get("SPARK_LOCAL_DIRS")
    if local_dirs:
        base = local_dirs.split(",")[0]
    else:
        from pyspark import SparkFiles
        base = SparkFiles.getRootDirectory()
    return os.path.join(base, "rnnlm-residuals", run)


def _path(run: str, seq: int, pid: int, name: str) -> str:
    return os.path.join(root(run), f"{pid}.{seq}.{name}.npy")


def save(run: str, seq: int, pid: int, arrays: dict) -> Stored:
    """Write ``arrays`` (name -> array; names are file name parts) and prune this partition's
    files older than the :data:`KEEP` newest rounds."""
    for name, a in arrays.items():
        path = _path(run, seq, pid, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, a, allow_pickle=False)
        os.replace(tmp, path)
    _prune(root(run), pid, seq - KEEP)
    return Stored(run, seq, tuple(arrays))


def load(ref: Stored, pid: int) -> dict | None:
    """The arrays ``ref`` names, or None where this host has no whole copy of one of them."""
    try:
        return {name: np.load(_path(ref.run, ref.seq, pid, name), allow_pickle=False) for name in ref.names}
    except (OSError, ValueError):       # absent, pruned, or unreadable: rebuilt by the caller
        return None


def _prune(directory: str, pid: int, upto: int) -> None:
    for name in os.listdir(directory):
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == str(pid) and parts[3] == "npy" and int(parts[1]) <= upto:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:       # another task of the same partition pruned it first
                pass


def remove(run: str) -> None:
    """Delete the run's files on this host."""
    shutil.rmtree(root(run), ignore_errors=True)


def remover(run: str):
    """A task removing the run's files where it runs (for ``RDD.foreachPartition``)."""
    def go(_):
        remove(run)
    return go
