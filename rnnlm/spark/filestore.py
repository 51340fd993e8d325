"""What a partition holds between its rounds (error feedback's residual, ``train.eager``'s last
change), on the executor's local disk: each round of a partition reads its own file and writes the
next, and the cached element keeps a :class:`Stored` reference (where the file is not, the caller
rebuilds what the partition held from its lineage, :mod:`rnnlm.spark.lineage`). docs/design.md
("Rounds whose carryover stays in Spark") says why files, where they live and how a reader knows
its own.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import NamedTuple

import numpy as np

KEEP = 3        # files kept per partition: the newest rounds, which a retried or recomputed round reads
_NAME = re.compile(r"([0-9]+)\.([0-9]+)\.([A-Za-z0-9_]+)\.npy")      # "<pid>.<seq>.<name>.npy"


class Stored(NamedTuple):
    """Where a partition's arrays after round ``seq`` of run ``run`` were written, by name, and what
    each file written was (:func:`_identity`)."""

    run: str
    seq: int
    names: tuple
    files: tuple


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
    files = []
    for name, a in arrays.items():
        path = _path(run, seq, pid, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                np.save(f, a, allow_pickle=False)
                f.flush()
                files.append(_identity(os.fstat(f.fileno()), a))
            os.replace(tmp, path)
        finally:                            # a full disk, an object array: no temporary file stays
            if os.path.exists(tmp):
                os.unlink(tmp)
    _prune(root(run), pid, seq - KEEP)
    return Stored(run, seq, tuple(arrays), tuple(files))


def _file(st: os.stat_result) -> tuple:
    """The file itself: its device, inode, size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _identity(st: os.stat_result, a) -> tuple:
    """What names one file written: the file (:func:`_file`), its array's shape and dtype."""
    return (*_file(st), tuple(np.shape(a)), np.asarray(a).dtype.str)


def load(ref: Stored, pid: int) -> dict | None:
    """The arrays ``ref`` names, or None where this host has no whole copy of one of them (or a file
    under its name that is not the one written)."""
    out = {}
    for name, written in zip(ref.names, ref.files):
        try:
            with open(_path(ref.run, ref.seq, pid, name), "rb") as f:
                st = os.fstat(f.fileno())
                if _file(st) != written[:4]:                    # another file: not read at all
                    return None
                a = np.load(f, allow_pickle=False)
        except (OSError, ValueError, EOFError):     # absent, pruned, empty or unreadable: rebuilt by the caller
            return None
        if _identity(st, a) != written:
            return None
        out[name] = a
    return out


def _prune(directory: str, pid: int, upto: int) -> None:
    """Remove partition ``pid``'s files of rounds up to ``upto``; a name this module does not write is
    left alone."""
    for name in os.listdir(directory):
        m = _NAME.fullmatch(name)
        if m and m[1] == str(pid) and int(m[2]) <= upto:
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
