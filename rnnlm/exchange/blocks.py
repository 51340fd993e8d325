"""Blocks: one parameter slot's change as it travels, and the sums merging forms.

A slot is seen as a matrix (R, C) (a vector (n,) as (n, 1)). A :class:`Block`
carries all its rows or only some (sorted ``ids``), with the values in a codec:

=========  ===================================================================
``f32``    float32 as computed
``fp16``   multiplied by a power of two F, cast to float16, divided by F on
           arrival (seed 002, section III-C). F is the largest power of two that
           keeps the block's largest magnitude below 2^15, so nothing overflows;
           an element comes back within ``|v| 2^-11 + max|v| 2^-24`` of ``v``
``bf16``   float32 truncated to its upper 16 bits (no scale needed: bfloat16
           keeps float32's exponent); within ``|v| 2^-7``
=========  ===================================================================

Merging never happens in a codec: a leaf's block is decoded once into a
float64 weighted :class:`Sum`; sums of row blocks merge as the union of their ids
with the values of shared rows added (seed 002's all-gather of indices followed
by an all-reduce over the union), so a level of the tree never holds more rows
than the union of what its partitions sent.
"""
from __future__ import annotations

import math

import numpy as np

CODECS = ("f32", "fp16", "bf16")
FP16_TOP = 2.0 ** 15        # scaled magnitudes stay below this (float16's largest is 65504)


def fp16_scale(values) -> float:
    """The power of two F that maps the block's largest magnitude just below 2^15."""
    top = float(np.max(np.abs(values))) if values.size else 0.0
    if top == 0.0 or not math.isfinite(top):
        return 1.0
    return 2.0 ** math.floor(math.log2(FP16_TOP / top))


class Block:
    """One slot's values as sent: ``ids`` (rows, sorted int32) or None for all rows.

    Parameters
    ----------
    values : float32 array (n, ...)
        The rows to send (all R rows when ``ids`` is None).
    shape : tuple
        The slot's full shape (R, ...); rows index its first axis.
    ids : int32 array (n,) or None
    codec : {"f32", "fp16", "bf16"}
    """

    __slots__ = ("shape", "ids", "codec", "data", "scale")

    def __init__(self, values, shape, ids=None, codec="f32"):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        self.shape, self.ids, self.codec, self.scale = tuple(shape), ids, codec, 1.0
        values = np.ascontiguousarray(values).reshape(len(values), -1)                     # (n, C)
        if codec == "f32":
            self.data = values          # float32, or float64 for a float64 model (model.dtype)
            return
        values = values.astype(np.float32, copy=False)
        if codec == "fp16":
            self.scale = fp16_scale(values)
            self.data = (values * np.float32(self.scale)).astype(np.float16)
        else:
            self.data = (values.view(np.uint32) >> 16).astype(np.uint16)

    def decode(self) -> np.ndarray:
        """The values (n, C) as float32."""
        if self.codec == "f32":
            return self.data
        if self.codec == "fp16":
            return self.data.astype(np.float32) / np.float32(self.scale)
        return (self.data.astype(np.uint32) << 16).view(np.float32)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.ids is None else len(self.ids)

    def __getstate__(self):
        return self.shape, self.ids, self.codec, self.data, self.scale

    def __setstate__(self, s):
        self.shape, self.ids, self.codec, self.data, self.scale = s


class Sum:
    """A float64 weighted sum of blocks of one slot: all rows, or the union of some."""

    __slots__ = ("shape", "ids", "values")

    def __init__(self, shape, ids, values):
        self.shape, self.ids, self.values = shape, ids, values

    @classmethod
    def of(cls, block: Block, weight: float) -> "Sum":
        return cls(block.shape, block.ids, np.multiply(block.decode(), weight, dtype=np.float64))

    def add(self, other: "Sum") -> "Sum":
        """Fold ``other`` in (in place where the shapes allow) and return the result."""
        if not self.values.flags.writeable:     # arrived from another process: read-only buffers
            self.values = self.values.copy()
        if self.ids is None and other.ids is None:
            self.values += other.values
            return self
        if self.ids is None:
            self.values[other.ids] += other.values
            return self
        if other.ids is None:
            return other.add(self)
        ids = np.union1d(self.ids, other.ids).astype(np.int32)
        if len(ids) == len(self.ids):
            self.values[np.searchsorted(ids, other.ids)] += other.values
            return self
        values = np.zeros((len(ids), self.values.shape[1]), np.float64)
        values[np.searchsorted(ids, self.ids)] = self.values
        values[np.searchsorted(ids, other.ids)] += other.values
        self.ids, self.values = ids, values
        return self

    def dense(self, scale: float, dtype) -> np.ndarray:
        """``scale`` times the sum as a full array of the slot's shape (rows not sent are zero)."""
        out = np.zeros(self.values.shape if self.ids is None else (self.shape[0], self.values.shape[1]), dtype)
        if self.ids is None:
            np.multiply(self.values, scale, out=out, casting="same_kind")
        else:
            out[self.ids] = self.values * scale
        return out.reshape(self.shape)

    def __getstate__(self):
        return self.shape, self.ids, self.values

    def __setstate__(self, s):
        self.shape, self.ids, self.values = s
