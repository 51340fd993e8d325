"""Continuing a run differently: ``--resume`` to a longer run (and other cadence keys), ``--init-from``
(a new run from a checkpoint's weights), and what ``rnnlm train`` finds before Spark's JVM starts
(a resumed run already at its length, ``train.device = "gpu"`` without CuPy or a GPU)."""
import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rnnlm import cli, config
from rnnlm.cli import checks
from rnnlm.core import backend, checkpoint
from rnnlm.core.models import build as build_model
from rnnlm.core.vocab import Vocab
from rnnlm.spark import runinfo
from rnnlm.spark.async_trainer import AsyncTrainer
from rnnlm.spark.rundir import Init, TrainingError, check_init, check_kept, check_longer, check_resume, resume_keys
from rnnlm.spark.trainer import Trainer

from conftest import HARBOUR, HARBOUR_VALID, ROOT, TINY, metrics

VALID = f"data.valid={HARBOUR_VALID}"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def cfg_of(*sets):
    return config.load(None, [f"data.train={HARBOUR}", "data.level=char", "data.partitions=2", "optim.name=adam",
                              "optim.lr=0.01", "train.grad_norm=token", "train.eval_every=0", *TINY, *sets])


def differs(cfg, section, **changes):
    return config.replace(cfg, section, **changes)


def run(spark, cfg, out, resume=False, init=None, log=None, data=None):
    tr = Trainer(spark, cfg, str(out), log=log.append if log is not None else (lambda s: None))
    tr.run(resume=resume, init=init, data=data)
    return tr


# ----------------------------------------------------------------- what a resume may change (no Spark)
def test_a_resume_takes_a_longer_run_and_other_cadence_but_not_what_changes_the_numbers():
    cfg = cfg_of("exchange.broadcast=delta+bf16")
    for section, changes in (("train", {"rounds": 9}), ("train", {"epochs": 3.0}), ("train", {"eval_every": 3}),
                             ("train", {"checkpoint_every": 2}), ("train", {"checkpoint_s": 5.0}),
                             ("train", {"rebase_every": 4}), ("train", {"rebase_fraction": 0.1}),
                             ("train", {"device": "auto"}), ("server", {"lock": True, "port": 7})):
        check_resume(cfg, differs(cfg, section, **changes), "ck", resume_keys(cfg))
    refused = [
        (cfg, "train", {"results": "direct"}),              # another merge order
        (cfg, "train", {"local_steps": 4}),
        (cfg, "data", {"min_count": 2}),                    # the rest of data is compared
        (cfg, "data", {"max_record_mb": 32}),               # an older run may have trained without a record
        (cfg_of("optim.schedule=plateau", VALID), "train", {"eval_every": 3}),    # it steps at evaluations
        (cfg_of("train.mode=async"), "server", {"lock": True}),
        (cfg_of("train.mode=async", "server.update=adagrad", "optim.name=sgd"), "server", {"lr": 0.5}),
        (cfg_of("train.mode=async", "server.update=adagrad", "optim.name=sgd"), "server", {"eps": 0.5}),
    ]
    for mine, section, changes in refused:
        (k, v), = changes.items()
        with pytest.raises(TrainingError) as e:
            check_resume(mine, differs(mine, section, **changes), "ck", resume_keys(mine))
        assert str(e.value) == f"cannot resume: {section}.{k} is {getattr(getattr(mine, section), k)!r} here but " \
                               f"{v!r} in ck"
    # the server's rate means nothing to a server that adds: accepted
    add = cfg_of("train.mode=async")
    check_resume(add, differs(add, "server", lr=0.5), "ck", resume_keys(add))


def test_a_plateau_run_that_stepped_at_its_end_off_the_cadence_is_not_made_longer():
    cfg = cfg_of("optim.schedule=plateau", VALID, "train.eval_every=3")
    evaluated = [{"round": 1}, {"round": 2, "valid_loss": 3.1}]
    with pytest.raises(TrainingError) as e:
        check_longer(cfg, 2, 4, evaluated, None, "run/checkpoint")
    assert str(e.value) == (
        "cannot resume to 4 rounds: optim.schedule = 'plateau' stepped on the evaluation that ended the run at "
        "round 2 in run/checkpoint, which a run of 4 rounds, evaluating every 3 rounds, does not make; start a new "
        "run from its weights with --init-from")
    with pytest.raises(TrainingError, match="evaluating only at the end"):     # without metrics: best/'s round
        check_longer(differs(cfg, "train", eval_every=0), 2, 4, [], {"round": 2, "valid_loss": 3.1}, "ck")
    check_longer(cfg, 2, 4, [{"round": 1}, {"round": 2}], {"round": 1, "valid_loss": 3.0}, "ck")   # stopped at 2
    check_longer(cfg, 3, 6, [{"round": 3, "valid_loss": 3.1}], None, "ck")          # on the cadence
    check_longer(differs(cfg, "optim", schedule="constant"), 2, 4, evaluated, None, "ck")
    check_longer(cfg, 2, 2, evaluated, None, "ck")                                  # not longer


def test_init_from_needs_the_vocabulary_level_and_the_shape_and_kept_state_the_same_optimizer():
    cfg = cfg_of("model.dropout=0.3", "model.init_scale=0.2", "optim.lr=0.001", "train.seed=5")
    saved = config.resolve(cfg_of(), 47)
    check_init(cfg, saved, "ck", keep_optimizer=True)       # another rate, dropout, init and seed: the same model
    check_init(differs(cfg, "model", context=5), saved, "ck")           # an LSTM reads no context
    for section, changes in (("data", {"level": "word"}), ("model", {"cell": "rnn"}), ("model", {"hidden": 32}),
                             ("model", {"embed": 8}), ("model", {"layers": 2}), ("model", {"dtype": "float64"}),
                             ("model", {"biases": "two"})):
        (k, v), = changes.items()
        with pytest.raises(TrainingError) as e:
            check_init(differs(cfg, section, **changes), saved, "runs/a/best")
        assert str(e.value) == (f"cannot start from runs/a/best: {section}.{k} is {v!r} here but "
                                f"{getattr(getattr(saved, section), k)!r} there")
    ffnn = cfg_of("model.cell=ffnn", "model.embed=8")
    with pytest.raises(TrainingError, match="model.context is 5 here but 3 there"):
        check_init(differs(ffnn, "model", context=5), config.resolve(ffnn, 47), "ck")
    for mine, message in ((differs(cfg, "optim", name="sgd"), "optim.name is 'sgd' here but 'adam'"),
                          (differs(cfg, "train", optim_state="reset"), "train.optim_state is 'reset' here"),
                          (differs(cfg, "train", outer="momentum"), "train.outer is 'momentum' here")):
        check_init(mine, saved, "ck")                       # fresh optimizer state: any optimizer
        with pytest.raises(TrainingError, match=f"^--keep-optimizer: {message}"):
            check_init(mine, saved, "ck", keep_optimizer=True)
    local = differs(cfg, "train", optim_state="local")
    check_init(differs(cfg, "data", partitions=3), saved, "ck", keep_optimizer=True)     # averaged: one state
    with pytest.raises(TrainingError, match="data.partitions is 3 here but 2"):         # one per partition
        check_init(differs(local, "data", partitions=3), differs(saved, "train", optim_state="local"), "ck",
                   keep_optimizer=True)


def test_kept_optimizer_state_must_be_the_checkpoints_state():
    """A single-process trainer's checkpoint holds one Adam state (m, v) whatever its configuration's
    train.optim_state says: a run keeping per-partition state (local) started fresh and said "kept"; an
    async AdaGrad run from a checkpoint without the server's accumulator did the same; a run that resets
    its state each round dropped the checkpoint's and said "kept" too."""
    cfg = config.resolve(cfg_of(), 47)
    zeros = np.zeros(4, np.float32)

    def ck(**optim):
        return checkpoint.Checkpoint(params=zeros, config=cfg, vocab=Vocab.build("ab", "char"), optim=optim)
    check_kept(cfg, ck(m=zeros, v=zeros), "ck")                                   # averaged: one state
    local = differs(cfg, "train", optim_state="local")
    with pytest.raises(TrainingError, match=r"^--keep-optimizer: ck holds no p0/m \(4 of the 4 arrays"):
        check_kept(local, ck(m=zeros, v=zeros), "ck")
    check_kept(local, ck(**{f"p{p}/{s}": zeros for p in range(2) for s in "mv"}), "ck")
    with pytest.raises(TrainingError, match="holds no p1/v"):
        check_kept(local, ck(**{"p0/m": zeros, "p0/v": zeros, "p1/m": zeros}), "ck")
    with pytest.raises(TrainingError, match="holds no m"):
        check_kept(cfg, ck(), "ck")
    check_kept(differs(cfg, "optim", name="sgd"), ck(), "ck")                    # SGD keeps no state
    check_kept(differs(cfg, "train", optim_state="reset"), ck(), "ck")           # reset each round: none
    nesterov = differs(cfg, "train", outer="nesterov")                           # its velocity too
    with pytest.raises(TrainingError, match="holds no outer.velocity"):
        check_kept(nesterov, ck(m=zeros, v=zeros), "ck")
    check_kept(nesterov, ck(m=zeros, v=zeros, **{"outer.velocity": zeros}), "ck")
    adagrad = config.load(None, ["train.mode=async", "server.update=adagrad"])
    with pytest.raises(TrainingError, match="holds no server.acc"):
        check_kept(adagrad, ck(m=zeros, v=zeros), "ck")
    check_kept(adagrad, ck(**{"server.acc": zeros}), "ck")
    # state it would not read: kept would be a claim with nothing behind it
    with pytest.raises(TrainingError, match=r"^--keep-optimizer: ck holds optimizer state 'm' that this run would "
                                            r"not read \(train.optim_state = 'reset'"):
        check_kept(differs(cfg, "train", optim_state="reset"), ck(m=zeros, v=zeros), "ck")   # a one-process run's
    with pytest.raises(TrainingError, match="holds optimizer state 'p2/m'"):
        check_kept(local, ck(**{f"p{p}/{s}": zeros for p in range(3) for s in "mv"}), "ck")
    with pytest.raises(TrainingError, match="holds optimizer state 'outer.velocity'"):
        check_kept(cfg, ck(m=zeros, v=zeros, **{"outer.velocity": zeros}), "ck")
    with pytest.raises(TrainingError, match=r"holds optimizer state 'm' that this run would not read \(server.update "
                                            r"= 'adagrad'\)"):
        check_kept(adagrad, ck(m=zeros, **{"server.acc": zeros}), "ck")
    # what its partitions held and its executors' view belong to its own run: a new run leaves them
    check_kept(cfg, ck(m=zeros, v=zeros, **{"feedback.p0": zeros, "eager.p5": zeros, "outer.view": zeros}), "ck")


def test_run_json_keeps_where_the_weights_came_from_across_resumes(spark):
    cfg = config.resolve(cfg_of(), 47)
    origin = {"path": "runs/a/best", "round": 3, "optimizer": "fresh"}
    first = runinfo.describe(spark.sparkContext, cfg, init_from=origin)
    assert first["init_from"] == origin
    again = runinfo.describe(spark.sparkContext, cfg, resume_of=first)
    assert again["init_from"] == origin and again["started"] == first["started"] and len(again["resumed"]) == 1
    assert "init_from" not in runinfo.describe(spark.sparkContext, cfg)


def test_a_damaged_run_json_is_replaced_on_resume_never_fatal(spark, tmp_path):
    """Its fields not of their kind ("resumed": 5 was a traceback, "ab" became ["a", "b"]), or nested
    deeper than Python's parser goes (a RecursionError)."""
    from rnnlm.core.files import LocalFS
    sc, cfg = spark.sparkContext, config.resolve(cfg_of(), 47)
    for damaged, kept in (({"resumed": 5, "started": 7, "init_from": "x"}, []), ({"resumed": "ab"}, []),
                          ({"resumed": None}, []), ({"resumed": ["2026-01-01T00:00:00+00:00", 3]},
                                                    ["2026-01-01T00:00:00+00:00"])):
        info = runinfo.describe(sc, cfg, resume_of=damaged)
        assert info["resumed"][:-1] == kept and info["started"] is None and "init_from" not in info
    for text in ("[" * 100_000 + "]" * 100_000, "[1, 2]", "null"):       # too deep; JSON, not a table
        (tmp_path / "run.json").write_text(text)
        runinfo.write(LocalFS(), str(tmp_path), sc, cfg, resume=True)
        info = json.loads((tmp_path / "run.json").read_text())
        assert info["started"] is None and len(info["resumed"]) == 1, text


# ------------------------------------------------------------ rnnlm train before the JVM starts (no Spark)
@pytest.fixture
def no_jvm(monkeypatch):
    """Starting Spark fails the test: what these commands decide, they decide without it."""
    def refuse(*a, **k):
        raise AssertionError("Spark was started")
    monkeypatch.setattr("rnnlm.spark.session.get_spark", refuse)


def train(out, *sets, resume=False, init_from=None, keep=False, master=None, overwrite=False):
    a = argparse.Namespace(config=os.path.join(ROOT, "conf", "demo.toml"),
                           set=[*TINY, "data.valid=", "train.eval_every=0", *sets], out=str(out), resume=resume,
                           overwrite=overwrite, master=master, samples=1, dry_run=False, verbose=False,
                           init_from=init_from, keep_optimizer=keep)
    return cli.guarded(lambda: cli.train(a))


def one_error(capsys, rc, expected):
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    return err


def saved_run(out, *sets, position, lines):
    """A run directory as training leaves it, written without Spark: its checkpoint and metrics."""
    cfg = config.load(os.path.join(ROOT, "conf", "demo.toml"), [*TINY, "data.valid=", "train.eval_every=0", *sets])
    vocab = Vocab.build(open(HARBOUR).read(), "char")
    cfg = config.resolve(cfg, len(vocab))
    checkpoint.save(str(out / "checkpoint"), checkpoint.Checkpoint(
        params=build_model(cfg.model).init_params(7), config=cfg, vocab=vocab, position=position))
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def test_an_out_the_run_cannot_write_in_is_one_line_before_spark(tmp_path, capsys, no_jvm):
    """A file, or a path under one: a traceback once Spark and the corpus were up (os.makedirs)."""
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "run"):
        one_error(capsys, train(out, "train.rounds=2"), f"--out {out}: {tmp_path / 'f'} is a file, not a directory")
    assert (tmp_path / "f").read_text() == "x"
    # where nothing can be made, root included (os.access said yes to root: a raw ENOENT once the corpus was read)
    one_error(capsys, train("/proc/rnnlm-run", "train.rounds=2"), "--out /proc/rnnlm-run: /proc is not writable (")
    (tmp_path / "ok").mkdir()
    checks._check_writable(str(tmp_path / "ok" / "run"), str(tmp_path / "ok" / "run"))
    assert os.listdir(tmp_path / "ok") == []                 # the try leaves nothing behind


def test_an_async_resume_from_a_line_without_its_bytes_and_time_is_one_line(tmp_path, capsys):
    """The first line after an asynchronous resume subtracts the last kept line's bytes and wall time: a line
    without them (edited, damaged) was a KeyError traceback once the parameter server had started."""
    lines = [{"round": 1, "syncs": 2, "bytes_sent": 10, "bytes_broadcast": 20, "wall_s": 1.5},
             {"round": 2, "syncs": 4, "train_loss": 3.8}]
    saved_run(tmp_path, "train.rounds=2", "train.mode=async", "train.push_every=3", lines=lines,
              position={"round": 2, "version": 4, "done": [2, 2], "totals": {}, "tokens": 384, "bytes_sent": 0,
                        "bytes_broadcast": 0, "wall_s": 1.0})
    rc = train(tmp_path, "train.rounds=3", "train.mode=async", "train.push_every=3", resume=True)
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[-1] == (f"error: {tmp_path}/metrics.jsonl: the line of round 2, which a resume goes on "
                                   "from, lacks bytes_sent, bytes_broadcast, wall_s (numbers >= 0): mend it, or "
                                   "start again with --overwrite"), err
    assert not any("Traceback" in x for x in err)


def test_a_finished_runs_damaged_last_line_is_said_for_what_it_holds(tmp_path, capsys, no_jvm):
    """Its loss a string and its perplexity null: the closing line formatted them as numbers (a traceback)."""
    lines = [{"round": 1, "syncs": 1, "train_loss": 3.9},
             {"round": 2, "syncs": 2, "train_loss": "x", "valid_ppl": None}]
    saved_run(tmp_path / "run", "train.rounds=2", lines=lines, position={
        "round": 2, "tokens": 384, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0})
    assert train(tmp_path / "run", "train.rounds=2", resume=True) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[1] == f"done: round 2 | checkpoint {tmp_path}/run/checkpoint", said


def test_a_run_patience_ended_resumes_to_nothing_without_spark_whatever_its_length(tmp_path, capsys, no_jvm):
    """Ended at round 6 by train.patience = 2 (evaluations at 4 and 6 since round 2's best): --resume says so
    without starting Spark, its length in rounds or in epochs (which alone needs the corpus counted); with
    more patience, or off the evaluations' cadence, it is left to the trainer."""
    lines = [{"round": r, "syncs": r, "train_loss": 3.9} for r in range(1, 7)]
    sets = (f"data.valid={HARBOUR_VALID}", "train.eval_every=2", "train.patience=2")
    saved_run(tmp_path / "run", *sets, "train.rounds=20", lines=lines, position={
        "round": 6, "tokens": 384, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0,
        "best": {"round": 2, "valid_loss": 1.25}})
    for length in ("train.rounds=20", "train.epochs=40"):
        assert train(tmp_path / "run", *sets, length, *(["train.rounds=0"] if "epochs" in length else []),
                     resume=True) == 0
        said = capsys.readouterr().out.splitlines()
        assert said[0] == (f"nothing to do: {tmp_path}/run stopped early at round 6: 2 evaluations since round 2 "
                           "without a lower validation loss than its 1.2500 (train.patience = 2); raise "
                           "train.patience to train on"), said
    cfg = config.load(os.path.join(ROOT, "conf", "demo.toml"), [*sets, "train.rounds=20"])
    assert checks.finished_run(cfg, str(tmp_path / "run"), True, False) == str(tmp_path / "run")
    for more in (config.replace(cfg, "train", patience=3), config.replace(cfg, "train", eval_every=4)):
        assert checks.finished_run(more, str(tmp_path / "run"), True, False) is None


def test_a_run_resumes_from_a_directory_that_names_its_files_otherwise(tmp_path, capsys, no_jvm, monkeypatch):
    """Started in the checkout (``rnnlm/data/harbour.txt``) and resumed elsewhere, where the path is found in
    the config's checkout, it was refused: "data.train is '/.../rnnlm/data/harbour.txt' here but
    'rnnlm/data/harbour.txt'"; the other way round as well. Another file is still another experiment."""
    lines = [{"round": 1, "syncs": 1, "train_loss": 3.9}, {"round": 2, "syncs": 2, "train_loss": 3.8}]
    position = {"round": 2, "tokens": 384, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0}
    saved_run(tmp_path / "rel", "train.rounds=2", lines=lines, position=position)
    saved_run(tmp_path / "abs", "train.rounds=2", f"data.train={HARBOUR}", lines=lines, position=position)
    saved_run(tmp_path / "other", "train.rounds=2", f"data.train={HARBOUR_VALID}", lines=lines, position=position)
    assert checkpoint.load(str(tmp_path / "rel")).config.data.train == "rnnlm/data/harbour.txt"
    monkeypatch.chdir(tmp_path)                     # not the checkout: the relative path is found in it
    assert train(tmp_path / "rel", "train.rounds=2", resume=True) == 0
    assert "nothing to do" in capsys.readouterr().out
    monkeypatch.chdir(ROOT)                         # the checkout: the relative path names the absolute one's file
    assert train(tmp_path / "abs", "train.rounds=2", resume=True) == 0
    assert "nothing to do" in capsys.readouterr().out
    one_error(capsys, train(tmp_path / "other", "train.rounds=2", resume=True),
              f"cannot resume: data.train is 'rnnlm/data/harbour.txt' here but '{HARBOUR_VALID}' in ")


def test_a_saved_relative_name_is_the_file_it_names_here_or_in_the_checkout_nothing_else(tmp_path, monkeypatch):
    """A name that ends the same is not the same file: train.txt saved, another train.txt read now."""
    from rnnlm.spark.rundir import same_data
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("one")
    (tmp_path / "train.txt").write_text("another")
    assert not same_data("data/train.txt", "train.txt") and not same_data(str(tmp_path / "data" / "train.txt"),
                                                                          "train.txt")
    assert same_data(str(tmp_path / "train.txt"), "train.txt") and same_data("train.txt", str(tmp_path / "train.txt"))
    assert same_data(HARBOUR, "rnnlm/data/harbour.txt")          # not here: the checkout's
    assert not same_data(HARBOUR_VALID, "rnnlm/data/harbour.txt")
    # another filesystem's names are one text when equal, and else not (nothing here to compare them by)
    assert same_data("hdfs://nn:8020/ptb/train.txt", "hdfs://nn:8020/ptb/train.txt")
    assert not same_data("hdfs://nn:8020/ptb/train.txt", "hdfs://nn:8020/ptb/valid.txt")


def test_a_resumed_run_already_at_its_length_has_nothing_to_do_without_spark(tmp_path, capsys, no_jvm):
    lines = [{"round": 1, "syncs": 1, "train_loss": 3.9},
             {"round": 2, "syncs": 2, "train_loss": 3.8, "valid_ppl": 45.0}]
    saved_run(tmp_path / "sync", "train.rounds=3", position={"round": 3, "tokens": 576, "bytes_sent": 0,
                                                             "bytes_broadcast": 0, "wall_s": 1.0},
              lines=[{"round": 1, "syncs": 1, "train_loss": 4.0}, *({**m, "round": m["round"] + 1} for m in lines)])
    line = dict(lines[-1], syncs=4, pushes=2, windows_lost=0, bytes_sent=0, bytes_broadcast=0,
                wall_s=1.0)                                          # the run's last line (test_async: one that is not)
    saved_run(tmp_path / "async", "train.rounds=2", "train.mode=async", "train.push_every=3",
              lines=[lines[0], line], position={"round": 2, "version": 4, "done": [2, 2], "totals": {}, "line": line,
                                                "tokens": 384, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0})
    # a metrics file cut short (its last line lost in a crash) ends before its checkpoint's round
    saved_run(tmp_path / "short", "train.rounds=3", lines=lines, position={
        "round": 3, "tokens": 576, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0})
    full = " | train_loss 3.8000 | valid_ppl 45.00"
    for name, rounds, sets, figures in (("sync", 3, (), full), ("short", 3, (), ""),
                                        ("async", 2, ("train.mode=async", "train.push_every=3"), full)):
        out = tmp_path / name
        before = (out / "metrics.jsonl").read_bytes()
        assert train(out, f"train.rounds={rounds}", *sets, resume=True) == 0
        said = capsys.readouterr().out.splitlines()      # the last line's figures, not another's
        assert said[:3] == [f"nothing to do: {out} is at round {rounds} of {rounds} (raise train.rounds or "
                            "train.epochs to train on)",
                            f"done: round {rounds}{figures} | checkpoint {out}/checkpoint", "--- sample 1 ---"], said
        assert (out / "metrics.jsonl").read_bytes() == before
    # a longer run of it needs Spark (here: refused, as a run of 4 rounds would start it)
    with pytest.raises(AssertionError, match="Spark was started"):
        train(tmp_path / "sync", "train.rounds=4", resume=True)


def test_a_plateau_run_ended_off_the_cadence_is_refused_before_spark(tmp_path, capsys, no_jvm):
    sets = ("optim.schedule=plateau", f"data.valid={HARBOUR_VALID}", "train.eval_every=3", "train.rounds=2")
    saved_run(tmp_path, *sets, lines=[{"round": 1}, {"round": 2, "valid_loss": 3.5}],
              position={"round": 2, "tokens": 384, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0})
    one_error(capsys, train(tmp_path, *sets[:3], "train.rounds=4", resume=True),
              "cannot resume to 4 rounds: optim.schedule = 'plateau' stepped on the evaluation that ended the run "
              f"at round 2 in {tmp_path}/checkpoint")
    one_error(capsys, train(tmp_path, *sets[:2], "train.eval_every=2", "train.rounds=4", resume=True),
              "cannot resume: train.eval_every is 2 here but 3 in")


def test_gpu_without_cupy_or_a_device_is_one_line_before_spark_for_a_local_master(tmp_path, capsys, monkeypatch,
                                                                                  no_jvm):
    if backend.gpu_available():
        pytest.skip("this machine has a GPU and CuPy: train.device = 'gpu' is fine here")
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    for master in (None, "local[*]", "local-cluster[2,1,1024]"):
        one_error(capsys, train(tmp_path / "o", "train.device=gpu", master=master),
                  f"train.device = 'gpu' but this machine has no CuPy or no CUDA device, and the master "
                  f"{master or 'local[2]'} runs every executor here: pip install \"rnnlm[gpu]\" on a machine")
    assert not (tmp_path / "o").exists()
    gpu = cfg_of("train.device=gpu")
    for master in ("yarn", "spark://head:7077", "k8s://https://api:6443"):     # executors elsewhere: theirs to say
        checks.check_device(gpu, master)
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)                    # the executors' Python is this one
    with pytest.raises(config.ConfigError, match=r"pip install \"rnnlm\[gpu\]\""):
        checks.check_device(gpu, "local[2]")
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/gpu-env/bin/python")         # executors in another Python
    checks.check_device(gpu, "local[2]")
    monkeypatch.delenv("PYSPARK_PYTHON")
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")                         # under spark-submit: its master
    checks.check_device(gpu, None)
    checks.check_device(cfg_of("train.device=auto"), "local[2]")            # auto falls back to the CPU
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT")
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--master yarn pyspark-shell")   # the master plain Python starts
    checks.check_device(gpu, None)
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--master local[3] pyspark-shell")
    with pytest.raises(config.ConfigError, match=r"the master local\[3\] runs every executor here"):
        checks.check_device(gpu, None)
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS")
    # evaluate --device gpu: every task failed 4 times on "CuPy is not installed", after Spark started
    from rnnlm.cli.main import main
    one_error(capsys, main(["evaluate", "--checkpoint", str(tmp_path / "none"), "--data", "x.txt", "--device", "gpu"]),
              "--device gpu but this machine has no CuPy or no CUDA device, and the master local[2] runs every "
              "executor here")


def test_init_from_is_checked_before_spark(tmp_path, capsys, no_jvm):
    saved_run(tmp_path / "a", "train.rounds=2", lines=[{"round": 2}],
              position={"round": 2, "tokens": 384, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.0})
    out = tmp_path / "b"
    one_error(capsys, train(out, "model.hidden=32", init_from=str(tmp_path / "a")),
              f"cannot start from {tmp_path}/a: model.hidden is 32 here but 16 there")
    one_error(capsys, train(out, "optim.name=sgd", init_from=str(tmp_path / "a" / "checkpoint"), keep=True),
              "--keep-optimizer: optim.name is 'sgd' here but 'adam' in")
    one_error(capsys, train(out, init_from=str(tmp_path / "a" / "best")),
              f"checkpoint not found: {tmp_path}/a/best")
    one_error(capsys, train(tmp_path / "a", init_from=str(tmp_path / "a"), resume=True),
              "--init-from starts a new run from a checkpoint's weights; --resume continues the run in --out")
    one_error(capsys, train(out, keep=True), "--keep-optimizer goes with --init-from")
    assert not out.exists()
    # --overwrite would delete the checkpoint the run starts from (and its run.json would name it as its origin)
    for source in ("a", "a/best", "a/checkpoint"):
        one_error(capsys, train(tmp_path / "a", init_from=str(tmp_path / source), overwrite=True),
                  f"--init-from {tmp_path / source} lies in what --overwrite deletes of --out {tmp_path / 'a'}: copy "
                  "the checkpoint elsewhere first, or write the new run to another --out")
    assert (tmp_path / "a" / "checkpoint").is_dir()


def test_init_from_is_compared_with_what_overwrite_deletes_path_by_path(monkeypatch):
    """Under spark-submit no path was compared (a run deleted the checkpoint it started from), and a copy kept in
    the run directory beside what --overwrite deletes was refused."""
    from rnnlm.cli.checks import check_init_outside
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")                     # as under spark-submit
    refused = [("/r", "/r/"), ("/r/best", "/r"), ("/r/checkpoint/", "/r"), ("file:/r/best", "/r"),
               ("hdfs://nn/r", "hdfs://nn/r/"), ("hdfs://nn/r/best/", "hdfs://nn/r")]
    kept = [("/r/saved", "/r"), ("/r2/best", "/r"), ("/rbest", "/r"), ("hdfs://nn/r/saved", "hdfs://nn/r"),
            ("hdfs://other/r/best", "hdfs://nn/r"), ("hdfs://nn/r/best", "/r")]
    for init, out in refused:
        with pytest.raises(config.ConfigError, match="lies in what --overwrite deletes of --out"):
            check_init_outside(init, out)
    for init, out in kept:
        check_init_outside(init, out)


# ------------------------------------------------------------------------------------------- with Spark
@pytest.fixture(scope="module")
def corpus(spark):
    """``corpus(*sets)``: the project's text as a run of ``cfg_of(*sets)`` reads it, read once for this
    module's runs (as the benchmarks share one): Spark's jobs that read it take longer than these runs'
    rounds. Each round cuts its batches by its own run's data.strategy; only a length in train.epochs
    reads the corpus' expected tokens per round."""
    from rnnlm.spark.corpus import load_corpus, unpersist_corpus
    read = {}

    def load(*sets):
        if sets not in read:
            read[sets] = load_corpus(spark.sparkContext, cfg_of(*sets))
        return read[sets]
    yield load
    for data in read.values():
        unpersist_corpus(data, blocking=True)


def test_a_run_resumed_to_twice_its_length_with_other_cadence_equals_the_longer_run(spark, tmp_path, corpus):
    """One round (evaluating, checkpointing and re-basing every round), resumed to train.epochs' two rounds
    (evaluating every 3 rounds and at the end, checkpointing at the end, re-basing by size): the two-round
    run's numbers, bit for bit."""
    common = ("exchange.embed=rows+fp16", "exchange.softmax=rows+fp16", "exchange.broadcast=delta+bf16", VALID)
    longer = cfg_of(*common, "train.rounds=0", "train.epochs=0.06", "train.eval_every=3")       # 2 rounds
    data = corpus(VALID)
    whole = run(spark, longer, tmp_path / "whole", data=data)
    assert [m["round"] for m in metrics(tmp_path / "whole")] == [1, 2]
    run(spark, cfg_of(*common, "train.rounds=1", "train.eval_every=1", "train.checkpoint_every=1",
                      "train.checkpoint_s=0", "train.rebase_every=1"), tmp_path / "halves", data=data)
    logs = []
    resumed = run(spark, longer, tmp_path / "halves", resume=True, log=logs, data=data)
    assert "resumed from round 1" in logs
    assert np.array_equal(resumed.params, whole.params)
    halves, m = metrics(tmp_path / "halves"), metrics(tmp_path / "whole")
    assert [x["train_loss"] for x in halves] == [x["train_loss"] for x in m]
    assert "valid_loss" in halves[0] and "valid_loss" not in m[0] and halves[1]["valid_loss"] == m[1]["valid_loss"]


def test_a_shared_corpus_counts_a_round_by_each_runs_own_settings(corpus):
    """A corpus read for one run's settings (local_steps 3, batch 4, bptt 8) and trained on by a run of
    others, as the benchmarks' sweeps and the async trainer (a window is push_every steps) do: a length
    in train.epochs is counted in that run's rounds (its tokens per round once counted the reader's),
    and a run whose batches do not fit a partition is refused as reading the corpus itself would."""
    from rnnlm.spark.corpus import CorpusError, total_rounds
    data = corpus(VALID)
    sizes = [len(p[1]) for p in data.train.collect()]

    def epoch(B, T):                    # a pass of B streams of T steps over each partition: its targets
        return sum((n // B - 1) // T * T * B for n in sizes)
    epochs = ("train.rounds=0", "train.epochs=1")
    assert total_rounds(cfg_of(VALID, *epochs), data) == math.ceil(epoch(4, 8) / (2 * 3 * 4 * 8))
    for sets, (K, B, T) in ((("train.local_steps=6",), (6, 4, 8)), (("train.batch=2", "train.bptt=5"), (3, 2, 5))):
        assert total_rounds(cfg_of(VALID, *epochs, *sets), data) == math.ceil(epoch(B, T) / (2 * K * B * T))
    with pytest.raises(CorpusError, match=r"harbour.txt: partition \d: .* \(strategy streams, bptt 1000, batch 4\)$"):
        total_rounds(cfg_of(VALID, *epochs, "train.bptt=1000"), data)


def test_init_from_starts_a_new_run_from_the_checkpoints_weights_and_vocabulary_in_both_modes(spark, tmp_path):
    """A checkpoint holding seed 7's initial weights over a vocabulary of the project's text and three
    characters it lacks (as a model trained on a larger text has): a run from it under seed 1234 reads the
    text with that vocabulary and is seed 7's run on it, bit for bit (round 0, fresh optimizer and
    schedule); so is an asynchronous one with one worker (its windows of 3 steps are the rounds' 3 local
    steps, as in test_async)."""
    from rnnlm.spark.corpus import load_corpus, unpersist_corpus
    from rnnlm.spark.dryrun import dry_run
    one = ("data.partitions=1", "train.rounds=2")
    vocab = Vocab.build(open(HARBOUR).read() + "\u00e6\u00f8\u00e5", "char")
    cfg = config.resolve(cfg_of(*one, "train.seed=7"), len(vocab))
    checkpoint.save(str(tmp_path / "init"), checkpoint.Checkpoint(
        params=build_model(cfg.model).init_params(7), config=cfg, vocab=vocab, position={"round": 0}))
    init = Init(checkpoint.load(str(tmp_path / "init")), "init")
    data = load_corpus(spark.sparkContext, cfg, vocab)
    try:
        ref = run(spark, cfg_of(*one, "train.seed=7"), tmp_path / "seed7", data=data)
        assert len(ref.vocab) == len(vocab) == 50
        logs = []
        tr = run(spark, cfg_of(*one, "train.seed=1234"), tmp_path / "sync", init=init, log=logs)
        assert tr.vocab.tokens == vocab.tokens
        assert np.array_equal(tr.params, ref.params)
        a = AsyncTrainer(spark, cfg_of(*one, "train.seed=1234", "train.mode=async", "train.push_every=3",
                                       "server.heartbeat_s=0.2", "server.timeout_s=5"), str(tmp_path / "async"),
                         log=lambda s: None)
        a.run(init=init, data=data)
        assert np.array_equal(a.params, ref.params)
    finally:
        unpersist_corpus(data, blocking=True)
    said = []                   # a dry run reads the text with the checkpoint's vocabulary too (it built its own)
    dry_run(spark, cfg_of(*one, "train.seed=1234"), log=said.append, init=init)
    assert [x for x in said if x.startswith("vocab ")] == [f"vocab 50 | params {tr.params.size:,} "
                                                           f"({tr.params.size * 4 / 1e6:.2f} MB as float32) | "
                                                           f"train tokens {data.tokens:,} ({data.spread()})"]
    assert [m["round"] for m in metrics(tmp_path / "sync")] == [1, 2]
    assert "initialised from init (round 0 of its run; its vocabulary of 50 tokens; optimizer state fresh)" in logs
    info = json.loads((tmp_path / "sync" / "run.json").read_text())
    assert info["init_from"] == {"path": "init", "round": 0, "optimizer": "fresh"} and info["resumed"] == []
    assert json.loads((tmp_path / "async" / "run.json").read_text())["init_from"]["path"] == "init"


def test_kept_optimizer_state_continues_the_run_and_fresh_state_does_not(spark, tmp_path, corpus):
    """With whole passes over fixed windows every round reads the same batches: a new run from round 1's
    checkpoint with its Adam state kept computes round 2 of the run, bit for bit; with fresh state it
    does not."""
    sets = ("data.strategy=windows", "data.window_stride=8", "train.local_steps=0", "train.rounds=1")
    data = dataclasses.replace(corpus(VALID), valid=None)        # no evaluation
    first = run(spark, cfg_of(*sets), tmp_path / "a", data=data)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    second = run(spark, cfg_of(*sets[:-1], "train.rounds=2"), tmp_path / "b", resume=True, data=data)
    ck = checkpoint.load(str(tmp_path / "a"))
    assert ck.optim_t > 0 and not np.array_equal(second.params, first.params)
    kept = run(spark, cfg_of(*sets), tmp_path / "kept", init=Init(ck, "a", keep_optimizer=True), data=data)
    assert np.array_equal(kept.params, second.params)
    assert metrics(tmp_path / "kept")[0]["train_loss"] == metrics(tmp_path / "b")[1]["train_loss"]
    fresh = run(spark, cfg_of(*sets), tmp_path / "fresh", init=Init(ck, "a"), data=data)
    assert not np.array_equal(fresh.params, second.params)


def test_a_resume_onto_other_blas_threads_says_its_numbers_may_differ(tmp_path):
    """Executors' BLAS threads are part of a round's arithmetic (``spark.task.cpus`` 1 and 2 end a PTB round in
    other parameters): run.json records each partition's, and a resume onto others says so. The threads come from
    ``$PYSPARK_SUBMIT_ARGS`` here, whose ``spark.executorEnv`` the session overwrote with ``spark.task.cpus``."""
    out = str(tmp_path / "run")

    def train(threads, *more):
        env = dict(os.environ, PYTHONPATH=ROOT,
                   PYSPARK_SUBMIT_ARGS=f"--conf spark.executorEnv.OPENBLAS_NUM_THREADS={threads} pyspark-shell")
        r = subprocess.run([sys.executable, "jobs/train.py", "--config", os.path.join(ROOT, "conf", "demo.toml"),
                            "--out", out, "--samples", "0", "--set", "train.eval_every=0", *more],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(os.path.join(out, runinfo.NAME)) as f:
            return r.stdout, sorted(d["arithmetic"] for d in json.load(f)["devices"].values())

    said, arithmetic = train(1, "--set", "train.rounds=1")
    assert "note:" not in said and len(arithmetic) == 2 and arithmetic[0] == arithmetic[1], said
    assert arithmetic[0].startswith("openblas ") and " x1, numpy " in arithmetic[0], arithmetic
    said, again = train(2, "--resume", "--set", "train.rounds=2")
    assert again == [a.replace(" x1, ", " x2, ") for a in arithmetic], again
    assert (f"note: this run resumes on other arithmetic than it last ran on (partition 0: {again[0]}, was x1; "
            "1 more partition): its numbers from here may differ") in said, said


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resume_onto_a_corpus_that_changed_is_refused_and_onto_the_same_text_goes_on(spark, tmp_path, capsys, mode):
    """The configuration names the corpus, but its file can change between a run and its resume (text appended):
    the resume trained on, silently, with epochs and numbers no uninterrupted run has. run.json records the
    tokens' digest; a resume that reads others is refused in one line, its files left as they were. So is one
    whose held-out text changed (its scores pick the best checkpoint and step a plateau schedule)."""
    text, held = tmp_path / "text.txt", tmp_path / "held.txt"
    shutil.copy(HARBOUR, text)
    shutil.copy(HARBOUR_VALID, held)
    sets = (f"data.train={text}", f"data.test={held}", f"train.mode={mode}", "data.partitions=1")
    out = tmp_path / "run"
    assert train(out, *sets, "train.rounds=2") == 0
    saved = {p: (out / p).read_bytes() for p in ("run.json", "metrics.jsonl")}
    corpus = json.loads(saved["run.json"])["corpus"]
    digest = corpus["digest"]
    capsys.readouterr()
    with open(text, "a") as f:
        f.write(open(HARBOUR_VALID).read()[:3000])
    rc = train(out, *sets, "train.rounds=4", resume=True)
    err = one_error(capsys, rc, "cannot resume: data.train reads other text than this run trained on (6,092 tokens "
                                f"then, 6,799 now; their digests {digest} and ")
    assert err.endswith(f"give it its text back, or start a new run from these weights with --init-from "
                        f"{out}/checkpoint\n"), err
    assert {p: (out / p).read_bytes() for p in saved} == saved
    shutil.copy(HARBOUR, text)
    held.write_text(held.read_text().replace(" the ", " thy ", 1))     # one letter other, the count the same
    rc = train(out, *sets, "train.rounds=4", resume=True)
    n = corpus["test"]["tokens"]
    one_error(capsys, rc, f"cannot resume: data.test reads other text than this run was scored on ({n:,} tokens "
                          f"then, {n:,} now; their digests {corpus['test']['digest']} and ")
    assert {p: (out / p).read_bytes() for p in saved} == saved
    shutil.copy(HARBOUR_VALID, held)
    assert train(out, *sets, "train.rounds=4", resume=True) == 0
    assert json.loads((out / "run.json").read_text())["corpus"] == corpus == {
        "tokens": 6092, "digest": digest, "balance": "tokens",
        "test": {"tokens": n, "digest": corpus["test"]["digest"]}}
