"""Matrix products on CuPy through a cuBLAS handle of our own, so a CUDA graph can capture them.

CuPy refuses cuBLAS while a stream is being captured (``NotImplementedError: calling cuBLAS
API during stream capture is currently unsupported``, CuPy issue #6290); the cuBLAS bindings of
``nvmath-python`` (NVIDIA) do not. One handle per device, a fixed workspace (so cuBLAS picks the
same algorithm eagerly and under capture, and allocates nothing), the stream set per call to
CuPy's current one. Eager steps use it too, so an eager step and a replayed one agree to the bit.
cuBLAS is bitwise reproducible for one GPU model and toolkit on one stream.

A row-major (r, c) operand with row stride ``ld`` is cuBLAS's column-major (c, r) matrix with
leading dimension ``ld``; a transposed view (unit row stride) is the same matrix transposed.
Strided views of either kind go in without a copy; anything else is made contiguous first.
"""
from __future__ import annotations

import numpy as np

try:  # the gpu extra installs it
    from nvmath.bindings import cublas as _cublas
except Exception:  # ImportError, or CUDA libraries that fail to load
    _cublas = None

WORKSPACE_BYTES = 32 << 20      # what cuBLAS asks for on Hopper
_handles: dict = {}             # device id -> (handle, workspace array)
_ONE = {np.dtype(np.float32): np.ones(1, np.float32), np.dtype(np.float64): np.ones(1, np.float64)}
_ZERO = {k: np.zeros(1, v.dtype) for k, v in _ONE.items()}


def available() -> bool:
    """Whether the bindings imported (CuPy then multiplies through them)."""
    return _cublas is not None


def _handle(cupy):
    dev = cupy.cuda.Device().id
    if dev not in _handles:
        h = _cublas.create()
        ws = cupy.empty(WORKSPACE_BYTES, dtype=np.uint8)
        _cublas.set_workspace(h, ws.data.ptr, WORKSPACE_BYTES)
        _handles[dev] = (h, ws)
    return _handles[dev][0]


def _operand(cupy, a):
    """(array, transposed?, leading dimension) of a 2-d ``a`` with no empty side, in cuBLAS's column-major
    terms (a step of zero or below is never >= a side, so broadcast and reversed views are copied)."""
    r, c = a.shape
    s = a.itemsize
    s0, s1 = a.strides
    if (c == 1 or s1 == s) and (r == 1 or (s0 % s == 0 and s0 // s >= c)):
        return a, False, c if r == 1 else s0 // s                   # row-major: (c, r) column-major
    if (r == 1 or s0 == s) and s1 % s == 0 and s1 // s >= r:
        return a, True, s1 // s                                      # a transposed view
    return cupy.ascontiguousarray(a), False, c


def matmul(cupy, a, b, out=None):
    """``out = a @ b`` for 2-d ``a`` (m, k) and ``b`` (k, n), or 1-d ``b`` (k,) / ``a`` (k,):
    float32 or float64, ``out`` allocated when None. Returns ``out``."""
    vec_a, vec_b = a.ndim == 1, b.ndim == 1
    a2 = a.reshape(1, -1) if vec_a else a
    b2 = b.reshape(-1, 1) if vec_b else b
    if a2.ndim != 2 or b2.ndim != 2 or a2.shape[1] != b2.shape[0]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not multiply")
    m, k = a2.shape
    n = b2.shape[1]
    dtype = np.dtype(a.dtype)
    if dtype not in _ONE or b.dtype != dtype:
        raise TypeError(f"matmul: float32 or float64 operands of one dtype, got {a.dtype} and {b.dtype}")
    shape = (m,) if vec_b and not vec_a else (n,) if vec_a and not vec_b else () if vec_a else (m, n)
    if out is None:
        out = cupy.empty(shape, dtype=dtype)
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(f"matmul: out is {out.shape} {out.dtype}, the product is {shape} {dtype}")
    c2 = out.reshape(m, n)
    direct = c2.strides[1] == dtype.itemsize or n == 1
    direct = direct and (m == 1 or (c2.strides[0] % dtype.itemsize == 0 and c2.strides[0] // dtype.itemsize >= n))
    target = c2 if direct else cupy.empty((m, n), dtype=dtype)
    if k == 0:
        target.fill(0)
    elif m and n:
        ldc = n if m == 1 else target.strides[0] // dtype.itemsize
        A, ta, lda = _operand(cupy, a2)
        B, tb, ldb = _operand(cupy, b2)
        h = _handle(cupy)
        _cublas.set_stream(h, cupy.cuda.get_current_stream().ptr)
        gemm = _cublas.sgemm if dtype == np.float32 else _cublas.dgemm
        # column-major: out^T (n, m) = b^T (n, k) a^T (k, m)
        gemm(h, int(tb), int(ta), n, m, k, _ONE[dtype].ctypes.data, B.data.ptr, ldb,
             A.data.ptr, lda, _ZERO[dtype].ctypes.data, target.data.ptr, ldc)
    if target is not c2:
        c2[...] = target
    return out
