"""Where error feedback's residuals live: in Spark, as an RDD beside the corpus.

A residual (what a partition has not sent yet, see :mod:`rnnlm.exchange.plan`)
is as large as the model, per partition. Shipping it through the driver every
round would cost more than the exchange saves, and an executor's memory alone
would lose it with the executor. So it is an RDD with one ``(pid, array)`` per
partition, zipped with the corpus' partitions:

* round r's tasks read ``residual[r-1]`` and emit ``residual[r]`` next to their
  contribution; the round's output is persisted (memory, spilling to disk), the
  contributions go into ``treeAggregate`` and the residuals stay on their executor
  for round r+1, which usually runs there too (the cached partitions are its
  preferred location);
* a lost executor costs nothing but time: Spark recomputes the lost partitions
  from their lineage (the earlier rounds' tasks, pure functions of their
  broadcasts, which this class keeps alive), bit for bit;
* every checkpoint truncates the lineage: the residuals are collected (one
  partition at a time), written into the checkpoint (``optim.npz``, under
  :class:`rnnlm.exchange.round.StateKeys`' names), broadcast back one per partition, and the broadcasts and
  cached rounds before are released. A resumed run starts from the same
  broadcasts, so resume reproduces the uninterrupted run's numbers. A cut moves
  values, never changes them: whatever writes a checkpoint (``train.checkpoint_every``,
  ``train.checkpoint_s``, an evaluation, a signal) and at whichever round, the numbers are
  the uninterrupted run's; only the bytes counted move with the cuts.

* a lineage also ends after :data:`MAX_LINEAGE` rounds without a checkpoint
  (:meth:`Residuals.trim`), the same way: Spark serialises a task's whole RDD chain
  recursively, and PTB small's 232 rounds between checkpoints overflowed the
  driver's stack (``StackOverflowError`` at round 135).

What it costs: lineage (and kept broadcasts) of at most ``MAX_LINEAGE`` rounds; per
truncation, the residuals once to the driver (counted in that round's bytes sent,
except at a checkpoint, which any trainer pays) and once back (counted in the next
round's broadcast bytes).
"""
from __future__ import annotations

from pyspark import StorageLevel

from .executor import fold

MAX_LINEAGE = 48           # rounds; three RDDs each (zip, mapPartitions, filter)


def _is_residual(x) -> bool:
    return isinstance(x, tuple)


def _from_broadcasts(bcs: dict):
    def read(item):
        pid = item[0]
        return pid, (bcs[pid].value if pid in bcs else None)
    return read


class Residuals:
    """Owns the residual RDD, its lineage and the broadcasts that lineage reads.

    Parameters
    ----------
    sc : SparkContext
    data : RDD of (pid, tokens, starts), one element per partition (persisted)
    saved : dict of int -> array, optional
        Residuals from a checkpoint (None: all zero).
    """

    def __init__(self, sc, data, saved: dict | None = None):
        self.sc, self.data = sc, data
        self._kept, self._out = [], None
        self.pending_broadcast = []         # per-partition broadcasts the next round measures
        self._seed(saved or {})

    def _seed(self, saved: dict):
        bcs = {pid: self.sc.broadcast(a) for pid, a in saved.items()}
        self._kept += bcs.values()
        self.pending_broadcast = list(bcs.values())
        self.rdd = self.data.map(_from_broadcasts(bcs), preservesPartitioning=True)
        self.depth = 0

    def inputs(self):
        """The corpus zipped with the residuals: what a feedback round's tasks read."""
        return self.data.zip(self.rdd)

    def keep(self, broadcasts) -> None:
        """Broadcasts a round's tasks read: alive until the lineage is next truncated."""
        self._kept += list(broadcasts)

    def run_round(self, task, depth: int, zero, merge):
        """Run one round's ``task`` over :meth:`inputs`; return the aggregate, keep the residuals."""
        out = self.inputs().mapPartitions(task).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            agg = out.treeAggregate(zero, fold, merge, depth=depth)
        except BaseException:
            out.unpersist()
            raise
        prev, self._out = self._out, out
        self.rdd = out.filter(_is_residual)
        self.depth += 1
        if prev is not None:
            prev.unpersist()     # round r's cached output holds all round r+1 needs
        return agg

    def collect(self) -> dict:
        """pid -> residual, one partition at a time (for a checkpoint)."""
        return {pid: a for pid, a in self.rdd.toLocalIterator() if a is not None}

    def truncate(self, saved: dict) -> None:
        """Restart the lineage from ``saved`` (what :meth:`collect` returned and a checkpoint holds)."""
        old, out = self._kept, self._out
        self._kept, self._out = [], None
        self._seed(saved)
        _release(old, out)

    def trim(self) -> int:
        """Truncate the lineage once it is :data:`MAX_LINEAGE` rounds deep; return the bytes collected."""
        if self.depth < MAX_LINEAGE:
            return 0
        saved = self.collect()
        self.truncate(saved)
        return sum(a.nbytes for a in saved.values())

    def close(self) -> None:
        _release(self._kept, self._out)
        self._kept, self._out = [], None


def _release(broadcasts, out) -> None:
    if out is not None:
        out.unpersist()
    for b in broadcasts:
        b.unpersist()
        b.destroy()
