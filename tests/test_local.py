"""The executor-side local loop, batching, generation and learning."""
import math
import warnings

import numpy as np
import pytest

from rnnlm.core import backend
from rnnlm.config import ModelConfig, OptimConfig
from rnnlm.core.generate import generate
from rnnlm.core.local import evaluate, held_out_nll, train_steps
from rnnlm.core.metrics import EVAL_BPTT
from rnnlm.core.strategies import Batch, StreamBlock
from rnnlm.core.model import RNNLM
from rnnlm.core.optim import clip_grads, make_optimizer
from rnnlm.core.vocab import Vocab

TEXT = ("the quick brown fox jumps over the lazy dog. " * 12).strip()


def test_stream_block_batches_and_resets():
    toks = np.arange(2 * 11, dtype=np.int32)          # 2 streams of 11 tokens
    blk = StreamBlock(toks, B=2, T=3)
    assert blk.steps_per_pass == 3
    b0 = blk.batch(0)
    assert b0.x[:, 0].tolist() == [0, 1, 2] and b0.x[:, 1].tolist() == [11, 12, 13]
    assert b0.y[:, 0].tolist() == [1, 2, 3]
    assert b0.reset[0].all() and not b0.reset[1:].any()
    b2 = blk.batch(2)
    assert b2.x[:, 0].tolist() == [6, 7, 8] and b2.y[:, 1].tolist() == [18, 19, 20] and b2.reset is None
    assert np.array_equal(blk.batch(3).x, b0.x) and blk.batch(3).reset[0].all()   # next pass
    with pytest.raises(ValueError, match="cannot fill"):
        StreamBlock(toks[:7], B=2, T=3)


def _setup(xp, cell="lstm", optim="sgd", lr=0.5):
    vocab = Vocab.build(TEXT, "char")
    cfg = ModelConfig(cell=cell, vocab_size=len(vocab), hidden=32, layers=1)
    m = RNNLM(cfg, xp=xp)
    opt = make_optimizer(OptimConfig(name=optim, lr=lr))
    p = m.init_params(0)
    return vocab, m, opt, p, opt.init_state(p)


@pytest.mark.parametrize("grad_norm, scale, clip", [("batch", 1 / 4, 1.0), ("batch", 1 / 4, 0.0),
                                                    ("token", 1 / 40, 0.0)])
def test_train_steps_equals_manual_steps(xp, grad_norm, scale, clip):
    """As the step is defined: the summed NLL's gradient over B = 4 streams (or the 40 tokens
    scored), clipped (or not: clipping to a norm would hide a wrong scale), then the update."""
    vocab, m, opt, p, st = _setup(xp, optim="momentum", lr=0.3)
    blk = StreamBlock(vocab.encode(TEXT), B=4, T=10)
    ref_p, ref_st, state = p.copy(), opt.init_state(p), m.zero_state(4)
    g = xp.empty_like(p)
    losses = 0.0
    for k in range(3):
        b = blk.batch(k)
        loss, _, state = m.loss_and_grad(ref_p, g, xp.asarray(b.x), xp.asarray(b.y), state,
                                         None if b.reset is None else xp.asarray(b.reset), grad_scale=scale)
        clip_grads(g, clip)
        opt.step(ref_p, g, ref_st, 0.3)
        losses += float(loss)
    res = train_steps(m, opt, p, st, blk.batches(0, 3), m.zero_state(4), lr=0.3, clip_norm=clip,
                      grad_norm=grad_norm)
    assert res.steps == 3 and res.tokens == 3 * 40
    assert res.loss_sum == pytest.approx(losses, rel=1e-6)
    assert np.array_equal(backend.to_numpy(res.params), backend.to_numpy(ref_p))   # bit for bit
    assert np.array_equal(backend.to_numpy(res.state), backend.to_numpy(state))
    assert res.opt_state["t"] == 3


@pytest.mark.parametrize("cell,optim,lr", [("lstm", "adam", 0.01), ("rnn", "adagrad", 0.1)])
def test_tiny_model_overfits_short_text(xp, cell, optim, lr):
    vocab, m, opt, p, st = _setup(xp, cell, optim, lr)
    ids = vocab.encode(TEXT)
    counts = np.bincount(ids, minlength=len(vocab))
    pr = counts[counts > 0] / counts.sum()
    unigram = float(-(pr * np.log(pr)).sum())          # nats per char
    blk = StreamBlock(ids, B=4, T=16)
    state = m.zero_state(4)
    for k in range(0, 240, 20):
        res = train_steps(m, opt, p, st, blk.batches(k, 20), state, lr=lr, clip_norm=5.0, grad_norm="token")
        state = res.state
    total, n = evaluate(m, p, ids, B=1, T=50)
    assert n == len(ids) - 1                            # every next character scored once
    assert total / n < 0.35 * unigram, (total / n, unigram)


def test_nan_loss_stops_the_loop(xp):
    vocab, m, opt, p, st = _setup(xp)
    p[:] = np.nan
    blk = StreamBlock(vocab.encode(TEXT), B=2, T=8)
    with pytest.raises(FloatingPointError, match="loss became nan"):
        train_steps(m, opt, p, st, blk.batches(0, 2), m.zero_state(2), lr=0.1)


def test_a_diverging_step_raises_one_error_and_no_numpy_warning():
    """An update that overflows: NumPy's "overflow encountered in subtract" reached the user's terminal as
    two lines before the run's one-line error; the loop checks for it and says it once."""
    vocab, m, opt, p, st = _setup(np)
    blk = StreamBlock(vocab.encode(TEXT), B=2, T=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a warning would be raised instead of the loop's error
        with pytest.raises(FloatingPointError, match="loss became nan at local step 2$"):
            train_steps(m, opt, p, st, blk.batches(0, 3), m.zero_state(2), lr=1e38)


def test_generation_is_deterministic_and_learns(xp):
    vocab, m, opt, p, st = _setup(xp, optim="adam", lr=0.01)
    blk = StreamBlock(vocab.encode(TEXT), B=4, T=16)
    res = train_steps(m, opt, p, st, blk.batches(0, 200), m.zero_state(4), lr=0.01, grad_norm="token")
    a = generate(m, res.params, vocab, prime="the quick", length=40, seed=3)
    assert a == generate(m, res.params, vocab, prime="the quick", length=40, seed=3)
    assert a != generate(m, res.params, vocab, prime="the quick", length=40, seed=4)
    assert len(a) == 40
    greedy = generate(m, res.params, vocab, prime="the quick brown fox jumps over the lazy", length=5, argmax=True)
    assert greedy == " dog."
    for t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"^temperature must be a number > 0 \(or use argmax\), not {t!r}$"):
            generate(m, res.params, vocab, temperature=t)


@pytest.mark.parametrize("length", [101, 92, 91])   # 3 chunks of 30 targets and a tail of 10, of 1, of none
def test_evaluate_matches_model_loss_on_one_stream(length):
    vocab, m, _, p, _ = _setup(np)
    ids = vocab.encode(TEXT[:length])
    total, n = evaluate(m, p, ids, B=1, T=30)
    x, y = ids[:-1, None], ids[1:, None]
    ref, count, _ = m.loss(p, x, y, m.zero_state(1))
    assert n == count == length - 1 and total == pytest.approx(ref, rel=1e-5)
    assert math.isfinite(total)


def test_no_batches_and_a_batch_with_nothing_scored():
    """No steps: nothing counted and the parameters untouched; a batch whose targets are all unscored
    (-1) under the token norm: no division by zero tokens, and no step that moves a parameter."""
    vocab, m, opt, p, st = _setup(np)
    before = p.copy()
    res = train_steps(m, opt, p, st, [], m.zero_state(2), lr=0.3)
    assert (res.steps, res.tokens, res.loss_sum) == (0, 0, 0.0) and np.array_equal(res.params, before)
    b = StreamBlock(vocab.encode(TEXT), B=2, T=5).batch(0)
    b = Batch(b.x, np.full_like(b.y, -1), b.reset)
    res = train_steps(m, opt, p, st, [b], m.zero_state(2), lr=0.3, grad_norm="token")
    assert (res.steps, res.tokens, res.loss_sum) == (1, 0, 0.0) and np.array_equal(res.params, before)


def test_held_out_nll_scores_each_stream_whole_from_a_zero_state():
    """Streams of 0, 1, 2 tokens and one longer than two evaluation chunks plus a tail: each scored
    as one stream from a zero state (as the model's loss over the whole stream at once)."""
    vocab, m, _, p, _ = _setup(np)
    long = vocab.encode(TEXT)[:2 * EVAL_BPTT + 7]
    streams = [long[:0], long[:1], long[5:7], long]
    total, count = held_out_nll(m, p, streams)
    want, n = 0.0, 0
    for s in streams[2:]:
        loss, c, _ = m.loss(p, s[:-1, None], s[1:, None], m.zero_state(1))
        want, n = want + loss, n + c
    assert count == n == 1 + 2 * EVAL_BPTT + 6 and total == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("bad", [0, 1])
def test_a_nan_gradient_with_a_finite_loss_is_named_by_its_step(bad):
    """The loop reads the device once, at its end: a gradient poisoned at one step is reported
    then, by that step's number, though later steps ran (the parameters are not to be used)."""
    vocab, m, opt, p, st = _setup(np)
    calls = []

    def poisoned(real):
        def run(params, grads, *a, **k):
            out = real(params, grads, *a, **k)
            if len(calls) == bad:
                grads[7] = np.nan               # the loss stays finite; only the gradient is poisoned
            calls.append(1)
            return out
        return run
    for name in ("loss_and_grad", "loss_and_sparse_grad"):     # whichever the optimizer calls for
        setattr(m, name, poisoned(getattr(m, name)))
    blk = StreamBlock(vocab.encode(TEXT), B=2, T=8)
    with pytest.raises(FloatingPointError, match=f"gradient norm became nan at local step {bad}$"):
        train_steps(m, opt, p, st, blk.batches(0, 3), m.zero_state(2), lr=0.1, clip_norm=5.0)
    assert len(calls) == 3


@pytest.mark.parametrize("value,fails", [(np.inf, True), (np.nan, True), (1e20, False), (-3e38, False)])
def test_parameters_left_non_finite_by_the_last_update_are_caught_and_only_those(value, fails):
    """The end-of-call check: an update that overflowed is named; weights whose squares overflow
    float32 (the check's sum of squares) but are finite are not."""
    vocab, m, opt, p, st = _setup(np)
    real = opt.step

    def overflowing(params, *a, **k):
        real(params, *a, **k)
        if st["t"] == 3:
            params[3] = value                  # as an overflowing last update would leave it
    opt.step = overflowing
    blk = StreamBlock(vocab.encode(TEXT), B=2, T=8)
    run = lambda: train_steps(m, opt, p, st, blk.batches(0, 3), m.zero_state(2), lr=0.1, clip_norm=5.0)  # noqa: E731
    if fails:
        with pytest.raises(FloatingPointError, match="parameters are no longer finite after local step 2$"):
            run()
    else:
        assert run().steps == 3 and p[3] == np.float32(value)


def test_train_steps_repeat_bit_for_bit(xp):
    """No atomics: the same steps from the same start give the same bits (on a GPU the embedding's
    scatter and every reduction keep their order), for a word model with V above the one-hot bound."""
    rng = np.random.default_rng(5)
    ids = (rng.zipf(1.3, 4000) % 1500).astype(np.int32)       # many repeats in a chunk, as in text
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=1500, embed=16, hidden=24, layers=2, dropout=0.2), xp=xp)
    opt = make_optimizer(OptimConfig(name="momentum", lr=0.5))
    blk = StreamBlock(ids, B=8, T=12)
    runs = []
    for _ in range(2):
        p = m.init_params(1)
        res = train_steps(m, opt, p, opt.init_state(p), blk.batches(0, 6), m.zero_state(8), lr=0.5,
                          clip_norm=1.0, dropout_rng=backend.rng_for(xp, 7, 1))
        runs.append((backend.to_numpy(res.params), backend.to_numpy(res.state), res.loss_sum))
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2]


def test_word_generation_continues_the_prime_inside_its_sentence():
    text = "\n".join(["the cat sat on the mat", "a dog ran to the park"] * 30) + "\n"
    vocab = Vocab.build(text, "word")
    assert vocab.encode("the cat", open_end=True).tolist() == [vocab.index["the"], vocab.index["cat"]]
    assert vocab.encode("the cat\n", open_end=True)[-1] == vocab.index["<eos>"]
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=len(vocab), embed=16, hidden=32), xp=np)
    opt = make_optimizer(OptimConfig(name="adam", lr=0.01))
    p = m.init_params(0)
    blk = StreamBlock(vocab.encode(text), B=4, T=10)
    res = train_steps(m, opt, p, opt.init_state(p), blk.batches(0, 300), m.zero_state(4), lr=0.01,
                      grad_norm="token")
    out = generate(m, res.params, vocab, prime="the cat sat on the", length=1, argmax=True)
    assert out == "mat"                                  # with <eos> after the prime it would start a sentence
    assert vocab.join("the cat sat on the", out) == "the cat sat on the mat"
    assert vocab.join("the cat\n", "a dog") == "the cat\na dog"


def test_generate_defaults_edges_and_temperature():
    """Near zero temperature samples what argmax picks (the logits divided by it, the largest first
    subtracted: at 0.001 they reach thousands); the defaults are 200 tokens, temperature 1, seed 0,
    from the line end; a length of 0 is an empty continuation."""
    vocab = Vocab.build("hello world, hello there\n", "char")
    m = RNNLM(ModelConfig(vocab_size=len(vocab), hidden=16, init_scale=1.5))
    p = m.init_params(4)
    greedy = generate(m, p, vocab, prime="he", length=30, argmax=True)
    assert generate(m, p, vocab, prime="he", length=30, temperature=0.001, seed=9) == greedy
    # one past float64's range once divided by it (NaN probabilities were the sampler's error)
    assert generate(m, p, vocab, prime="he", length=30, temperature=1e-320, seed=9) == greedy
    assert generate(m, p, vocab, prime="he", length=30, temperature=100.0, seed=9) != greedy
    default = generate(m, p, vocab)
    assert len(default) == 200 and default == generate(m, p, vocab, "", 200, 1.0, False, 0)
    assert default == generate(m, p, vocab, prime="\n", length=200)      # no prime: from the line end
    assert generate(m, p, vocab, prime="he", length=0) == ""
    with pytest.raises(ValueError, match="length must be >= 0"):
        generate(m, p, vocab, length=-1)
    assert generate(m, p, vocab, length=5, temperature=0.0, argmax=True) == generate(m, p, vocab, length=5, argmax=True)
