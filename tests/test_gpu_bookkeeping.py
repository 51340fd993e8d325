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


_HANDLE = object()      # the handle gemm's fixture hands out: every call must pass it


def _gemm(dtype):
    """cuBLAS's ``gemm`` on host memory: C = alpha op(A) op(B) + beta C, column-major, with its checks
    of the leading dimensions; alpha and beta are read through their pointers as cuBLAS reads them."""
    def gemm_(handle, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        assert handle is _HANDLE
        assert min(m, n, k) > 0, "rnnlm calls gemm with no empty dimension"
        assert lda >= max(1, k if ta else m) and ldb >= max(1, n if tb else k) and ldc >= max(1, m)
        a = _column_major(A, *((k, m) if ta else (m, k)), lda, dtype)
        b = _column_major(B, *((n, k) if tb else (k, n)), ldb, dtype)
        c = _column_major(C, m, n, ldc, dtype)
        size = np.dtype(dtype).itemsize
        al, be = (np.frombuffer((ctypes.c_char * size).from_address(p), dtype=dtype)[0] for p in (alpha, beta))
        c[...] = al * ((a.T if ta else a) @ (b.T if tb else b)) + (be * c if be else 0)
    return gemm_


@pytest.fixture
def column_major_blas(monkeypatch):
    """gemm's cuBLAS replaced by :func:`_gemm`; returns what :func:`gemm.matmul` copied or allocated
    on the "device" (``("copy", shape)``, ``("empty", shape)``), the caller's ``out`` aside."""
    made = []

    def ascontiguousarray(a):
        made.append(("copy", a.shape))
        return _dev(np.ascontiguousarray(a))

    def empty(shape, dtype):
        made.append(("empty", shape))
        return _dev(np.empty(shape, dtype))

    def set_stream(handle, stream):
        assert handle is _HANDLE
    monkeypatch.setattr(gemm, "_cublas", types.SimpleNamespace(
        set_stream=set_stream, sgemm=_gemm(np.float32), dgemm=_gemm(np.float64)))
    monkeypatch.setitem(gemm._handles, 0, (_HANDLE, None))
    monkeypatch.setattr(_XP, "ascontiguousarray", ascontiguousarray)
    monkeypatch.setattr(_XP, "empty", empty)
    return made


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


def _packed(dtype, rows, cols):
    """A (rows, cols) view whose steps are no multiple of the item size: a field of packed records."""
    rec = np.zeros((cols, rows), np.dtype([("v", dtype), ("pad", np.uint8)]))
    rec["v"] = np.random.default_rng(4).normal(size=(cols, rows))
    return _dev(rec["v"]).T


def _operands(dtype):
    """(name, array) of every layout a row-major or transposed view can have, sized to multiply a (k=6) side."""
    r = np.random.default_rng(1)

    def n(*shape):
        return _dev(r.normal(size=shape).astype(dtype))
    return [("row-major", n(5, 6)), ("transposed", n(6, 5).T), ("rows strided", n(5, 3, 6)[:, 1, :]),
            ("transposed, columns strided", n(6, 3, 5)[:, 1, :].T), ("one row", n(1, 6)),
            ("one row of a wide view", n(4, 9)[2:3, 1:7]), ("one column", n(6, 9)[:, 4:5].T),
            ("one row strided", n(8, 2)[:, :1].T[:, 1:7]), ("one column, rows strided", n(1, 6, 3)[:, :, 1]),
            ("one row of a vector", n(6)[None, :])]


def _copied(dtype):
    """(name, array) of layouts cuBLAS cannot read as they lie, each (5, 6)."""
    r = np.random.default_rng(2)
    base = _dev(r.normal(size=(12, 14)).astype(dtype))
    flat = _dev(r.normal(size=16).astype(dtype))
    s = flat.itemsize
    windows = np.lib.stride_tricks.as_strided(flat, (5, 6), (s, s))
    return [("every other, both ways", base[:10:2, :12:2]), ("rows reversed", base[4::-1, :6]),
            ("columns reversed", base[:5, 5::-1]), ("broadcast rows", _dev(np.broadcast_to(base[0, :6], (5, 6)))),
            ("overlapping rows", _dev(windows)),
            ("overlapping columns", _dev(np.lib.stride_tricks.as_strided(flat, (5, 6), (s, 2 * s)))),
            ("packed records", _packed(dtype, 5, 6)), ("packed records, transposed", _packed(dtype, 6, 5).T)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_views_go_in_without_a_copy(column_major_blas, dtype):
    """Row-major and transposed views, strided or not, are passed as they lie (the module's promise),
    and the product lands in ``out`` directly; whatever cuBLAS cannot read (steps between elements in
    both directions, reversed, broadcast, overlapping, no multiple of the item) is copied first."""
    made = column_major_blas
    ops = _operands(dtype)
    for name, a in ops:
        for other, b in ops:
            out = _dev(np.empty((a.shape[0], b.shape[0]), dtype))
            gemm.matmul(_XP, a, b.T, out)                                      # (r, 6) @ (6, r')
            np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(b).T, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} @ ({other}).T")
            assert made == [], f"{name} @ ({other}).T: {made}"
    b = _dev(np.random.default_rng(3).normal(size=(6, 7)).astype(dtype))
    for name, a in _copied(dtype):
        made.clear()
        got = gemm.matmul(_XP, a, b)
        np.testing.assert_allclose(got, np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
        assert made == [("empty", (5, 7)), ("copy", (5, 6))], name
        made.clear()
        got = gemm.matmul(_XP, b.T, a.T)
        np.testing.assert_allclose(got, np.asarray(b).T @ np.asarray(a).T, rtol=1e-5, atol=1e-5, err_msg=name)
        assert made == [("empty", (7, 5)), ("copy", (6, 5))], name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_out_cublas_cannot_write_gets_the_product_through_a_buffer(column_major_blas, dtype):
    made = column_major_blas
    r = np.random.default_rng(5)
    A, B = _dev(r.normal(size=(5, 6)).astype(dtype)), _dev(r.normal(size=(6, 3)).astype(dtype))
    item = np.dtype(dtype).itemsize
    unaligned = np.lib.stride_tricks.as_strided(np.zeros(40, dtype), (5, 3), (3 * item + 1, item))
    direct = [_dev(np.zeros((5, 4, 3), dtype))[:, 2, :], _dev(np.zeros((9, 3), dtype))[2:7],
              _dev(np.zeros((5, 4), dtype))[:, :3], _dev(np.zeros(3, dtype))[None, :]]
    buffered = [_dev(np.zeros((3, 5), dtype)).T, _dev(np.zeros((5, 6), dtype))[:, ::2],
                _packed(dtype, 5, 3), _dev(np.zeros((5, 3), dtype))[::-1], _dev(np.zeros((5, 6), dtype))[:1, ::2],
                _dev(unaligned)]                                                  # rows 3 items and a byte apart
    for out in direct + buffered:
        made.clear()
        gemm.matmul(_XP, A[:out.shape[0]], B, out)
        np.testing.assert_allclose(out, np.asarray(A[:out.shape[0]]) @ np.asarray(B), rtol=1e-5, atol=1e-5,
                                   err_msg=str(out.strides))
        assert made == ([] if any(out is o for o in direct) else [("empty", out.shape)]), out.strides
    for a, b, out in [(A[:1], B, _dev(np.zeros((4, 3), dtype))[1:2]),
                      (A, B[:, :1], _dev(np.zeros((5, 2), dtype))[:, 1:]),
                      (A, B[:, 0], _dev(np.zeros((5, 2), dtype))[:, 1]), (A[0], B, _dev(np.zeros((2, 3), dtype))[1])]:
        made.clear()
        gemm.matmul(_XP, a, b, out)                                           # one row or column: written in place
        np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5)
        assert made == [], (a.shape, b.shape, out.strides)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_overwrite_their_out_and_take_empty_sides(column_major_blas, dtype):
    """``out`` is overwritten (cuBLAS's beta is zero), an empty inner dimension gives zeros, and an
    empty outer one an empty product; vectors on either side give vectors."""
    r = np.random.default_rng(3)
    A, B = _dev(r.normal(size=(4, 5)).astype(dtype)), _dev(r.normal(size=(5, 3)).astype(dtype))
    out = _dev(np.full((4, 3), 7.0, dtype))
    assert gemm.matmul(_XP, A, B, out) is out
    np.testing.assert_allclose(out, np.asarray(A) @ np.asarray(B), rtol=1e-5, atol=1e-5)
    out = _dev(np.full((4, 3), 7.0, dtype))
    gemm.matmul(_XP, A[:, :0], B[:0], out)
    assert (np.asarray(out) == 0).all()
    assert gemm.matmul(_XP, A[:0], B).shape == (0, 3) and gemm.matmul(_XP, A, B[:, :0]).shape == (4, 0)
    v = _dev(r.normal(size=5).astype(dtype))
    np.testing.assert_allclose(gemm.matmul(_XP, A, v), np.asarray(A) @ np.asarray(v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gemm.matmul(_XP, v, B), np.asarray(v) @ np.asarray(B), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gemm.matmul(_XP, v, v), np.asarray(v) @ np.asarray(v), rtol=1e-5, atol=1e-5)
    assert gemm.matmul(_XP, v, v).shape == ()


def test_products_check_their_shapes(column_major_blas):
    A = _dev(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="do not multiply"):
        gemm.matmul(_XP, A, A)
    with pytest.raises(ValueError, match="out is"):
        gemm.matmul(_XP, A, A.T, _dev(np.ones((3, 4), np.float32)))
    with pytest.raises(ValueError, match="do not multiply"):
        gemm.matmul(_XP, _dev(np.ones((2, 3, 4), np.float32)), A.T)
    with pytest.raises(ValueError, match="do not multiply"):
        gemm.matmul(_XP, A, _dev(np.ones((2, 4, 3), np.float32)))
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


def test_a_step_is_captured_only_where_every_step_runs_the_same_kernels(monkeypatch):
    """Graphs need CuPy with the cuBLAS bindings, the recurrent model, an optimizer whose update is the
    same every step and the batch's norm (a token norm's scale depends on the batch)."""
    sgd, adam = types.SimpleNamespace(same_every_step=True), types.SimpleNamespace(same_every_step=False)
    rnn, ffnn = types.SimpleNamespace(xp=np, resets=None), types.SimpleNamespace(xp=np)
    assert not graphs.usable(rnn, sgd, grad_norm="batch")                   # NumPy: nothing to capture
    monkeypatch.setattr(graphs.backend, "graphs_available", lambda xp: True)
    assert graphs.capturable(rnn) and not graphs.capturable(ffnn)
    assert graphs.usable(rnn, sgd, grad_norm="batch")
    assert not graphs.usable(rnn, adam, grad_norm="batch")
    assert not graphs.usable(rnn, sgd, grad_norm="token")
    assert not graphs.usable(ffnn, sgd, grad_norm="batch")


def test_a_step_key_holds_what_a_graph_freezes():
    """Buffer addresses, shapes, reset steps and the frozen scalars; not the optimizer's step count,
    which a graph reads from the device."""
    def args(**over):
        a = dict(optimizer=types.SimpleNamespace(cfg=("sgd", 1.0)), params=_dev(np.zeros(8)), grads=_dev(np.zeros(8)),
                 opt_state={"t": _dev(np.zeros(1)), "m": _dev(np.zeros(8))}, x=np.zeros((3, 2), np.int32),
                 y=np.zeros((3, 2), np.int32), resets=None, state=np.zeros((2, 2, 4)))
        a.update(over)
        return a
    base = args()
    key = graphs.step_key(**base, lr=0.1)
    assert graphs.step_key(**base, lr=0.1) == key
    assert graphs.step_key(**{**base, "opt_state": {**base["opt_state"], "t": _dev(np.zeros(1))}}, lr=0.1) == key
    for name, over in [("m", {"opt_state": {**base["opt_state"], "m": _dev(np.zeros(8))}}),
                       ("params", {"params": _dev(np.zeros(8))}), ("grads", {"grads": _dev(np.zeros(8))}),
                       ("x", {"x": np.zeros((4, 2), np.int32)}), ("y", {"y": np.zeros((3, 2), np.int64)}),
                       ("state", {"state": np.zeros((2, 3, 4))}),
                       ("resets", {"resets": types.SimpleNamespace(steps=(1,))})]:
        assert graphs.step_key(**{**base, **over}, lr=0.1) != key, name
    assert graphs.step_key(**base, lr=0.2) != key


def test_the_keys_seen_once_are_forgotten_past_a_thousand():
    g = graphs.StepGraphs()
    for i in range(1001):
        assert g.get(i, None) is None
    assert len(g.seen) == 1001
    assert g.get(1001, None) is None and g.seen == {1001}                  # a trainer's rounds allocate anew
    assert g.get(0, None) is None                                           # forgotten: eager again
