"""The sampled softmax: forward over v_f, ``Wo``/``bo`` rows of v_all; the paper's literal variant
(dummy words without backward) and the corrected one (float64 checks)."""
import numpy as np
import pytest

from rnnlm.core import backend, sampled
from rnnlm.config import ModelConfig, OptimConfig
from rnnlm.core.local import train_steps
from rnnlm.core.model import RNNLM
from rnnlm.core.optim import make_optimizer
from rnnlm.core.sampled import Sets, corrected_sets, log_inclusion, presence, softmax_sets
from rnnlm.core.strategies import StreamBlock

V = 13
# targets are drawn from TARGETS; v_all adds a "top" id and a "beta" id; v_f adds dummy words
TARGETS = [0, 1, 2, 4, 6]
V_ALL = np.array([0, 1, 2, 3, 4, 6, 9])
V_F = np.array([0, 1, 2, 3, 4, 6, 7, 9, 11, 12])
GAMMA = np.setdiff1d(V_F, V_ALL)
OUTSIDE = np.setdiff1d(np.arange(V), V_F)


def _setup(xp, cell="lstm", layers=2, embed=3, T=4, B=3, H=4, reset=True):
    cfg = ModelConfig(cell=cell, vocab_size=V, embed=embed, hidden=H, layers=layers,
                      init_scale=0.5, forget_bias=1.0)
    m = RNNLM(cfg, xp=xp, dtype="float64")
    r = np.random.default_rng(11)
    x = xp.asarray(r.integers(0, V, (T, B)))
    y = r.choice(TARGETS, (T, B))
    y[1, 0] = -1                                        # an unscored position
    state = xp.asarray(r.normal(0, 0.5, (layers, m.S, H, B)))
    rs = None
    if reset:
        rs = np.zeros((T, B), bool)
        rs[2, 1] = True
        rs = xp.asarray(rs)
    p = m.init_params(3)
    p += xp.asarray(r.normal(0, 0.1, p.size))          # non-zero biases too
    return m, p, x, xp.asarray(y), state, rs


def _grad(m, p, x, y, state, reset, softmax):
    g = m.xp.full(p.shape, np.nan)                      # every slot must be overwritten
    loss, count, st = m.loss_and_grad(p, g, x, y, state, reset, grad_scale=1.0, softmax=softmax)
    return float(loss), int(count), backend.to_numpy(st), backend.to_numpy(g)


def _reference_sampled_loss(m, p, x, y, state, v_f):
    """-log softmax over the v_f columns, from ``next_logits`` of every prefix (NumPy)."""
    yh = backend.to_numpy(y)
    total = 0.0
    for t in range(x.shape[0]):
        logits = backend.to_numpy(m.next_logits(p, x[:t + 1], state)[0])[:, v_f]   # (B, n_f)
        mx = logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits - mx).sum(axis=1)) + mx[:, 0]
        for b in range(x.shape[1]):
            if yh[t, b] >= 0:
                col = int(np.searchsorted(v_f, yh[t, b]))
                assert v_f[col] == yh[t, b]
                total += logz[b] - logits[b, col]
    return total


def _same(a, b, xp):
    """Bit for bit on NumPy (the same GEMMs on a gathered copy of Wo); to rounding on CuPy,
    whose GEMMs may pick kernels by the operands' alignment."""
    if xp is np:
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("cell,layers,embed", [("lstm", 2, 3), ("rnn", 1, 0)])
def test_whole_vocabulary_equals_full_softmax(xp, cell, layers, embed):
    m, p, x, y, state, reset = _setup(xp, cell, layers, embed)
    full = _grad(m, p, x, y, state, reset, None)
    every = np.arange(V)
    for sets in [(every, every), (xp.asarray(every), xp.asarray(every.astype(np.int32)))]:
        samp = _grad(m, p, x, y, state, reset, sets)
        assert samp[1] == full[1]
        assert _same(samp[0], full[0], xp) and _same(samp[2], full[2], xp) and _same(samp[3], full[3], xp)


def test_all_of_v_f_with_a_smaller_v_all_keeps_the_loss_and_v_all_rows(xp):
    m, p, x, y, state, reset = _setup(xp)
    loss, count, _, g = _grad(m, p, x, y, state, reset, None)
    s_loss, s_count, _, sg = _grad(m, p, x, y, state, reset, (V_ALL, np.arange(V)))
    assert s_count == count and s_loss == pytest.approx(loss, rel=1e-13)
    for name in ("Wo", "bo"):
        sl = m.layout[name]
        a = g[sl.offset:sl.end].reshape(sl.shape)
        b = sg[sl.offset:sl.end].reshape(sl.shape)
        assert np.allclose(b[V_ALL], a[V_ALL], rtol=1e-12, atol=1e-14), name
        rest = np.setdiff1d(np.arange(V), V_ALL)
        assert np.all(b[rest] == 0), name                           # exactly zero outside v_all
        assert np.abs(a[rest]).max() > 0                            # where the full gradient is not


def test_sampled_loss_equals_an_independent_computation(xp):
    m, p, x, y, state, _ = _setup(xp, reset=False)
    ref = _reference_sampled_loss(m, p, x, y, state, V_F)
    loss, count, _, _ = _grad(m, p, x, y, state, None, (V_ALL, V_F))
    assert count == 11 and loss == pytest.approx(ref, rel=1e-12)
    full = m.loss(p, x, y, state)[0]
    assert loss < full - 1e-3                                       # fewer words share the mass
    # only v_f normalises: v_all alone (a smaller denominator) gives a different loss
    assert _grad(m, p, x, y, state, None, (V_ALL, V_ALL))[0] == pytest.approx(
        _reference_sampled_loss(m, p, x, y, state, V_ALL), rel=1e-12)
    assert abs(_grad(m, p, x, y, state, None, (V_ALL, V_ALL))[0] - loss) > 1e-3


def _slot(m, a, name):
    sl = m.layout[name]
    return a[sl.offset:sl.end].reshape(sl.shape)


@pytest.mark.parametrize("cell,layers,embed", [("lstm", 2, 3), ("rnn", 1, 0)])
def test_gradients_match_finite_differences_of_the_sampled_loss(xp, cell, layers, embed, numeric_grad):
    m, p, x, y, state, _ = _setup(xp, cell, layers, embed, reset=False)
    ph = backend.to_numpy(p)

    def f(q, v_f):
        return _reference_sampled_loss(m, xp.asarray(q), x, y, state, v_f)

    # v_all == v_f: the exact gradient of the sampled loss, every parameter
    num = numeric_grad(lambda q: f(q, V_F), ph)
    g = _grad(m, p, x, y, state, None, (V_F, V_F))[3]
    for slot in m.layout:
        a, b = g[slot.offset:slot.end], num[slot.offset:slot.end]
        assert np.allclose(a, b, rtol=1e-5, atol=1e-7), slot.name
        assert np.abs(b).max() > 0, slot.name

    # v_all strict subset of v_f: Wo / bo rows of v_all still exact, dummy words get no backward
    g = _grad(m, p, x, y, state, None, (V_ALL, V_F))[3]
    for name in ("Wo", "bo"):
        a, b = _slot(m, g, name), _slot(m, num, name)
        assert np.allclose(a[V_ALL], b[V_ALL], rtol=1e-5, atol=1e-7), name
        assert np.all(a[GAMMA] == 0) and np.abs(b[GAMMA]).max() > 1e-4, name
        assert np.all(a[OUTSIDE] == 0) and np.allclose(b[OUTSIDE], 0, atol=1e-9), name
    hidden = [s for s in m.layout if s.name not in ("Wo", "bo")]
    for slot in hidden:                     # the dummy words' share of dL/dh is missing
        a, b = g[slot.offset:slot.end], num[slot.offset:slot.end]
        assert not np.allclose(a, b, rtol=1e-3, atol=1e-5), slot.name

    # ...and it is exactly that share: with the dummy words' Wo rows zeroed, dL/dh has no
    # contribution from them, so every gradient but Wo's dummy rows matches again
    q = ph.copy()
    _slot(m, q, "Wo")[GAMMA] = 0
    num0 = numeric_grad(lambda r: f(r, V_F), q)
    g0 = _grad(m, xp.asarray(q), x, y, state, None, (V_ALL, V_F))[3]
    for slot in m.layout:
        a, b = g0[slot.offset:slot.end], num0[slot.offset:slot.end]
        if slot.name in ("Wo", "bo"):
            a, b = a.reshape(slot.shape)[V_ALL], b.reshape(slot.shape)[V_ALL]
        assert np.allclose(a, b, rtol=1e-5, atol=1e-7), slot.name


def test_sampled_gradient_with_dropout_and_resets(xp, numeric_grad):
    """Dropout and resets act below the output layer: v_all == v_f stays the exact gradient."""
    cfg = ModelConfig(cell="lstm", vocab_size=V, embed=3, hidden=4, layers=2, dropout=0.3, init_scale=0.5)
    m = RNNLM(cfg, xp=xp, dtype="float64")
    _, p, x, y, state, reset = _setup(xp)

    def run(q, grads):
        return m.loss_and_grad(q, grads, x, y, state, reset, grad_scale=1.0,
                               rng=backend.rng_for(xp, 1, 2), softmax=(V_F, V_F))[0]
    g = xp.zeros_like(p)
    run(p, g)
    num = numeric_grad(lambda q: run(xp.asarray(q), xp.zeros_like(p)), backend.to_numpy(p))
    assert np.allclose(backend.to_numpy(g), num, rtol=1e-5, atol=1e-7)


def test_a_target_outside_v_all_is_rejected(xp):
    m, p, x, y, state, reset = _setup(xp)
    g = xp.zeros_like(p)
    v_all = np.array([0, 1, 2, 3, 6, 9])                # 4 is a target
    with pytest.raises(ValueError, match="every scored target must be in v_all.*\\[4\\]"):
        m.loss_and_grad(p, g, x, y, state, reset, softmax=(v_all, V_F))
    with pytest.raises(ValueError, match="sorted unique"):
        m.loss_and_grad(p, g, x, y, state, reset, softmax=(V_ALL, V_ALL[::-1]))
    with pytest.raises(ValueError, match="subset"):
        m.loss_and_grad(p, g, x, y, state, reset, softmax=(V_ALL, np.setdiff1d(V_F, [9])))
    with pytest.raises(ValueError, match="subset"):
        m.loss_and_grad(p, g, x, y, state, reset, softmax=(V_ALL, np.append(V_F, V)))
    for v_all_bad, v_f_bad in [(np.insert(V_ALL, 1, 0), V_F),                   # a repeated id
                               (V_ALL, np.insert(V_F, 7, 7)),
                               (V_ALL[[0, 3, 2, 1, 4, 5, 6]], V_F),                 # unsorted past the first
                               (V_ALL, V_F[[0, 1, 2, 3, 4, 5, 6, 7, 9, 8]]),
                               (V_ALL, np.insert(V_F, 0, -1))]:                 # an id below 0
        with pytest.raises(ValueError, match="sorted unique"):
            m.loss_and_grad(p, g, x, y, state, reset, softmax=(v_all_bad, v_f_bad))
    # the targets 0 (the smallest id) and 6 (above every id of v_all) are not in it
    for v_all_bad, missing in [(np.array([1, 2, 3, 4, 6, 9]), 0), (np.array([0, 1, 2, 3, 4]), 6)]:
        with pytest.raises(ValueError, match=f"every scored target must be in v_all.*\\[{missing}\\]"):
            m.loss_and_grad(p, g, x, y, state, reset, softmax=(v_all_bad, V_F))
    # an unscored target (-1) needs no row
    y2 = backend.to_numpy(y).copy()
    y2[y2 == 4] = -1
    m.loss_and_grad(p, g, x, xp.asarray(y2), state, reset, softmax=(v_all, V_F))


def test_softmax_sets_contents():
    r = np.random.default_rng(0)
    Vb = 1000
    targets = r.integers(0, Vb, (20, 5))
    targets[3, 2] = -1
    beta = np.array([500, 3, 999, 500])
    v_all, v_f = softmax_sets(targets, Vb, top=10, beta=beta, mu=0.05, rng=np.random.default_rng(5))
    for s in (v_all, v_f):
        assert s.dtype == np.int64 and np.all(np.diff(s) > 0) and s[0] >= 0 and s[-1] < Vb
    t = targets[targets >= 0]
    expected = np.unique(np.concatenate([t, np.arange(10), beta]))
    assert np.array_equal(v_all, expected)
    assert np.all(np.isin(v_all, v_f))
    gamma = np.setdiff1d(v_f, v_all)
    # 50 = ceil(0.05 * 1000) drawn without replacement, less those already in v_all
    # (|v_all| ~ 100 of 1000: about 5 expected overlaps)
    assert 35 < len(gamma) <= 50
    again = softmax_sets(targets, Vb, top=10, beta=beta, mu=0.05, rng=np.random.default_rng(5))
    assert np.array_equal(again[0], v_all) and np.array_equal(again[1], v_f)
    other = softmax_sets(targets, Vb, top=10, beta=beta, mu=0.05, rng=np.random.default_rng(6))
    assert np.array_equal(other[0], v_all) and not np.array_equal(other[1], v_f)
    # the draw itself: exactly ceil(mu V) distinct ids, whatever the seed; 99 of 100 ids drawn with
    # replacement would repeat some (all distinct: probability 100! / 100^99 ~ 1e-42). With nothing
    # scored v_all is word 0 alone: v_f is the draw plus word 0 (NumPy's draw tells which holds it)
    for seed in range(5):
        for n, mu, drawn in ((Vb, 0.05, 50), (100, 0.99, 99)):
            v_all, v_f = softmax_sets(np.array([-1]), n, top=0, beta=np.array([], int), mu=mu,
                                      rng=np.random.default_rng(seed))
            has_0 = 0 in np.random.default_rng(seed).choice(n, drawn, replace=False)
            assert v_all.tolist() == [0] and len(v_f) == drawn + (not has_0)
    _, full = softmax_sets(targets, Vb, top=10, beta=beta, mu=1.0, rng=np.random.default_rng(5))
    assert np.array_equal(full, np.arange(Vb))
    v0, f0 = softmax_sets(targets, Vb, top=0, beta=np.array([], int), mu=0.0, rng=r)
    assert np.array_equal(v0, np.unique(t)) and np.array_equal(f0, v0)
    with pytest.raises(ValueError):
        softmax_sets(targets, Vb, top=10, beta=np.array([Vb]), mu=0.05, rng=r)
    with pytest.raises(ValueError):
        softmax_sets(targets, Vb, top=10, beta=beta, mu=1.5, rng=r)


@pytest.mark.parametrize("V, mu, top, sorts", [(1000, 0.05, 10, False), (100_000, 0.001, 10, True),
                                               (1000, 0.001, 0, False), (100_000, 0.00001, 0, True)])
def test_softmax_sets_by_flags_or_by_sorting_are_the_sets_defined(V, mu, top, sorts):
    """Both ways of building the sets (a (V,) array of flags, or sorting where V is large against the
    ids) give the sorted unique union of the ids, v_f with exactly the dummy words the rng draws;
    with no top words, word 0 as a target (no other set holds it) and a single dummy word."""
    r = np.random.default_rng(1)
    targets = r.integers(0, V, (20, 5))
    targets[0, :3] = -1
    targets[1, 0] = 0
    beta = np.array([V - 1, 7, 7, V // 2])
    k = sampled.gamma_size(mu, V)
    assert (V > sampled.BITMAP_RATIO * (97 + top + beta.size + k)) == sorts      # the path under test
    v_all, v_f = softmax_sets(targets, V, top=top, beta=beta, mu=mu, rng=np.random.default_rng(11))
    gamma = np.random.default_rng(11).choice(V, size=k, replace=False)
    expected = np.unique(np.concatenate([targets[targets >= 0], np.arange(top), beta]))
    assert expected[0] == 0 and np.setdiff1d(gamma, expected).size >= 1        # the cases can fail
    assert v_all.dtype == v_f.dtype == np.int64
    assert np.array_equal(v_all, expected)
    assert np.array_equal(v_f, np.union1d(expected, gamma))


def test_softmax_sets_feed_loss_and_grad(xp):
    m, p, x, y, state, reset = _setup(xp)
    v_all, v_f = softmax_sets(y, V, top=2, beta=np.array([9]), mu=0.3, rng=np.random.default_rng(2))
    g = xp.zeros_like(p)
    loss, count, _ = m.loss_and_grad(p, g, x, y, state, reset, softmax=(v_all, v_f))
    assert int(count) == 11 and np.isfinite(float(loss))
    gw = _slot(m, backend.to_numpy(g), "Wo")
    assert np.all(gw[np.setdiff1d(np.arange(V), v_all)] == 0) and np.abs(gw[v_all]).min() > 0


def _local_setup(xp, dtype):
    text = ("the quick brown fox jumps over the lazy dog. " * 6).strip()
    from rnnlm.core.vocab import Vocab
    vocab = Vocab.build(text, "char")
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=len(vocab), embed=8, hidden=16), xp=xp, dtype=dtype)
    opt = make_optimizer(OptimConfig(name="momentum", lr=0.3))
    return m, opt, m.init_params(0), StreamBlock(vocab.encode(text), B=4, T=8)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_train_steps_with_whole_vocabulary_sets_equals_full(xp, dtype):
    m, opt, p, blk = _local_setup(xp, dtype)
    every = np.arange(m.V)
    seen = []

    def sets(k, y):
        assert isinstance(y, np.ndarray)
        seen.append((k, y.copy()))
        return every, every
    a = train_steps(m, opt, p.copy(), opt.init_state(p), blk.batches(0, 3), m.zero_state(4), lr=0.3,
                    clip_norm=1.0)
    b = train_steps(m, opt, p.copy(), opt.init_state(p), blk.batches(0, 3), m.zero_state(4), lr=0.3,
                    clip_norm=1.0, softmax_sets=sets)
    assert [k for k, _ in seen] == [0, 1, 2]
    assert all(np.array_equal(yk, blk.batch(k).y) for k, yk in seen)
    assert a.tokens == b.tokens
    if xp is np:                                        # bit for bit
        assert a.loss_sum == b.loss_sum
        assert np.array_equal(a.params, b.params) and np.array_equal(a.state, b.state)
    else:
        tol = 1e-5 if dtype == "float32" else 1e-12
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=tol)
        assert np.allclose(backend.to_numpy(a.params), backend.to_numpy(b.params), rtol=tol, atol=tol)


def test_train_steps_with_sampled_sets_moves_only_v_all_rows_of_wo(xp):
    m, _, p, blk = _local_setup(xp, "float64")
    opt = make_optimizer(OptimConfig(name="sgd", lr=0.3))
    r = np.random.default_rng(4)

    def sets(k, y):
        return softmax_sets(y, m.V, top=1, beta=np.array([m.V - 1]), mu=0.2, rng=r)
    used = set()
    for k in range(2):
        used.update(sets(k, blk.batch(k).y)[0].tolist())
    r = np.random.default_rng(4)
    res = train_steps(m, opt, p.copy(), opt.init_state(p), blk.batches(0, 2), m.zero_state(4), lr=0.3,
                      softmax_sets=sets)
    before, after = _slot(m, backend.to_numpy(p), "Wo"), _slot(m, backend.to_numpy(res.params), "Wo")
    moved = np.flatnonzero(np.any(before != after, axis=1))
    assert set(moved.tolist()) == used


@pytest.mark.parametrize("corrected", [False, True])
def test_a_chunk_of_padding_alone_is_a_step_that_scores_and_moves_nothing(xp, corrected):
    """Paragraph lanes end in padding: with 1-token paragraphs (a blank line at character level, or
    bptt = 1) a whole chunk can score nothing. Its v_all was empty under the default exchange.frequent =
    exchange.random = 0, and the layout refused it: the task failed, and every retry with it. Now its one
    row is word 0's, and the step is a step of no loss: under plain SGD nothing moves."""
    from rnnlm.core.strategies import LaneSource
    tokens = np.array([5, 6, 7, 8, 9, 10, 11], np.int32)        # a 3-token paragraph, then four of 1 token
    src = LaneSource(tokens, np.array([0, 3, 4, 5, 6]), B=1, T=2)
    batches = [src.batch(k) for k in range(src.steps_per_pass)]
    assert [int((b.y >= 0).sum()) for b in batches] == [2, 0, 0]
    m = RNNLM(ModelConfig(vocab_size=V, hidden=4), xp=xp, dtype="float64")
    p = m.init_params(1)
    opt = make_optimizer(OptimConfig(name="sgd", lr=0.5))
    pres, none = presence(tokens, 2, V), np.empty(0, np.int64)

    def sets(k, y):
        rng = np.random.default_rng(k)
        if corrected:
            return corrected_sets(y, V, 0, none, 0.2, rng, pres)
        return softmax_sets(y, V, 0, none, 0.2, rng)
    assert sets(1, batches[1].y)[0].tolist() == [0]
    if corrected:                # surely in the set, as the rows' reweighting reads it (log pi = 0, not -inf)
        assert sets(1, batches[1].y).log_pi_rows.tolist() == [0.0]
    whole = train_steps(m, opt, p.copy(), opt.init_state(p), batches, m.zero_state(1), lr=0.5, softmax_sets=sets)
    first = train_steps(m, opt, p.copy(), opt.init_state(p), batches[:1], m.zero_state(1), lr=0.5,
                        softmax_sets=sets)
    assert whole.tokens == first.tokens == 2 and whole.loss_sum == first.loss_sum
    assert np.array_equal(backend.to_numpy(whole.params), backend.to_numpy(first.params))
    assert not np.array_equal(backend.to_numpy(first.params), backend.to_numpy(p))


# ---------------------------------------------------------------- the corrected variant
# log pi over V_F (its order), hand-picked: 0 for the frequent word 0, the rest below 0
LOG_PI = np.log(np.array([1.0, 0.9, 0.5, 0.3, 0.7, 0.2, 0.05, 0.1, 0.02, 0.04]))


def _reference_corrected_loss(m, p, x, y, state, v_f, log_pi):
    """-log(e^s_y / (e^s_y + sum_{i in v_f, i != y} e^(s_i - log pi_i))) from ``next_logits`` (NumPy)."""
    yh = backend.to_numpy(y)
    total = 0.0
    for t in range(x.shape[0]):
        logits = backend.to_numpy(m.next_logits(p, x[:t + 1], state)[0])[:, v_f]   # (B, n_f)
        for b in range(x.shape[1]):
            if yh[t, b] >= 0:
                col = int(np.searchsorted(v_f, yh[t, b]))
                s = logits[b] - log_pi
                s[col] = logits[b, col]
                total += np.log(np.exp(s).sum()) - s[col]
    return total


def test_corrected_loss_equals_an_independent_computation(xp):
    m, p, x, y, state, reset = _setup(xp, reset=False)
    loss, count, _, _ = _grad(m, p, x, y, state, None, Sets(V_ALL, V_F, LOG_PI, True))
    assert count == 11 and loss == pytest.approx(_reference_corrected_loss(m, p, x, y, state, V_F, LOG_PI),
                                                 rel=1e-12)
    # each non-target word weighs 1 / pi: more than the uncorrected loss, which counts it once
    assert loss > _grad(m, p, x, y, state, None, (V_ALL, V_F))[0] + 0.5
    with pytest.raises(ValueError, match="one value per word of v_f"):
        _grad(m, p, x, y, state, None, Sets(V_ALL, V_F, LOG_PI[:-1], True))
    with pytest.raises(ValueError, match="one value per word of v_all"):
        _grad(m, p, x, y, state, None, Sets(V_ALL, V_F, LOG_PI, True, LOG_PI[:-1]))


@pytest.mark.parametrize("cell,layers,embed", [("lstm", 2, 3), ("rnn", 1, 0)])
def test_corrected_gradient_is_the_gradient_of_the_corrected_loss_for_every_parameter(
        xp, cell, layers, embed, numeric_grad):
    log_pi = LOG_PI
    m, p, x, y, state, _ = _setup(xp, cell, layers, embed, reset=False)
    ph = backend.to_numpy(p)
    num = numeric_grad(lambda q: _reference_corrected_loss(m, xp.asarray(q), x, y, state, V_F, log_pi), ph)
    g = _grad(m, p, x, y, state, None, Sets(V_ALL, V_F, log_pi, True))[3]
    for slot in m.layout:
        a, b = g[slot.offset:slot.end], num[slot.offset:slot.end]
        if slot.name in ("Wo", "bo"):
            a, b = a.reshape(slot.shape), b.reshape(slot.shape)
            assert np.all(a[GAMMA] == 0) and np.abs(b[GAMMA]).max() > 1e-4, slot.name   # rows not updated
            assert np.all(a[OUTSIDE] == 0) and np.allclose(b[OUTSIDE], 0, atol=1e-9), slot.name
            a, b = a[V_ALL], b[V_ALL]
        assert np.allclose(a, b, rtol=1e-5, atol=1e-7), slot.name       # hidden layers included
        assert np.abs(b).max() > 0, slot.name


def test_corrected_with_mu_one_is_the_full_softmax_below_the_output_layer(xp):
    m, p, x, y, state, reset = _setup(xp)
    loss, count, st, g = _grad(m, p, x, y, state, reset, None)
    v_all, v_f = softmax_sets(y, V, top=2, beta=np.array([9]), mu=1.0, rng=np.random.default_rng(0))
    sets = corrected_sets(y, V, 2, np.array([9]), 1.0, np.random.default_rng(0), np.full(V, 1 / V))
    assert np.array_equal(sets.v_f, np.arange(V)) and np.array_equal(sets.log_pi, np.zeros(V))
    s_loss, s_count, s_st, sg = _grad(m, p, x, y, state, reset, sets)
    assert s_count == count and s_loss == pytest.approx(loss, rel=1e-13) and np.allclose(s_st, st, rtol=1e-13)
    for slot in m.layout:
        a, b = g[slot.offset:slot.end], sg[slot.offset:slot.end]
        if slot.name in ("Wo", "bo"):
            a, b = a.reshape(slot.shape), b.reshape(slot.shape)
            rest = np.setdiff1d(np.arange(V), v_all)
            assert np.all(b[rest] == 0) and np.abs(a[rest]).max() > 0, slot.name
            # the frequent rows (in v_all for sure) as the full softmax; the others' push-down
            # is weighted for their chance of being in v_all (test_row_weights_...)
            assert not np.allclose(a[v_all[2:]], b[v_all[2:]], rtol=1e-3), slot.name
            a, b = a[:2], b[:2]
        assert np.allclose(a, b, rtol=1e-11, atol=1e-14), slot.name


def test_corrected_over_the_whole_vocabulary_is_the_full_softmax_bit_for_bit(xp):
    m, p, x, y, state, reset = _setup(xp)
    full = _grad(m, p, x, y, state, reset, None)
    sets = corrected_sets(y, V, V, np.array([], int), 0.0, np.random.default_rng(0), np.full(V, 1 / V))
    samp = _grad(m, p, x, y, state, reset, sets)
    assert samp[1] == full[1]
    assert _same(samp[0], full[0], xp) and _same(samp[2], full[2], xp) and _same(samp[3], full[3], xp)


def test_log_inclusion_values():
    freq = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])     # presence: in a stream's targets
    # 3 streams, top 1, 2 beta rows and 3 dummy words of V = 6
    got = log_inclusion(np.array([0, 1, 4, 5]), freq, 3, 1, 2, 3, 6)
    out = np.array([0.8 ** 3, 0.95 ** 3, 0.95 ** 3]) * (4 / 6) * (3 / 6)       # P(not in the set)
    assert np.allclose(np.exp(got), [1.0, *(1 - out)], rtol=1e-14, atol=0)
    assert log_inclusion(np.array([3]), freq, 3, 1, 0, 6, 6)[0] == 0.0          # mu = 1: always in
    # windows of 4: [0 0 1 3] [2 0 5 5] (then [1 -1], too short, left out); never seen: half a window
    assert np.array_equal(presence(np.array([0, 0, 1, 3, 2, 0, 5, 5, 1, -1]), 4, 7),
                          [1.0, 0.5, 0.5, 0.5, 0.25, 0.5, 0.25])


def test_a_chunk_without_scored_targets_includes_words_by_the_random_rows_alone():
    """No stream scores a target (a chunk of lane padding): a word present in every window (a space at
    character level) had 0 x log(1 - 1) = NaN, and the whole step's loss and gradient with it."""
    freq = np.array([1.0, 0.2, 0.1, 0.1, 0.05, 0.05])
    got = log_inclusion(np.array([0, 1, 4]), freq, 0, 0, 2, 3, 6)
    assert np.allclose(np.exp(got), 1 - (4 / 6) * (3 / 6), rtol=1e-14, atol=0)     # the beta rows and dummies


def test_log_inclusion_is_the_frequency_a_word_is_drawn_into_v_f():
    """Monte Carlo: 2 streams of 4 targets drawn from the unigram (a stream holds word i with
    probability 1 - (1 - f_i)^4), random rows and dummy words as a partition draws them."""
    Vb, top, N, draws = 60, 3, 8, 6000
    r = np.random.default_rng(7)
    freq = r.dirichlet(np.full(Vb, 0.3))
    freq = np.sort(freq)[::-1]
    inside = np.zeros(Vb)
    for _ in range(draws):
        y = r.choice(Vb, N, p=freq)
        beta = r.choice(Vb, 2, replace=False)
        inside[softmax_sets(y, Vb, top, beta, 0.05, r)[1]] += 1
    pi = np.exp(log_inclusion(np.arange(Vb), 1 - (1 - freq) ** 4, 2, top, 2, 3, Vb))
    sd = np.sqrt(pi * (1 - pi) / draws)
    assert np.all(np.abs(inside / draws - pi) <= 4 * sd + 1e-12)
    assert pi[top:].min() < 0.2 and pi[:top].min() == 1.0                       # the check has room to fail


# log P(word in v_all) for V_ALL = [0, 1, 2, 3, 4, 6, 9]: at most LOG_PI's value (v_all is in v_f)
LOG_PI_ROWS = np.log(np.array([1.0, 0.6, 0.3, 0.1, 0.5, 0.15, 0.05]))


def test_row_weights_reweigh_only_the_push_down_of_v_all_rows(xp):
    m, p, x, y, state, _ = _setup(xp, reset=False)
    plain = _grad(m, p, x, y, state, None, Sets(V_ALL, V_F, LOG_PI, True))
    rows = _grad(m, p, x, y, state, None, Sets(V_ALL, V_F, LOG_PI, True, LOG_PI_ROWS))
    assert rows[0] == plain[0] and np.array_equal(rows[2], plain[2])            # the loss is the same
    for slot in m.layout:                                                      # so is every hidden gradient
        if slot.name not in ("Wo", "bo"):
            assert np.array_equal(rows[3][slot.offset:slot.end], plain[3][slot.offset:slot.end]), slot.name
    ratio = np.exp(LOG_PI[np.searchsorted(V_F, V_ALL)] - LOG_PI_ROWS)          # pi_f / pi_all per v_all row
    # rows 3 and 9 are no token's target: their whole gradient scales by the ratio (2 and 4 here)
    for name in ("Wo", "bo"):
        a, b = _slot(m, plain[3], name), _slot(m, rows[3], name)
        for i in (3, 6):
            assert np.allclose(b[V_ALL[i]], ratio[i] * a[V_ALL[i]], rtol=1e-12), (name, V_ALL[i])
        assert np.all(b[GAMMA] == 0) and np.all(b[OUTSIDE] == 0)
    # bo against a NumPy computation: dlogit = softmax over corrected logits, the push-down of a
    # non-target entry times pi_f / pi_all, a target's entry p_y - 1 as it is
    yh = backend.to_numpy(y)
    want = np.zeros(V)
    for t in range(x.shape[0]):
        logits = backend.to_numpy(m.next_logits(p, x[:t + 1], state)[0])[:, V_F]   # (B, n_f)
        for b in range(x.shape[1]):
            if yh[t, b] < 0:
                continue
            col = int(np.searchsorted(V_F, yh[t, b]))
            s = logits[b] - LOG_PI
            s[col] = logits[b, col]
            q = np.exp(s - s.max())
            q /= q.sum()
            push = q[np.searchsorted(V_F, V_ALL)] * ratio
            push[np.searchsorted(V_ALL, yh[t, b])] = q[col] - 1.0
            want[V_ALL] += push
    assert np.allclose(_slot(m, rows[3], "bo"), want, rtol=1e-12, atol=1e-14)
    assert np.abs(_slot(m, plain[3], "bo") - want).max() > 1e-2


def test_corrected_sets_inclusion_probabilities():
    # V = 10, T = 4, B = 3: 2 streams with targets (one of them only word 0) and a third with none
    # (its end padded); top 1 (word 0); beta {5}; mu 0.1: one dummy word
    y = np.array([[3, 0, -1], [4, 0, -1], [3, 0, -1], [-1, 0, -1]])
    pres = np.array([0.4, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.03, 0.02])   # in a stream's 4 targets
    s = corrected_sets(y, 10, 1, np.array([5]), 0.1, np.random.default_rng(3), pres)
    v_all, v_f = softmax_sets(y, 10, 1, np.array([5]), 0.1, np.random.default_rng(3))
    assert s.through_gamma and np.array_equal(s.v_all, v_all) and np.array_equal(s.v_f, v_f)
    assert np.array_equal(v_all, [0, 3, 4, 5]) and v_f.size == 5
    g = int(np.setdiff1d(v_f, v_all)[0])
    # v_f: pi = 1 - (1 - presence)^2 (1 - 1/10: beta) (1 - 1/10: the dummy word); v_all: no dummy word
    want_f = {0: 1.0, 3: 1 - 0.9 ** 2 * 0.81, 4: 1 - 0.9 ** 2 * 0.81, 5: 1 - 0.95 ** 2 * 0.81,
              g: 1 - (1 - pres[g]) ** 2 * 0.81}
    assert np.allclose(np.exp(s.log_pi), [want_f[i] for i in v_f], rtol=1e-14, atol=0)
    assert np.allclose(np.exp(s.log_pi_rows), [1.0, 1 - 0.9 ** 3, 1 - 0.9 ** 3, 1 - 0.95 ** 2 * 0.9],
                       rtol=1e-14, atol=0)


@pytest.mark.parametrize("bucket", [4, 128])
@pytest.mark.parametrize("sets", [Sets(V_ALL, V_F), Sets(V_ALL, V_F, LOG_PI, True, LOG_PI_ROWS)],
                         ids=["literal", "corrected"])
def test_padded_rows_compute_the_unpadded_step(xp, bucket, sets):
    """A GPU pads the sets to multiples of ROW_BUCKET rows (so that its steps can be replayed from a
    graph): a padded row is a word outside v_f whose probability and gradient are exactly zero.
    bucket 4 pads after v_all (7 -> 8) and at the end (11 -> 12); 128 pads v_all up to the
    vocabulary's room (13 - 3 dummy words = 10)."""
    m, p, x, y, state, reset = _setup(xp)
    lay = m.out.layout(sets, y, bucket)
    na, nf = V_ALL.size, V_F.size
    assert (lay.n_all, lay.n_f) == {4: (8, 12), 128: (10, 13)}[bucket]
    pads = np.r_[lay.rows[na:lay.n_all], lay.rows[lay.n_all + nf - na:]]
    assert np.array_equal(lay.rows[:na], V_ALL) and np.array_equal(lay.rows[lay.n_all:][:nf - na], GAMMA)
    assert pads.size == lay.n_f - nf and np.unique(pads).size == pads.size and not np.isin(pads, V_F).any()
    padded = _grad(m, p, x, y, state, reset, m.sampled_rows(lay, *x.shape))
    plain = _grad(m, p, x, y, state, reset, sets)
    assert padded[1] == plain[1] and padded[0] == pytest.approx(plain[0], rel=1e-13)
    assert np.allclose(padded[2], plain[2], rtol=1e-13, atol=1e-15)
    assert np.allclose(padded[3], plain[3], rtol=1e-11, atol=1e-14)
    for name in ("Wo", "bo"):                           # the pads' rows get no gradient
        assert np.all(_slot(m, padded[3], name)[pads] == 0)


def test_gamma_size_reads_mu_as_a_share_of_v_without_float_noise():
    """0.07 * 100 is 7.000000000000001 in floats: its ceiling took an eighth word."""
    assert [sampled.gamma_size(mu, V) for mu, V in ((0.07, 100), (0.14, 10000), (0.05, 10000))] == [7, 1400, 500]
    assert sampled.gamma_size(0.071, 100) == 8 and sampled.gamma_size(1.0, 7) == 7 and sampled.gamma_size(2.0, 7) == 7
