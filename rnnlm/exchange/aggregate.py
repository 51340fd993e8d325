"""The value that ``treeAggregate`` combines: a small structure of blocks.

Each partition contributes named **dense blocks** (the parameters, optimizer
accumulators), a weight (tokens processed) and scalar statistics; merging two
values forms the weight-averaged blocks. Partitions send float32 blocks; merged
values hold float64 weighted sums, so the average does not depend on the order
in which Spark happens to merge (float32 rounding would). Sparse row blocks and
compressed blocks are meant to join ``dense`` as further block kinds. A partition
that fails (a non-finite loss) sends no blocks, only its error, and merges with
healthy partitions at any level of the tree.

``wire_bytes`` is measured, not estimated: every time a value is pickled to
cross a process boundary (executor to executor in the tree, or to the driver)
its serialised size is added, so the driver's final value carries the total.
"""
from __future__ import annotations

import pickle

import numpy as np


class Aggregate:
    """A weighted sum of per-partition contributions.

    Attributes
    ----------
    weight : float
        Sum of the contributions' weights (tokens processed).
    dense : dict of str -> array
        Block name -> weighted sum (float64 once merged, float32 as sent by a leaf).
    local : dict of int -> dict
        Per-partition values that are gathered, not averaged (carried hidden
        states, optimizer state kept per partition).
    stats : dict of str -> float
        ``tokens``, ``loss_sum``, ``steps`` (summed) and ``compute_s`` (max).
    wire_bytes : int
        Serialised bytes of every hop this value and its parts made.
    """

    __slots__ = ("weight", "dense", "leaf", "local", "stats", "wire_bytes")

    def __init__(self):
        self.weight = 0.0
        self.dense = {}
        self.leaf = False          # dense blocks are unweighted float32 values (a leaf)
        self.local = {}
        self.stats = {"tokens": 0, "loss_sum": 0.0, "steps": 0, "compute_s": 0.0}
        self.wire_bytes = 0

    @classmethod
    def contribution(cls, weight, dense: dict, local: dict | None = None, **stats):
        """One partition's result: ``dense`` blocks as they are (weighted on merge)."""
        a = cls()
        a.weight, a.dense, a.leaf = float(weight), dict(dense), True
        a.local = dict(local or {})
        a.stats.update(stats)
        return a

    def _sums(self):
        # weighted float64 sums of the dense blocks (one pass each: convert and scale)
        if self.leaf:
            self.dense = {k: np.multiply(v, self.weight, dtype=np.float64) for k, v in self.dense.items()}
            self.leaf = False
        else:
            # sums that arrived from another process sit in read-only buffers (one copy, then in place)
            self.dense = {k: v if v.flags.writeable else v.copy() for k, v in self.dense.items()}
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
                if other.leaf:
                    mine[k] += np.multiply(v, other.weight, dtype=np.float64)
                else:
                    mine[k] += v
            self.weight += other.weight
        self.local.update(other.local)
        for k in ("tokens", "loss_sum", "steps"):
            self.stats[k] += other.stats[k]
        self.stats["compute_s"] = max(self.stats["compute_s"], other.stats["compute_s"])
        self.wire_bytes += other.wire_bytes
        return self

    def errors(self) -> list:
        """``"partition P: message"`` for every partition that reported an error."""
        return [f"partition {pid}: {v['error']}" for pid, v in sorted(self.local.items()) if "error" in v]

    def mean(self, name: str, dtype=np.float32) -> np.ndarray:
        """The weight-averaged block ``name``."""
        v = self.dense[name]
        if self.leaf:
            return v.astype(dtype)
        return np.multiply(v, 1.0 / self.weight, out=np.empty(v.shape, dtype), casting="same_kind")

    def __reduce_ex__(self, protocol):
        # Protocol 5 hands the arrays' memory out of band: the outer pickle copies it once, and
        # the size of this hop is the header plus those buffers, measured without a second copy.
        buffers = []
        head = pickle.dumps((self.weight, self.dense, self.leaf, self.local, self.stats),
                            protocol=5, buffer_callback=buffers.append)
        size = len(head) + sum(b.raw().nbytes for b in buffers)
        if protocol < 5:
            buffers = [b.raw().tobytes() for b in buffers]
        return _rebuild, (head, buffers, self.wire_bytes + size)


def _rebuild(head, buffers, wire_bytes) -> Aggregate:
    a = Aggregate.__new__(Aggregate)
    a.weight, a.dense, a.leaf, a.local, a.stats = pickle.loads(head, buffers=buffers)
    a.wire_bytes = wire_bytes
    return a


def merge(a: Aggregate, b: Aggregate) -> Aggregate:
    """``treeAggregate``'s seqOp and combOp alike: fold ``b`` into ``a``."""
    return a.merge(b)
