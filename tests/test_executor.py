"""Task functions called in-process, as an executor's Python worker calls them."""
import time
import types

import numpy as np
import pytest

from rnnlm import config
from rnnlm.exchange import plan
from rnnlm.exchange.round import Carry, RoundMessage
from rnnlm.spark import executor
from rnnlm.spark.memo import MEMO
from rnnlm.core.model import RNNLM
from rnnlm.core.optim import make_optimizer


class Bc:
    """A broadcast handle as a task sees one."""

    def __init__(self, value):
        self.value = value


class Untouchable:
    @property
    def value(self):
        raise AssertionError("a task read another partition's broadcast")


def cfg_for(vocab_size, *sets):
    return config.load(None, ["model.hidden=8", f"model.vocab_size={vocab_size}", "optim.name=adam",
                              "optim.lr=0.01", "train.bptt=5", "train.batch=2", "train.local_steps=3",
                              "train.grad_norm=token", "train.rounds=1", *sets])


def contribute(cfg, params, pid, tokens, bc_local=None):
    """Partition ``pid``'s round-1 contribution, as its task yields it."""
    task = executor.round_task(cfg, Bc(params), Bc(RoundMessage("test:0", {}, None)), bc_local or {}, 1, 0.01,
                               chained=False, carries_in_spark=False)
    (agg,) = list(task(iter([(pid, tokens, np.array([0]))])))
    assert not agg.errors()
    return agg


def run_task(cfg, params, pid, tokens, bc_local=None):
    agg = contribute(cfg, params, pid, tokens, bc_local)
    return params + plan.mean_change(RNNLM(cfg.model).layout, agg, np.float32)


@pytest.mark.parametrize("optim_state, strategy", [("average", "windows"), ("local", "streams"), ("reset", "streams")])
def test_a_tasks_contribution_is_what_the_channel_expects_and_fits_its_frame_cap(optim_state, strategy):
    """The driver's :func:`~rnnlm.spark.channel.expected` of a run takes what that run's tasks send (else
    every contribution would be refused and the round recomputed through Spark), and the frame cap covers
    the largest one: every block whole, the carried state, the optimizer slots, every word."""
    from rnnlm.exchange.frames import Malformed, contribution_from_wire, contribution_to_wire
    from rnnlm.spark.channel import expected, max_frame_bytes
    cfg = cfg_for(20, f"train.optim_state={optim_state}", f"data.strategy={strategy}", "data.partitions=2",
                  "train.local_steps=0")                                    # one pass: every word read
    model = RNNLM(cfg.model)
    agg = contribute(cfg, model.init_params(1), 1, np.arange(400, dtype=np.int32) % 20)
    fields, arrays = contribution_to_wire(1, agg)
    expect = expected(cfg, model)
    pid, got = contribution_from_wire(fields, arrays, expect)
    assert pid == 1 and got.weight == agg.weight and sorted(got.dense) == sorted(agg.dense)
    assert len(arrays["words"]) == 20 and all(b.ids is None for b in agg.dense.values())     # the largest
    assert sum(a.nbytes for a in arrays.values()) <= max_frame_bytes(expect) - (1 << 20)      # less its slack
    other = expected(config.replace(cfg, "train", optim_state="local" if optim_state != "local" else "reset"), model)
    with pytest.raises(Malformed):
        contribution_from_wire(fields, arrays, other)


def test_memo_never_serves_another_partitions_data():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 20, 200).astype(np.int32)
    b = a.copy()
    b[100:] = rng.integers(0, 20, 100)            # same partition, length and first 64 tokens: other data
    assert len(a) == len(b) and a[:64].sum() == b[:64].sum() and not np.array_equal(a, b)
    cfg = cfg_for(20)
    params = RNNLM(cfg.model).init_params(1)
    MEMO.clear()
    run_task(cfg, params, 0, a)
    after_a = run_task(cfg, params, 0, b)
    MEMO.clear()
    fresh = run_task(cfg, params, 0, b)
    assert np.array_equal(after_a, fresh)


def stepped_from(cfg, params, tokens, opt_state):
    """Partition 0's round-1 parameters after its local steps from ``opt_state``, computed directly
    (no broadcast, no aggregate)."""
    model = RNNLM(cfg.model)
    src = executor.make_source(cfg, 0, tokens, np.array([0]))
    res, *_ = executor.train_and_encode(cfg, model, src, make_optimizer(cfg.optim), params.copy(), opt_state,
                                        model.zero_state(cfg.train.batch), params, 1, 0, 0.01,
                                        cfg.train.local_steps, None, by_tokens=True)
    return res.params


def test_a_round_that_scores_no_token_keeps_its_residual_whole():
    """A sample of one-token paragraphs runs a step and scores nothing: its blocks weigh 0 in the round's
    mean, so with feedback it keeps its residual whole (the int8 blocks it sent were lost: neither applied
    nor kept). An async push, which the server applies whatever it scored, keeps only what it did not send."""
    cfg = cfg_for(7, "data.strategy=sampled_paragraphs", "data.sample_fraction=0.1", "train.local_steps=0",
                  "exchange.hidden=dense+int8", "exchange.feedback=true", "optim.name=sgd")
    model = RNNLM(cfg.model)
    params = model.init_params(1)
    src = executor.make_source(cfg, 0, np.arange(24, dtype=np.int32) % 7, np.append(np.arange(19), 19))
    residual = np.random.default_rng(0).normal(size=params.size).astype(params.dtype)
    for by_tokens in (True, False):
        opt = make_optimizer(cfg.optim)
        res, _, _, left, _, change = executor.train_and_encode(
            cfg, model, src, opt, params.copy(), opt.init_state(params), model.zero_state(2), params, 1, 0, 0.1, 0,
            residual, by_tokens=by_tokens)
        assert res.steps == 1 and res.tokens == 0 and not change.any()
        assert np.array_equal(left, residual) == by_tokens, by_tokens


def test_a_task_reads_only_its_own_partitions_broadcast():
    """Partition 0 steps from its own optimizer state (Adam at t = 3, v = 1e-4), not a fresh one, and never
    reads partition 1's."""
    cfg = cfg_for(20, "train.optim_state=local")
    params = RNNLM(cfg.model).init_params(1)
    tokens = np.arange(200, dtype=np.int32) % 20

    def state():
        return {"t": 3, "m": np.zeros_like(params), "v": np.full_like(params, 1e-4)}

    mine = run_task(cfg, params, 0, tokens, {0: Bc(Carry(opt=state())), 1: Untouchable()})
    fresh = run_task(cfg, params, 0, tokens, {1: Untouchable()})
    # equal up to the float32 rounding of parameters + averaged change
    np.testing.assert_allclose(mine, stepped_from(cfg, params, tokens, state()), rtol=1e-6, atol=1e-8)
    init = make_optimizer(cfg.optim).init_state(params)
    np.testing.assert_allclose(fresh, stepped_from(cfg, params, tokens, init), rtol=1e-6, atol=1e-8)
    assert np.abs(mine - fresh).max() > 1e-3       # the two states lead apart: the comparisons tell them apart


def test_an_eager_partition_starts_from_the_base_plus_its_last_change_over_the_partition_count():
    """``train.eager``: a partition holding its last change ``e`` trains from ``base + e / P``: the same
    numbers, to the bit, as a partition sent that sum as its base; and ``e`` changes them."""
    cfg = cfg_for(20, "train.overlap=1", "train.eager=true", "data.partitions=2", "train.optim_state=local")
    base = RNNLM(cfg.model).init_params(1)
    e = np.random.default_rng(0).normal(0, 0.05, base.shape).astype(np.float32)
    tokens = np.arange(200, dtype=np.int32) % 20

    def task(params, held, name):
        MEMO.clear()
        t = executor.round_task(cfg, Bc(params), Bc(RoundMessage(name, {}, None)), {}, 1, 0.01,
                                chained=True, carries_in_spark=True)
        agg, (pid, _, _, held_next, carry) = list(t(iter([(0, tokens, np.array([0]), held, None)])))
        assert pid == 0 and carry is agg.local[0] and not agg.errors()
        return plan.mean_change(RNNLM(cfg.model).layout, agg, np.float32), held_next["eager"]

    eager, change = task(base, {"eager": e}, "eager")
    sent, sent_change = task(base + e / 2, {}, "sent")
    assert np.array_equal(eager, sent) and np.array_equal(change, sent_change)
    plain, _ = task(base, {}, "plain")
    assert np.abs(eager - plain).max() > 1e-4


def test_a_tasks_phases_are_timed_within_its_wall_time_and_its_sampled_sets_counted():
    cfg = cfg_for(50, "exchange.sampled_softmax=true", "optim.name=sgd", "optim.lr=0.5")
    params = RNNLM(cfg.model).init_params(1)
    t0 = time.perf_counter()
    agg = contribute(cfg, params, 0, np.arange(400, dtype=np.int32) % 50)
    wall = time.perf_counter() - t0
    for k in ("steps_s", "encode_s", "view_s", "compute_s"):
        assert 0 <= agg.stats[k] <= wall, (k, agg.stats[k], wall)
    assert agg.stats["steps_s"] <= agg.stats["compute_s"]
    v_all, v_f = agg.stats["softmax_v_all"], agg.stats["softmax_v_f"]
    assert 0 < v_all < v_f <= 50, (v_all, v_f)                     # V_f = V_all and a random share


def test_where_a_task_computes_is_named_in_its_metrics(monkeypatch):
    assert executor.device_field(0, 4) == "cpu"
    assert executor.device_field(1, 4) == "gpu+cpu" and executor.device_field(3, 4) == "gpu+cpu"
    assert executor.device_field(4, 4) == "gpu"
    assert executor.device_label(np) == "cpu"
    monkeypatch.setattr(executor.backend, "device_key", lambda xp: "cupy:3")
    assert executor.device_label(object()) == "gpu 3"


def test_a_task_on_the_gpu_uses_the_first_address_spark_assigned_it(monkeypatch):
    used, gpu = [], types.SimpleNamespace()
    monkeypatch.setattr(executor.backend, "get_xp", lambda device: gpu if device == "gpu" else np)
    monkeypatch.setattr(executor.backend, "use_gpu", used.append)
    monkeypatch.setattr(executor, "assigned_gpus", lambda: ["5", "2"])
    assert executor.task_xp("gpu") is gpu and used == [5]
    assert executor.task_xp("cpu") is np and used == [5]


@pytest.mark.parametrize("address", ["GPU-5b2e1c4d", "-1", ""])
def test_a_gpu_address_that_is_no_device_index_is_the_partitions_answer_not_a_task_failure(monkeypatch, address):
    """int() raised ValueError in the task: Spark retried it, and the run failed with a Python traceback."""
    monkeypatch.setattr(executor.backend, "get_xp", lambda device: types.SimpleNamespace())
    monkeypatch.setattr(executor.backend, "use_gpu", lambda index: pytest.fail("no device to use"))
    monkeypatch.setattr(executor, "assigned_gpus", lambda: [address])
    part = (3, np.arange(50, dtype=np.int32) % 20, np.array([0]))
    (pid, *_, error, device, _), = executor.probe_task(cfg_for(20, "train.device=gpu"))(iter([part]))
    assert error == (f"Spark assigned the GPU address {address!r}, not a CUDA device index: the discovery script "
                     "(spark.*.resource.gpu.discoveryScript) must print indices, as nvidia-smi's")
    assert device == {"ran": None, "assigned": [address]}


def test_a_partition_that_cannot_run_expects_no_tokens_and_says_why():
    cfg = cfg_for(20, "train.device=gpu")
    part = (3, np.arange(50, dtype=np.int32) % 20, np.array([0]))
    (pid, n, expect, per_pass, error, device, digest), = executor.probe_task(cfg)(iter([part]))
    assert (pid, n, expect, per_pass, digest) == (3, 50, 0.0, 0, None) and device["ran"] is None
    assert "CuPy" in error or "CUDA" in error, error
    short = cfg_for(20)
    part = (1, np.arange(4, dtype=np.int32), np.array([0]))                 # too short for a batch
    (pid, n, expect, per_pass, error, device, digest), = executor.probe_task(short)(iter([part]))
    assert (pid, n, expect, per_pass, device["ran"], digest) == (1, 4, 0.0, 0, "cpu", None) and error


def test_a_python_worker_keeps_its_memo_across_rounds(spark, tiny_cfg, tmp_path):
    """The model is built once per Python worker, not once per task: tasks reach the worker's own memo (a
    closure that named it would be pickled with an empty copy of it, and every round would start cold)."""
    from rnnlm.spark.trainer import Trainer
    tr = Trainer(spark, config.replace(tiny_cfg, "train", rounds=3), str(tmp_path / "run"), log=lambda s: None)
    tr.run()
    key = ("model", tr.cfg.model, "numpy")

    def has_model(it):
        list(it)                      # a worker is reused only when its task reads all its input
        import os
        from rnnlm.spark import memo as worker_memo
        yield os.getpid(), key in worker_memo.MEMO.entries     # (the pid: what the assertion's message shows)

    # Idle workers are taken first in, first out, so 16 tasks visit every worker of the pool. The pool may
    # hold workers that earlier jobs of this session started and that ran no round (they lack the model);
    # the workers that ran the rounds hold it. A closure pickled with its own copy of the memo leaves none.
    seen = spark.sparkContext.parallelize(range(16), 16).mapPartitions(has_model).collect()
    assert any(has for _, has in seen), seen
