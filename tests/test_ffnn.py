"""The feed-forward NNLM (Tai and Xu 2014): gradients, context window, carried state, resets, learning."""
import numpy as np
import pytest

from rnnlm.core import backend
from rnnlm.config import ModelConfig, OptimConfig
from rnnlm.core.ffnn import FFNNLM
from rnnlm.core.local import evaluate, train_steps
from rnnlm.core.models import build
from rnnlm.core.optim import make_optimizer
from rnnlm.core.strategies import StreamBlock


def _model(xp, V=9, E=3, H=5, K=3, dtype="float64", **kw):
    cfg = ModelConfig(cell="ffnn", vocab_size=V, embed=E, hidden=H, context=K, init_scale=0.5, **kw)
    return FFNNLM(cfg, xp=xp, dtype=dtype)


def _data(m, T, B, seed=7):
    """Inputs, targets (one unscored) and a carried state of real previous words (id + 1)."""
    r = np.random.default_rng(seed)
    x, y = r.integers(0, m.V, (T, B)), r.integers(0, m.V, (T, B))
    y[1, 0] = -1
    state = r.integers(1, m.V + 1, (1, 1, m.K - 1, B)).astype(np.float64)
    return x, y, state


def _ref_nll(m, p, x, y, state):
    """Per-stream, per-position loops straight from the formula (float64, no resets)."""
    v = {k: backend.to_numpy(a).astype(np.float64) for k, a in m.layout.views(p).items()}
    total = 0.0
    for b in range(x.shape[1]):
        hist = [int(w) - 1 for w in state[0, 0, :, b]] + [int(w) for w in x[:, b]]   # -1: no word
        for t in range(x.shape[0]):
            words = hist[t:t + m.K]                             # the K words ending at x[t, b]
            ctx = np.concatenate([v["embed"][w] if w >= 0 else np.zeros(m.E) for w in words])
            logits = v["Wo"] @ np.tanh(v["W1"] @ ctx + v["b1"]) + v["bo"]
            if y[t, b] >= 0:
                total -= logits[y[t, b]] - np.log(np.exp(logits).sum())
    return total


@pytest.mark.parametrize("K", [1, 3, 6])
def test_gradients_match_finite_differences(xp, K, numeric_grad):
    m = _model(xp, K=K)
    T, B = 4, 2
    x, y, state = _data(m, T, B)
    state[0, 0, :1, 1] = 0                              # a stream that started K - 2 words ago
    reset = np.zeros((T, B), bool)
    reset[2, 1] = True                                  # a stream restarting mid-chunk
    x, y, state, reset = (xp.asarray(a) for a in (x, y, state, reset))
    p = m.init_params(3)
    g = xp.full(p.shape, np.nan)                        # every slot must be overwritten
    loss, count, _ = m.loss_and_grad(p, g, x, y, state, reset, grad_scale=1.0)
    loss, count = float(loss), int(count)               # 0-d arrays on a GPU
    assert count == T * B - 1 and loss == pytest.approx(m.loss(p, x, y, state, reset)[0], rel=1e-12)
    num = numeric_grad(lambda q: m.loss(xp.asarray(q), x, y, state, reset)[0], backend.to_numpy(p))
    g = backend.to_numpy(g)
    for slot in m.layout:   # per parameter, so a failure names it
        a, b = g[slot.offset:slot.end], num[slot.offset:slot.end]
        assert np.abs(b).max() > 0, f"{slot.name} receives no gradient"
        assert np.abs(a - b).max() / np.abs(b).max() < 1e-6, slot.name
    g2 = xp.zeros_like(p)
    m.loss_and_grad(p, g2, x, y, state, reset, rng=object())   # default: mean over scored tokens
    assert np.allclose(backend.to_numpy(g2) * count, g, rtol=1e-12, atol=1e-15)


def test_one_chunk_of_2T_equals_two_chunks_with_carried_state(xp):
    m = _model(xp, V=11, E=4, H=8, K=4)
    x, y, _ = _data(m, 12, 3, seed=3)
    x, y = xp.asarray(x), xp.asarray(y)
    p = m.init_params(2)
    full, n, s_full = m.loss(p, x, y, m.zero_state(3))
    a, na, s = m.loss(p, x[:6], y[:6], m.zero_state(3))
    b, nb, s2 = m.loss(p, x[6:], y[6:], s)
    assert a + b == pytest.approx(full, rel=1e-12) and na + nb == n
    last = backend.to_numpy(x[-3:]) + 1                 # the last K - 1 tokens (+ 1), oldest first
    assert np.array_equal(backend.to_numpy(s_full)[0, 0], last)
    assert np.array_equal(backend.to_numpy(s2), backend.to_numpy(s_full))
    # the carried words matter: a fresh second chunk scores differently
    assert m.loss(p, x[6:], y[6:], m.zero_state(3))[0] != pytest.approx(b, rel=1e-6)


def test_loss_equals_formula_and_reads_exactly_K_words(xp):
    m = _model(xp, V=6, E=2, H=3, K=3)
    x, y, state = _data(m, 5, 2, seed=11)
    state[0, 0, 0, 0] = 0                               # no word before the carried one
    p = m.init_params(4)
    loss, count, _ = m.loss(p, xp.asarray(x), xp.asarray(y), xp.asarray(state))
    assert count == 9
    assert loss == pytest.approx(_ref_nll(m, p, x, y, state), rel=1e-12)
    ref0 = _ref_nll(m, p, x, y, np.zeros_like(state))   # a fresh start: missing words are zero vectors
    assert m.loss(p, xp.asarray(x), xp.asarray(y), m.zero_state(2))[0] == pytest.approx(ref0, rel=1e-12)

    seq = np.random.default_rng(5).integers(0, 6, (8, 1))
    base = backend.to_numpy(m.next_logits(p, xp.asarray(seq), m.zero_state(1))[0])

    def changed(back):                                  # logits after changing the token `back` steps back
        s = seq.copy()
        s[-1 - back] = (s[-1 - back] + 1) % 6
        return backend.to_numpy(m.next_logits(p, xp.asarray(s), m.zero_state(1))[0])
    assert np.array_equal(changed(m.K), base)           # outside the window
    assert np.array_equal(changed(m.K + 1), base)
    assert not np.allclose(changed(m.K - 1), base)      # the oldest word inside it


def test_reset_equals_fresh_stream(xp):
    m = _model(xp, V=9, E=3, H=6, K=3)
    T = 6
    x, y, state = _data(m, T, 2, seed=2)
    reset = np.zeros((T, 2), bool)
    reset[3, 1] = True                                  # stream 1 restarts at step 3
    reset[T - 1, 0] = True                              # stream 0 restarts at the last step
    p = m.init_params(1)
    X, Y, S = xp.asarray(x), xp.asarray(y), xp.asarray(state)
    loss, count, new = m.loss(p, X, Y, S, xp.asarray(reset))
    parts = [m.loss(p, X[:T - 1, :1], Y[:T - 1, :1], S[..., :1]),
             m.loss(p, X[T - 1:, :1], Y[T - 1:, :1], m.zero_state(1)),
             m.loss(p, X[:3, 1:], Y[:3, 1:], S[..., 1:]),
             m.loss(p, X[3:, 1:], Y[3:, 1:], m.zero_state(1))]
    assert loss == pytest.approx(sum(q[0] for q in parts), rel=1e-12)
    assert count == sum(q[1] for q in parts)
    new = backend.to_numpy(new)
    assert new[0, 0, :, 0].tolist() == [0, x[T - 1, 0] + 1]        # nothing before the reset is kept
    assert np.array_equal(new[..., 1], backend.to_numpy(parts[3][2])[..., 0])
    # the reset matters
    assert m.loss(p, X, Y, S)[0] != pytest.approx(loss, rel=1e-6)


def _train_on_sentence(xp, K, steps=200):
    words = "the cat sat on the mat and the dog sat on it".split()
    names = sorted(set(words))
    ids = np.tile(np.array([names.index(w) for w in words], np.int32), 20)   # 240 tokens
    m = _model(xp, V=len(names), E=10, H=32, K=K, dtype="float32")
    opt = make_optimizer(OptimConfig(name="adagrad", lr=0.5))
    p = m.init_params(0)
    blk = StreamBlock(ids, B=4, T=10)                   # 4 streams, each starting at "the cat"
    res = train_steps(m, opt, p, opt.init_state(p), blk.batches(0, steps), m.zero_state(4), lr=0.5,
                      clip_norm=5.0, grad_norm="token")
    assert res.steps == steps and res.tokens == steps * 40
    total, n = evaluate(m, res.params, ids, B=1, T=50)
    assert n == len(ids) - 1
    return total / n                                    # log(8) = 2.08 nats is uniform


def test_overfits_a_repeated_sentence(xp):
    assert _train_on_sentence(xp, K=3) < 0.05
    # two words back do not decide what follows "sat on" (the / it): the third word is really read
    assert _train_on_sentence(xp, K=2) > 0.1


def test_build_and_next_logits_agree_with_loss(xp):
    cfg = ModelConfig(cell="ffnn", vocab_size=7, embed=3, hidden=5, context=2, init_scale=0.5)
    m = build(cfg, xp=xp, dtype="float64")
    assert isinstance(m, FFNNLM) and (m.K, m.L, m.S) == (2, 1, 1)
    assert [(s.name, s.shape) for s in m.layout] == [("embed", (7, 3)), ("W1", (5, 6)), ("b1", (5,)),
                                                     ("Wo", (7, 5)), ("bo", (7,))]
    p = m.init_params(0)
    v = m.layout.views(p)
    assert not v["b1"].any() and not v["bo"].any() and 0 < float(abs(v["W1"]).max()) <= 0.5
    assert np.array_equal(backend.to_numpy(p), backend.to_numpy(build(cfg, xp=xp, dtype="float64").init_params(0)))
    x = xp.asarray(np.random.default_rng(0).integers(0, 7, (4, 2)))
    state = xp.asarray([[[[3.0, 0.0]]]])                # stream 0 saw token 2, stream 1 nothing
    logits, new = m.next_logits(p, x, state)
    logits = backend.to_numpy(logits)
    assert logits.shape == (2, 7)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    for b in range(2):
        for w in range(7):
            y = -np.ones((4, 2), int)
            y[3, b] = w                                 # score only target w at the last position
            loss, _, s = m.loss(p, x, xp.asarray(y), state)
            assert -loss == pytest.approx(logp[b, w], rel=1e-12)
    assert np.array_equal(backend.to_numpy(new), backend.to_numpy(s))


def test_rejects_sampled_softmax_and_bad_configs(xp):
    m = _model(xp)
    x, y, state = _data(m, 3, 2)
    p = m.init_params(0)
    with pytest.raises(ValueError, match="sampled softmax"):
        m.loss_and_grad(p, xp.zeros_like(p), xp.asarray(x), xp.asarray(y), xp.asarray(state),
                        softmax=(np.arange(3), np.arange(5)))
    with pytest.raises(ValueError):
        FFNNLM(ModelConfig(cell="ffnn", vocab_size=0, embed=3))
    with pytest.raises(ValueError):
        FFNNLM(ModelConfig(cell="ffnn", vocab_size=9, embed=0))
    assert m.zero_state(4).shape == (1, 1, 2, 4)


@pytest.mark.parametrize("T", [1, 2, 3])
def test_a_reset_at_a_chunks_first_step_forgets_the_carried_words_even_in_chunks_shorter_than_the_window(xp, T):
    """K = 4 reads three words back: in a chunk of T <= 3 steps a reset at step 0 must cut every
    position from the carried state, the oldest (d = T back) included."""
    m = _model(xp, K=4)
    x, y, state = _data(m, 3, 2, seed=5)
    x, y = x[:T], y[:T]
    reset = np.zeros((T, 2), bool)
    reset[0, 1] = True                                  # stream 1 starts afresh at this chunk
    p = m.init_params(2)
    X, Y, S = xp.asarray(x), xp.asarray(y), xp.asarray(state)
    fresh = S.copy()
    fresh[..., 1] = 0
    got = m.loss(p, X, Y, S, xp.asarray(reset))
    want = m.loss(p, X, Y, fresh)
    assert got[0] == pytest.approx(want[0], rel=1e-12) and got[1] == want[1]
    assert np.array_equal(backend.to_numpy(got[2]), backend.to_numpy(want[2]))
    assert m.loss(p, X, Y, S)[0] != pytest.approx(got[0], rel=1e-6)      # the carried words mattered


def test_the_smallest_config_builds_and_a_context_of_zero_is_refused(xp):
    m = FFNNLM(ModelConfig(cell="ffnn", vocab_size=1, embed=1, hidden=2, context=1), xp=xp, dtype="float64")
    assert m.zero_state(3).shape == (1, 1, 0, 3)
    x = xp.zeros((2, 3), dtype=np.int64)
    loss, count, _ = m.loss(m.init_params(0), x, x, m.zero_state(3))
    assert float(loss) == 0.0 and int(count) == 6       # one word: log 1
    with pytest.raises(ValueError, match="context >= 1"):
        FFNNLM(ModelConfig(cell="ffnn", vocab_size=9, embed=3, context=0))


def test_normal_init_scales_by_fan_in():
    """Embeddings are a lookup (fan-in 1), W1 reads K embeddings (fan-in K * E)."""
    m = FFNNLM(ModelConfig(cell="ffnn", vocab_size=400, embed=16, hidden=64, context=4,
                           init="normal", init_scale=0.8))
    v = m.layout.views(m.init_params(1))
    assert v["embed"].std() == pytest.approx(0.8, rel=0.05)
    assert v["W1"].std() == pytest.approx(0.8 / 8, rel=0.05)              # sqrt(4 * 16) = 8
