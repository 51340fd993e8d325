"""The broadcast that shrinks: a base the executors keep, and per round only the rows
that differ from it (seed 000's row selection, applied to what the driver sends).

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
"""
from __future__ import annotations

import numpy as np


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

    def round(self, params) -> tuple:
        """(base broadcast, rows for this round, whether a new base was broadcast)."""
        rows = None if self.base is None else changed_rows(self.layout, params, self.base)
        if (rows is None or size(rows) >= self.fraction * self.layout.size
                or (self.every and self.age >= self.every)):
            self.close()
            self.base, self.age = params.copy(), 0
            self.bc_base = self.sc.broadcast(self.base)
            self.rebases += 1
            return self.bc_base, {}, True
        self.age += 1
        return self.bc_base, rows, False

    def close(self):
        if self.bc_base is not None and self.retire is not None:
            self.retire([self.bc_base])
        elif self.bc_base is not None:
            self.bc_base.unpersist()
            self.bc_base.destroy()
        self.bc_base = None
