"""Distributed training in Spark local mode (one shared session)."""
import json
import os

import numpy as np
import pytest

from rnnlm import checkpoint, config
from rnnlm.local import train_steps
from rnnlm.model import RNNLM
from rnnlm.optim import make_optimizer
from rnnlm.strategies import Source
from rnnlm.trainer import Trainer, TrainingError, load_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def run(spark, cfg, out, resume=False):
    tr = Trainer(spark, cfg, str(out), log=lambda s: None)
    tr.run(resume=resume)
    return tr


def metrics(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.parametrize("strategy", ["streams", "paragraphs", "windows", "sampled_windows",
                                      "sampled_paragraphs"])
def test_every_strategy_learns(spark, tiny_cfg, tmp_path, strategy):
    cfg = config.from_dict(config.apply_overrides(tiny_cfg.to_dict(), [
        f"data.strategy={strategy}", "train.rounds=12", "data.sample_fraction=0.5", "data.window_stride=4"]))
    run(spark, cfg, tmp_path)
    m = metrics(tmp_path)
    assert len(m) == 12 and [x["round"] for x in m] == list(range(1, 13))
    first, last = np.mean([x["train_loss"] for x in m[:2]]), np.mean([x["train_loss"] for x in m[-2:]])
    assert last < first - 0.4, (first, last)             # from ~ln(44) = 3.8 towards ~3
    assert m[-1]["syncs"] == 12 and m[-1]["tokens"] > m[0]["tokens"] > 0
    assert m[-1]["bytes_sent"] > m[0]["bytes_sent"] > 0 and m[-1]["bytes_broadcast"] > 0


def test_one_partition_equals_the_core_loop_bit_for_bit(spark, tiny_cfg, tmp_path):
    cfg = config.replace(config.replace(tiny_cfg, "data", partitions=1), "train", rounds=1, local_steps=5)
    tr = run(spark, cfg, tmp_path)
    data = load_corpus(spark.sparkContext, cfg)
    (pid, tokens, starts), = data.train.collect()
    data.train.unpersist()
    mcfg = tr.cfg.model
    model, opt = RNNLM(mcfg), make_optimizer(cfg.optim)
    p = model.init_params(cfg.train.seed)
    src = Source("streams", tokens, starts, cfg.train.batch, cfg.train.bptt, seed=cfg.train.seed)
    train_steps(model, opt, p, opt.init_state(p), src.batches(1, 0, 5), model.zero_state(cfg.train.batch),
                lr=cfg.optim.lr, clip_norm=cfg.optim.clip_norm, grad_norm="token")
    assert np.array_equal(tr.params, p)


def test_two_partitions_average_is_the_token_weighted_mean(spark, tiny_cfg, tmp_path):
    # long chunks: paragraphs end inside them, so the partitions score different token counts
    cfg = config.replace(tiny_cfg, "train", rounds=1, local_steps=2, bptt=300)
    cfg = config.replace(cfg, "data", strategy="paragraphs")
    tr = run(spark, cfg, tmp_path)
    data = load_corpus(spark.sparkContext, cfg)
    parts = data.train.collect()
    data.train.unpersist()
    model, opt = RNNLM(tr.cfg.model), make_optimizer(cfg.optim)
    results, weights = [], []
    for pid, tokens, starts in parts:
        p = model.init_params(cfg.train.seed)
        src = Source("paragraphs", tokens, starts, 4, 300, seed=cfg.train.seed, partition=pid)
        r = train_steps(model, opt, p, opt.init_state(p), src.batches(1, 0, 2), model.zero_state(4),
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
    (["train.optim_state=local", "train.outer=nesterov", "model.dropout=0.2"], True),
    (["train.optim_state=reset", "optim.schedule=plateau", "train.eval_every=1",
      "data.valid=rnnlm/data/harbour_valid.txt", "data.strategy=sampled_windows"], True),
])
def test_resume_two_plus_two_equals_four(spark, tiny_cfg, tmp_path, settings, uri):
    """With ``uri`` the run writes through Hadoop's FileSystem (file://), else Python I/O."""
    base = config.apply_overrides(tiny_cfg.to_dict(), settings)
    four = config.from_dict(config.apply_overrides(base, ["train.rounds=4"]))
    two = config.from_dict(config.apply_overrides(base, ["train.rounds=2"]))
    prefix = "file://" if uri else ""
    a = run(spark, four, f"{prefix}{tmp_path / 'a'}")
    run(spark, two, f"{prefix}{tmp_path / 'b'}")
    if not uri:   # (Hadoop's local filesystem checksums its files: no editing behind its back)
        with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
            f.write('{"round": 3, "train_lo')      # a line cut short by a crash is dropped
    b = run(spark, four, f"{prefix}{tmp_path / 'b'}", resume=True)
    assert np.array_equal(a.params, b.params)
    ma, mb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [x["train_loss"] for x in ma] == [x["train_loss"] for x in mb]
    ck = checkpoint.load(str(tmp_path / "b" / "checkpoint"))
    assert ck.position["round"] == 4 and np.array_equal(ck.params, a.params)


def test_resume_with_incompatible_config_is_refused(spark, tiny_cfg, tmp_path):
    run(spark, tiny_cfg, tmp_path)
    before = open(tmp_path / "metrics.jsonl").read()
    other = config.replace(tiny_cfg, "model", hidden=32)
    with pytest.raises(TrainingError, match="cannot resume: model.hidden is 32 here but 16"):
        run(spark, other, tmp_path, resume=True)
    with pytest.raises(TrainingError, match="already holds a run"):
        run(spark, tiny_cfg, tmp_path)
    assert open(tmp_path / "metrics.jsonl").read() == before
    checkpoint.load(str(tmp_path / "checkpoint"))


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
