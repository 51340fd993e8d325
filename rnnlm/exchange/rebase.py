"""The broadcast that shrinks: a base the executors keep, and per round only the rows
that differ from it (Xiao et al.'s row selection, applied to what the driver sends).

Spark keeps a broadcast on every executor until it is destroyed, so the base travels
once; each round's broadcast holds, per parameter slot, the rows whose current values
differ from the base's (the values themselves, not differences, so an executor
rebuilds the driver's parameters bit for bit: ``base.copy()`` with those rows
written). A slot with more than half of its rows changed goes whole. When a round's
rows reach ``train.rebase_fraction`` of the model, or ``train.rebase_every`` rounds
have passed, the current parameters become the new base. With dense exchange every
row changes every round, so every round re-bases: the broadcast is what it was.
Tasks stay pure functions of (broadcasts, round, partition): a retried task reads the
same base and the same rows.

:class:`DeltaBroadcast` (``exchange.broadcast = "delta+CODEC"``) sends less: per round
only the change of the parameters since the previous round, in a codec (the blocks of
:mod:`rnnlm.exchange.blocks`), and executors keep every such delta since the base. The
driver keeps the executors' **view** (base plus the decoded deltas, added in the same
order, so both sides hold it bit for bit) next to its own exact parameters; each round's
delta is ``params - view``, so what a codec rounds away is sent in later rounds (error
feedback with no state beyond the view). Partitions train from the view; the driver
applies their mean change to its exact parameters, which evaluation and checkpoints use
(a checkpoint holds the view too, so a resumed run continues the same numbers).
"""
from __future__ import annotations

import os

import numpy as np

from .blocks import Block


def changed_rows(layout, params, base) -> dict:
    """``{slot: (ids or None, values)}`` rebuilding ``params`` from ``base`` (None: the whole slot)."""
    out = {}
    for slot in layout:
        p = params[slot.offset:slot.end].reshape(slot.shape[0], -1)
        b = base[slot.offset:slot.end].reshape(slot.shape[0], -1)
        ids = np.flatnonzero(np.any(p != b, axis=1)).astype(np.int32)
        if len(ids) == 0:
            continue
        out[slot.name] = (None, p.copy()) if 2 * len(ids) > slot.shape[0] else (ids, p[ids])
    return out


def rebuild(layout, base, rows: dict) -> np.ndarray:
    """The parameters (P,) from ``base`` and :func:`changed_rows`' output (a new array)."""
    params = base.copy()
    for slot in layout:
        if slot.name not in rows:
            continue
        ids, values = rows[slot.name]
        view = params[slot.offset:slot.end].reshape(slot.shape[0], -1)
        if ids is None:
            view[...] = values
        else:
            view[ids] = values
    return params


def size(rows: dict) -> int:
    """Values and ids the rows hold."""
    return sum(v.size + (0 if ids is None else ids.size) for ids, v in rows.values())


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
        lineage may still read it, see :mod:`rnnlm.spark.residuals`).
    """

    def __init__(self, sc, layout, every: int, fraction: float, retire=None):
        self.sc, self.layout, self.every, self.fraction, self.retire = sc, layout, every, fraction, retire
        self.base, self.bc_base, self.age = None, None, 0
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
        self.base, self.age = params.copy(), 0
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
            for b in old:
                b.destroy(blocking)
        self.bc_base, self.deltas = None, []


def delta_blocks(layout, delta, codec: str) -> dict:
    """``{slot: Block}`` of the rows of ``delta`` (P,) that are not zero (a slot with more than
    half of them goes whole)."""
    out = {}
    for slot in layout:
        d = delta[slot.offset:slot.end].reshape(slot.shape[0], -1)                       # (R, C)
        ids = np.flatnonzero(np.any(d != 0, axis=1)).astype(np.int32)
        if len(ids):
            whole = 2 * len(ids) > slot.shape[0]
            out[slot.name] = Block(d if whole else d[ids], slot.shape, None if whole else ids, codec)
    return out


def apply_delta(layout, view, blocks: dict) -> None:
    """Add :func:`delta_blocks`' decoded values to ``view`` (P,) in place."""
    for slot in layout:
        if slot.name in blocks:
            b = blocks[slot.name]
            v = view[slot.offset:slot.end].reshape(slot.shape[0], -1)
            if b.ids is None:
                v += b.decode()
            else:
                v[b.ids] += b.decode()


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
