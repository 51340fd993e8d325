"""The run directory both drivers write, without Spark (a LocalFS): the Spark tests run it end to end."""
import json
import os
import re
import types

import pytest

from rnnlm import config
from rnnlm.core import checkpoint as ckpt
from rnnlm.core.files import LocalFS
from rnnlm.core.model import RNNLM
from rnnlm.core.vocab import Vocab
from rnnlm.spark.rundir import (ASYNC_RESUME_KEYS, RESUME_KEYS, Init, RunDir, TrainingError, arithmetic_notes,
                                best_record, check_init, check_longer, check_resume, devices_line, resume_keys)
from rnnlm.core.schedule import improves


def test_an_async_resume_also_refuses_another_push_size_or_server_rule():
    cfg = config.load(None, ["train.mode=async", "train.push_every=3"])
    for section, key, value in (("train", "push_every", 4), ("server", "update", "adagrad"),
                                ("server", "staleness", "divide")):
        saved = config.replace(cfg, section, **{key: value})
        check_resume(cfg, saved, "ck")          # the same experiment to a synchronous run: it has no pushes
        mine, theirs = getattr(getattr(cfg, section), key), value
        with pytest.raises(TrainingError) as e:
            check_resume(cfg, saved, "ck", ASYNC_RESUME_KEYS)
        assert str(e.value) == f"cannot resume: {section}.{key} is {mine!r} here but {theirs!r} in ck"
    # the vocabulary's size is the corpus', never the configuration's choice
    check_resume(cfg, config.replace(cfg, "model", vocab_size=7), "ck", ASYNC_RESUME_KEYS)


def test_lines_checkpoints_and_a_resume_in_a_local_run_directory(tmp_path):
    logs = []
    out = RunDir(f"{tmp_path}/run/", fs=LocalFS(), log=logs.append)
    out.prepare(resume=False)
    for r in (1, 2, 3):
        out.add_line({"round": r}, 3, f"line {r}")
    assert logs == ["line 1", "line 2", "line 3"]
    assert out.kept() == "no checkpoint was written yet"
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4"]), "model", vocab_size=len(vocab))
    position = {"round": 2, "tokens": 80, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.5}   # what a resume reads
    ck = ckpt.Checkpoint(params=RNNLM(cfg.model).init_params(1), config=cfg, vocab=vocab, position=position)
    out.write_checkpoint(ck, best=False)
    assert not (tmp_path / "run" / "best").exists()
    out.write_checkpoint(ck, best=True)
    assert ckpt.load(str(tmp_path / "run" / "best")).position == position
    assert out.kept() == f"the last good checkpoint is kept in {tmp_path}/run/checkpoint"

    again = RunDir(str(tmp_path / "run"), fs=LocalFS(), log=logs.append)
    with pytest.raises(TrainingError, match=f"^{re.escape(str(tmp_path))}/run already holds a run "):
        again.prepare(resume=False)
    # a folder holding what a run writes, but no run: checkpoint/ and best/ were replaced whole, run.json too
    for names in (["checkpoint"], ["best"], ["run.json"], ["checkpoint", "best", "run.json"]):
        mine = tmp_path / f"mine-{len(names)}-{names[0]}"
        mine.mkdir()
        for name in names:
            if name == "run.json":
                (mine / name).write_text('{"mine": 1}')
            else:
                (mine / name).mkdir()
                (mine / name / "photo.jpg").write_bytes(b"keep")
        with pytest.raises(TrainingError) as e:
            RunDir(str(mine), fs=LocalFS()).prepare(resume=False)
        them = "them" if len(names) > 1 else "it"
        assert str(e.value) == (f"{mine} holds {', '.join(names)} but no run to resume: this run would replace "
                                f"{them} (--overwrite to replace {them}, or another --out)")
    for other in ({"config": {"mine": 1}}, {"started": "yesterday"}):      # half a run's record: another's file
        (mine / "run.json").write_text(json.dumps(other))
        with pytest.raises(TrainingError, match="holds checkpoint, best, run.json but no run to resume"):
            RunDir(str(mine), fs=LocalFS()).prepare(resume=False)
    # a run's own record alone: one that stopped before its first round ended, started again as before
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "run.json").write_text(json.dumps({"config": cfg.to_dict(), "started": "2026-11-28T00:00:00+00:00"}))
    RunDir(str(stopped), fs=LocalFS()).prepare(resume=False)
    RunDir(str(tmp_path / "mine-1-checkpoint"), fs=LocalFS()).prepare(resume=False, overwrite=True)   # as asked
    again.prepare(resume=True)
    assert again.read_checkpoint(cfg).position == position
    assert again.saved_lines() == [{"round": 1}, {"round": 2}, {"round": 3}]
    again.keep_lines(again.saved_lines()[:2])         # round 3 runs again
    assert again.nothing_to_do(2, 2) == {"round": 2}
    # the file is rewritten with the resumed run's first line: a resume that stops before it drops nothing
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"round": 1}\n{"round": 2}\n{"round": 3}\n'
    assert logs[-1] == (f"nothing to do: {tmp_path}/run is at round 2 of 2 (raise train.rounds or train.epochs "
                        "to train on)")
    again.add_line({"round": 3, "again": True}, 3, "line 3 again")
    again.add_line({"round": 4}, 4, "line 4")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ('{"round": 1}\n{"round": 2}\n'
                                                                '{"round": 3, "again": true}\n{"round": 4}\n')

    (tmp_path / "run" / "run.json").write_text("{}")
    fresh = RunDir(str(tmp_path / "run"), fs=LocalFS(), log=logs.append)
    with pytest.raises(TrainingError, match="^--overwrite starts the run in --out again; --resume continues it"):
        fresh.prepare(resume=True, overwrite=True)          # the deletion would follow the resume
    fresh.prepare(resume=False, overwrite=True)
    # nothing goes before the new run starts: one stopped while its corpus is read leaves the earlier run
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["best", "checkpoint", "metrics.jsonl", "run.json"]
    sc = types.SimpleNamespace(version="4", master="local[2]", defaultParallelism=2, applicationId="local-1",
                               appName="rnnlm")
    fresh.write_info(sc, cfg, False, {})
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.json"]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["application_id"] == "local-1"


def test_a_new_run_refuses_a_directory_holding_only_the_earlier_runs_backup_or_checkpoint(tmp_path):
    """A rewrite of metrics.jsonl cut between its renames leaves metrics.jsonl.old (a checkpoint, with no
    metrics, a run stopped between its checkpoint and its line): a new run took either directory as
    empty, replaced the checkpoint and then the backup, and the earlier run was lost without --overwrite."""
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4"]), "model", vocab_size=len(vocab))
    ck = ckpt.Checkpoint(params=RNNLM(cfg.model).init_params(1), config=cfg, vocab=vocab, position={"round": 2})
    for name in ("backup", "checkpoint"):
        out = RunDir(str(tmp_path / name), fs=LocalFS(), log=lambda s: None)
        out.prepare(resume=False)
        if name == "backup":
            (tmp_path / name).mkdir()
            (tmp_path / name / "metrics.jsonl.old").write_text('{"round": 1}\n{"round": 2}\n')
        else:
            out.write_checkpoint(ck, best=False)
        with pytest.raises(TrainingError, match=f"^{re.escape(str(tmp_path / name))} already holds a run "):
            out.prepare(resume=False)
    assert (tmp_path / "backup" / "metrics.jsonl").read_text() == '{"round": 1}\n{"round": 2}\n'   # restored


def test_the_last_line_said_of_a_run_already_at_its_length_is_its_checkpoints_rounds(tmp_path):
    """A metrics file that ends before the checkpoint's round: "done" said round 80's line of a run at 100."""
    out = RunDir(str(tmp_path), fs=LocalFS(), log=lambda s: None)
    out.keep_lines([{"round": 79, "train_loss": 3.0}, {"round": 80, "train_loss": 2.9}])
    assert out.nothing_to_do(100, 100) == {"round": 100}
    assert out.nothing_to_do(80, 80) == {"round": 80, "train_loss": 2.9}


@pytest.mark.parametrize("lines, key, taken", [
    ('{"round": 1}\n{"round": 2}\n{"rou', "round", [{"round": 1}, {"round": 2}]),    # a crash cut the last
    ('{"round": 0, "syncs": 0}\n', "syncs", [{"round": 0, "syncs": 0}]),
    ('{"round": 1}\n5\n{"round": 3}\n', "round", 2),                # a JSON number: m["round"] was a TypeError
    ('{"round": 1}\n{"loss": 2.0}\n', "round", 2),                  # no round: a KeyError
    ('{"round": "1"}\n', "round", 1),                               # a string: "1" <= 2 was a TypeError
    ('{"round": -1}\n', "round", 1),
    ('{"round": true}\n', "round", 1),
    ('{"round": 1}\n{"round": 2}\n', "syncs", 1),                   # an async resume reads syncs
    ('{"round": 1}\n{"rou\n{"round": 3}\n', "round", 2),           # only the last line may be cut short:
])                                                                  # json_lines dropped round 3 on resume
def test_saved_metrics_lines_are_metrics_lines_or_one_line_error(tmp_path, lines, key, taken):
    """What a resume reads back from metrics.jsonl: tables with the integer counts it filters on. A
    line of anything else was a traceback in the resume (or, before Spark, in the plateau check); a
    cut line before the last silently dropped every line after it when the resume rewrote the file."""
    (tmp_path / "metrics.jsonl").write_text(lines)
    run = RunDir(str(tmp_path), fs=LocalFS())
    keys = ("round", "syncs") if key == "syncs" else ("round",)
    if isinstance(taken, list):
        assert run.saved_lines(keys) == taken
        return
    with pytest.raises(TrainingError) as e:
        run.saved_lines(keys)
    assert str(e.value) == (f"{tmp_path}/metrics.jsonl: line {taken} is not a metrics line (a JSON table with "
                            f"integers {' and '.join(keys)} >= 0): mend or remove it, or start again with "
                            "--overwrite"), str(e.value)


def test_a_metrics_file_too_large_or_not_a_file_is_refused_before_it_is_read(tmp_path):
    """A resume read metrics.jsonl whole: a 20 GB one (or /dev/zero linked there) was a MemoryError
    traceback, an OOM kill or a hang before Spark started."""
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "metrics.jsonl", "wb") as f:
        f.truncate((256 << 20) + 1)                                  # sparse: nothing written
    with pytest.raises(TrainingError) as e:
        RunDir(str(big), fs=LocalFS()).saved_lines()
    assert str(e.value) == (f"{big}/metrics.jsonl: 268,435,457 bytes, more than the 256 MiB it is read up to: "
                            "not a run's metrics to resume")
    zero = tmp_path / "zero"
    zero.mkdir()
    os.symlink("/dev/zero", zero / "metrics.jsonl")
    with pytest.raises(TrainingError, match=r"metrics.jsonl is not a regular file: not a run's metrics to resume$"):
        RunDir(str(zero), fs=LocalFS()).saved_lines()


def test_resume_keys_add_what_changes_the_numbers_in_each_mode():
    sync = config.load(None, [])
    assert resume_keys(sync) == RESUME_KEYS
    assert "server" not in resume_keys(config.replace(sync, "server", update="adagrad"))
    plateau = config.replace(sync, "optim", schedule="plateau")
    assert resume_keys(plateau)["train"] == RESUME_KEYS["train"] + ("eval_every",)
    check_resume(sync, config.replace(sync, "train", eval_every=7), "ck", resume_keys(sync))     # when, not what
    with pytest.raises(TrainingError, match="train.eval_every"):
        check_resume(plateau, config.replace(plateau, "train", eval_every=7), "ck", resume_keys(plateau))
    run = config.load(None, ["train.mode=async"])
    assert resume_keys(run) == ASYNC_RESUME_KEYS
    check_resume(run, config.replace(run, "server", lr=0.5), "ck", resume_keys(run))            # "add" has no rate
    adagrad = config.replace(run, "server", update="adagrad")
    assert resume_keys(adagrad)["server"] == ASYNC_RESUME_KEYS["server"] + ("lr", "eps")
    with pytest.raises(TrainingError, match="server.eps"):
        check_resume(adagrad, config.replace(adagrad, "server", eps=1e-3), "ck", resume_keys(adagrad))
    assert ASYNC_RESUME_KEYS["server"] == ("update", "staleness", "lock")           # the tables were not changed


def _every(every):
    return config.replace(config.load(None, []), "train", eval_every=every)


@pytest.mark.parametrize("cfg, at, rounds, lines, best, refused", [
    (_every(5), 7, 10, [{"round": 7, "valid_loss": 4.0}], None, True),       # stepped off the cadence at its end
    (_every(0), 7, 10, [{"round": 7, "valid_loss": 4.0}], None, True),       # evaluating only at the end
    (_every(5), 7, 10, [{"round": 7}], {"round": 7, "valid_loss": 4.0}, True),   # its checkpoint says so
    (_every(5), 7, 7, [{"round": 7, "valid_loss": 4.0}], None, False),       # not longer
    (_every(5), 7, 6, [{"round": 7, "valid_loss": 4.0}], None, False),
    (_every(5), 10, 12, [{"round": 10, "valid_loss": 4.0}], None, False),    # on the cadence: the longer run too
    (_every(4), 2, 12, [{"round": 2, "valid_loss": 4.0}], None, True),       # 2 // 4 == 0, 2 % 4 != 0
    (_every(5), 7, 10, [{"round": 7}], {"round": 5, "valid_loss": 4.0}, False),   # stopped by a signal
    (_every(5), 7, 10, [{"round": 5, "valid_loss": 4.0}, {"round": 7}, {"round": 8, "valid_loss": 3.0}], None,
     False),                                                                   # other rounds' evaluations
])
def test_check_longer_refuses_only_a_plateau_that_stepped_on_the_last_evaluation(cfg, at, rounds, lines, best, refused):
    plateau = config.replace(cfg, "optim", schedule="plateau")
    check_longer(config.replace(cfg, "optim", schedule="epoch_decay"), at, rounds, lines, best, "ck")
    if not refused:
        check_longer(plateau, at, rounds, lines, best, "ck")
        return
    with pytest.raises(TrainingError) as e:
        check_longer(plateau, at, rounds, lines, best, "ck")
    cadence = f"every {cfg.train.eval_every} rounds" if cfg.train.eval_every else "only at the end"
    assert f"ended the run at round {at} in ck, which a run of {rounds} rounds, evaluating {cadence}" in str(e.value)


def test_check_init_compares_the_shape_and_with_the_optimizer_what_its_state_means():
    lstm = config.load(None, [])
    check_init(lstm, config.replace(lstm, "model", context=9), "ck")          # an RNN reads no context
    with pytest.raises(TrainingError, match="model.hidden"):
        check_init(lstm, config.replace(lstm, "model", hidden=9), "ck")
    ffnn = config.replace(lstm, "model", cell="ffnn", embed=8)
    with pytest.raises(TrainingError, match="model.context"):
        check_init(ffnn, config.replace(ffnn, "model", context=9), "ck")
    moved = {"train": {"mode": "async"}, "data": {"partitions": 3}, "server": {"update": "adagrad"}}
    for sec, change in moved.items():
        check_init(lstm, config.replace(lstm, sec, **change), "ck")          # fresh optimizer state: any
    check_init(lstm, config.replace(lstm, "data", partitions=3), "ck", keep_optimizer=True)   # averaged: one
    with pytest.raises(TrainingError, match="^--keep-optimizer: train.mode is 'sync' here but 'async' in ck"):
        check_init(lstm, config.replace(lstm, "train", mode="async"), "ck", keep_optimizer=True)
    local = config.replace(lstm, "train", optim_state="local")                # one state per partition
    with pytest.raises(TrainingError, match="data.partitions"):
        check_init(local, config.replace(local, "data", partitions=3), "ck", keep_optimizer=True)
    run = config.load(None, ["train.mode=async"])
    check_init(lstm, config.replace(lstm, "server", update="adagrad"), "ck", keep_optimizer=True)  # sync: no server
    with pytest.raises(TrainingError, match="server.update"):
        check_init(run, config.replace(run, "server", update="adagrad"), "ck", keep_optimizer=True)


def test_init_keeps_a_fresh_optimizer_unless_told():
    vocab = Vocab.build("abc", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4"]), "model", vocab_size=len(vocab))
    ck = ckpt.Checkpoint(params=RNNLM(cfg.model).init_params(1), config=cfg, vocab=vocab, position={"round": 4})
    assert Init(ck, "p").record() == {"path": "p", "round": 4, "optimizer": "fresh"}
    assert Init(ck, "p", keep_optimizer=True).line().endswith("optimizer state kept)")
    with pytest.raises(AttributeError):
        Init(ck, "p").path = "q"                                              # frozen


def test_best_record_and_improves():
    assert best_record({"round": 3, "valid_loss": 4}) == {"round": 3, "valid_loss": 4.0}
    for bad in (None, [], {"round": 3}, {"valid_loss": 4.0}, {"round": True, "valid_loss": 4.0},
                {"round": 3, "valid_loss": "4"}, {"round": 3, "valid_loss": 10 ** 400},
                {"round": 3, "valid_loss": float("nan")}, {"round": 3, "valid_loss": -float("inf")}):
        assert best_record(bad) is None             # a huge integer: OverflowError; NaN: no loss beat it again
    assert improves(None, 9.0) and improves({"valid_loss": 4.0}, 3.5)
    assert not improves({"valid_loss": 4.0}, 4.0) and not improves({"valid_loss": 4.0}, 4.5)


def test_devices_line_says_where_partitions_ran():
    cpu = {0: {"ran": "cpu", "assigned": []}, 1: {"ran": "cpu", "assigned": []}}
    assert devices_line(cpu, "cpu") == ""
    assert devices_line(cpu, "auto") == "devices: cpu x 2 (no CUDA device: auto runs on the CPU)"
    given = {1: {"ran": "gpu 1", "assigned": ["1"]}, 0: {"ran": "gpu 0", "assigned": ["0"]},
             2: {"ran": "cpu", "assigned": ["10"]}}
    assert devices_line(given, "auto") == ("devices: cpu x 1, gpu 0 x 1, gpu 1 x 1 "
                                           "(Spark assigned gpu 0, 1, 10; no CUDA device: auto runs on the CPU)")
    assert devices_line(given, "cpu") == "devices: cpu x 1, gpu 0 x 1, gpu 1 x 1 (Spark assigned gpu 0, 1, 10)"
    assert devices_line({0: {"ran": "gpu 0", "assigned": []}}, "gpu") == "devices: gpu 0 x 1"


ONE = "openblas 0.3.31 Haswell x1, numpy 2.4.6 X86_V4"


def test_arithmetic_notes_say_partitions_that_compute_differently_and_a_resume_onto_other_arithmetic():
    """A round's bits rest on each executor's BLAS, its kernels and threads: ``spark.task.cpus`` 1 and 2 end the
    same PTB round in other parameters (``docs/cluster.md``)."""
    same = {0: {"ran": "cpu", "assigned": [], "arithmetic": ONE}, 1: {"ran": "cpu", "assigned": [], "arithmetic": ONE}}
    record = {"0": same[0], "1": same[1]}                       # run.json's devices, its keys strings
    assert arithmetic_notes(same) == [] and arithmetic_notes(same, record) == []
    two = {p: dict(d, arithmetic="openblas 0.3.31 Haswell x2, numpy 2.4.6 X86_V4") for p, d in same.items()}
    assert arithmetic_notes(two, record) == [
        "note: this run resumes on other arithmetic than it last ran on (partition 0: openblas 0.3.31 Haswell x2, "
        "numpy 2.4.6 X86_V4, was x1; 1 more partition): its numbers from here may differ from an uninterrupted "
        "run's (the same spark.task.cpus and kind of executor as before reproduce them)"]
    gpu = {0: dict(same[0], arithmetic="NVIDIA H100 cuda 13000 cupy 14.2.0"), 1: same[1]}
    mixed = arithmetic_notes(gpu, record)
    assert mixed[0] == ("note: the partitions compute with different arithmetic (NVIDIA H100 cuda 13000 cupy 14.2.0 "
                        "on 1; openblas 0.3.31 Haswell x1, numpy 2.4.6 X86_V4 on 1): a task Spark runs again on an "
                        "executor of another kind computes other numbers than its first try (executors of one kind "
                        "reproduce a run: "
                        "spark.executorEnv.OPENBLAS_CORETYPE and NPY_DISABLE_CPU_FEATURES can make them one)")
    assert mixed[1].startswith("note: this run resumes on other arithmetic than it last ran on (partition 0: "
                               "NVIDIA H100 cuda 13000 cupy 14.2.0, was openblas 0.3.31 Haswell x1, numpy 2.4.6 "
                               "X86_V4): ")
    # what an older or damaged run.json holds is no evidence either way
    for before in (None, [], "x", {"0": "cpu"}, {"0": {"ran": "cpu"}}, {"0": {"arithmetic": 1}}, {"7": same[0]}):
        assert arithmetic_notes(two, before) == []
    # a partition whose probe failed has no arithmetic
    assert arithmetic_notes({0: {"ran": None, "assigned": []}, 1: same[1]}, record) == []


def test_a_checkpoint_without_a_runs_position_is_not_resumed_and_the_quiet_lines(tmp_path):
    logs = []
    out = RunDir(str(tmp_path / "run"), fs=LocalFS(), log=logs.append)
    out.prepare(resume=False)
    vocab = Vocab.build("abc", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4"]), "model", vocab_size=len(vocab))
    out.write_checkpoint(ckpt.Checkpoint(params=RNNLM(cfg.model).init_params(1), config=cfg, vocab=vocab,
                                         position={"round": 2}), best=False)     # a one-machine run's
    with pytest.raises(ckpt.CheckpointError, match="position has no tokens: not a checkpoint a sync run can resume"):
        out.read_checkpoint(cfg)
    assert out.nothing_to_do(2, 2) == {"round": 2}                               # no lines read back
    out.keep_lines([{"round": 1}, {"round": 2}, {"round": 3}])
    assert out.nothing_to_do(3, 3) == {"round": 3}                               # the last line
    out.say_evaluating("valid", 12345)
    out.say_evaluating("test", None)
    assert logs[-2:] == ["evaluating valid (12,345 tokens)...", "evaluating test..."]


def test_a_crash_between_a_best_rounds_two_writes_leaves_best_ahead_not_behind(tmp_path, monkeypatch):
    """checkpoint/ first would leave best/ behind the checkpoint whose best record names it: a resume
    then never writes it again (its rounds are past)."""
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4"]), "model", vocab_size=len(vocab))
    params = RNNLM(cfg.model).init_params(1)
    run = RunDir(str(tmp_path / "run"), fs=LocalFS())
    at = lambda r: ckpt.Checkpoint(params=params, config=cfg, vocab=vocab, position={"round": r})   # noqa: E731
    run.write_checkpoint(at(3), best=True)
    real, writes = run.fs.write_dir_atomic, []

    def dies_on_the_second(d, files):
        writes.append(d)
        if len(writes) == 2:
            raise KeyboardInterrupt            # killed
        real(d, files)
    monkeypatch.setattr(run.fs, "write_dir_atomic", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        run.write_checkpoint(at(9), best=True)
    assert ckpt.load(str(tmp_path / "run" / "best")).position["round"] == 9
    assert ckpt.load(str(tmp_path / "run" / "checkpoint")).position["round"] == 3


def test_a_resumes_first_checkpoint_drops_the_lines_past_the_one_it_resumed_from_first(tmp_path, monkeypatch):
    """The lines past the resumed checkpoint went only with the resumed run's first line, written after its
    first checkpoint: a death between the two left them beside the new checkpoint, and the next resume kept
    those at or below its round, lines of work the run had thrown away (an async run's review)."""
    cfg, ck, out = saved(tmp_path / "run", (1, 2, 3, 4))
    again = RunDir(str(tmp_path / "run"), fs=LocalFS(), log=lambda _: None)
    again.prepare(resume=True)
    again.keep_lines(again.saved_lines()[:2])                # resumed from round 2: rounds 3 and 4 run again
    ck.position["round"] = 3

    def dies(*_):
        raise KeyboardInterrupt                              # killed before the line
    again.write_checkpoint(ck, best=False)
    monkeypatch.setattr(again.fs, "append", dies)
    with pytest.raises(KeyboardInterrupt):
        again.add_line({"round": 3, "again": True}, 4, "line 3 again")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"round": 1}\n{"round": 2}\n'


def test_best_saved_is_the_record_best_holds(tmp_path):
    cfg, ck, out = saved(tmp_path / "run", (1, 2))
    assert out.best_saved() is None                          # no best/
    ck.position["best"] = {"round": 2, "valid_loss": 1.5}
    out.write_checkpoint(ck, best=True)
    assert out.best_saved() == {"round": 2, "valid_loss": 1.5}
    (tmp_path / "run" / "best" / "params.npy").write_bytes(b"cut")     # unreadable: as if none
    assert out.best_saved() is None


def saved(path, rounds: tuple, best: bool = False) -> tuple:
    """A run directory holding a line per round of ``rounds`` and a checkpoint at the last:
    ``(configuration, checkpoint, RunDir)``."""
    vocab = Vocab.build("abracadabra", "char")
    cfg = config.replace(config.load(None, ["model.hidden=4"]), "model", vocab_size=len(vocab))
    position = {"round": rounds[-1], "tokens": 80, "bytes_sent": 0, "bytes_broadcast": 0, "wall_s": 1.5}
    ck = ckpt.Checkpoint(params=RNNLM(cfg.model).init_params(1), config=cfg, vocab=vocab, position=position)
    out = RunDir(str(path), fs=LocalFS(), log=lambda _: None)
    out.prepare(resume=False)
    for r in rounds:
        out.add_line({"round": r}, rounds[-1], f"line {r}")
    out.write_checkpoint(ck, best=best)
    return cfg, ck, out


def test_an_overwrite_cut_midway_leaves_no_earlier_checkpoint_to_resume_without_its_lines(tmp_path, monkeypatch):
    """--overwrite deleted metrics.jsonl first: killed after that, the earlier run's checkpoint was left, a plain
    start said to --resume it, and the resume went on with the earlier run's lines gone. The checkpoint goes
    first now: what a cut leaves is refused, naming --overwrite."""
    cfg, _, _ = saved(tmp_path, rounds=(1, 2), best=True)
    again = RunDir(str(tmp_path), fs=LocalFS(), log=lambda _: None)
    again.prepare(resume=False, overwrite=True)
    deleted, real = [], LocalFS.delete

    def killed_after_one(fs, p):
        if deleted:
            raise KeyboardInterrupt
        deleted.append(os.path.basename(p))
        real(fs, p)
    monkeypatch.setattr(LocalFS, "delete", killed_after_one)
    sc = types.SimpleNamespace(version="4", master="local[2]", defaultParallelism=2, applicationId="local-1",
                               appName="rnnlm")
    with pytest.raises(KeyboardInterrupt):
        again.write_info(sc, cfg, False, {})
    monkeypatch.setattr(LocalFS, "delete", real)
    assert deleted == ["checkpoint"]
    with pytest.raises(TrainingError, match="holds metrics but no checkpoint .*: start it again with --overwrite"):
        RunDir(str(tmp_path), fs=LocalFS()).prepare(resume=True)


def test_a_checkpoint_cut_between_its_two_renames_is_moved_back_and_resumed(tmp_path):
    """Killed between a save's two renames, the last good checkpoint lies as checkpoint.old: the run's start
    moves it back, and --resume reads it (no test ran this: without the move, --resume said to --overwrite)."""
    cfg, ck, _ = saved(tmp_path, rounds=(2,))
    os.rename(tmp_path / "checkpoint", tmp_path / "checkpoint.old")
    again = RunDir(str(tmp_path), fs=LocalFS(), log=lambda _: None)
    again.prepare(resume=True)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "metrics.jsonl"]
    assert again.read_checkpoint(cfg).position == ck.position


def test_a_full_disk_is_one_line_naming_the_file_and_what_is_kept(tmp_path, monkeypatch):
    """ENOSPC while a checkpoint or a metrics line was written was a traceback (an OSError the command line did
    not expect); the files already written are as they were."""
    import errno
    from rnnlm.core import files
    _, ck, out = saved(tmp_path, rounds=(1,))
    real = files._local_write

    def full(q, data, mode):
        real(q, data[:5], mode)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files, "_local_write", full)
    kept = f"the last good checkpoint is kept in {tmp_path}/checkpoint"
    with pytest.raises(TrainingError) as e:
        out.write_checkpoint(ck, best=True)
    assert str(e.value) == f"cannot write {tmp_path}/best: No space left on device; {kept}"
    with pytest.raises(TrainingError) as e:
        out.add_line({"round": 2}, 2, "line 2")
    assert str(e.value) == f"cannot write {tmp_path}/metrics.jsonl: No space left on device; {kept}"
    monkeypatch.setattr(files, "_local_write", real)
    assert ckpt.load(str(tmp_path)).position == ck.position
    assert RunDir(str(tmp_path), fs=LocalFS()).saved_lines() == [{"round": 1}]         # the cut line dropped
