"""Distributed training in Spark local mode (one shared session)."""
import dataclasses
import math
import time

import numpy as np
import pytest

from rnnlm.core import checkpoint
from rnnlm import config
from rnnlm.core.local import train_steps
from rnnlm.core.model import RNNLM
from rnnlm.core.optim import make_optimizer
from rnnlm.core.strategies import Source
from rnnlm.spark import executor
from rnnlm.spark.rundir import TrainingError
from rnnlm.spark.corpus import load_corpus
from rnnlm.spark.trainer import Trainer

from conftest import HARBOUR, HARBOUR_VALID, ROOT, core_nll, held_out_tokens, metrics


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def run(spark, cfg, out, resume=False):
    tr = Trainer(spark, cfg, str(out), log=lambda s: None)
    tr.run(resume=resume)
    return tr


def partitions(spark, cfg) -> list:
    """The run's training partitions as the trainer reads them, ``(pid, tokens, starts)`` by pid."""
    data = load_corpus(spark.sparkContext, cfg)
    try:
        return sorted(data.train.collect(), key=lambda r: r[0])
    finally:
        data.train.unpersist()


@pytest.mark.parametrize("strategy,sets", [
    ("streams", []), ("paragraphs", []), ("windows", ["data.window_stride=4"]),
    ("sampled_windows", ["data.window_stride=4", "data.sample_fraction=0.03", "train.local_steps=0"]),
    ("sampled_paragraphs", ["data.sample_fraction=0.25", "train.local_steps=0"])])
def test_every_strategy_learns(spark, tiny_cfg, tmp_path, strategy, sets):
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        f"data.strategy={strategy}", "train.rounds=12", *sets]))
    tr = run(spark, cfg, tmp_path)
    m = metrics(tmp_path)
    assert len(m) == 12 and [x["round"] for x in m] == list(range(1, 13))
    first, last = np.mean([x["train_loss"] for x in m[:2]]), np.mean([x["train_loss"] for x in m[-2:]])
    assert last < first - 0.4, (first, last)             # from ~ln(44) = 3.8 towards ~3
    assert m[-1]["syncs"] == 12 and m[-1]["tokens"] > m[0]["tokens"] > 0
    # each round, each of the 2 partitions sends its dense float32 change and its 2 Adam slots (averaged) in
    # full, plus a few KiB of pickle headers, word ids and hidden states; the driver broadcasts the
    # parameters in round 1, then the rows that changed (all of them) and the averaged slots
    n = tr.params.nbytes
    for x in m:
        assert 2 * 3 * n <= x["round_bytes_sent"] <= 2 * 3 * n + 2 * 4096, x
        lo = n if x["round"] == 1 else 3 * n
        assert lo <= x["round_bytes_broadcast"] <= lo + 4096, x
    assert m[-1]["bytes_sent"] == sum(x["round_bytes_sent"] for x in m)
    assert m[-1]["bytes_broadcast"] == sum(x["round_bytes_broadcast"] for x in m)


def test_a_merge_spilled_to_the_workers_disk_is_not_counted_as_bytes_sent(spark, tiny_cfg, tmp_path):
    """Past spark.python.worker.memory, PySpark's merger pickles the tree's values to its local disk and reads them
    back: no hop between processes. Counted, it doubled every round's bytes_sent (8 partitions, 1m, depth 2)."""
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), ["data.partitions=8", "train.tree_depth=2"]))
    plain = run(spark, cfg, tmp_path / "plain")
    conf = spark.sparkContext._conf
    before = conf.get("spark.python.worker.memory", "512m")        # PySpark's default
    conf.set("spark.python.worker.memory", "1m")                # read where a job is built: every merge spills
    try:
        assert spark.sparkContext.parallelize([1])._memory_limit() == 1
        spilled = run(spark, cfg, tmp_path / "spilled")
    finally:
        conf.set("spark.python.worker.memory", before)
    np.testing.assert_array_equal(spilled.params, plain.params)
    assert [x["round_bytes_sent"] for x in metrics(tmp_path / "spilled")] == \
        [x["round_bytes_sent"] for x in metrics(tmp_path / "plain")]


def weighted_mean(arrays, weights):
    """Token-weighted mean in float64, as the all-reduce must form it, cast back to float32."""
    total = sum(np.float64(w) * a.astype(np.float64) for a, w in zip(arrays, weights))
    return (total * (1.0 / sum(weights))).astype(np.float32)


@pytest.mark.parametrize("strategy", ["streams", "sampled_windows"])
def test_two_partitions_three_rounds_equal_an_independent_computation(spark, tiny_cfg, tmp_path, strategy):
    """Averaging, carried hidden state (streams), per-round sampling (sampled_windows), the broadcast
    round trip and averaged Adam slots with their step counter, bit for bit."""
    from threadpoolctl import threadpool_limits
    sampled = strategy == "sampled_windows"
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        f"data.strategy={strategy}", "train.rounds=3", "train.optim_state=average", "optim.name=adam",
        "data.window_stride=2", "data.sample_fraction=0.01", f"train.local_steps={0 if sampled else 4}"]))
    tr = run(spark, cfg, tmp_path)
    parts = partitions(spark, cfg)
    t = cfg.train
    model, opt = RNNLM(tr.cfg.model), make_optimizer(cfg.optim)
    params = model.init_params(t.seed)
    slots, step = {"m": np.zeros_like(params), "v": np.zeros_like(params)}, 0
    states = {pid: model.zero_state(t.batch) for pid, _, _ in parts}
    with threadpool_limits(1):     # executors run BLAS on one thread (spark.task.cpus = 1)
        for rnd in (1, 2, 3):
            outs, counts = [], []
            for pid, tokens, starts in parts:
                src = Source(strategy, tokens, starts, t.batch, t.bptt, stride=2, fraction=0.01,
                             seed=t.seed, partition=pid)
                batches = src.round_batches(rnd, t.local_steps)
                windows = len(range(0, len(tokens) - t.bptt, 2))
                assert len(batches) == (4 if not sampled else math.ceil(math.ceil(0.01 * windows) / t.batch))
                counts.append(len(batches))
                st = {k: v.copy() for k, v in slots.items()}
                st["t"] = step
                res = train_steps(model, opt, params.copy(), st, batches,
                                  states[pid] if not sampled else model.zero_state(t.batch),
                                  lr=cfg.optim.lr, clip_norm=cfg.optim.clip_norm, grad_norm="token")
                states[pid] = res.state
                outs.append(res)
            w = [r.tokens for r in outs]
            params = params + weighted_mean([r.params - params for r in outs], w)   # the mean change
            slots = {k: weighted_mean([r.opt_state[k] for r in outs], w) for k in slots}
            step += round(sum(counts) / len(counts))     # Adam's step counter: the partitions' mean steps
    assert np.array_equal(tr.params, params)
    ck = checkpoint.load(str(tmp_path / "checkpoint"))
    assert ck.optim_t == step
    assert np.array_equal(ck.optim["m"], slots["m"]) and np.array_equal(ck.optim["v"], slots["v"])
    if not sampled:
        assert np.array_equal(ck.hidden, np.stack([states[pid] for pid, _, _ in parts]))


def test_outer_momentum_applies_the_mean_change_with_velocity(spark, tiny_cfg, tmp_path):
    from threadpoolctl import threadpool_limits
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "data.partitions=1", "train.rounds=3", "train.outer=momentum", "train.outer_lr=0.7",
        "train.outer_momentum=0.5", "train.optim_state=reset", "optim.name=sgd", "optim.lr=0.5"]))
    tr = run(spark, cfg, tmp_path)
    (pid, tokens, starts), = partitions(spark, cfg)
    t = cfg.train
    model, opt = RNNLM(tr.cfg.model), make_optimizer(cfg.optim)
    p = model.init_params(t.seed).astype(np.float64)
    velocity, state = np.zeros_like(p), model.zero_state(t.batch)
    src = Source("streams", tokens, starts, t.batch, t.bptt, seed=t.seed)
    with threadpool_limits(1):
        for rnd in (1, 2, 3):
            q = p.astype(np.float32)
            res = train_steps(model, opt, q.copy(), opt.init_state(q), src.round_batches(rnd, t.local_steps), state,
                              lr=0.5, clip_norm=cfg.optim.clip_norm, grad_norm="token")
            state = res.state
            velocity = 0.5 * velocity + (res.params.astype(np.float64) - q)
            p = q + 0.7 * velocity
    assert np.abs(tr.params - p).max() < 1e-6
    assert np.abs(tr.params - res.params).max() > 1e-3     # not the last mean, which plain averaging applies


@pytest.mark.parametrize("strategy", ["streams", "paragraphs"])
def test_epochs_are_passes_as_the_single_process_trainer_counts_them(spark, tiny_cfg, tmp_path, strategy):
    """A pass scores fewer tokens than the partitions hold (each lane's last tokens, each paragraph's last
    token): counted in the corpus' tokens, ``train.epochs = 3`` of one-pass rounds trained 4 passes, and the
    rate decayed a pass late. Zaremba's decay from the second epoch on: passes start at epochs 0, 1, 2."""
    cfg = config.replace(tiny_cfg, "train", rounds=0, epochs=3, local_steps=0)
    cfg = config.replace(config.replace(cfg, "data", strategy=strategy), "optim", name="sgd", lr=1.0,
                         schedule="epoch_decay", decay_after=1, decay=0.5)
    run(spark, cfg, tmp_path / "run")
    m = metrics(tmp_path / "run")
    assert [x["lr"] for x in m] == [1.0, 0.5, 0.25]
    assert [x["epoch"] for x in m] == [1.0, 2.0, 3.0]
    parts = partitions(spark, cfg)
    assert m[-1]["tokens"] < 3 * sum(len(p[1]) for p in parts)          # a pass is not the partitions' length


def test_two_partitions_average_is_the_token_weighted_mean(spark, tiny_cfg, tmp_path):
    # long chunks: paragraphs end inside them, so the partitions score different token counts
    cfg = config.replace(tiny_cfg, "train", rounds=1, local_steps=2, bptt=300)
    cfg = config.replace(cfg, "data", strategy="paragraphs")
    tr = run(spark, cfg, tmp_path)
    parts = partitions(spark, cfg)
    model, opt = RNNLM(tr.cfg.model), make_optimizer(cfg.optim)
    results, weights = [], []
    for pid, tokens, starts in parts:
        p = model.init_params(cfg.train.seed)
        src = Source("paragraphs", tokens, starts, 4, 300, seed=cfg.train.seed, partition=pid)
        r = train_steps(model, opt, p, opt.init_state(p), src.round_batches(1, 2), model.zero_state(4),
                        lr=cfg.optim.lr, clip_norm=cfg.optim.clip_norm, grad_norm="token")
        results.append(r.params.astype(np.float64))
        weights.append(r.tokens)
    assert weights[0] != weights[1]
    hand = (weights[0] * results[0] + weights[1] * results[1]) / (weights[0] + weights[1])
    # executors run BLAS on 1 thread, this process on 2: float32 results differ in the last bits
    assert np.abs(tr.params - hand).max() < 1e-6
    assert np.abs(tr.params - (results[0] + results[1]) / 2).max() > 1e-5   # not the plain mean
    assert metrics(tmp_path)[0]["tokens"] == sum(weights)


@pytest.mark.parametrize("settings,uri", [
    (["train.optim_state=average"], False),
    # one pass per round: the partitions' shares differ, and so do their own Adam step counts
    (["train.optim_state=local", "train.outer=nesterov", "model.dropout=0.2", "train.local_steps=0"], True),
    (["train.optim_state=reset", "optim.schedule=plateau", "train.eval_every=1", "train.local_steps=0",
      "data.valid=rnnlm/data/harbour_valid.txt", "data.strategy=sampled_windows", "data.sample_fraction=0.02"], True),
    (["model.dtype=float64", "train.outer=momentum"], False),
    (["exchange.embed=rows+fp16", "exchange.softmax=rows+fp16", "exchange.hidden=rows+bf16",
      "exchange.random=0.3", "exchange.frequent=0.1", "exchange.seed_groups=one"], False),
    # error feedback: residuals live in Spark, are checkpointed at rounds 2 and 3 here, 3 and 4 there
    (["exchange.embed=rows+onebit", "exchange.softmax=rows+onebit", "exchange.hidden=dense+onebit",
      "exchange.random=0.2", "exchange.feedback=true", "train.checkpoint_every=3"], True),
    # the broadcast as bf16 deltas: the checkpoint holds the executors' view (resumed at round 2, not 3)
    (["exchange.embed=rows+fp16", "exchange.softmax=rows+fp16", "exchange.broadcast=delta+bf16",
      "train.checkpoint_every=3", "train.rebase_fraction=0.02"], False),
    # the sampled softmax draws its words per (round, seed group, step)
    (["exchange.softmax=rows+fp16", "exchange.sampled_softmax=true", "exchange.mu=0.1", "exchange.frequent=0.1",
      "exchange.random=0.1", "exchange.seed_groups=log2"], False),
])
def test_resume_two_plus_two_equals_four(spark, tiny_cfg, tmp_path, settings, uri):
    """``file://`` URIs and plain paths both resolve to the local disk (Python I/O; tests/test_hfs.py
    covers Hadoop's client)."""
    base = config.apply_overrides(tiny_cfg.to_dict(), settings)
    four = config.from_dict(config.apply_overrides(base, ["train.rounds=4"]))
    two = config.from_dict(config.apply_overrides(base, ["train.rounds=2"]))
    prefix = "file://" if uri else ""
    a = run(spark, four, f"{prefix}{tmp_path / 'a'}")
    run(spark, two, f"{prefix}{tmp_path / 'b'}")
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "train_lo')      # a line cut short by a crash is dropped
    b = run(spark, four, f"{prefix}{tmp_path / 'b'}", resume=True)
    assert np.array_equal(a.params, b.params)
    ma, mb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [x["train_loss"] for x in ma] == [x["train_loss"] for x in mb]
    ck = checkpoint.load(str(tmp_path / "b" / "checkpoint"))
    assert ck.position["round"] == 4 and np.array_equal(ck.params, a.params)
    if "exchange.feedback=true" in settings:
        # the resumed round broadcasts the partitions' residuals again (its lineage seeded from the
        # checkpoint), each the parameters' size in float32, besides what round 3 broadcasts unresumed
        extra = mb[2]["round_bytes_broadcast"] - ma[2]["round_bytes_broadcast"]
        assert extra >= four.data.partitions * a.params.size * 4, (extra, a.params.size)


def test_sampled_softmax_moves_only_target_rows_and_over_the_whole_vocabulary_is_the_full_softmax(
        spark, tiny_cfg, tmp_path):
    sgd = config.apply_overrides(tiny_cfg.to_dict(), ["optim.name=sgd", "optim.lr=0.5", "train.rounds=1"])
    full = run(spark, config.from_dict(sgd), tmp_path / "full")
    every = run(spark, config.from_dict(config.apply_overrides(sgd, [
        "exchange.sampled_softmax=true", "exchange.mu=1.0", "exchange.frequent=1.0"])), tmp_path / "every")
    assert np.abs(every.params - full.params).max() < 1e-6
    few_cfg = config.from_dict(config.apply_overrides(sgd, ["exchange.sampled_softmax=true", "exchange.mu=0.0"]))
    few = run(spark, few_cfg, tmp_path / "few")
    data = load_corpus(spark.sparkContext, few_cfg)
    parts = data.train.collect()
    data.train.unpersist()
    targets = set()
    for pid, tokens, starts in parts:
        for b in executor.make_source(few.cfg, pid, tokens, starts).round_batches(1, few_cfg.train.local_steps):
            targets |= set(b.y[b.y >= 0].tolist())
    model = RNNLM(few.cfg.model)
    init = model.layout.views(model.init_params(few_cfg.train.seed))["Wo"]

    def moved(tr):
        return set(np.flatnonzero(np.any(model.layout.views(tr.params)["Wo"] != init, axis=1)).tolist())
    assert moved(few) and moved(few) <= targets               # no other row of Wo got a gradient
    assert len(moved(full)) == model.V > len(targets)         # the full softmax moves every row
    m = metrics(tmp_path / "few")[0]
    assert 0 < m["softmax_v_f"] == m["softmax_v_all"] <= len(targets) and m["seed_groups"] == 2


def test_residual_lineage_is_cut_every_max_lineage_rounds_without_changing_numbers(
        spark, tiny_cfg, tmp_path, monkeypatch):
    from rnnlm.spark import lineage
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "exchange.embed=rows+onebit", "exchange.hidden=dense+onebit", "exchange.softmax=dense+onebit",
        "exchange.feedback=true", "train.rounds=6", "train.checkpoint_every=0"]))

    def every(n):
        return config.from_dict(config.apply_overrides(cfg.to_dict(), [f"train.checkpoint_every={n}"]))
    long = run(spark, cfg, tmp_path / "long")
    # a checkpoint cuts it too, collecting the same residuals: counted as sent as well
    saved = run(spark, every(2), tmp_path / "saved")
    monkeypatch.setattr(lineage, "MAX_LINEAGE", 2)
    cut = run(spark, cfg, tmp_path / "cut")
    # 2 deep after rounds 2 and 5, with a checkpoint a round later at depth 3 (half as deep again): the
    # checkpoint's cut alone, not two
    waits = run(spark, every(3), tmp_path / "waits")
    residuals = 2 * 4 * cut.params.size                 # both partitions' float32 residuals
    for name, other, want in (("cut", cut, [0, 1, 0, 1, 0, 0]), ("saved", saved, [0, 1, 0, 1, 0, 0]),
                              ("waits", waits, [0, 0, 1, 0, 0, 0])):
        assert np.array_equal(long.params, other.params), name
        pairs = list(zip(metrics(tmp_path / "long"), metrics(tmp_path / name)))
        extra = [c["round_bytes_sent"] - x["round_bytes_sent"] for x, c in pairs]
        # the rounds marked collect the residuals (round 6 is the final checkpoint's, in every run)
        assert extra == [residuals * w for w in want], name
        # and none comes back: after a cut each partition reads the file its residual was collected from
        assert [c["round_bytes_broadcast"] - x["round_bytes_broadcast"] for x, c in pairs] == [0] * 6, name


class _ResidualFiles:
    """A progress report that counts, at each metrics line, the residual files of the run being trained
    in the executors' store (``store``: :func:`rnnlm.spark.filestore.root`'s parent), and with ``lose``
    deletes them there, as an executor lost between rounds would."""

    def __init__(self, store: str, lose: bool):
        import os
        self.store, self.lose, self.counts = store, lose, []
        self.before = set(os.listdir(store)) if os.path.isdir(store) else set()

    def run_dirs(self) -> list:
        import os
        return [os.path.join(self.store, d) for d in sorted(set(os.listdir(self.store)) - self.before)]

    def update(self, m, total, line):
        import os
        import shutil
        (directory,) = self.run_dirs()
        files = os.listdir(directory)
        assert all(f.endswith(".npy") for f in files), files        # no half-written file left behind
        self.counts.append(len(files))
        if self.lose:
            shutil.rmtree(directory)


def test_residual_files_lost_between_rounds_are_recomputed_from_the_lineage(spark, tiny_cfg, tmp_path):
    """Error feedback keeps each partition's residual in a file on its executor. A round (or the final
    checkpoint) that finds no file, as on another executor or after losing one, recomputes the residual
    from the rounds since the lineage began: the same parameters, losses and checkpointed residuals."""
    import os
    from rnnlm.spark import filestore
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "exchange.embed=rows+onebit", "exchange.hidden=dense+onebit", "exchange.softmax=rows+onebit",
        "exchange.random=0.2", "exchange.feedback=true", "train.rounds=4", "train.checkpoint_every=0"]))
    local_dirs = spark.sparkContext.parallelize([0], 1).map(lambda _: os.environ["SPARK_LOCAL_DIRS"]).first()
    store = os.path.dirname(filestore.root("run", local_dirs))
    runs = {}
    for name, lose in (("kept", False), ("lost", True)):
        files = _ResidualFiles(store, lose)
        runs[name] = Trainer(spark, cfg, str(tmp_path / name), log=lambda s: None, progress=files)
        runs[name].run()
        assert files.run_dirs() == [], name            # the run's files are removed when it closes
        # each round writes one file per partition; the newest filestore.KEEP rounds' are kept
        assert files.counts == ([2, 2, 2, 2] if lose else [2 * min(r, filestore.KEEP) for r in (1, 2, 3, 4)]), name
    assert np.array_equal(runs["lost"].params, runs["kept"].params)
    losses = [[x["train_loss"] for x in metrics(tmp_path / name)] for name in ("lost", "kept")]
    assert losses[0] == losses[1]
    saved = [np.load(tmp_path / name / "checkpoint" / "optim.npz") for name in ("kept", "lost")]
    assert sorted(saved[0].files) == sorted(saved[1].files) and len(saved[0].files) >= 2
    for name in saved[0].files:
        assert np.array_equal(saved[0][name], saved[1][name]), name


def test_resume_with_incompatible_config_is_refused(spark, tiny_cfg, tmp_path):
    run(spark, tiny_cfg, tmp_path)
    before = open(tmp_path / "metrics.jsonl").read()
    saved = {f.name: f.read_bytes() for f in (tmp_path / "checkpoint").iterdir()}
    other = config.replace(tiny_cfg, "model", hidden=32)
    with pytest.raises(TrainingError, match="cannot resume: model.hidden is 32 here but 16"):
        run(spark, other, tmp_path, resume=True)
    with pytest.raises(TrainingError, match="cannot resume: exchange.embed is 'rows' here but 'dense'"):
        run(spark, config.replace(tiny_cfg, "exchange", embed="rows"), tmp_path, resume=True)
    with pytest.raises(TrainingError, match="already holds a run"):
        run(spark, tiny_cfg, tmp_path)
    assert open(tmp_path / "metrics.jsonl").read() == before
    assert {f.name: f.read_bytes() for f in (tmp_path / "checkpoint").iterdir()} == saved     # untouched
    assert checkpoint.load(str(tmp_path / "checkpoint")).position["round"] == 2
    # optimizer state under a name no run of this configuration writes: a partition it lacks, a slot Adam lacks
    ck = checkpoint.load(str(tmp_path / "checkpoint"))
    for name in ("p7/m", "p0/s", "feedback.p2"):
        optim = dict(ck.optim)
        optim[name] = optim.pop("m")
        checkpoint.save(str(tmp_path / "checkpoint"), dataclasses.replace(ck, optim=optim))
        why = f"holds optimizer state '{name}' that no run of this configuration writes"
        with pytest.raises(TrainingError, match=why + r" \(2 partitions; the optimizer's slots: m, v\)"):
            run(spark, tiny_cfg, tmp_path, resume=True)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(spark, tiny_cfg, tmp_path):
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "optim.name=adam", "optim.lr=1e37", "optim.clip_norm=0.0",   # parameters overflow in a few rounds
        "train.rounds=30", "train.checkpoint_every=1", "train.grad_norm=batch"]))
    with pytest.raises(TrainingError, match="stopped, the last good checkpoint is kept"):
        run(spark, cfg, tmp_path)
    m = metrics(tmp_path)
    assert len(m) >= 1 and all(np.isfinite(x["train_loss"]) for x in m)
    ck = checkpoint.load(str(tmp_path / "checkpoint"))
    assert ck.position["round"] == m[-1]["round"] and np.isfinite(ck.params).all()


def test_an_update_that_overflows_is_not_accepted(spark, tiny_cfg, tmp_path):
    # the loss before the one update is finite; the update itself overflows float32
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "optim.name=sgd", "optim.lr=3e38", "optim.clip_norm=0.0", "train.grad_norm=batch",
        "train.rounds=1", "train.local_steps=1", "train.checkpoint_every=1"]))
    with pytest.raises(TrainingError, match="parameters are no longer finite.*no checkpoint was written yet"):
        run(spark, cfg, tmp_path)
    assert not (tmp_path / "checkpoint").exists()
    assert not (tmp_path / "metrics.jsonl").exists() or metrics(tmp_path) == []


def test_test_metrics_do_not_need_validation_data(spark, tiny_cfg, tmp_path):
    cfg = config.replace(tiny_cfg, "data", valid="", test="rnnlm/data/harbour_valid.txt")
    tr = run(spark, cfg, tmp_path)
    last = metrics(tmp_path)[-1]
    assert "test_loss" in last and "test_bpc" in last and "valid_loss" not in last
    # the text's 708 tokens (707 characters and the blank line ending them) read as one stream by the core
    total, count = core_nll(RNNLM(tr.cfg.model), tr.params, [held_out_tokens(tr.vocab, HARBOUR_VALID)])
    assert count == 707
    assert last["test_loss"] == pytest.approx(total / count, rel=1e-9)
    assert last["test_bpc"] == pytest.approx(last["test_loss"] / math.log(2), rel=1e-12)


def test_evaluate_rdd_is_the_cores_mean_nll_of_the_held_out_tokens(spark, tiny_cfg):
    """evaluate_rdd against the core model on the same tokens, each stream read whole in one pass: the
    summed NLL over every predicted token, divided by their count (a stream's first token is not one).
    Three streams, one per partition (test_test_metrics_do_not_need_validation_data reads one)."""
    streams = 3
    from rnnlm.core.vocab import Vocab
    from rnnlm.spark.corpus import evaluate_rdd, load_held_out
    sc = spark.sparkContext
    text = HARBOUR                                                   # 20 paragraphs, 6,092 tokens
    vocab = Vocab.build(open(text).read()[:400], "char")             # some of its characters are unknown
    cfg = config.resolve(config.replace(tiny_cfg, "data", eval_streams=streams), len(vocab))
    model = RNNLM(cfg.model)
    params = np.random.default_rng(3).normal(0, 1.0, model.layout.size).astype(np.float32)
    held = load_held_out(sc, cfg, text, sc.broadcast(vocab))
    try:
        parts = [tokens for _, tokens, _ in sorted(held.collect(), key=lambda r: r[0])]
        got = evaluate_rdd(sc, cfg, params, held)
    finally:
        held.unpersist()
    assert len(parts) == streams
    assert np.array_equal(np.concatenate(parts), held_out_tokens(vocab, text))
    total, count = core_nll(model, params, parts)
    assert count == 6092 - streams
    assert got == pytest.approx(total / count, rel=1e-9)      # float64 sums, in another order
    # these weights read the text in order: backwards, its tokens cost other amounts
    backwards, _ = core_nll(model, params, [p[::-1] for p in parts])
    assert abs(backwards / total - 1) > 1e-3


class _Crash(Exception):
    pass


class _CrashAt:
    """A progress report that kills the run when round ``crash``'s line is written: a driver dying after
    the line, before that round's checkpoint (whatever would have been written then is not). Each line
    is marked in ``calls`` as ``("line", round)``."""

    def __init__(self, crash=None, calls=None):
        self.crash, self.calls = crash, calls if calls is not None else []

    def update(self, m, total, line):
        self.calls.append(("line", m["round"]))
        if m["round"] == self.crash:
            raise _Crash


def crashed_at(spark, cfg, out, r):
    with pytest.raises(_Crash):
        Trainer(spark, cfg, str(out), log=lambda s: None, progress=_CrashAt(r)).run()
    return checkpoint.load(str(out / "checkpoint")).position["round"]


def test_checkpoint_s_counts_from_the_start_of_training_not_from_the_trainers(spark, tiny_cfg, tmp_path):
    """The clock started when the Trainer was built: a corpus read longer than train.checkpoint_s (HDFS, a
    large text) made round 1 write a checkpoint by time."""
    cfg = config.replace(tiny_cfg, "train", rounds=3, checkpoint_every=0, checkpoint_s=60.0)
    tr = Trainer(spark, cfg, str(tmp_path / "run"), log=lambda s: None, progress=_CrashAt(2))
    tr.ck_time = time.monotonic() - 61               # as if built 61 s before training: a read this long
    with pytest.raises(_Crash):
        tr.run()                                     # rounds 1 and 2 take well under a minute
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_a_close_that_fails_still_gives_the_signal_handlers_back(spark, tiny_cfg, tmp_path, monkeypatch):
    """A raise in the round's close skipped the release: in a shared session (a notebook) the next Ctrl-C
    only said "stopping after this round"."""
    import signal
    from rnnlm.spark.allreduce import AllReduce

    close = AllReduce.close

    def dead(self, blocking=True):
        close(self, blocking=blocking)              # (its resources go, not to leak into the shared session)
        raise RuntimeError("the SparkContext is gone")
    monkeypatch.setattr(AllReduce, "close", dead)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="SparkContext is gone"):
        Trainer(spark, config.replace(tiny_cfg, "train", rounds=1), str(tmp_path / "run"), log=lambda s: None).run()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


VALID = "data.valid=rnnlm/data/harbour_valid.txt"


def untimed(lines):
    return [{k: v for k, v in x.items() if not k.endswith("_s")} for x in lines]


def test_resume_from_a_checkpoint_written_by_time_or_at_an_evaluation_equals_an_uninterrupted_run(
        spark, tiny_cfg, tmp_path):
    # error feedback: the residuals' lineage is cut at every checkpoint, whatever wrote it
    base = config.apply_overrides(tiny_cfg.to_dict(), [
        "exchange.embed=rows+onebit", "exchange.softmax=rows+onebit", "exchange.hidden=dense+onebit",
        "exchange.random=0.2", "exchange.feedback=true", "train.rounds=3", "train.checkpoint_every=0"])
    whole = run(spark, config.from_dict(base), tmp_path / "whole")
    for name, sets in (("time", ["train.checkpoint_s=1e-9"]), ("eval", ["train.eval_every=2", VALID])):
        cfg = config.from_dict(config.apply_overrides(base, sets))
        out = tmp_path / name
        assert crashed_at(spark, cfg, out, 3) == 2          # neither checkpoint_every nor the end wrote it
        logs = []
        tr = Trainer(spark, cfg, str(out), log=logs.append)
        tr.run(resume=True)
        assert np.array_equal(tr.params, whole.params), name
        assert [x["train_loss"] for x in metrics(out)] == [x["train_loss"] for x in metrics(tmp_path / "whole")]
        assert "resumed from round 2" in logs
        assert "compression" in logs[-1] and "syncs" not in logs[-1]
    m = metrics(tmp_path / "eval")
    assert ["eval_s" in x for x in m] == [False, True, True]     # evaluated at rounds 2 and 3 (the end)


def test_best_holds_the_lowest_validation_loss_and_survives_a_resume(spark, tiny_cfg, tmp_path):
    """Adam at a rate of 3 makes round 2 worse than round 1: best/ keeps round 1 while checkpoint/
    moves on, in an uninterrupted run and in one resumed from round 1's checkpoint."""
    from rnnlm.cli import load_checkpoint, read_checkpoint
    from rnnlm.spark.corpus import evaluate_rdd, load_held_out
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "optim.lr=3.0", "train.eval_every=1", VALID, "train.rounds=2"]))
    logs = []
    whole = Trainer(spark, cfg, str(tmp_path / "whole"), log=logs.append)
    whole.run()
    m = metrics(tmp_path / "whole")
    assert m[1]["valid_loss"] > m[0]["valid_loss"] and [x["best_round"] for x in m] == [1, 1]
    assert logs.count("evaluating valid (708 tokens)...") == 2      # 707 characters and the blank line ending them
    assert [f.split(" ")[0] for f in logs[-1].split(" | ")] == [     # no syncs, no compression on a dense run
        "round", "epoch", "tokens", "wall_s", "compute_s", "tokens_per_s", "train_loss", "lr", "valid_loss",
        "valid_ppl", "valid_bpc", "best_round", "eval_s"]
    best = checkpoint.load(str(tmp_path / "whole" / "best"))
    assert best.position["round"] == 1 and checkpoint.load(str(tmp_path / "whole")).position["round"] == 2
    sc = spark.sparkContext
    valid = load_held_out(sc, whole.cfg, cfg.data.valid, sc.broadcast(best.vocab))
    assert evaluate_rdd(sc, whole.cfg, best.params, valid) == m[0]["valid_loss"]
    valid.unpersist()
    # jobs/evaluate.py and jobs/generate.py read RUN/best as they read RUN (the last) or a checkpoint
    assert read_checkpoint(sc, str(tmp_path / "whole" / "best")).position["round"] == 1
    assert load_checkpoint(str(tmp_path / "whole" / "best")).position["round"] == 1
    assert load_checkpoint(str(tmp_path / "whole")).position["round"] == 2

    out = tmp_path / "resumed"
    assert crashed_at(spark, cfg, out, 2) == 1
    run(spark, cfg, out, resume=True)
    assert untimed(metrics(out)) == untimed(m)
    assert checkpoint.load(str(out / "best")).position["round"] == 1
    assert np.array_equal(checkpoint.load(str(out / "best")).params, best.params)

    # resumed again at its length: nothing to do, nothing written
    before = {p: (out / p).read_bytes() for p in ("metrics.jsonl", "run.json", "checkpoint/params.npy")}
    logs = []
    last = Trainer(spark, cfg, str(out), log=logs.append).run(resume=True)
    assert logs == [f"nothing to do: {out} is at round 2 of 2 (raise train.rounds or train.epochs to train on)"]
    assert last == metrics(out)[-1]
    assert {p: (out / p).read_bytes() for p in before} == before
    # --overwrite: a run stopped before it starts (its corpus is not there) leaves the earlier run as it was
    from rnnlm.spark.corpus import CorpusError
    elsewhere = config.replace(cfg, "data", train=str(tmp_path / "nothing.txt"))
    with pytest.raises(CorpusError, match="nothing.txt"):
        Trainer(spark, elsewhere, str(out), log=lambda *_: None).run(overwrite=True)
    assert {p: (out / p).read_bytes() for p in before} == before and (out / "best").exists()
    Trainer(spark, config.replace(cfg, "train", rounds=1), str(out), log=lambda *_: None).run(overwrite=True)
    assert [m["round"] for m in metrics(out)] == [1]
    assert [checkpoint.load(str(out / d)).position["round"] for d in ("checkpoint", "best")] == [1, 1]


def test_patience_ends_a_run_at_an_evaluation_and_a_resume_with_more_goes_on_as_if_it_had_not(
        spark, tiny_cfg, tmp_path):
    """Adam at a rate of 3: round 2's validation loss is above round 1's, the later ones below. With
    train.patience = 1 the run ends after round 2 (its lines the longer run's, checkpointed there, best/ holding
    round 1); resumed as it is, it has nothing to do; resumed with train.patience = 2, it trains on to round 5 as
    the run that never stopped did."""
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "optim.lr=3.0", "train.eval_every=1", VALID, "train.rounds=5"]))
    run(spark, cfg, tmp_path / "whole")
    whole = metrics(tmp_path / "whole")
    losses = [x["valid_loss"] for x in whole]
    assert losses[1] > losses[0] > losses[2] > losses[3] > losses[4], losses
    out, logs = tmp_path / "patient", []
    Trainer(spark, config.replace(cfg, "train", patience=1), str(out), log=logs.append).run()
    assert untimed(metrics(out)) == untimed(whole[:2])
    why = f"1 evaluation since round 1 without a lower validation loss than its {losses[0]:.4f} (train.patience = 1)"
    assert logs[-1] == f"stopped early after round 2 of 5: {why}; best/ holds round 1"
    assert [checkpoint.load(str(out / d)).position["round"] for d in ("checkpoint", "best")] == [2, 1]
    before = {p: (out / p).read_bytes() for p in ("metrics.jsonl", "run.json", "checkpoint/params.npy")}
    logs = []
    Trainer(spark, config.replace(cfg, "train", patience=1), str(out), log=logs.append).run(resume=True)
    assert logs == [f"nothing to do: {out} stopped early at round 2: {why}; raise train.patience to train on"]
    assert {p: (out / p).read_bytes() for p in before} == before
    run(spark, config.replace(cfg, "train", patience=2), out, resume=True)
    assert untimed(metrics(out)) == untimed(whole)
    assert np.array_equal(checkpoint.load(str(out)).params, checkpoint.load(str(tmp_path / "whole")).params)


def test_a_stop_request_said_while_the_main_thread_writes_is_still_said(capfd):
    """The handler logs through print: a signal arriving while the main thread is inside a write raised
    "RuntimeError: reentrant call" out of the handler, in the middle of the run."""
    import os
    import signal
    import time
    from rnnlm.spark.stop import StopRequest

    def busy(line):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")
    stop = StopRequest(busy)
    try:
        os.kill(os.getpid(), signal.SIGTERM)             # handled in this (the main) thread, at once
        for _ in range(100):
            if stop.requested:
                break
            time.sleep(0.01)
    finally:
        stop.release()
    assert stop.requested and capfd.readouterr().err == ("SIGTERM: stopping after this round with a checkpoint "
                                                         "(SIGTERM again to stop now)\n")


def test_a_dry_run_stopped_by_a_signal_says_so_and_names_no_checkpoint(spark, tiny_cfg, monkeypatch):
    """The probe's rounds run in a scratch directory, deleted: a Ctrl-C there ended with "its checkpoint is in
    file:///tmp/rnnlm-dry-run-.../checkpoint (--resume continues)", a directory already gone."""
    import dataclasses
    import signal
    from rnnlm.spark.dryrun import probe
    from rnnlm.spark.stop import Interrupted

    def stopped(self, **kwargs):
        raise Interrupted(f"interrupted after round 1; its checkpoint is in {self.dir.ck_path} (--resume continues)",
                          signal.SIGTERM)

    @dataclasses.dataclass
    class Data:
        valid: object = 1
        test: object = 1
    monkeypatch.setattr(Trainer, "run", stopped)
    with pytest.raises(Interrupted) as e:
        probe(spark, tiny_cfg, Data())
    assert str(e.value) == "dry run stopped after 0 of its 4 rounds; nothing was written" and e.value.exit_code == 143


@pytest.mark.parametrize("eager", [False, True])
def test_overlap_three_rounds_equal_an_independent_computation(spark, tiny_cfg, tmp_path, eager):
    """``train.overlap = 1``: round r trains from P_{r-2} (P_{-1} = P_0) and its mean change is applied to
    P_{r-1}; hidden state and each partition's own Adam state pass from round to round inside Spark.
    With ``train.eager`` a partition starts from P_{r-2} plus its own change of round r-1 over the
    partition count, and sends its change from there."""
    from threadpoolctl import threadpool_limits
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "train.rounds=3", "train.overlap=1", "train.optim_state=local", "optim.name=adam",
        "train.local_steps=4", f"train.eager={str(eager).lower()}"]))
    tr = run(spark, cfg, tmp_path)
    parts = partitions(spark, cfg)
    t = cfg.train
    model, opt = RNNLM(tr.cfg.model), make_optimizer(cfg.optim)
    history = [model.init_params(t.seed)]                 # P_0, P_1, ...
    states = {pid: model.zero_state(t.batch) for pid, _, _ in parts}
    slots = {pid: opt.init_state(history[0]) for pid, _, _ in parts}
    own = {}                                              # each partition's last change
    with threadpool_limits(1):
        for rnd in (1, 2, 3):
            outs, changes = [], []
            for pid, tokens, starts in parts:
                start = history[max(0, rnd - 2)]
                if eager and pid in own:
                    start = start + own[pid] / 2
                src = Source("streams", tokens, starts, t.batch, t.bptt, seed=t.seed, partition=pid)
                res = train_steps(model, opt, start.copy(), {k: (v.copy() if k != "t" else v)
                                                             for k, v in slots[pid].items()},
                                  src.round_batches(rnd, t.local_steps), states[pid],
                                  lr=cfg.optim.lr, clip_norm=cfg.optim.clip_norm, grad_norm="token")
                states[pid], slots[pid] = res.state, res.opt_state
                own[pid] = res.params - start
                outs.append(res)
                changes.append(own[pid])
            change = weighted_mean(changes, [r.tokens for r in outs])
            history.append(history[-1] + change)
    assert np.array_equal(tr.params, history[3])
    assert not np.array_equal(history[3], history[2])
    ck = checkpoint.load(str(tmp_path / "checkpoint"))
    # the checkpoint holds the job after the last: round 4 would train from P_2
    assert np.array_equal(ck.optim["outer.view"], history[2])
    assert ck.position["pending_lr"] == cfg.optim.lr
    assert np.array_equal(ck.hidden, np.stack([states[pid] for pid, _, _ in parts]))
    assert np.array_equal(ck.optim["p1/m"], slots[1]["m"]) and ck.optim_t == slots[0]["t"] == 12
    assert ck.optim_t_local == {0: slots[0]["t"], 1: slots[1]["t"]}
    # with eager, each partition's last change, the start of its next round
    assert sorted(k for k in ck.optim if k.startswith("eager.")) == (["eager.p0", "eager.p1"] if eager else [])
    if eager:
        assert np.array_equal(ck.optim["eager.p1"], own[1])


@pytest.mark.parametrize("eager", [False, True])
def test_overlap_resumes_from_a_checkpoint_written_while_the_next_round_ran(
        spark, tiny_cfg, tmp_path, monkeypatch, eager):
    """A checkpoint by time under overlap is written with the next round's job running: it holds that
    job's parameters and rate, and the last finished round's residuals (and with ``train.eager`` the
    partitions' last changes); resuming reproduces the uninterrupted run bit for bit, and so does a run
    that waits at every round (checkpoint_every=1)."""
    from rnnlm.spark.lineage import Lineage
    base = config.apply_overrides(tiny_cfg.to_dict(), [
        "exchange.embed=rows+onebit", "exchange.softmax=rows+onebit", "exchange.hidden=dense+onebit",
        "exchange.random=0.2", "exchange.feedback=true", "exchange.broadcast=delta+int8", "optim.name=sgd",
        "optim.lr=0.5", "train.overlap=1", "train.rounds=4", "train.checkpoint_every=0",
        f"train.eager={str(eager).lower()}"])
    whole = run(spark, config.from_dict(base), tmp_path / "whole")
    drained = run(spark, config.from_dict(config.apply_overrides(base, ["train.checkpoint_every=1"])),
                  tmp_path / "drained")
    assert np.array_equal(drained.params, whole.params)
    cuts = []
    real = Lineage.truncate

    def truncate(self, held, carries=None):
        cuts.append(real(self, held, carries))
        return cuts[-1]
    monkeypatch.setattr(Lineage, "truncate", truncate)
    cfg = config.from_dict(config.apply_overrides(base, ["train.checkpoint_s=1e-9"]))
    out = tmp_path / "time"
    assert crashed_at(spark, cfg, out, 3) == 2
    assert cuts == [False, False]     # rounds 2 and 3 ran while rounds 1 and 2's checkpoints were written
    tr = Trainer(spark, cfg, str(out), log=lambda s: None)
    tr.run(resume=True)
    assert np.array_equal(tr.params, whole.params)
    assert [x["train_loss"] for x in metrics(out)] == [x["train_loss"] for x in metrics(tmp_path / "whole")]


@pytest.mark.serial          # how many updates arrive before a round closes depends on the CPU's other work
def test_a_contribution_that_reaches_its_round_late_twice_or_never_changes_nothing(
        spark, tiny_cfg, tmp_path, monkeypatch):
    """Rounds that keep their carries in Spark take the partitions' contributions from an accumulator.
    Dropped on arrival (as when another job computed the partition first), a contribution is
    recomputed from the round's inputs; delivered twice (a partition computed twice), it counts once."""
    import copy
    from rnnlm.spark.lineage import Contributions
    base = config.apply_overrides(tiny_cfg.to_dict(), [
        "exchange.embed=rows+onebit", "exchange.softmax=rows+onebit", "exchange.hidden=dense+onebit",
        "exchange.feedback=true", "train.rounds=3", "train.overlap=1", "train.optim_state=local"])
    cfg = config.from_dict(base)
    plain = run(spark, cfg, tmp_path / "plain")
    real = Contributions.addInPlace
    seen = []

    def drop_one(self, a, b):       # on the driver: pid -> contribution, a task's accumulated value
        if 1 in b and 1 not in a and len(seen) < 2:
            seen.append("dropped")
            return a
        return real(self, a, b)
    monkeypatch.setattr(Contributions, "addInPlace", drop_one)
    dropped = run(spark, cfg, tmp_path / "dropped")
    assert seen == ["dropped", "dropped"]       # rounds 1 and 2 lost partition 1's contribution
    assert np.array_equal(dropped.params, plain.params)

    def twice(self, a, b):
        if 0 in b and not self.closed:
            seen.append("twice")
            a = real(self, a, copy.deepcopy(b))
        return real(self, a, b)
    monkeypatch.setattr(Contributions, "addInPlace", twice)
    doubled = run(spark, cfg, tmp_path / "doubled")
    assert seen.count("twice") == 3
    assert np.array_equal(doubled.params, plain.params)
    losses = [[x["train_loss"] for x in metrics(tmp_path / name)] for name in ("doubled", "plain")]
    assert losses[0] == losses[1]


def test_the_rounds_after_a_broken_channel_merge_as_the_channel_did(spark, tiny_cfg, tmp_path, monkeypatch):
    """At 5 partitions Spark's tree of depth 2 adds a level whose fp16 sum is rounded as it leaves; the
    direct channel merges every leaf on the driver. The rounds sent through Spark after the channel failed
    merge on the driver too (depth 1): a transient failure changes no number."""
    from rnnlm.spark import channel
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        "data.partitions=5", "train.rounds=3", "train.checkpoint_every=0", "train.results=direct",
        "exchange.embed=dense+fp16", "exchange.softmax=dense+fp16", "exchange.hidden=dense+fp16"]))
    direct = run(spark, cfg, tmp_path / "direct")

    class Unreachable(channel.Channel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server.close()                 # as behind a firewall that refuses the port
    monkeypatch.setattr(channel, "Channel", Unreachable)
    fell_back = run(spark, cfg, tmp_path / "fell_back")
    assert np.array_equal(fell_back.params, direct.params)
    tree = run(spark, config.replace(cfg, "train", results="spark"), tmp_path / "tree")
    assert not np.array_equal(tree.params, direct.params)       # depth 2 at 5 partitions: another sum


@pytest.mark.parametrize("settings", [
    # dense, through treeAggregate: Adam's slots averaged, hidden state carried through the driver
    ["train.local_steps=4", "train.optim_state=average"],
    # carryover in Spark (error feedback's residuals, overlap's carries), Adam's slots kept per partition
    ["exchange.embed=rows+onebit", "exchange.softmax=rows+onebit", "exchange.hidden=dense+onebit",
     "exchange.feedback=true", "train.overlap=1", "train.optim_state=local"],
], ids=["tree", "carried"])
def test_direct_results_equal_spark_results_and_fall_back_to_them(spark, tiny_cfg, tmp_path, monkeypatch, settings):
    """``train.results = "direct"``: the tasks send their contributions to the driver's frame server, which
    merges them in partition order; the numbers are Spark's to the bit. When the executors cannot reach the
    driver (nothing listens), the first round recomputes through Spark, says so once, and the rounds submitted
    from then on send through Spark: the same numbers again. Each run's channel is kept to read what it took."""
    from pyspark import SparkContext
    from rnnlm.exchange.frames import Malformed
    from rnnlm.spark import channel
    base = config.apply_overrides(tiny_cfg.to_dict(), ["train.rounds=3", "train.checkpoint_every=0", *settings])
    through_spark = run(spark, config.from_dict(base), tmp_path / "spark")
    direct_cfg = config.from_dict(config.apply_overrides(base, ["train.results=direct"]))
    made, reran, real_run_job = [], [], SparkContext.runJob

    class Kept(channel.Channel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    class Unreachable(Kept):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server.close()                 # as behind a firewall that refuses the port

    def run_job(self, rdd, f, partitions=None, allowLocal=False):
        if type(partitions) is list:            # RDD.take passes ranges; the recompute its list
            reran.append(partitions)
        return real_run_job(self, rdd, f, partitions, allowLocal)
    monkeypatch.setattr(SparkContext, "runJob", run_job)
    monkeypatch.setattr(channel, "Channel", Kept)
    run(spark, direct_cfg, tmp_path / "direct")
    assert (made[0].taken, made[0].broken, reran) == (3 * 2, None, [])     # every contribution came through it
    monkeypatch.setattr(channel, "Channel", Unreachable)
    lines = []
    Trainer(spark, direct_cfg, str(tmp_path / "fell_back"), log=lines.append).run()
    # what was submitted before the channel broke still went to it: under train.overlap = 1, round 2's job
    # (submitted before round 1's result was taken); the rounds submitted after it went through Spark. Each
    # round's job takes its result on a thread of its own, so under overlap round 1 or round 2 may be the one
    # that finds the channel failed (round 2 was, once in five runs on a loaded machine)
    overlap = direct_cfg.train.overlap == 1
    assert made[1].broken in [f"partitions [0, 1] of round {r} did not arrive" for r in ((1, 2) if overlap else (1,))]
    assert [x for x in lines if "direct result channel" in x] == [
        f"warning: the direct result channel failed ({made[1].broken}); recomputed through Spark, and the rounds "
        "submitted from now on send their results through Spark"]
    assert (made[1].taken, reran) == (0, [[0, 1]] * (2 if overlap else 1))
    # one partition's frame refused in round 1: that partition alone runs again, through Spark
    monkeypatch.setattr(channel, "Channel", Kept)
    real_decode, reran[:] = channel.contribution_from_wire, []

    def refuse(fields, arrays, expect):
        if fields.get("round") == 1 and fields.get("pid") == 1:
            raise Malformed("refused by the test")
        return real_decode(fields, arrays, expect)
    monkeypatch.setattr(channel, "contribution_from_wire", refuse)
    run(spark, direct_cfg, tmp_path / "partial")
    assert (made[2].taken, made[2].broken, reran) == (
        1 + (2 if overlap else 0), "partitions [1] of round 1 did not arrive", [[1]])
    for name in ("direct", "fell_back", "partial"):
        assert np.array_equal(checkpoint.load(str(tmp_path / name / "checkpoint")).params, through_spark.params), name
        losses = [[x["train_loss"] for x in metrics(tmp_path / n)] for n in (name, "spark")]
        assert losses[0] == losses[1], name
        saved = [np.load(tmp_path / n / "checkpoint" / "optim.npz") for n in (name, "spark")]
        assert sorted(saved[0].files) == sorted(saved[1].files) and len(saved[0].files) >= 2
        for key in saved[0].files:
            assert np.array_equal(saved[0][key], saved[1][key]), (name, key)
    if overlap:
        return
    # the driver cannot merge a contribution (out of memory): the run stops with one line naming the round
    monkeypatch.setattr(channel, "contribution_from_wire", real_decode)
    real_merge = channel.Aggregate.merge

    def merge(self, other):
        if 1 in other.local:
            raise MemoryError("no room for the float64 sums")
        return real_merge(self, other)
    monkeypatch.setattr(channel.Aggregate, "merge", merge)
    with pytest.raises(TrainingError, match=r"^round 1: merging the contributions failed: MemoryError: no room for "
                                            r"the float64 sums; stopped, "):
        run(spark, direct_cfg, tmp_path / "no_room")


def recorded_releases(monkeypatch) -> list:
    """Every broadcast destroyed and RDD unpersisted from now on (PySpark's own methods), as ``(kind, blocking)``."""
    from pyspark.core.broadcast import Broadcast
    from pyspark.core.rdd import RDD
    calls, destroy, unpersist = [], Broadcast.destroy, RDD.unpersist

    def recording(kind, real):
        def call(self, *args, **kwargs):
            calls.append((kind, kwargs.get("blocking", args[0] if args else False)))
            return real(self, *args, **kwargs)
        return call
    monkeypatch.setattr(Broadcast, "destroy", recording("broadcast", destroy))
    monkeypatch.setattr(RDD, "unpersist", recording("rdd", unpersist))
    return calls


def releases(calls) -> list:
    """``calls`` without the lines' marks."""
    return [c for c in calls if c[0] != "line"]


def last_releases(calls) -> list:
    """The releases after the last one that did not wait."""
    calls = releases(calls)
    waited = [i for i, (_, blocking) in enumerate(calls) if blocking is False]
    return calls[waited[-1] + 1 if waited else 0:]


@pytest.mark.parametrize("sets", [
    [],
    ["exchange.embed=rows+onebit", "exchange.softmax=rows+onebit", "exchange.hidden=dense+onebit",
     "exchange.feedback=true", "exchange.broadcast=delta+int8"]], ids=["dense", "residuals"])
def test_a_run_that_ends_waits_for_its_last_releases_and_a_failing_one_does_not(
        spark, tiny_cfg, tmp_path, monkeypatch, sets):
    """The session stops right after a run: an executor told to stop with a release unanswered makes
    the driver log "ERROR TransportResponseHandler: Still have 1 requests outstanding" (local-cluster),
    so a run's last releases (its parameters' broadcasts and its corpus) wait for the executors' answers;
    those of the rounds do not. A failing run's executors may be gone: its releases do not wait."""
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), sets))
    calls = recorded_releases(monkeypatch)
    Trainer(spark, cfg, str(tmp_path / "ended"), log=lambda s: None, progress=_CrashAt(calls=calls)).run()
    last = last_releases(calls)
    # the base broadcast (and, with residuals, the broadcasts the lineage kept) and the corpus
    assert {kind for kind, _ in last} == {"broadcast", "rdd"}, calls
    mid_run = releases(calls[:calls.index(("line", 2))])      # before the last round's line: round 1's
    assert mid_run and all(blocking is False for _, blocking in mid_run), calls

    calls.clear()
    with pytest.raises(_Crash):
        Trainer(spark, cfg, str(tmp_path / "failed"), log=lambda s: None, progress=_CrashAt(1, calls)).run()
    after = calls[calls.index(("line", 1)) + 1:]
    assert {kind for kind, _ in after} == {"broadcast", "rdd"}, calls
    assert all(blocking is False for _, blocking in after), after


def test_a_corpus_that_fails_to_load_leaves_nothing_in_the_session_and_one_that_loads_owns_its_vocabulary(
        spark, tiny_cfg, tmp_path, monkeypatch):
    """A notebook's or a sweep's session outlives a run: a held-out text that cannot be read left the
    training partitions cached, and every corpus left its vocabulary's broadcast behind."""
    from rnnlm.spark.corpus import CorpusError, unpersist_corpus
    sc = spark.sparkContext

    def cached() -> set:        # (the JVM's map holds RDDs weakly: others' may leave it during the test)
        return set(sc._jsc.getPersistentRDDs().keySet())
    before = cached()
    calls = recorded_releases(monkeypatch)
    missing = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [f"data.valid={tmp_path / 'nothing.txt'}"]))
    with pytest.raises(CorpusError, match="nothing.txt"):
        load_corpus(sc, missing)
    assert cached() - before == set()
    assert [kind for kind, _ in calls].count("broadcast") == 1 and "rdd" in [kind for kind, _ in calls]
    calls.clear()
    data = load_corpus(sc, config.from_dict(config.apply_overrides(tiny_cfg.to_dict(),
                                                                   [f"data.valid={HARBOUR_VALID}"])))
    assert len(cached() - before) == 2 and ("broadcast", False) not in calls
    calls.clear()
    unpersist_corpus(data, blocking=True)
    assert cached() - before == set()
    assert sorted(calls) == [("broadcast", True), ("rdd", True), ("rdd", True)]
