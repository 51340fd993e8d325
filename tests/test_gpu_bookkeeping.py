"""The GPU step's bookkeeping that needs no GPU, run in CI.

- :func:`rnnlm.core.gemm.matmul` maps row-major, strided and transposed operands onto cuBLAS's
  column-major ``gemm`` (which operand first, which transposed, which leading dimensions). Here
  ``gemm`` is a column-major matrix product written in NumPy over the same raw memory, so any wrong
  transpose, order or stride shows as a wrong product against ``numpy.matmul``; the device tests
  (``tests/test_gpu_step.py``) check the real cuBLAS against CuPy.
- :class:`rnnlm.core.graphs.StepGraphs`: a key's first step eager, its second captured, then replayed;
  the least recently used graph dropped first.
"""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from rnnlm.core import gemm, graphs


class _DeviceArray(np.ndarray):
    """A NumPy array with CuPy's ``.data.ptr``."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _dev(a):
    return np.asarray(a).view(_DeviceArray)


_XP = types.SimpleNamespace(
    empty=lambda shape, dtype: _dev(np.empty(shape, dtype)),
    ascontiguousarray=lambda a: _dev(np.ascontiguousarray(a)),
    cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0),
                               get_current_stream=lambda: types.SimpleNamespace(ptr=0)))


def _column_major(ptr, rows, cols, ld, dtype):
    """The (rows, cols) column-major matrix with leading dimension ``ld`` at address ``ptr``."""
    item = np.dtype(dtype).itemsize
    n = ld * (cols - 1) + rows
    flat = np.frombuffer((ctypes.c_char * (n * item)).from_address(ptr), dtype=dtype, count=n)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (item, ld * item))


def _gemm(dtype):
    def gemm_(handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        assert lda >= max(1, k if ta else m) and ldb >= max(1, n if tb else k) and ldc >= max(1, m)
        a = _column_major(A, *((k, m) if ta else (m, k)), lda, dtype)
        b = _column_major(B, *((n, k) if tb else (k, n)), ldb, dtype)
        _column_major(C, m, n, ldc, dtype)[...] = (a.T if ta else a) @ (b.T if tb else b)
    return gemm_


@pytest.fixture
def column_major_blas(monkeypatch):
    monkeypatch.setattr(gemm, "_cublas", types.SimpleNamespace(
        set_stream=lambda *a: None, sgemm=_gemm(np.float32), dgemm=_gemm(np.float64)))
    monkeypatch.setitem(gemm._handles, 0, (1, None))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_of_strided_and_transposed_operands(column_major_blas, dtype):
    r = np.random.default_rng(0)
    A, B = _dev(r.normal(size=(30, 41)).astype(dtype)), _dev(r.normal(size=(41, 23)).astype(dtype))
    wide = _dev(r.normal(size=(41, 3, 23)).astype(dtype))[:, 1, :]                       # rows strided
    hcat = _dev(r.normal(size=(41, 5, 7)).astype(dtype))[:, 1:, :].reshape(41, 28)       # cells.hout's layout
    cases = [(A, B), (A, _dev(B.T.copy()).T), (_dev(A.T.copy()).T, wide), (B.T, A.T), (A, B[:, 0]),
             (A[:, 0], A), (_dev(r.normal(size=(9, 28)).astype(dtype)), hcat.T),
             (hcat, _dev(r.normal(size=(28, 4)).astype(dtype))), (A[:1], B), (A, B[:, :1]), (A[::2], B)]
    for a, b in cases:
        got = gemm.matmul(_XP, a, b)
        want = np.asarray(a) @ np.asarray(b)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{a.strides} {b.strides}")
    for out in (_dev(np.zeros((30, 3, 23), dtype))[:, 1, :], _dev(np.zeros((23, 30), dtype)).T):
        gemm.matmul(_XP, A, B, out)                                                        # strided, transposed
        np.testing.assert_allclose(out, np.asarray(A) @ np.asarray(B), rtol=1e-5, atol=1e-5)


def test_products_check_their_shapes(column_major_blas):
    A = _dev(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="do not multiply"):
        gemm.matmul(_XP, A, A)
    with pytest.raises(ValueError, match="out is"):
        gemm.matmul(_XP, A, A.T, _dev(np.ones((3, 4), np.float32)))
    with pytest.raises(TypeError, match="one dtype"):
        gemm.matmul(_XP, A, _dev(np.ones((4, 2), np.float64)))


def test_a_key_runs_eagerly_then_is_captured_then_replayed(monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    made = []

    def make(name):
        return lambda: made.append(name) or name
    g = graphs.StepGraphs()
    assert g.get("a", make("a")) is None and made == []              # first step: eager
    assert g.get("a", make("a")) == "a" and made == ["a"]            # second: captured
    assert g.get("a", make("a")) == "a" and made == ["a"]            # then replayed, not captured again
    g.get("b", make("b"))
    g.get("b", make("b"))
    assert g.get("a", make("a")) == "a"                              # "a" used after "b"
    g.get("c", make("c"))
    g.get("c", make("c"))
    assert list(g.graphs) == ["a", "c"]                              # "b", the least recently used, dropped
    assert g.get("b", make("b")) == "b" and made == ["a", "b", "c", "b"]   # seen before: captured at once
