"""Optimizers, clipping and schedules against hand-computed values."""
import math

import numpy as np
import pytest

from rnnlm.config import OptimConfig, TrainConfig
from rnnlm.core.optim import clip_factor, clip_grads, make_optimizer
from rnnlm.core.schedule import Schedule, early_stop, rounds_for


def run(name, grads_seq, lr=0.1, **kw):
    opt = make_optimizer(OptimConfig(name=name, **kw))
    p = np.array([1.0, -2.0], np.float64)
    st = opt.init_state(p)
    for g in grads_seq:
        opt.step(p, np.array(g, np.float64), st, lr)
    return p, st


def test_sgd():
    p, st = run("sgd", [[1.0, 2.0], [0.5, -1.0]])
    assert np.allclose(p, [1 - 0.1 - 0.05, -2 - 0.2 + 0.1]) and st["t"] == 2


def test_momentum_and_nesterov():
    p, st = run("momentum", [[1.0, 0.0], [1.0, 0.0]], momentum=0.9)
    # v1 = 1, p = 1 - .1; v2 = .9 + 1 = 1.9, p = .9 - .19
    assert np.allclose(p, [0.71, -2.0]) and np.allclose(st["velocity"], [1.9, 0])
    p, _ = run("momentum", [[1.0, 0.0], [1.0, 0.0]], momentum=0.9, nesterov=True)
    # step1: v=1, p -= .1*(1 + .9) ; step2: v=1.9, p -= .1*(1 + 1.71)
    assert np.allclose(p, [1 - 0.19 - 0.271, -2.0])
    # a momentum other than Adam's beta1 (0.9): v = 1, 1.5, 1.75; p = 1 - .1 (1 + 1.5 + 1.75)
    p, st = run("momentum", [[1.0, 0.0]] * 3, momentum=0.5)
    assert np.allclose(p, [1 - 0.425, -2.0]) and np.allclose(st["velocity"], [1.75, 0])


@pytest.mark.parametrize("eps", [1e-12, 0.5])     # eps large enough to count, and where it cannot
def test_adagrad(eps):
    p, st = run("adagrad", [[2.0, 0.0], [1.0, 0.0]], eps=eps)
    assert np.allclose(st["sum_sq"], [5.0, 0.0])
    assert p[0] == pytest.approx(1 - 0.1 * 2 / (2 + eps) - 0.1 * 1 / (math.sqrt(5) + eps), rel=1e-14)
    assert p[1] == -2.0


@pytest.mark.parametrize("eps", [1e-8, 0.1])
def test_adam(eps):
    p, st = run("adam", [[2.0, -1.0], [1.0, 3.0]], lr=0.01, eps=eps)
    b1, b2 = 0.9, 0.999
    ref = np.array([1.0, -2.0])
    m = v = np.zeros(2)
    for t, g in enumerate([np.array([2.0, -1.0]), np.array([1.0, 3.0])], 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        ref = ref - 0.01 * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    assert np.allclose(p, ref, rtol=1e-12, atol=0) and np.allclose(st["m"], m) and np.allclose(st["v"], v)


def test_float32_updates_in_place():
    opt = make_optimizer(OptimConfig(name="adam"))
    p = np.ones(5, np.float32)
    st = opt.init_state(p)
    before = p.__array_interface__["data"][0]
    opt.step(p, np.full(5, 0.5, np.float32), st, 0.1)
    assert p.dtype == np.float32 and p.__array_interface__["data"][0] == before
    assert np.allclose(p, 0.9, atol=1e-6)


def test_clip_global_norm_and_value():
    g = np.array([3.0, 4.0])
    assert clip_grads(g, clip_norm=1.0) == pytest.approx(5.0)
    assert np.allclose(g, [0.6, 0.8])
    g = np.array([3.0, 4.0])
    clip_grads(g, clip_norm=10.0)
    assert np.allclose(g, [3.0, 4.0])
    g = np.array([3.0, -0.5, -7.0])
    clip_grads(g, clip_value=1.0)
    assert np.allclose(g, [1.0, -0.5, -1.0])


def test_epoch_decay_matches_zaremba():
    s = Schedule(OptimConfig(lr=1.0, schedule="epoch_decay", decay=0.5, decay_after=4))
    # epochs are 0-based fractions: the first four run at lr, then halve each epoch
    assert [s.lr(e) for e in (0, 2.5, 3.9, 4.0, 5.2, 12.0)] == [1, 1, 1, 0.5, 0.25, 0.5 ** 9]
    floor = Schedule(OptimConfig(lr=1.0, schedule="epoch_decay", decay=0.5, decay_after=1, min_lr=0.1))
    assert [floor.lr(e) for e in range(7)] == [1, 0.5, 0.25, 0.125, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("epochs, per_epoch, per_round, rounds", [
    (13, 929_589, 929_589, 13),     # 13 passes of one-pass rounds
    (2.2, 25, 1, 55),               # 2.2 * 25 is 55.000000000000007 in floats: not 56 rounds
    (1, 10, 3, 4),                  # a part of a round's worth is a round
    (1, 10, 20, 1),                 # half a round's worth: one round
    (3, 100, 7, 43),                # 42.86 rounds' worth
])
def test_rounds_for_counts_whole_rounds_and_not_the_quotients_last_bit(epochs, per_epoch, per_round, rounds):
    assert rounds_for(epochs, per_epoch, per_round) == rounds


def test_plateau_halves_when_validation_stalls():
    s = Schedule(OptimConfig(lr=2.0, schedule="plateau", decay=0.5))
    for v, want in [(5.0, 2.0), (4.0, 2.0), (4.5, 1.0), (3.0, 1.0), (3.0, 0.5)]:
        s.observe(v)
        assert s.lr(0) == want
    restored = Schedule(s.cfg, s.state)
    assert restored.lr(0) == 0.5
    assert Schedule(OptimConfig(lr=0.3)).lr(99) == 0.3
    floored = Schedule(OptimConfig(lr=1.0, schedule="plateau", decay=0.5, min_lr=0.3))
    for v in (5.0, 6.0, 7.0, 8.0):                          # halves at each stall, down to the floor
        floored.observe(v)
    assert floored.lr(0) == 0.3


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
def test_grad_scale_equals_prescaled_gradient(name):
    opt = make_optimizer(OptimConfig(name=name))
    g = np.array([0.3, -1.2, 2.0])
    p1, p2 = np.ones(3), np.ones(3)
    s1, s2 = opt.init_state(p1), opt.init_state(p2)
    for _ in range(2):
        opt.step(p1, g * 0.25, s1, 0.1)
        opt.step(p2, g.copy(), s2, 0.1, grad_scale=0.25)
    assert np.allclose(p1, p2, rtol=1e-12)
    assert not np.allclose(p1, 1.0)


def test_clip_factor_stays_an_array_and_is_exactly_one_up_to_the_bound():
    g = np.array([3.0, 4.0], np.float32)
    for bound in (5.0, 10.0):
        norm, factor = clip_factor(g, clip_norm=bound)
        assert factor == 1.0 and norm == 5.0              # clip / max(norm, clip): no rounding up to the bound
    norm, factor = clip_factor(g, clip_norm=2.0)
    assert norm == 5.0 and factor == 0.4
    assert isinstance(norm, np.floating) and norm.dtype == np.float64   # not read through Python's float
    assert clip_factor(g)[1] == 1.0


def test_a_float32_gradient_whose_squares_overflow_is_clipped_not_read_as_an_infinite_norm():
    """3e20 squared passes float32's 3.4e38: its norm is still 5e20 and the clip scales it (as the GPU's
    float64 sum does), where an infinite norm stopped a run that the clip was there to rescue. A gradient
    holding inf or NaN still reads as not finite."""
    g = np.array([3e20, -4e20, 0.0], np.float32)
    norm, factor = clip_factor(g, clip_norm=5.0)
    assert norm == pytest.approx(5e20, rel=1e-6) and factor == pytest.approx(1e-20, rel=1e-6)
    for bad in (np.inf, np.nan):
        assert not np.isfinite(clip_factor(np.array([3e20, bad], np.float32), clip_norm=5.0)[0])


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
def test_a_device_factor_updates_bit_for_bit_as_a_python_float(name):
    """A clip factor as a 0-d float64 array (what clip_factor leaves on a GPU) or as NumPy's float64
    updates float32 parameters to the bit as a Python float folded in by hand does (SGD: into the
    learning rate; the others: into the gradient): rounded to float32 once, not multiplied in float64."""
    opt = make_optimizer(OptimConfig(name=name))
    rng = np.random.default_rng(3)
    g = rng.normal(size=1000).astype(np.float32)
    factor = 0.1234567890123
    start = rng.normal(size=1000).astype(np.float32)
    ps = [start.copy() for _ in range(3)]
    ss = [opt.init_state(p) for p in ps]
    for _ in range(3):
        if name == "sgd":
            opt.step(ps[0], g.copy(), ss[0], 0.7 * factor)
        else:
            scaled = g.copy()
            scaled *= factor                                # a Python float: float32 arithmetic
            opt.step(ps[0], scaled, ss[0], 0.7)
        opt.step(ps[1], g.copy(), ss[1], 0.7, grad_scale=np.asarray(factor))     # an array
        opt.step(ps[2], g.copy(), ss[2], 0.7, grad_scale=np.float64(factor))     # a host scalar
    assert not np.array_equal(ps[0], start)
    for p in ps[1:]:
        assert p.dtype == np.float32 and np.array_equal(p, ps[0])


def test_early_stop_counts_the_evaluations_on_the_cadence_since_the_best():
    t, best = TrainConfig(eval_every=10, patience=2), {"round": 10, "valid_loss": 1.5}
    assert early_stop(t, 20, best) is None                  # one evaluation since round 10
    assert early_stop(t, 30, best) == ("2 evaluations since round 10 without a lower validation loss than its "
                                       "1.5000 (train.patience = 2)")
    assert early_stop(t, 35, best) is None                  # no evaluation's round (a longer run's last)
    # an earlier, shorter run's last round, 15, evaluated there: since then the evaluations at 20 and 30
    assert early_stop(t, 20, {"round": 15, "valid_loss": 1.5}) is None
    assert early_stop(t, 30, {"round": 15, "valid_loss": 1.5}).startswith("2 evaluations since round 15 ")
    assert early_stop(TrainConfig(eval_every=1, patience=1), 2, {"round": 1, "valid_loss": 1.0}).startswith(
        "1 evaluation since round 1 ")
    assert early_stop(TrainConfig(eval_every=10, patience=0), 1000, best) is None      # off
    assert early_stop(t, 30, None) is None                  # no validation loss yet
