"""The broadcasts of a round's parameters, on the Spark side: a base the executors keep and
the rows changed since it (:class:`ParamsBroadcast`), or coded deltas (:class:`DeltaBroadcast`);
the maths is :mod:`rnnlm.exchange.rebase`'s. Owned by :class:`rnnlm.spark.allreduce.AllReduce`.
"""
from __future__ import annotations

import os

import numpy as np

from ..exchange.rebase import apply_delta, changed_rows, delta_blocks, size
from .session import release


class ParamsBroadcast:
    """Owns the driver's side of the protocol: which base is alive and what each round sends.

    Parameters
    ----------
    sc : SparkContext
    layout : Layout
    every : int
        Re-base at least every this many rounds (0: only by size).
    fraction : float
        Re-base when a round's rows would reach this fraction of the model.
    retire : callable, optional
        Receives a replaced base instead of it being destroyed (error feedback's
        lineage may still read it, see :mod:`rnnlm.spark.lineage`).
    """

    def __init__(self, sc, layout, every: int, fraction: float, retire=None):
        self.sc, self.layout, self.every, self.fraction, self.retire = sc, layout, every, fraction, retire
        self.base, self.bc_base, self.age = None, None, 0     # age: the rounds the base has served
        self.rebases = 0
        self.deltas, self.view = [], None     # DeltaBroadcast's deltas since the base, and their sum
        self.nonce = os.urandom(8).hex()

    def round(self, params) -> tuple:
        """``(base broadcast, rows, deltas, new)`` for this round.

        ``rows`` is :func:`changed_rows`' output for the payload, ``deltas`` the delta
        broadcasts tasks apply in order (:class:`DeltaBroadcast`), ``new`` the
        broadcasts created now (their bytes travel this round).
        """
        rows = None if self.base is None else changed_rows(self.layout, params, self.base)
        if rows is None or self._due(size(rows)):
            return self._rebase(params), {}, [], [self.bc_base]
        self.age += 1
        return self.bc_base, rows, [], []

    @property
    def token(self) -> str:
        """Names the current base for executors' caches (unique to this object and base)."""
        return f"{self.nonce}:{self.rebases}"

    def _due(self, amount) -> bool:
        return (amount >= self.fraction * self.layout.size
                or bool(self.every and self.age >= self.every))

    def _rebase(self, params):
        """Retire the old base and its deltas; broadcast ``params`` as the new base (returned)."""
        self.close()
        self.base, self.age = params.copy(), 1                # it serves the round it is made for
        self.bc_base = self.sc.broadcast(self.base)
        self.rebases += 1
        return self.bc_base

    def close(self, blocking: bool = False):
        """Retire the base and its deltas (to ``retire``, which releases them later; ``blocking`` is
        then not used) or destroy them (``blocking``: wait for the executors' answers, as
        :func:`rnnlm.spark.session.release` does at the end of a run)."""
        old = [b for b in [self.bc_base, *self.deltas] if b is not None]
        if self.retire is not None:
            self.retire(old)
        else:
            release(old, blocking=blocking)
        self.bc_base, self.deltas = None, []


class DeltaBroadcast(ParamsBroadcast):
    """Per round the change since the last round in a codec; executors keep every delta since the base.

    Each round sends ``Q(params - view)`` and adds it to ``view``, the parameters
    executors rebuild (base plus the decoded deltas). A new base is the current
    view, so re-basing changes bytes, never numbers: it happens when the deltas'
    bytes since the base reach ``fraction`` of the model's float32 bytes or every
    ``every`` rounds. The view is all the state a resumed run needs (checkpointed
    as ``outer.view``).
    """

    def __init__(self, sc, layout, every: int, fraction: float, codec: str, view=None, retire=None):
        super().__init__(sc, layout, every, fraction, retire)
        self.codec, self.sent = codec, 0
        self.view = None if view is None else np.array(view)

    def round(self, params) -> tuple:
        if self.view is None:
            self.view = params.copy()
        new = []
        if self.base is None or self._due(self.sent / 4):
            self.sent = 0
            new.append(self._rebase(self.view))
        else:
            self.age += 1
        blocks = delta_blocks(self.layout, params - self.view, self.codec)
        if blocks:
            apply_delta(self.layout, self.view, blocks)
            self.sent += sum(b.nbytes for b in blocks.values())
            self.deltas.append(self.sc.broadcast(blocks))
            new.append(self.deltas[-1])
        return self.bc_base, {}, list(self.deltas), new
