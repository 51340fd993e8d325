"""Flat parameter buffers: one vector, a table of named slices.

Averaging, broadcasting, clipping and optimizer updates are single vector
operations on the flat buffer; kernels see shaped views into it.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import NamedTuple


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    shape: tuple

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.size

    def view(self, flat):
        """This slot's shaped view into the flat buffer ``flat`` (P,)."""
        return flat[self.offset:self.end].reshape(self.shape)


class Layout:
    """An ordered table of ``(name, offset, shape)`` over a flat buffer."""

    def __init__(self, entries):
        self.slots: dict[str, Slot] = {}
        off = 0
        for name, shape in entries:
            if name in self.slots:
                raise ValueError(f"duplicate parameter name {name!r}")
            shape = tuple(int(s) for s in shape)
            self.slots[name] = Slot(name, off, shape)
            off += prod(shape)
        self.size = off

    def __iter__(self):
        return iter(self.slots.values())

    def __getitem__(self, name: str) -> Slot:
        return self.slots[name]

    def views(self, flat) -> dict:
        """Named, shaped views sharing memory with ``flat``."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat buffer has shape {flat.shape}, layout needs ({self.size},)")
        return {s.name: s.view(flat) for s in self}

    def describe(self) -> list:
        """JSON-ready table: ``[[name, offset, [shape...]], ...]``."""
        return [[s.name, s.offset, list(s.shape)] for s in self]

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self.describe() == other.describe()


class RowGrad(NamedTuple):
    """The gradient of a table ``slot`` (V, W) that is zero but on a few rows: ``rows`` (n,), distinct
    ids, and ``values`` (n, W), their gradient. A step that hands these to the optimizer leaves the
    slot's range of the flat gradient undefined (:func:`rnnlm.core.local.train_steps`)."""
    slot: Slot
    rows: object
    values: object


def dense_ranges(size: int, tables) -> list:
    """The slices of a flat buffer of ``size`` that the :class:`RowGrad` ``tables`` leave out, in order."""
    out, at = [], 0
    for s in sorted((t.slot for t in tables), key=lambda s: s.offset):
        if s.offset > at:
            out.append(slice(at, s.offset))
        at = s.end
    return out + ([slice(at, size)] if at < size else [])
