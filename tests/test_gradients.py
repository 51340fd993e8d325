"""Finite-difference gradient checks in float64 (Chainer check_backward style)."""
import numpy as np
import pytest

from rnnlm.core import backend
from rnnlm.config import ModelConfig
from rnnlm.core.model import RNNLM


def _setup(xp, cell, layers, embed, dropout=0.0, T=5, B=3, V=7, H=4, biases="one"):
    cfg = ModelConfig(cell=cell, vocab_size=V, embed=embed, hidden=H, layers=layers,
                      dropout=dropout, init_scale=0.5, forget_bias=1.0, biases=biases)
    m = RNNLM(cfg, xp=xp, dtype="float64")
    r = np.random.default_rng(7)
    x = xp.asarray(r.integers(0, V, (T, B)))
    y = r.integers(0, V, (T, B))
    y[1, 0] = -1                                        # an unscored position
    y = xp.asarray(y)
    state = xp.asarray(r.normal(0, 0.5, (layers, m.S, H, B)))   # carried input state
    reset = np.zeros((T, B), bool)
    reset[2, 1] = reset[0, 2] = reset[1, 0] = True      # streams restarting mid-chunk, at the first step, the second
    return m, m.init_params(3), x, y, state, xp.asarray(reset)


@pytest.mark.parametrize("cell", ["rnn", "lstm"])
@pytest.mark.parametrize("layers,embed,H", [(1, 0, 4), (2, 0, 4), (1, 3, 4), (2, 3, 4), (2, 0, 16)],
                         ids=["1-onehot", "2-onehot", "1-embed", "2-embed", "2-onehot-H16"])
def test_gradients_match_finite_differences(xp, cell, layers, embed, H, numeric_grad):
    """H = 16 takes the backward's panel transpose of Whh (backend.transpose_into), H = 4 the plain copy."""
    m, p, x, y, state, reset = _setup(xp, cell, layers, embed, H=H)
    g = xp.zeros_like(p)
    m.loss_and_grad(p, g, x, y, state, reset, grad_scale=1.0)
    num = numeric_grad(lambda q: m.loss(q, x, y, state, reset)[0], p)
    g = backend.to_numpy(g)
    for slot in m.layout:   # per parameter, so a failure names it
        a, b = g[slot.offset:slot.end], num[slot.offset:slot.end]
        assert np.allclose(a, b, rtol=1e-5, atol=1e-7), slot.name
        assert np.abs(b).max() > 0, f"{slot.name} receives no gradient"


@pytest.mark.parametrize("cell", ["rnn", "lstm"])
def test_two_biases_per_gate_are_their_sum_and_share_its_gradient(xp, cell, numeric_grad):
    """model.biases = "two" (Torch's b_ih and b_hh): the model is the one-bias model whose bias
    is their sum, every bias is drawn, and each of the two gets the sum's gradient."""
    m, p, x, y, state, reset = _setup(xp, cell, 2, 3, biases="two")
    one, q = _setup(xp, cell, 2, 3)[:2]
    v, w = m.layout.views(p), one.layout.views(q)
    for name in w:
        w[name][...] = v[name] + v["bh" + name[1:]] if name in ("b0", "b1") else v[name]
    assert all(float(abs(v[k]).min()) > 0 for k in ("b0", "bh0", "b1", "bh1", "bo"))   # drawn, not zero
    assert m.loss(p, x, y, state, reset)[0] == pytest.approx(one.loss(q, x, y, state, reset)[0], rel=1e-13)
    g = xp.zeros_like(p)
    m.loss_and_grad(p, g, x, y, state, reset, grad_scale=1.0)
    num = numeric_grad(lambda r: m.loss(r, x, y, state, reset)[0], p)
    assert np.allclose(backend.to_numpy(g), num, rtol=1e-5, atol=1e-7)
    gv = m.layout.views(backend.to_numpy(g))
    assert np.array_equal(gv["b0"], gv["bh0"]) and np.abs(gv["b1"]).max() > 0


@pytest.mark.parametrize("layers", [2, 3])                 # 3: the top layer's mask is not the second's
def test_gradients_with_dropout(xp, numeric_grad, layers):
    m, p, x, y, state, reset = _setup(xp, "lstm", layers, 3, dropout=0.3)
    g = xp.zeros_like(p)
    m.loss_and_grad(p, g, x, y, state, reset, grad_scale=1.0, rng=backend.rng_for(xp, 1, 2))

    def f(q):
        scratch = xp.zeros_like(q)
        return m.loss_and_grad(q, scratch, x, y, state, reset, grad_scale=1.0,
                               rng=backend.rng_for(xp, 1, 2))[0]
    num = numeric_grad(f, p)
    assert np.allclose(backend.to_numpy(g), num, rtol=1e-5, atol=1e-7)
    # dropout actually changed the function
    assert abs(f(p) - m.loss(p, x, y, state, reset)[0]) > 1e-6


def test_grad_scale_scales_gradient(xp):
    m, p, x, y, state, reset = _setup(xp, "rnn", 1, 0)
    g1, g2 = xp.zeros_like(p), xp.zeros_like(p)
    m.loss_and_grad(p, g1, x, y, state, reset, grad_scale=1.0)
    n = int(m.loss_and_grad(p, g2, x, y, state, reset)[1])  # default: mean over scored tokens
    assert n == 14
    assert np.allclose(backend.to_numpy(g2) * n, backend.to_numpy(g1))
