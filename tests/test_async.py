"""Asynchronous training through Spark: the parameter server on the driver, one long task per partition."""
import json
import re
import subprocess

import numpy as np
import pytest

from rnnlm import config
from rnnlm.cli import make_trainer
from rnnlm.cli.checks import finished_run
from rnnlm.core import checkpoint
from rnnlm.spark.async_trainer import AsyncTrainer, window_lrs
from rnnlm.spark.rundir import TrainingError
from conftest import CLUSTER_RUN, ROOT, blocked_at_round_3, metrics, train_cmd, wait_for

BASE = ["data.train=rnnlm/data/harbour.txt", "data.level=char", "model.cell=lstm", "model.hidden=16",
        "optim.name=adam", "optim.lr=0.01", "train.bptt=8", "train.batch=4", "train.grad_norm=token",
        "train.eval_every=0", "server.heartbeat_s=0.2", "server.timeout_s=5"]


def cfg_of(*sets):
    return config.load(None, BASE + list(sets))


def test_one_worker_equals_k_local_steps_then_a_push(spark, tmp_path):
    """With one worker nothing is stale: each window is push_every local steps from the server's parameters,
    then the change is added; the synchronous trainer with local_steps = push_every does the same per round."""
    common = ("data.partitions=1", "train.rounds=5")
    sync = make_trainer(spark, cfg_of(*common, "train.local_steps=3"), str(tmp_path / "sync"), log=lambda *_: None)
    sync.run()
    tr = make_trainer(spark, cfg_of(*common, "train.mode=async", "train.push_every=3"), str(tmp_path / "async"),
                      log=lambda *_: None)
    assert isinstance(tr, AsyncTrainer)
    tr.run()
    np.testing.assert_array_equal(tr.params, sync.params)
    last = metrics(tmp_path / "async")[-1]
    assert last["syncs"] == 5 and last["windows_lost"] == 0 and last.get("refused_duplicate", 0) == 0
    assert sum(m["pushes"] for m in metrics(tmp_path / "async")) == 5
    assert last["tokens"] == metrics(tmp_path / "sync")[-1]["tokens"]
    # and its checkpoint holds the server's parameters and progress
    ck = checkpoint.load(str(tmp_path / "async" / "checkpoint"))
    np.testing.assert_array_equal(ck.params, tr.params)
    assert ck.position["done"] == [5] and ck.position["version"] == 5


def test_one_worker_decays_its_rate_where_the_sync_run_does_and_each_line_says_the_rate_it_trained_at(
        spark, tmp_path):
    """Windows of 30 steps read ~0.16 of the text: under epoch_decay from the first epoch the rate halves
    from window 8 on. One worker's run equals the sync run's, bit for bit, and a line's lr is the rate of
    its round's windows, as a sync round's is the rate it trained at (lines once gave the next window's)."""
    common = ("data.partitions=1", "train.rounds=9", "optim.schedule=epoch_decay", "optim.decay_after=1")
    sync = make_trainer(spark, cfg_of(*common, "train.local_steps=30"), str(tmp_path / "sync"), log=lambda *_: None)
    sync.run()
    tr = make_trainer(spark, cfg_of(*common, "train.mode=async", "train.push_every=30"), str(tmp_path / "async"),
                      log=lambda *_: None)
    tr.run()
    np.testing.assert_array_equal(tr.params, sync.params)
    rate = {m["round"]: m["lr"] for m in metrics(tmp_path / "sync")}
    assert sorted(set(rate.values())) == [0.005, 0.01]
    lines = metrics(tmp_path / "async")
    assert lines[-1]["syncs"] == 9 and all(m["lr"] == rate[max(1, m["syncs"])] for m in lines), lines


def test_a_window_that_starts_a_whole_epoch_trains_at_that_epochs_rate():
    """49 windows of 1,000 tokens are one epoch of 49,000: window 49 starts epoch 1 and trains at its
    halved rate (49 x (1,000 / 49,000) is 0.9999999999999999: it once kept the first epoch's rate)."""
    cfg = config.Config(optim=config.OptimConfig(schedule="epoch_decay", lr=1.0, decay=0.5, decay_after=1))
    lrs = window_lrs(cfg, 1000, 49000, 100)
    assert lrs[:49] == [1.0] * 49 and lrs[49:98] == [0.5] * 49 and lrs[98:] == [0.25] * 2


@pytest.mark.parametrize("server", [
    (),                                                           # Hogwild!: lock-free, add
    ("server.lock=true", "server.staleness=divide"),
    ("server.update=adagrad", "server.lr=0.02", "optim.name=sgd", "optim.lr=1.0"),
], ids=["lock-free", "locked-staleness", "adagrad"])
def test_two_workers_complete_every_window_once_and_the_loss_falls(spark, tmp_path, server):
    cfg = cfg_of("data.partitions=2", "data.valid=rnnlm/data/harbour_valid.txt", "train.mode=async",
                 "train.push_every=4", "train.rounds=12", "train.eval_every=4", *server)
    tr = make_trainer(spark, cfg, str(tmp_path / "run"), log=lambda *_: None)
    tr.run()
    m = metrics(tmp_path / "run")
    assert m[-1]["syncs"] == 24 and sum(x["pushes"] for x in m) == 24 and m[-1]["windows_lost"] == 0
    assert tr.server.done == [12, 12] and m[-1].get("refused_duplicate", 0) == 0
    stale = {}
    for x in m:
        for k, v in x["staleness"].items():
            stale[k] = stale.get(k, 0) + v
    assert sum(stale.values()) == 24
    # every byte on the server's connections: each of the 24 pushes carries the dense float32 change in
    # full (the model's bytes), each reply the rows changed since the worker's last pull (all of them), each
    # hello the parameters; frame headers, handshakes and heartbeats (5 a second per worker) add the rest
    n, frames = tr.params.nbytes, 24 + 2 * (5 * m[-1]["wall_s"] + 4)
    assert 24 * n <= m[-1]["bytes_sent"] <= 24 * n + 2048 * frames, (n, m[-1])
    assert 26 * n <= m[-1]["bytes_broadcast"] <= 26 * n + 2048 * frames, (n, m[-1])
    assert m[-1]["bytes_sent"] == sum(x["round_bytes_sent"] for x in m)
    assert m[-1]["bytes_broadcast"] == sum(x["round_bytes_broadcast"] for x in m)
    assert all(type(x["tokens_per_s"]) is int and x["tokens_per_s"] > 0 for x in m if x["pushes"])   # not 1.179e+04
    valid = [x["valid_loss"] for x in m if "valid_loss" in x]
    assert len(valid) >= 2 and valid[-1] < np.log(tr.cfg.model.vocab_size) - 0.5, valid
    # each evaluation is a checkpoint's line; best/ holds the lowest validation loss's
    evaluated = [x for x in m if "valid_loss" in x]
    assert [x["best_round"] for x in evaluated] == [
        min(evaluated[:i + 1], key=lambda x: x["valid_loss"])["round"] for i in range(len(evaluated))]
    best = checkpoint.load(str(tmp_path / "run" / "best"))
    assert best.position["round"] == m[-1]["best_round"] and best.position["line"]["valid_loss"] == min(valid)
    assert [x["syncs"] for x in m] == sorted(x["syncs"] for x in m) and m[-1]["epoch"] > 0


def test_ffnn_trains_asynchronously_with_adagrad_on_the_server(spark, tmp_path):
    cfg = cfg_of("data.partitions=2", "data.valid=rnnlm/data/harbour_valid.txt", "model.cell=ffnn",
                 "model.embed=8", "model.hidden=16", "model.context=3", "optim.name=sgd", "optim.lr=0.5",
                 "train.mode=async", "train.push_every=5", "train.rounds=10", "train.eval_every=5",
                 "server.update=adagrad", "server.lr=0.05")
    tr = make_trainer(spark, cfg, str(tmp_path / "run"), log=lambda *_: None)
    tr.run()
    m = metrics(tmp_path / "run")
    valid = [x["valid_loss"] for x in m if "valid_loss" in x]
    assert valid[-1] < np.log(tr.cfg.model.vocab_size) - 0.5, valid
    assert m[-1]["syncs"] == 20


def test_a_diverging_worker_stops_the_run_at_once_with_its_error(spark, tmp_path):
    out = tmp_path / "run"
    cfg = cfg_of("data.partitions=2", "train.mode=async", "train.push_every=2", "train.rounds=2",
                 "server.checkpoint_s=0")
    make_trainer(spark, cfg, str(out), log=lambda *_: None).run()
    ck = checkpoint.load(str(out / "checkpoint"))
    ck.params[:5] = np.nan                  # the server hands poisoned parameters to both workers
    checkpoint.save(str(out / "checkpoint"), ck)
    before = {f.name: f.read_bytes() for f in (out / "checkpoint").iterdir()}
    tr = make_trainer(spark, config.replace(cfg, "train", rounds=400), str(out), log=lambda *_: None)
    with pytest.raises(TrainingError, match=r"^partition \d: loss became nan at local step 0; stopped, the last "
                                            r"good checkpoint is kept"):
        tr.run(resume=True)
    assert {f.name: f.read_bytes() for f in (out / "checkpoint").iterdir()} == before


def test_a_worker_without_its_device_answers_with_the_error_rather_than_failing_its_task():
    """As a synchronous round's task does: a retry would meet the same executor, so the partitions answer."""
    from rnnlm.spark.async_task import worker_task
    cfg = config.resolve(cfg_of("data.partitions=2", "train.mode=async", "train.push_every=2", "train.rounds=2",
                                "train.device=gpu"), 20)
    parts = [(pid, np.arange(80, dtype=np.int32) % 20, np.array([0])) for pid in (0, 1)]
    out = list(worker_task(cfg, ("127.0.0.1", 9), bytes(32), [0.01, 0.01])(iter(parts)))
    assert [(pid, trained) for pid, trained, _ in out] == [(0, 0), (1, 0)]
    assert all("CuPy" in error or "CUDA" in error for _, _, error in out), out


@pytest.mark.parametrize("newer_fails", [False, True])
def test_an_attempt_superseded_mid_run_stands_by_and_trains_on_if_the_newer_one_fails(monkeypatch, newer_fails):
    """Two attempts of one partition's task (as a speculative copy beside its original), on a real server over
    sockets: the original, superseded at its second window, ends well when the copy finishes; when the copy fails
    at window 4 (its task ends), the original takes over at once (no driver here reports silence) and finishes.
    Either way every window is applied once. (The old task raised when superseded: a failed task, which Spark counts
    against spark.task.maxFailures.)"""
    import threading
    from rnnlm.core.models import build as build_model
    from rnnlm.server import wire
    from rnnlm.server.paramserver import ParameterServer
    from rnnlm.spark import async_task, memo
    W = 8
    cfg = config.resolve(cfg_of("data.partitions=1", "train.mode=async", "train.push_every=2", f"train.rounds={W}"),
                         20)
    model = build_model(cfg.model)
    ps = ParameterServer(model.layout, model.init_params(cfg.train.seed), cfg.server, W, 1, log=lambda *_: None)
    secret = wire.new_secret()
    frames = wire.FrameServer(ps.handle, secret, log=lambda *_: None).start()
    real, copy_started = async_task.train_and_encode, threading.Event()

    def staged(*args, **kw):
        rnd = args[8]                                   # window + 1
        if threading.current_thread().name == "copy":
            copy_started.set()
            if newer_fails and rnd == 5:
                raise RuntimeError("the copy's executor failed")
        elif rnd == 2:                                  # the original's second window ends after the copy's hello
            assert copy_started.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(async_task, "train_and_encode", staged)
    memos = {}                      # each attempt its own model's buffers, as in its own Python worker under Spark

    class PerAttempt:
        def get(self, key, build):
            return memos.setdefault(threading.current_thread().name, memo.Memo()).get(key, build)
    monkeypatch.setattr(memo, "MEMO", PerAttempt())
    task = async_task.worker_task(cfg, frames.address, secret, [0.01] * W)
    part = [(0, np.arange(400, dtype=np.int32) % 20, np.array([0]))]
    out = {}

    def attempt(name):
        try:
            out[name] = list(task(iter(part)))
        except Exception as e:
            out[name] = e

    original = threading.Thread(target=attempt, args=("original",), name="original")
    original.start()
    wait_for(lambda: ps.version == 1)                   # its first window applied
    copy = threading.Thread(target=attempt, args=("copy",), name="copy")
    copy.start()
    for th in (copy, original):
        th.join(60)
    frames.close()
    assert not original.is_alive() and not copy.is_alive(), "an attempt never ended"
    assert ps.done == [W] and ps.version == W and ps.totals["refused_superseded"] >= 1
    if newer_fails:
        assert isinstance(out["copy"], RuntimeError) and out["original"] == [(0, 1 + 4, None)]
        assert ps.totals["attempts_retried"] == 2 and ps.totals["workers_lost"] == 0     # it left: not lost
    else:
        assert out == {"original": [(0, 1, None)], "copy": [(0, W - 1, None)]}
        assert ps.totals["attempts_retried"] == 1


def test_a_partitions_windows_are_a_function_of_the_seed_the_partition_and_the_window():
    """docs/async.md's guarantee for more than one worker: each partition alone on a real server, twice, on the
    same text and from the same weights, with dropout: a partition's pushes repeat bit for bit, and the two
    partitions' differ (each draws its own masks; the one-worker test cannot see a partition id taken for 0)."""
    from rnnlm.core.models import build as build_model
    from rnnlm.server import wire
    from rnnlm.server.paramserver import ParameterServer
    from rnnlm.spark import async_task, memo
    W = 3
    cfg = config.resolve(cfg_of("data.partitions=2", "train.mode=async", "train.push_every=2", f"train.rounds={W}",
                                "model.dropout=0.3"), 20)
    model = build_model(cfg.model)
    tokens = np.arange(400, dtype=np.int32) * 7 % 20

    def alone(pid):
        memo.MEMO.clear()
        ps = ParameterServer(model.layout, model.init_params(cfg.train.seed), cfg.server, W, 2, log=lambda *_: None)
        secret = wire.new_secret()
        frames = wire.FrameServer(ps.handle, secret, log=lambda *_: None).start()
        try:
            out = list(async_task.worker_task(cfg, frames.address, secret, [0.01] * W)(iter([(pid, tokens,
                                                                                             np.array([0]))])))
        finally:
            frames.close()
        assert out == [(pid, W, None)] and ps.done[pid] == W
        return ps.params

    first, again, other = alone(1), alone(1), alone(0)
    np.testing.assert_array_equal(first, again)
    diff = float(np.abs(first - other).max())
    assert diff > 1e-4, diff


def test_a_checkpoint_holding_every_window_before_the_last_line_gets_that_line_on_resume(spark, tmp_path):
    """A checkpoint by pushes can hold every window applied before the run's last line (which scores the
    held-out text) is written; the driver dying there left a run that --resume called done, unscored."""
    out, logs = tmp_path / "run", []
    cfg = cfg_of("data.partitions=1", "data.valid=rnnlm/data/harbour_valid.txt", "train.mode=async",
                 "train.push_every=2", "train.rounds=2")
    make_trainer(spark, cfg, str(out), log=lambda *_: None).run()
    m = metrics(out)
    assert "valid_loss" in m[-1] and m[-1]["windows_lost"] == 0
    ck = checkpoint.load(str(out / "checkpoint"))
    line = {k: v for k, v in m[-1].items() if not k.startswith(("valid_", "best_", "eval_", "windows_"))}
    assert finished_run(cfg, str(out), True, False) == str(out)          # the command line: nothing to do
    ck.position["line"] = line
    checkpoint.save(str(out / "checkpoint"), ck)
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [*m[:-1], line]))
    # it said done as well, and handed the run a trainer without Spark: an AttributeError traceback
    assert finished_run(cfg, str(out), True, False) is None
    tr = make_trainer(spark, cfg, str(out), log=logs.append)
    tr.run(resume=True)
    assert not any(x.startswith("nothing to do") for x in logs), logs
    again = metrics(out)
    assert again[:-1] == [*m[:-1], line] and again[-1]["valid_loss"] == m[-1]["valid_loss"]
    assert again[-1]["windows_lost"] == 0 and again[-1]["syncs"] == m[-1]["syncs"]
    np.testing.assert_array_equal(tr.params, ck.params)
    assert checkpoint.load(str(out / "checkpoint")).position["line"] == again[-1]


def test_a_resumed_async_run_keeps_a_best_saved_ahead_of_its_checkpoint_until_one_beats_it(spark, tmp_path):
    """best/ is written before checkpoint/: a driver dying between the two leaves best/ holding a round the
    checkpoint's record does not name. An async run's rounds differ when run again, so the resumed run
    compared its evaluations with the checkpoint's older record and replaced best/ with a worse model. (One
    worker is deterministic; best/'s record is set here to one no evaluation beats, as a lucky lost round's.)"""
    out = tmp_path / "run"
    sets = ("data.partitions=1", "data.valid=rnnlm/data/harbour_valid.txt", "train.mode=async",
            "train.push_every=2", "train.eval_every=1")
    make_trainer(spark, cfg_of(*sets, "train.rounds=2"), str(out), log=lambda *_: None).run()
    best = checkpoint.load(str(out / "best"))
    assert best.position["best"]["round"] == 2
    best.position["best"] = {"round": 3, "valid_loss": 0.01}              # a round of work the death discarded
    checkpoint.save(str(out / "best"), best)
    make_trainer(spark, cfg_of(*sets, "train.rounds=4"), str(out), log=lambda *_: None).run(resume=True)
    m = metrics(out)                       # (round 4 may have two lines: one that evaluates, then the last)
    resumed = [x for x in m if x["round"] > 2]
    assert resumed and m[-1]["round"] == 4 and all(x["valid_loss"] > 0.01 for x in m if "valid_loss" in x)
    assert {x["best_round"] for x in resumed if "valid_loss" in x} == {3}
    assert checkpoint.load(str(out / "best")).position["best"] == {"round": 3, "valid_loss": 0.01}


def test_a_resume_shortened_below_a_partitions_windows_ends_with_its_last_line(spark, tmp_path):
    """train.rounds lowered on resume, one partition already past the new end and one short of it: the
    line after its push counted a round past the run's rates, an IndexError traceback at every resume."""
    out, logs = tmp_path / "run", []
    cfg = cfg_of("data.partitions=2", "train.mode=async", "train.push_every=2", "train.rounds=3")
    make_trainer(spark, cfg, str(out), log=lambda *_: None).run()
    ck = checkpoint.load(str(out / "checkpoint"))
    ck.position.update(done=[3, 1], version=4, round=2)       # as if partition 1 had stopped after window 1
    ck.position.pop("line", None)
    checkpoint.save(str(out / "checkpoint"), ck)
    (out / "metrics.jsonl").write_text("")
    shorter = config.replace(cfg, "train", rounds=2)
    make_trainer(spark, shorter, str(out), log=logs.append).run(resume=True)
    last = metrics(out)[-1]
    assert last["syncs"] == 5 and last["windows_lost"] == 0 and last["round"] == 3, logs
    assert last["lr"] == shorter.optim.lr                     # the last round's rate (the schedule is flat)


def test_a_run_that_cannot_serve_stops_with_one_line_and_leaves_nothing_cached(spark, tmp_path):
    """A frame bound below the largest push, a port taken: its corpus (training and held-out text) is
    cached by then, and a notebook's session kept it."""
    import socket
    from rnnlm.core.models import build as build_model
    from rnnlm.core.vocab import Vocab
    from rnnlm.server.paramserver import max_push_bytes
    sc = spark.sparkContext
    cached = sc._jsc.getPersistentRDDs().size()
    sets = ("data.partitions=1", "data.valid=rnnlm/data/harbour_valid.txt", "train.mode=async", "train.push_every=2",
            "train.rounds=2")
    vocab = Vocab.build(open("rnnlm/data/harbour.txt").read(), "char")
    layout = build_model(config.resolve(cfg_of(*sets), len(vocab)).model).layout
    push, dense = max_push_bytes(layout, 4), 4 * layout.size + (1 << 16)
    mb = (push + dense) / 2 / (1 << 20)                 # a frame for the model and 64 KiB, not for a push of rows
    tr = make_trainer(spark, cfg_of(*sets, f"server.max_frame_mb={mb!r}"), str(tmp_path / "small"), log=lambda *_: None)
    with pytest.raises(config.ConfigError, match=r"^server.max_frame_mb = \S+ is smaller than a push can be "
                                                 rf"\({push / (1 << 20):.2f} MiB: the model's .* MiB with its rows' "
                                                 r"ids and scales\): it would be refused$"):
        tr.run()
    assert tr.layout.size == layout.size and sc._jsc.getPersistentRDDs().size() == cached
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tr = make_trainer(spark, cfg_of(*sets, f"server.port={port}"), str(tmp_path / "run"), log=lambda *_: None)
        with pytest.raises(TrainingError, match=rf"^the parameter server cannot listen on 127.0.0.1:{port}: "):
            tr.run()
    assert sc._jsc.getPersistentRDDs().size() == cached


def test_ctrl_c_stops_an_async_run_with_a_checkpoint_that_resumes_to_its_end(spark, tmp_path):
    """The first metrics line's log sends SIGINT to this process: the run checkpoints the server with its
    line and stops (exit code 130); --resume trains the windows it lacks, each push logged once."""
    import os
    import signal
    from rnnlm.spark.stop import Interrupted
    out, sent = tmp_path / "run", []

    def log(line):
        if line.startswith("round ") and not sent:
            sent.append(line)
            os.kill(os.getpid(), signal.SIGINT)
    cfg = cfg_of("data.partitions=2", "train.mode=async", "train.push_every=2", "train.rounds=200")
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted, match=r"^interrupted at version \d+; its checkpoint is in .*checkpoint "
                                          r"\(--resume continues\)$") as stopped:
        make_trainer(spark, cfg, str(out), log=log).run()
    assert stopped.value.exit_code == 130 and signal.getsignal(signal.SIGINT) is handler
    version = checkpoint.load(str(out / "checkpoint")).position["version"]
    assert 2 <= version < 400 and metrics(out)[-1]["syncs"] == version
    assert stopped.value.args[0].startswith(f"interrupted at version {version};")   # not a push landing after
    tr = make_trainer(spark, cfg, str(out), log=lambda *_: None)
    tr.run(resume=True)
    m = metrics(out)
    assert tr.server.done == [200, 200] and m[-1]["syncs"] == 400 and m[-1]["windows_lost"] == 0
    assert sum(x["pushes"] for x in m) == 400


def adagrad_by_hand(spark, cfg, model) -> tuple:
    """One worker's windows and the server's AdaGrad, from the core alone: each window trains
    ``push_every`` steps from the server's parameters (its SGD and hidden state carried on), then
    ``acc += change^2`` and the parameters move by ``lr * change / (sqrt(acc) + eps)``. (params, acc)."""
    from threadpoolctl import threadpool_limits
    from rnnlm.core.local import train_steps
    from rnnlm.core.optim import make_optimizer
    from rnnlm.core.strategies import Source
    from rnnlm.spark.corpus import load_corpus
    data = load_corpus(spark.sparkContext, cfg)
    (_, tokens, starts), = data.train.collect()
    data.train.unpersist()
    t, sv = cfg.train, cfg.server
    src = Source("streams", tokens, starts, t.batch, t.bptt, seed=t.seed, partition=0)
    opt = make_optimizer(cfg.optim)
    params = model.init_params(t.seed)
    acc, slots, state = np.zeros_like(params), opt.init_state(params), model.zero_state(t.batch)
    with threadpool_limits(1):          # executors run BLAS on one thread
        for w in range(t.rounds):
            res = train_steps(model, opt, params.copy(), slots, src.round_batches(w + 1, t.push_every), state,
                              lr=cfg.optim.lr, clip_norm=cfg.optim.clip_norm, grad_norm=t.grad_norm)
            slots, state, change = res.opt_state, res.state, res.params - params
            acc = acc + change * change
            params = params + sv.lr * change / (np.sqrt(acc) + sv.eps)
    return params, acc


def test_adagrad_state_is_checkpointed_and_modes_do_not_mix_on_resume(spark, tmp_path):
    from rnnlm.core.model import RNNLM
    out = str(tmp_path / "run")
    cfg = cfg_of("data.partitions=1", "optim.name=sgd", "train.mode=async", "train.push_every=3", "train.rounds=2",
                 "server.update=adagrad")
    tr = make_trainer(spark, cfg, out, log=lambda *_: None)
    tr.run()
    ck = checkpoint.load(out + "/checkpoint")
    # one worker: nothing is stale, the two windows' pushes land in order
    params, acc = adagrad_by_hand(spark, tr.cfg, RNNLM(tr.cfg.model))
    assert np.array_equal(ck.optim["server.acc"], acc) and np.array_equal(ck.params, params)
    assert ck.position["tokens"] == metrics(tmp_path / "run")[-1]["tokens"] > 0
    sync = config.replace(cfg, "train", mode="sync", local_steps=3)
    with pytest.raises(TrainingError, match="train.mode is 'sync' here but 'async'"):
        make_trainer(spark, sync, out, log=lambda *_: None).run(resume=True)
    logs = []
    last = make_trainer(spark, cfg, out, log=logs.append).run(resume=True)
    assert logs == [f"nothing to do: {out} is at round 2 of 2 (raise train.rounds or train.epochs to train on)"]
    assert last == metrics(tmp_path / "run")[-1]


def second_push_after_the_first_checkpoint(monkeypatch, out) -> list:
    """Hold push 2 until the driver has checkpointed push 1: otherwise that checkpoint can start while push 2
    is applied, and waits for push 2 instead (a race). A push is decoded before it is reserved. A checkpoint
    by time may hold version 0 (written before push 1 landed): the gate waits for version 1. The list returned
    says whether it opened so (False: it gave up after 60 s)."""
    import time
    from rnnlm.server import paramserver
    decode, pushes, opened, state = paramserver.blocks_from_wire, [], [], out / "checkpoint" / "state.json"

    def holds_push_1():
        try:
            return json.loads(state.read_text())["position"]["version"] >= 1
        except (OSError, ValueError, KeyError, TypeError):      # not yet written, or being replaced
            return False

    def gate(*args):
        pushes.append(1)
        if len(pushes) == 2:
            deadline = time.monotonic() + 60
            while not holds_push_1() and time.monotonic() < deadline:
                time.sleep(0.01)
            opened.append(holds_push_1())
        return decode(*args)

    monkeypatch.setattr(paramserver, "blocks_from_wire", gate)
    return opened


def test_a_push_that_fails_while_a_checkpoint_waits_for_it_is_not_checkpointed(spark, tmp_path, monkeypatch):
    """A checkpoint waits for the pushes being applied: one that failed there (half applied) was written as
    done, and a resume never redid its window."""
    import threading
    import time
    from rnnlm.server.paramserver import ParameterServer
    apply, snapshot, calls, waiting, seen = ParameterServer.apply, ParameterServer.snapshot, [], threading.Event(), []

    def second_fails_during_a_snapshot(self, decoded, scale):
        calls.append(1)
        apply(self, decoded, scale)
        if len(calls) == 2:
            seen.append(waiting.wait(30))     # the driver's checkpoint by time has started, and waits for it
            time.sleep(0.3)
            raise MemoryError("after the first slots")

    def snapshot_said(self, drain=False):
        if len(calls) == 2:                   # a snapshot begun while push 2 is applied waits for it
            waiting.set()
        return snapshot(self, drain)

    monkeypatch.setattr(ParameterServer, "apply", second_fails_during_a_snapshot)
    monkeypatch.setattr(ParameterServer, "snapshot", snapshot_said)
    opened = second_push_after_the_first_checkpoint(monkeypatch, tmp_path / "run")
    cfg = cfg_of("data.partitions=1", "train.mode=async", "train.push_every=2", "train.rounds=4",
                 "server.checkpoint_pushes=1", "server.checkpoint_s=1")
    with pytest.raises(TrainingError, match=r"^server: applying partition 0's window 1 failed: after the first slots"):
        make_trainer(spark, cfg, str(tmp_path / "run"), log=lambda *_: None).run()
    assert opened == [True] and seen == [True]
    position = checkpoint.load(str(tmp_path / "run" / "checkpoint")).position
    assert position["done"] == [1] and position["version"] == 1


def test_a_push_that_never_lands_stops_the_run_with_one_line(spark, tmp_path, monkeypatch):
    """The driver's checkpoint waits for the pushes being applied: at most server.timeout_s, then the run
    stops with one line and the last checkpoint (it once waited forever, and every later push with it)."""
    import threading
    import time
    from rnnlm.server.paramserver import ParameterServer
    release, original, calls = threading.Event(), ParameterServer.apply, []

    def second_hangs(self, decoded, scale):
        calls.append(1)
        if len(calls) == 2:
            release.wait(120)
        original(self, decoded, scale)

    monkeypatch.setattr(ParameterServer, "apply", second_hangs)
    opened = second_push_after_the_first_checkpoint(monkeypatch, tmp_path / "run")
    cfg = cfg_of("data.partitions=1", "train.mode=async", "train.push_every=2", "train.rounds=4",
                 "server.timeout_s=1", "server.checkpoint_pushes=1")
    tr = make_trainer(spark, cfg, str(tmp_path / "run"), log=lambda *_: None)
    t0 = time.monotonic()
    try:
        with pytest.raises(TrainingError, match=r"^parameter server: 1 push still being applied after 1 s "
                                                r"\(server.timeout_s\); stopped, the last good checkpoint is kept"):
            tr.run()
        assert time.monotonic() - t0 < 60
    finally:
        release.set()
    assert opened == [True]
    assert checkpoint.load(str(tmp_path / "run" / "checkpoint")).position["version"] == 1
    assert [m["syncs"] for m in metrics(tmp_path / "run")] == [1]


@pytest.mark.parametrize("master, host", [
    ("local", "127.0.0.1"), ("local[*]", "127.0.0.1"), ("local[4]", "127.0.0.1"), ("local[2,3]", "127.0.0.1"),
    ("local-cluster[2,1,1024]", "127.0.0.1"),
    ("yarn", "10.1.2.3"), ("spark://10.0.0.9:7077", "10.1.2.3"), ("k8s://https://api:6443", "10.1.2.3"),
    ("localhost:7077", "10.1.2.3"),
])
def test_the_server_listens_on_loopback_when_every_executor_is_local(master, host):
    from rnnlm.spark.session import bind_host
    assert bind_host("", master, "10.1.2.3") == host
    assert bind_host("192.168.7.7", master, "10.1.2.3") == "192.168.7.7"     # server.host wins


def test_a_local_run_does_not_listen_on_the_drivers_external_address(spark, tmp_path, monkeypatch):
    """spark.driver.host is an address other machines reach: a local run's server once listened there."""
    sc = spark.sparkContext
    conf = sc.getConf().set("spark.driver.host", "192.0.2.1")       # TEST-NET-1: routable, on no interface here
    monkeypatch.setattr(sc, "getConf", lambda: conf)
    logs = []
    tr = make_trainer(spark, cfg_of("data.partitions=1", "train.mode=async", "train.push_every=2", "train.rounds=2"),
                      str(tmp_path / "run"), log=logs.append)
    tr.run()
    assert sum(" | server 127.0.0.1:" in line for line in logs) == 1, logs


@pytest.mark.serial          # whether the last line counts a push depends on the CPU's other work
def test_a_metrics_line_without_pushes_carries_no_loss(spark, tmp_path, capsys, monkeypatch):
    """The last line of an async run often counts no push; it said train_loss 0.0000, and so did the run's
    closing line. A resumed run with every window applied writes only such a line. Whether the last line
    counts a push depends on when the last window lands against the driver's line (once in a CI run it did):
    the run is repeated, at most 3 times, until it does not."""
    import argparse
    import os
    from rnnlm import cli
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        a = argparse.Namespace(config=None, set=BASE + ["data.partitions=2", "train.mode=async",
                                                        "train.push_every=2", "train.rounds=2"],
                               out=str(out), resume=False, master=None, samples=0, dry_run=False, verbose=False)
        assert cli.guarded(lambda: cli.train(a)) == 0
        a.resume = True
        assert cli.guarded(lambda: cli.train(a)) == 0
        m = metrics(out)
        if m[-1]["pushes"] == 0:
            break
    assert m[-1]["pushes"] == 0 and m[-1]["syncs"] == 4 and "train_loss" not in m[-1], m
    assert all(("train_loss" in x) == (x["pushes"] > 0) for x in m), m
    loss = [x["train_loss"] for x in m if "train_loss" in x][-1]
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith(f"done: round 2 | train_loss {loss:.4f} | checkpoint "), done


class RunLines:
    """The run directory's part the async driver's loop (``_Run``) writes to, kept: its lines, and each
    checkpoint's position with whether it was a best one."""

    def __init__(self):
        self.metrics, self.written = [], []

    def say_evaluating(self, *args):
        pass

    def write_checkpoint(self, ck, best):
        self.written.append((ck.position, best))

    def add_line(self, m, total, line):
        self.metrics.append(m)

    def best_saved(self):
        return None


def driver_loop(cfg, lines: RunLines, position: dict):
    """The async driver's loop over ``cfg`` (2 partitions, 3 windows, one held-out text) from ``position``,
    without Spark: its own server, and the wire's and the corpus's figures stood in for."""
    import types
    from rnnlm.core.models import build
    from rnnlm.server.paramserver import ParameterServer
    from rnnlm.spark import async_trainer
    model = build(cfg.model)
    srv = ParameterServer(model.layout, model.init_params(0), cfg.server, 3, 2, log=lambda s: None)
    frames = types.SimpleNamespace(bytes_received=0, bytes_sent=0, refused={})
    data = types.SimpleNamespace(vocab=None, devices={0: {"ran": "cpu"}, 1: {"ran": "cpu"}})
    return async_trainer._Run(lines, cfg, data, 1000, srv, frames, model, {"valid": [[1, 2, 3]]}, [0.1] * 3,
                              position)


def test_a_lines_wall_time_holds_its_own_evaluation_and_a_resume_keeps_it(monkeypatch):
    """wall_s was read before the line's evaluation and eval_s after it: the last line's wall_s left out the
    time eval_s counted (wall_s - eval_s < 0), and its checkpoint, which a resume starts from, lost it for good.
    The next checkpoint by time was counted from the scoring's end, not from the instant the checkpoint holds."""
    import time
    from rnnlm.spark import async_trainer
    cfg = config.resolve(config.load(None, ["model.hidden=8", "train.bptt=4", "train.batch=2", "data.partitions=2",
                                            "data.level=char", "train.mode=async", "train.push_every=2",
                                            "train.rounds=3", "train.eval_every=0"]), 20)

    def scored_slowly(model, params, streams):
        time.sleep(0.3)
        return 2.0
    monkeypatch.setattr(async_trainer, "_evaluate", scored_slowly)
    lines = RunLines()
    run = driver_loop(cfg, lines, {})
    before = time.monotonic()
    m = run._line(time.perf_counter(), final=True, checkpoint=True)
    assert m["wall_s"] >= m["eval_s"] >= 0.3 and lines.written[-1][0]["wall_s"] >= 0.3
    assert run.ck_time - before < 0.25      # the checkpoint's instant, before the scoring: the next one is due from it
    resumed = driver_loop(cfg, lines, lines.written[-1][0])
    m = resumed._line(time.perf_counter(), final=True, checkpoint=True)
    assert m["wall_s"] >= m["eval_s"] >= 0.6, m


def test_a_last_line_at_the_version_just_scored_repeats_that_score_rather_than_evaluating_again(monkeypatch):
    """A run whose last push's line evaluated (an evaluation due) scored the same parameters again for its
    final line: every held-out text twice at the end of the run (a review)."""
    import time
    from rnnlm.spark import async_trainer
    cfg = config.resolve(config.load(None, ["data.train=rnnlm/data/harbour.txt", "data.level=char",
                                            "train.mode=async", "train.rounds=3", "train.eval_every=1"]), 20)
    calls = []
    monkeypatch.setattr(async_trainer, "_evaluate", lambda model, params, streams: calls.append(1) or 2.5)
    lines = RunLines()
    run = driver_loop(cfg, lines, {})
    run.eval_pending = True                          # an evaluation due at this line
    first = run._line(time.perf_counter(), checkpoint=True)
    last = run._line(time.perf_counter(), final=True, checkpoint=True)
    assert len(calls) == 1 and first["valid_loss"] == last["valid_loss"] == 2.5
    assert last["best_round"] == first["best_round"] and last["eval_s"] == first["eval_s"]
    assert [best for _, best in lines.written] == [True, False]         # best/ once


@pytest.mark.parametrize("master", ["local[2,2]", "local[2]"])
def test_an_attempt_blocked_in_its_training_is_found_stuck_ended_and_retried(tmp_path, master):
    """Heartbeats proved an attempt's process alive, not that it trained: one blocked inside its training held
    its partition and the run never ended. Now the server finds it stuck (no window for stall_factor x the
    slowest, its heartbeats arriving), its worker ends, Spark retries the task (local[2,2]: two tries), and the
    run ends with every window applied once; with no retry allowed (local[2]) the run stops in one line."""
    env = blocked_at_round_3(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run(train_cmd(out, *CLUSTER_RUN, "train.mode=async", "train.push_every=4", "train.rounds=8",
                                 "server.heartbeat_s=0.2", "server.timeout_s=3", master=master),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert (tmp_path / "blocked").exists()                  # the first attempt did block
    said = r.stdout + r.stderr
    assert re.search(r"partition 1: worker heard from but no window pushed for [\d.]+ s, past 3 s "
                     r"\(server.stall_factor 10 x the slowest window, [\d.]+ s; at least server.timeout_s\), "
                     "reported stuck and told to end; a retried task resumes at window 2", said), said[-3000:]
    assert "the parameter server found this task stuck" in said          # the worker's own line, before it ends
    if master == "local[2]":
        assert r.returncode == 2, r.stderr[-3000:]
        error = r.stderr.strip().splitlines()[-1]
        assert error.startswith("error: async training job failed (partition 1's worker, found stuck, was ended, "
                                "and spark.task.maxFailures allows its task no retry): Task 1 in stage "), error
        return
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    last = m[-1]
    assert last["workers_stuck"] == 1 and last["attempts_retried"] == 1 and last["windows_redone"] == 1
    assert last["syncs"] == 16 and sum(x["pushes"] for x in m) == 16 and last["windows_lost"] == 0
    assert last.get("refused_duplicate", 0) == 0 and last.get("workers_lost", 0) == 0
