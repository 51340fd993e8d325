"""Blocks: one parameter slot's change as it travels, and the sums merging forms.

A slot is seen as a matrix (R, C) (a vector (n,) as (n, 1)). A :class:`Block` carries all its
rows or only some (sorted ``ids``) in a codec (``f32``, ``fp16``, ``bf16``, ``int8``, ``onebit``);
merging is in float64 sums (:class:`Sum`), never in a codec. docs/exchange.md ("What travels",
"Merging in the tree") gives each codec's rule and error bound, and why merges do not depend on
Spark's order.
"""
from __future__ import annotations

import math

import numpy as np

CODECS = ("f32", "fp16", "bf16", "int8", "onebit")
FP16_TOP = 2.0 ** 15        # scaled magnitudes stay below this (float16's largest is 65504)
FP16_EXPS = (-113, 127)     # the scale, a power of two: 2^-113 for float32's largest block, at most 2^127


def fp16_scale(values) -> float:
    """The power of two F that maps the block's largest magnitude just below 2^15, at most 2^127
    (float32's largest power of two: a block below 2^-112 keeps what float16 holds of it, not NaN)."""
    top = float(np.max(np.abs(values))) if values.size else 0.0
    if top == 0.0 or not math.isfinite(top):
        return 1.0
    return 2.0 ** min(math.floor(math.log2(FP16_TOP / top)), FP16_EXPS[1])


class Block:
    """One slot's values as sent: ``ids`` (rows, sorted int32) or None for all rows.

    Parameters
    ----------
    values : float32 array (n, ...)
        The rows to send (all R rows when ``ids`` is None).
    shape : tuple
        The slot's full shape (R, ...); rows index its first axis.
    ids : int32 array (n,) or None
    codec : {"f32", "fp16", "bf16", "onebit"}
    """

    __slots__ = ("shape", "ids", "codec", "data", "scale")

    def __init__(self, values, shape, ids=None, codec="f32"):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        self.shape, self.ids, self.codec, self.scale = tuple(shape), ids, codec, 1.0
        C = math.prod(self.shape[1:])                                   # (not -1: a block may hold no rows)
        values = np.ascontiguousarray(values).reshape(len(values), C)                      # (n, C)
        if codec == "f32":
            self.data = values          # float32, or float64 for a float64 model (model.dtype)
            return
        values = values.astype(np.float32, copy=False)
        if codec == "fp16":
            self.scale = fp16_scale(values)
            self.data = (values * np.float32(self.scale)).astype(np.float16)
        elif codec == "bf16":
            self.data = _bf16(values)
        elif codec == "int8":
            self.data, self.scale = _int8(values)
        else:
            self.data, self.scale = _onebit(values)

    def decode(self) -> np.ndarray:
        """The values (n, C) as float32."""
        if self.codec == "f32":
            return self.data
        if self.codec == "fp16":
            return self.data.astype(np.float32) / np.float32(self.scale)
        if self.codec == "bf16":
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        n, C = self.rows, int(np.prod(self.shape[1:], dtype=np.int64))
        if self.codec == "int8":
            return (self.data.astype(np.float32) * self.scale).reshape(n, C)
        _, per_group = group_shape(n, C)         # not n * C // groups: a block may hold no rows
        pos = np.unpackbits(self.data, axis=1, count=per_group).astype(bool)
        return np.where(pos, self.scale[:, :1], self.scale[:, 1:]).reshape(n, C)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.ids is None else len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the payload: values, row ids, per-row scales."""
        extra = self.scale.nbytes if isinstance(self.scale, np.ndarray) else 0
        return self.data.nbytes + extra + (0 if self.ids is None else self.ids.nbytes)

    def __getstate__(self):
        return self.shape, self.ids, self.codec, self.data, self.scale

    def __setstate__(self, s):
        self.shape, self.ids, self.codec, self.data, self.scale = s


def group_shape(n: int, C: int) -> tuple:
    """(g, m): the groups a per-group scale covers in ``n`` rows of ``C`` values: the rows, or a
    vector (C = 1) whole, since a scale per value would send more than float32."""
    return (1, n) if C == 1 else (n, C)


def wire_shapes(codec: str, n: int, C: int) -> tuple:
    """(data shape, scale shape or None for a scalar scale) of a block of ``n`` rows of ``C`` values
    in ``codec``: what a receiver checks before decoding, so decoding allocates no more than n x C."""
    g, m = group_shape(n, C)
    if codec == "int8":
        return (g, m), (g, 1)
    if codec == "onebit":
        return (g, -(-m // 8)), (g, 2)
    return (n, C), None


def _groups(values):
    """``values`` (n, C) as its groups (:func:`group_shape`), (g, m)."""
    return values.reshape(group_shape(*values.shape))


def _bf16(values):
    """bfloat16's bits (n, C) uint16 of float32 ``values`` (n, C): rounded to nearest, ties to even (cut
    to the upper half, every value shrank: by 0.28% on average); a finite value past bfloat16's largest
    keeps that largest, not infinity; NaN stays NaN."""
    u = values.view(np.uint32)
    with np.errstate(over="ignore"):                     # a NaN's bits may wrap: replaced below
        r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    r[np.isfinite(values) & (r & np.uint16(0x7FFF) == 0x7F80)] -= np.uint16(1)            # 0x7F7F: the largest
    nan = np.isnan(values)
    r[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)                          # a quiet NaN
    return r


def _int8(values):
    """(int8 values (g, m), scales (g, 1) float32) of ``values`` (n, C); a group holding NaN or infinity
    has scale NaN (it decodes to NaN, as no int8 can say it, and a receiver refuses it)."""
    g = _groups(values)
    bad = ~np.isfinite(g).all(axis=1, keepdims=True)                                       # (g, 1)
    g = np.where(bad, np.float32(0), g)
    top = np.abs(g).max(axis=1, keepdims=True) if g.size else np.zeros((g.shape[0], 1), np.float32)
    # at least the smallest subnormal (top / 127 is 0 below 64 of them); clipped: among subnormals top / 127
    # rounds down, and 128 would wrap to -128
    step = np.maximum(top / np.float32(127), np.float32(2.0 ** -149))
    scale = np.where(top > 0, step, np.float32(1)).astype(np.float32)                    # (g, 1)
    q = np.clip(np.rint(g / scale), -127, 127).astype(np.int8)
    return q, np.where(bad, np.float32(np.nan), scale).astype(np.float32)


def _onebit(values):
    """(sign bits (g, ceil(m/8)) uint8, scales (g, 2) float32) of ``values`` (n, C)."""
    g = _groups(values)
    pos = g >= 0
    npos = pos.sum(axis=1)
    sum_pos = np.where(pos, g, 0).sum(axis=1, dtype=np.float64)
    sum_neg = g.sum(axis=1, dtype=np.float64) - sum_pos
    scales = np.stack([sum_pos / np.maximum(npos, 1), sum_neg / np.maximum(g.shape[1] - npos, 1)], axis=1)
    return np.packbits(pos, axis=1), scales.astype(np.float32)


# the codec a merged sum travels in, per leaf codec (float64 models keep float64)
_SUM_WIRE = {"f32": "f32", "fp16": "fp16", "bf16": "bf16", "int8": "fp16", "onebit": "fp16"}


class Sum:
    """A float64 weighted sum of blocks of one slot: all rows, or the union of some.

    ``wire`` is the codec it travels in when pickled (see the module's docstring).
    """

    __slots__ = ("shape", "ids", "values", "wire")

    def __init__(self, shape, ids, values, wire="f32"):
        self.shape, self.ids, self.values, self.wire = shape, ids, values, wire

    @classmethod
    def of(cls, block: Block, weight: float) -> "Sum":
        wire = "f64" if block.data.dtype == np.float64 else _SUM_WIRE[block.codec]
        return cls(block.shape, block.ids, np.multiply(block.decode(), weight, dtype=np.float64), wire)

    def add(self, other: "Sum") -> "Sum":
        """Fold ``other`` in (in place where the shapes allow) and return the result."""
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
        values = self.values if self.wire == "f64" else self.values.astype(np.float32)
        return self.wire, Block(values, self.shape, self.ids, "f32" if self.wire == "f64" else self.wire)

    def __setstate__(self, s):
        self.wire, b = s
        self.shape, self.ids, self.values = b.shape, b.ids, b.decode().astype(np.float64)
