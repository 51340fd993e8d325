"""The GPU step's own parts, on a CUDA device only (CI has none; ``benchmarks/gpu_check.py`` runs
them on the device): the fused cell kernels against the unfused path, the capturable cuBLAS
products against CuPy's, and a CUDA-graph step against the same step run eagerly, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from rnnlm.config import ModelConfig, OptimConfig
from rnnlm.core import backend, cells, gemm, graphs
from rnnlm.core.local import train_steps
from rnnlm.core.models import build
from rnnlm.core.optim import make_optimizer
from rnnlm.core.sampled import corrected_sets, presence
from rnnlm.core.strategies import StreamBlock

pytestmark = pytest.mark.skipif(not backend.gpu_available(), reason="no CUDA device / CuPy")


@pytest.fixture
def cp():
    return backend.get_xp("gpu")


def _chunk(cp, fused, G, T=12, B=5, H=16):
    """One layer's forward and backward over a chunk with resets at steps 0, 5 and 9."""
    ws = cells.Workspace(cp, T, B, H, G, np.float32, fused=fused)
    r = np.random.default_rng(1)
    f32 = lambda *s: cp.asarray(r.normal(0, 0.5, s).astype(np.float32))   # noqa: E731
    Whh, b, state = f32(G * H, H), f32(G * H), f32(2 if G == 4 else 1, H, B)
    ws.zin[...] = f32(*ws.zin.shape)
    reset = np.zeros((T, B), bool)
    reset[0, 1] = reset[5, 2] = reset[9, 0] = True
    keep = cp.asarray((~reset).astype(np.float32))[:, None, :]
    steps = frozenset(np.nonzero(reset.any(axis=1))[0].tolist())
    dhout, dWhh = f32(H, T, B), cp.empty((G * H, H), np.float32)
    fwd, bwd = (cells.lstm_forward, cells.lstm_backward) if G == 4 else (cells.rnn_forward, cells.rnn_backward)
    fin = fwd(cp, ws, Whh, b, state, keep, steps)
    bwd(cp, ws, Whh, dhout, dWhh, keep, steps)
    return [backend.to_numpy(a) for a in (fin, ws.hcat, ws.c if G == 4 else fin, ws.dz, dWhh)]


@pytest.mark.parametrize("G", [4, 1], ids=["lstm", "rnn"])
def test_fused_cells_equal_the_unfused_path_bit_for_bit(cp, G):
    fused, unfused = _chunk(cp, True, G), _chunk(cp, False, G)
    for a, b in zip(fused, unfused):
        assert np.array_equal(a, b), float(np.abs(a.astype(np.float64) - b).max())
    assert np.abs(fused[3]).max() > 0                         # the gradients are not all zero


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_capturable_products_match_cupy(cp, dtype):
    if not gemm.available():
        pytest.skip("nvmath-python is not installed")
    r = np.random.default_rng(2)
    A = cp.asarray(r.normal(size=(30, 41)).astype(dtype))
    Bm = cp.asarray(r.normal(size=(41, 23)).astype(dtype))
    wide = cp.asarray(r.normal(size=(41, 3, 23)).astype(dtype))[:, 1, :]      # rows strided
    cases = [(A, Bm), (A, Bm.T.copy().T), (A.T.copy().T, wide), (Bm.T, A.T), (A, Bm[:, 0]), (A[:, 0], A)]
    tol = 2e-5 if dtype == "float32" else 1e-12
    for a, b in cases:
        got = gemm.matmul(cp, a, b)
        ref = cp.matmul(a, b)
        assert got.shape == ref.shape
        assert cp.allclose(got, ref, rtol=tol, atol=tol), (a.shape, a.strides, b.shape, b.strides)
    out = cp.zeros((30, 3, 23), dtype)[:, 1, :]                                 # a strided destination
    gemm.matmul(cp, A, Bm, out)
    assert cp.allclose(out, cp.matmul(A, Bm), rtol=tol, atol=tol)


def _train(xp, use_graphs, cell="lstm", steps=7, optim="momentum", dropout=0.0, biases="one", sampled=False):
    m = build(ModelConfig(cell=cell, vocab_size=300, embed=16, hidden=24, layers=2, dropout=dropout,
                          biases=biases), xp=xp)
    opt = make_optimizer(OptimConfig(name=optim, lr=0.5))
    p = m.init_params(3)
    st = opt.init_state(p)
    ids = (np.random.default_rng(4).zipf(1.4, 800) % 300).astype(np.int32)
    block = StreamBlock(ids, 4, 10)                            # a pass of 19 steps: resets at step 0 only
    state = m.zero_state(4)
    pres = presence(ids, 10, 300)
    res = None
    for k in range(0, steps * 3, steps):                       # three calls, as a trainer makes them
        drop = backend.rng_for(xp, 9, k) if dropout else None
        sets = None
        if sampled:                                            # the corrected sets, sizes varying by step
            sets = lambda i, y, k=k: corrected_sets(y, 300, 3, np.array([5, 7]), 0.05,   # noqa: E731
                                                    np.random.default_rng(k + i), pres)
        res = train_steps(m, opt, p, st, block.batches(k, steps), state, lr=0.5, clip_norm=0.5,
                          dropout_rng=drop, cuda_graphs=use_graphs, softmax_sets=sets)
        state = res.state
    return m, res, [backend.to_numpy(a) for a in (res.params, res.state, st["velocity"])]


@pytest.mark.parametrize("cell,dropout,biases,sampled", [
    ("lstm", 0.0, "one", False), ("rnn", 0.0, "one", False), ("lstm", 0.4, "one", False),
    ("lstm", 0.4, "two", False), ("rnn", 0.0, "two", False), ("lstm", 0.0, "one", True), ("lstm", 0.4, "two", True)])
def test_graph_steps_equal_eager_steps_bit_for_bit(cp, cell, dropout, biases, sampled):
    if not backend.graphs_available(cp):
        pytest.skip("nvmath-python is not installed")
    m, res, graphed = _train(cp, True, cell, dropout=dropout, biases=biases, sampled=sampled)
    assert len(graphs.StepGraphs.of(m).graphs) >= 1            # steps were replayed from a graph
    assert res.opt_state["t"] == 21
    m_eager, res_eager, eager = _train(cp, False, cell, dropout=dropout, biases=biases, sampled=sampled)
    assert not graphs.StepGraphs.of(m_eager).graphs
    for a, b in zip(graphed, eager):
        assert np.array_equal(a, b), float(np.abs(a.astype(np.float64) - b).max())
    assert res.loss_sum == res_eager.loss_sum and res.tokens == res_eager.tokens


def test_sumsq_accumulates_in_float64(cp):
    a = np.random.default_rng(5).normal(size=100_003).astype(np.float32)
    got = float(backend.sumsq(cp.asarray(a)))
    assert got == pytest.approx(float(np.sum(a.astype(np.float64) ** 2)), rel=1e-12)


def test_graphed_evaluation_equals_the_eager_one(cp, monkeypatch):
    if not backend.graphs_available(cp):
        pytest.skip("nvmath-python is not installed")
    from rnnlm.core.local import evaluate
    m = build(ModelConfig(cell="lstm", vocab_size=300, embed=16, hidden=24, layers=2), xp=cp)
    p = m.init_params(3)
    ids = (np.random.default_rng(6).zipf(1.4, 1003) % 300).astype(np.int32)
    replays = []
    replay = graphs.EvalGraph.replay
    monkeypatch.setattr(graphs.EvalGraph, "replay", lambda g, *a: replays.append(1) or replay(g, *a))
    got = evaluate(m, p, ids, 1, 20)                     # 50 chunks, 49 replayed, and a tail of 2
    assert len(replays) == 49
    assert evaluate(m, p, ids, 1, 20, cuda_graphs=False) == got      # the same float and int, to the bit
    assert len(replays) == 49 and got[1] == 1002
