"""The broadcast's maths, without Spark: the rows of the parameters that differ from a base the
executors keep (:func:`changed_rows`, rebuilt bit for bit by :func:`rebuild`), and coded deltas
(:func:`delta_blocks`, added by :func:`apply_delta`).

The broadcasts themselves are :mod:`rnnlm.spark.broadcasts`'; docs/exchange.md ("The broadcast")
says when a base is renewed and how a delta view catches up.
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
