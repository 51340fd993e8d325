"""The value that ``treeAggregate`` combines: a small structure of blocks.

Each partition contributes named blocks (:mod:`rnnlm.exchange.blocks`), a weight (tokens), the
ids of the words it read, its carry and scalar statistics, or only its error; merged values hold
float64 weighted sums, merged in partition order whatever order Spark delivers them (:class:`Gathered`).
``wire_bytes`` is measured each time a value is pickled to cross a process boundary (not when PySpark
spills a merge to its local disk). docs/design.md
("How distributed training works") and docs/exchange.md ("Merging in the tree") say more.
"""
from __future__ import annotations

import pickle
import sys

import numpy as np

from .blocks import Block, Sum


class Aggregate:
    """A weighted sum of per-partition contributions.

    Attributes
    ----------
    weight : float
        Sum of the contributions' weights (tokens processed).
    dense : dict of str -> Block or Sum
        Block name -> the block as a leaf sent it, or the weighted :class:`Sum` once merged
        (a plain array given to :meth:`contribution` travels as an ``f32`` block).
    words : int32 array
        The sorted ids of the words the partitions read this round (their union).
    local : dict of int -> value
        Per-partition values that are gathered, not averaged (the synchronous round's
        :class:`rnnlm.exchange.round.Carry`: carried hidden state, optimizer state kept per
        partition, or the error that stopped the partition).
    stats : dict of str -> float
        ``tokens``, ``loss_sum``, ``steps`` and per-group block counts (summed); durations
        (``*_s``: ``compute_s``, the phases of a task) and ``*_end`` times the slowest task's
        (max), ``*_start`` times the first task's (min).
    wire_bytes : int
        Serialised bytes of every hop this value and its parts made.
    """

    __slots__ = ("weight", "dense", "leaf", "words", "local", "stats", "wire_bytes")

    def __init__(self):
        self.weight = 0.0
        self.dense = {}
        self.leaf = False          # blocks are unweighted, as sent (a leaf)
        self.words = np.zeros(0, np.int32)
        self.local = {}
        self.stats = {"tokens": 0, "loss_sum": 0.0, "steps": 0, "compute_s": 0.0}
        self.wire_bytes = 0

    @classmethod
    def contribution(cls, weight, dense: dict, local: dict | None = None, words=None, **stats):
        """One partition's result: ``dense`` blocks as they are (weighted on merge)."""
        a = cls()
        a.weight, a.leaf = float(weight), True
        a.dense = {k: v if isinstance(v, Block) else Block(v, v.shape) for k, v in dense.items()}
        if words is not None:
            a.words = np.unique(np.asarray(words, np.int32))
        a.local = dict(local or {})
        a.stats.update(stats)
        return a

    def _sums(self):
        # weighted float64 sums of the blocks (one pass each: decode and scale)
        if self.leaf:
            self.dense = {k: Sum.of(b, self.weight) for k, b in self.dense.items()}
            self.leaf = False
        return self.dense

    def merge(self, other: "Aggregate") -> "Aggregate":
        """Fold ``other`` into ``self`` (in place) and return the result.

        A value without blocks (the zero value, or a partition that reports an
        error instead of parameters) contributes its per-partition entries and
        statistics only, wherever it sits in the tree.
        """
        if other.dense and not self.dense:
            return other.merge(self)          # fold the block-less side into the one with blocks
        if other.dense:
            mine = self._sums()
            if mine.keys() != other.dense.keys():
                raise ValueError(f"cannot merge blocks {sorted(mine)} with {sorted(other.dense)}")
            for k, v in other.dense.items():
                mine[k] = mine[k].add(Sum.of(v, other.weight) if other.leaf else v)
            self.weight += other.weight
        if len(other.words):
            self.words = np.union1d(self.words, other.words).astype(np.int32)
        self.local.update(other.local)
        for k, v in other.stats.items():
            self.stats[k] = v if k not in self.stats else _combine(k, self.stats[k], v)
        self.wire_bytes += other.wire_bytes
        return self

    def errors(self) -> list:
        """``"partition P: message"`` for every partition that reported an error."""
        return [f"partition {pid}: {v.error}" for pid, v in sorted(self.local.items())
                if getattr(v, "error", None)]

    def mean(self, name: str, dtype=np.float32) -> np.ndarray:
        """The weight-averaged block ``name`` as a full (R, C) array (rows nobody sent are 0)."""
        return self._sums()[name].dense(1.0 / self.weight, dtype)

    def __reduce_ex__(self, protocol):
        # Protocol 5 hands the arrays' memory out of band: the outer pickle copies it once, and
        # the size of this hop is the header plus those buffers, measured without a second copy.
        buffers = []
        head = pickle.dumps((self.weight, self.dense, self.leaf, self.words, self.local, self.stats),
                            protocol=5, buffer_callback=buffers.append)
        size = 0 if _spilling() else len(head) + sum(b.raw().nbytes for b in buffers)
        if protocol < 5:
            buffers = [b.raw().tobytes() for b in buffers]
        return _rebuild, (head, buffers, self.wire_bytes + size)


def _spilling() -> bool:
    """Whether this pickling is PySpark's merger writing values to the worker's local disk (a ``_spill`` of
    pyspark/shuffle.py, past ``spark.python.worker.memory``): read back by the same process, no hop of the tree
    (counted, it doubled a round's bytes at 8 partitions and 1m)."""
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_spill" and code.co_filename.endswith("pyspark/shuffle.py"):
            return True
        frame = frame.f_back
    return False


def _combine(key: str, a, b):
    """Two statistics of one name merged: a phase's time is the slowest task's, a start the first's."""
    if key.endswith("_start"):
        return min(a, b)
    if key.endswith(("_s", "_end")):
        return max(a, b)
    return a + b


def _rebuild(head, buffers, wire_bytes) -> Aggregate:
    a = Aggregate.__new__(Aggregate)
    a.weight, a.dense, a.leaf, a.words, a.local, a.stats = pickle.loads(head, buffers=buffers)
    a.wire_bytes = wire_bytes
    return a


def in_order(parts) -> Aggregate:
    """Values (each a partition's, or a tree node's whole) merged in the order of each one's first
    partition: a function of their values alone, whichever finished first (float64 sums of three or
    more are not associative)."""
    agg = Aggregate()
    for a in sorted(parts, key=lambda a: min(a.local, default=-1)):
        agg = agg.merge(a)
    return agg


class Gathered:
    """The value ``treeAggregate`` passes: partitions' values gathered, not yet merged.

    A node of Spark's tree (a ``reduceByKey``, from 5 partitions at depth 2) receives its inputs in
    the order its fetches finish. They are merged only when the node's value leaves it (pickled) or the
    driver reads the result (:meth:`settle`), then in partition order (:func:`in_order`): the result is
    a function of the partitions' values, the partition count and the tree depth.
    """

    __slots__ = ("parts",)

    def __init__(self, parts=()):
        self.parts = list(parts)

    def settle(self) -> Aggregate:
        """The parts merged in partition order (once: merging folds them into the first)."""
        agg = in_order(self.parts)
        self.parts = [agg]
        return agg

    def __reduce__(self):
        if not self.parts:      # treeAggregate's zero value, shipped in every task's closure: no result bytes
            return Gathered, ()
        return Gathered, ([self.settle()],)


def gather(a: Gathered, b) -> Gathered:
    """``treeAggregate``'s seqOp (``b`` a partition's :class:`Aggregate`) and combOp (``b`` gathered too)."""
    a.parts.extend(b.parts if isinstance(b, Gathered) else [b])
    return a
