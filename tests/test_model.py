"""Forward semantics against an independent per-token reference."""
import numpy as np
import pytest

from rnnlm.core import backend
from rnnlm.config import ModelConfig
from rnnlm.core.layout import Layout, RowGrad, Slot, dense_ranges
from rnnlm.core.model import RNNLM


def _sig(a):
    return 1 / (1 + np.exp(-a))


def naive_nll(m, p, x, y, state, reset):
    """Per-stream, per-token loops straight from the cell equations (float64)."""
    v = {k: backend.to_numpy(a).astype(np.float64) for k, a in m.layout.views(p).items()}
    st = backend.to_numpy(state).astype(np.float64).copy()
    T, B = x.shape
    total, H = 0.0, m.H
    for b in range(B):
        hs = [st[layer, 0, :, b].copy() for layer in range(m.L)]
        cs = [st[layer, -1, :, b].copy() for layer in range(m.L)]
        for t in range(T):
            if reset is not None and reset[t, b]:
                hs = [np.zeros(H) for _ in hs]
                cs = [np.zeros(H) for _ in cs]
            tok = int(x[t, b])
            inp = v["embed"][tok]
            for layer in range(m.L):
                if layer == 0 and not m.E:   # one-hot input: embed is layer 0's input weights
                    a = np.eye(m.V)[tok] @ v["embed"]
                else:
                    a = v[f"Wx{layer}"] @ inp
                a = a + v[f"Whh{layer}"] @ hs[layer] + v[f"b{layer}"]
                if m.G == 1:
                    hs[layer] = np.tanh(a)
                else:
                    i, f, o, g = _sig(a[:H]), _sig(a[H:2 * H]), _sig(a[2 * H:3 * H]), np.tanh(a[3 * H:])
                    cs[layer] = f * cs[layer] + i * g
                    hs[layer] = o * np.tanh(cs[layer])
                inp = hs[layer]
            logits = v["Wo"] @ inp + v["bo"]
            if y[t, b] >= 0:
                total -= logits[y[t, b]] - np.log(np.exp(logits).sum())
    return total


@pytest.mark.parametrize("cell,layers,embed", [("rnn", 1, 0), ("lstm", 2, 5), ("lstm", 1, 0), ("rnn", 2, 5)])
def test_loss_equals_naive_per_token_sum(xp, cell, layers, embed):
    cfg = ModelConfig(cell=cell, vocab_size=11, embed=embed, hidden=6, layers=layers, init_scale=0.4)
    m = RNNLM(cfg, xp=xp)
    p = m.init_params(5)
    r = np.random.default_rng(1)
    x, y = r.integers(0, 11, (7, 4)), r.integers(0, 11, (7, 4))
    y[3, 2] = -1
    state = r.normal(0, 0.3, (layers, m.S, 6, 4)).astype(np.float32)
    reset = np.zeros((7, 4), bool)
    reset[4, 1] = reset[1, 3] = reset[6, 0] = True       # mid-chunk, at the second step, at the last
    loss, count, _ = m.loss(p, xp.asarray(x), xp.asarray(y), xp.asarray(state), xp.asarray(reset))
    assert count == 27
    assert loss == pytest.approx(naive_nll(m, p, x, y, state, reset), rel=1e-5)


@pytest.mark.parametrize("cell", ["rnn", "lstm"])
def test_one_chunk_of_2T_equals_two_chunks_with_carried_state(xp, cell):
    m = RNNLM(ModelConfig(cell=cell, vocab_size=9, embed=4, hidden=8, layers=2, init_scale=0.5), xp=xp, dtype="float64")
    p = m.init_params(2)
    r = np.random.default_rng(3)
    x, y = xp.asarray(r.integers(0, 9, (12, 3))), xp.asarray(r.integers(0, 9, (12, 3)))
    full, _, s_full = m.loss(p, x, y, m.zero_state(3))
    a, _, s = m.loss(p, x[:6], y[:6], m.zero_state(3))
    b, _, s2 = m.loss(p, x[6:], y[6:], s)
    assert a + b == pytest.approx(full, rel=1e-12)
    assert np.allclose(backend.to_numpy(s2), backend.to_numpy(s_full))
    # the carried state matters: a fresh second chunk scores differently
    assert m.loss(p, x[6:], y[6:], m.zero_state(3))[0] != pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize("cell", ["rnn", "lstm"])
def test_gathered_one_hot_input_equals_the_one_hot_product(xp, cell, monkeypatch):
    """Above ``ONE_HOT_INPUT_MAX_V`` (or on CuPy) one-hot input is gathered row by row: same loss,
    same gradient, and both equal the per-token reference."""
    cfg = ModelConfig(cell=cell, vocab_size=13, hidden=6, layers=2, init_scale=0.5)
    r = np.random.default_rng(6)
    x, y = r.integers(0, 13, (6, 3)), r.integers(0, 13, (6, 3))
    reset = np.zeros((6, 3), bool)
    reset[2, 1] = True
    state = r.normal(0, 0.3, (2, 2 if cell == "lstm" else 1, 6, 3))
    out = {}
    for limit in (80, 4):
        monkeypatch.setattr(backend, "ONE_HOT_INPUT_MAX_V", limit)
        m = RNNLM(cfg, xp=xp, dtype="float64")
        assert (m.chunk_buffers(6, 3).onehot is None) == (limit < 13 or xp is not np)
        p = m.init_params(7)
        g = xp.empty_like(p)
        loss, _, _ = m.loss_and_grad(p, g, xp.asarray(x), xp.asarray(y), xp.asarray(state), xp.asarray(reset),
                                     grad_scale=1.0)
        assert float(loss) == pytest.approx(naive_nll(m, p, x, y, state, reset), rel=1e-12)
        out[limit] = backend.to_numpy(g)
    assert np.allclose(out[4], out[80], rtol=1e-12, atol=1e-14)
    assert np.abs(out[4]).max() > 0


def test_reset_equals_fresh_state(xp):
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=9, hidden=8), xp=xp, dtype="float64")
    p = m.init_params(2)
    r = np.random.default_rng(4)
    x, y = xp.asarray(r.integers(0, 9, (5, 2))), xp.asarray(r.integers(0, 9, (5, 2)))
    carried = xp.asarray(r.normal(0, 1, (1, 2, 8, 2)))
    reset = xp.zeros((5, 2), dtype=bool)
    reset[0] = True
    assert m.loss(p, x, y, carried, reset)[0] == pytest.approx(m.loss(p, x, y, m.zero_state(2))[0], rel=1e-12)
    # a 0/1 integer mask means the same (its ~ was -1/-2: the state negated or doubled, every step a reset)
    mid = np.zeros((5, 2), dtype=np.int64)
    mid[2, 1] = 1
    as_bool = m.loss(p, x, y, carried, xp.asarray(mid.astype(bool)))[0]
    assert m.loss(p, x, y, carried, xp.asarray(mid))[0] == as_bool
    assert as_bool != m.loss(p, x, y, carried)[0]


def test_layout_is_one_flat_buffer_with_named_views():
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=10, embed=3, hidden=4, layers=2))
    p = m.init_params(0)
    v = m.layout.views(p)
    assert v["embed"].shape == (10, 3) and v["Wx0"].shape == (16, 3) and v["Whh1"].shape == (16, 4)
    assert v["Wo"].shape == (10, 4) and "Wx0" not in RNNLM(ModelConfig(vocab_size=10, hidden=4)).layout.slots
    v["Wo"][0, 0] = 42.0
    assert p[m.layout["Wo"].offset] == 42.0           # views share the buffer
    assert sum(s.size for s in m.layout) == p.size == m.layout.size


def test_init_is_seeded_and_forget_bias_set():
    cfg = ModelConfig(cell="lstm", vocab_size=10, hidden=4, forget_bias=1.0, init_scale=0.05)
    a, b = RNNLM(cfg).init_params(1), RNNLM(cfg).init_params(1)
    assert np.array_equal(a, b) and not np.array_equal(a, RNNLM(cfg).init_params(2))
    assert a.dtype == np.float32
    v = RNNLM(cfg).layout.views(a)
    assert np.all(v["b0"][4:8] == 1.0) and np.all(v["b0"][:4] == 0) and np.abs(v["embed"]).max() <= 0.05
    assert np.all(v["b0"][8:] == 0)                     # the forget gate's quarter only
    rnn = RNNLM(ModelConfig(cell="rnn", vocab_size=10, hidden=4, forget_bias=1.0))
    assert np.all(rnn.layout.views(rnn.init_params(1))["b0"] == 0)      # a tanh cell has no forget gate
    n = RNNLM(ModelConfig(vocab_size=10, hidden=64, init="normal", init_scale=1.0)).init_params(1)
    wh = RNNLM(ModelConfig(vocab_size=10, hidden=64, init="normal")).layout.views(n)["Whh0"]
    assert wh.std() == pytest.approx(1 / 8, rel=0.05)   # scale / sqrt(fan_in)
    assert abs(wh.mean()) < 0.01                        # centred: 4096 draws, the mean's sd 0.002
    for embed, std in ((50, 0.5), (0, 0.05)):          # a lookup table: fan-in 1; a one-hot product: V
        e = RNNLM(ModelConfig(vocab_size=100, hidden=64, embed=embed, init="normal", init_scale=0.5))
        assert e.layout.views(e.init_params(1))["embed"].std() == pytest.approx(std, rel=0.05)


def test_a_chunk_with_nothing_scored_has_zero_loss_and_zero_gradient(xp):
    """Every target unscored (a stream's padded end): no division by zero tokens, nothing to learn."""
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=9, embed=3, hidden=4), xp=xp, dtype="float64")
    p = m.init_params(2)
    x = xp.asarray(np.random.default_rng(0).integers(0, 9, (4, 2)))
    g = xp.full(p.shape, np.nan)
    loss, count, _ = m.loss_and_grad(p, g, x, xp.full((4, 2), -1), m.zero_state(2))
    assert float(loss) == 0.0 and int(count) == 0
    assert np.all(backend.to_numpy(g) == 0)


def test_float32_loss_is_stable_where_logits_are_large(xp):
    """The log-softmax shifts by the largest logit: a logit of 100 would overflow float32's exp
    (e^100 > 3.4e38 is not, e^200 is); the float32 loss equals the float64 one."""
    cfg = ModelConfig(cell="lstm", vocab_size=9, embed=3, hidden=4)
    m32, m64 = RNNLM(cfg, xp=xp, dtype="float32"), RNNLM(cfg, xp=xp, dtype="float64")
    p = m64.init_params(2)
    m64.layout.views(p)["bo"][3] = 100.0
    r = np.random.default_rng(1)
    x, y = xp.asarray(r.integers(0, 9, (4, 2))), xp.asarray(r.integers(0, 9, (4, 2)))
    want = m64.loss(p, x, y, m64.zero_state(2))[0]
    got = m32.loss(p.astype(np.float32), x, y, m32.zero_state(2))[0]
    assert np.isfinite(got) and want > 300 and got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("embed", [0, 6])
def test_dropout_masks_keep_a_unit_with_probability_1_minus_rate_scaled_by_its_inverse(embed):
    """Inverted dropout (Zaremba et al. 2014, as PyTorch's): a kept unit is scaled by 1 / (1 - rate), so
    a layer's expected output is the same with dropout as without; the gradient checks cannot see the
    scale (the forward and backward passes share the mask). The embedded input has a mask of its own."""
    rate = 0.3
    m = RNNLM(ModelConfig(vocab_size=10, hidden=50, layers=2, embed=embed, dropout=rate))
    buf = m.chunk_buffers(20, 40)
    m.draw_dropout(np.random.default_rng(0), buf)
    masks = buf.masks + ([buf.mask0] if embed else [])
    assert (buf.mask0 is None) == (embed == 0) and len(masks) == 2 + bool(embed)
    for mask in masks:
        kept = mask != 0
        assert np.all(mask[kept] == np.float32(1 / (1 - rate)))
        n = mask.size                                   # 40,000 or 4,800 draws: 5 sd of the kept share
        assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n), kept.mean()


def test_a_model_needs_its_vocabulary_size():
    with pytest.raises(ValueError, match="model.vocab_size must be set"):
        RNNLM(ModelConfig(vocab_size=0))
    assert RNNLM(ModelConfig(vocab_size=1)).V == 1


def _tables(*spans):
    return [RowGrad(Slot(f"t{i}", a, (b - a,)), None, None) for i, (a, b) in enumerate(spans)]


@pytest.mark.parametrize("spans, dense", [
    ([], [(0, 10)]),
    ([(5, 7), (0, 3)], [(3, 5), (7, 10)]),               # in any order; no empty range before the first
    ([(2, 4), (4, 6)], [(0, 2), (6, 10)]),               # adjacent tables leave nothing between them
    ([(0, 4), (7, 10)], [(4, 7)]),                       # nothing after a table that ends the buffer
    ([(0, 10)], []),
])
def test_dense_ranges_are_what_the_row_tables_leave_out(spans, dense):
    """The slices of the flat gradient a step still fills densely around the row-sparse tables."""
    assert dense_ranges(10, _tables(*spans)) == [slice(a, b) for a, b in dense]


def test_layouts_are_equal_when_their_tables_are():
    a, b = Layout([("w", (2, 3)), ("b", (3,))]), Layout([("w", (2, 3)), ("b", (3,))])
    assert a == b and a != Layout([("w", (3, 2)), ("b", (3,))]) and a != a.describe()
