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

The delta broadcast (``exchange.broadcast = "delta+CODEC"``) sends less: per round
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
