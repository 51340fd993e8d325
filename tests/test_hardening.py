"""Hostile input found before the JVM starts, or kept from stopping a run: one line on stderr, exit code 2.

Each case here fails without Spark (a subprocess ends in ~0.5 s), except where a Spark read is the
point, which uses the session's shared ``spark`` fixture.
"""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from rnnlm import config
from rnnlm.core import checkpoint
from rnnlm.core.models import build as build_model
from rnnlm.core.vocab import Vocab

from conftest import HARBOUR, ROOT

DEMO = os.path.join(ROOT, "conf", "demo.toml")
TINY = ["--set", f"data.train={HARBOUR}", "--set", "model.hidden=4", "--set", "train.bptt=4",
        "--set", "train.batch=2", "--set", "data.valid="]


def tiny_checkpoint(path, position, nan=False):
    """A checkpoint of the model ``TINY`` trains, at ``position``; its parameters NaN with ``nan``."""
    cfg = config.load(DEMO, TINY[1::2])
    vocab = Vocab.build(open(HARBOUR).read(), "char")
    cfg = config.replace(cfg, "model", vocab_size=len(vocab))
    params = build_model(cfg.model).init_params(1)
    if nan:
        params[::7] = np.nan
    checkpoint.save(str(path), checkpoint.Checkpoint(params=params, config=cfg, vocab=vocab, position=position))


def before_the_jvm(argv, expected):
    """``argv`` (a job file and its options) ends with exit code 2 and the one line ``expected`` starts,
    in the time an error found without Spark takes (its JVM takes 13-16 s to start)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 2, (argv, r.stderr[-2000:])
    assert r.stderr.startswith(expected) and r.stderr.count("\n") == 1, (argv, r.stderr[-2000:])
    assert took < 3.0, (argv, took)


@pytest.mark.parametrize("sets, expected", [
    (["optim.lr=1" + "0" * 400], "error: optim.lr = a number of about 401 digits is out of range: a run takes "
                                 "optim.lr in (0, 1.8e+308)\n"),
    (["model.hidden=" + "9" * 5000], "error: model.hidden: a number of 5000 characters is out of range"),
    (["model.hidden=65536", "model.layers=64"], "error: the model has "),
    (["data.train=/x\nerror: forged"], "error: --set 'data.train': the value holds a control character (U+000A); "
                                       "refused\n"),
])
def test_a_bad_setting_is_one_line_before_the_jvm(sets, expected):
    before_the_jvm(["jobs/train.py", "--config", DEMO, "--out", "/nonexistent/out",
                    *[a for s in sets for a in ("--set", s)]], expected)


def test_resuming_a_checkpoint_without_its_position_is_one_line_before_the_jvm(tmp_path):
    """``--resume`` on a state.json without ``tokens`` reached trainer._resume: KeyError after Spark started."""
    run = tmp_path / "run"
    tiny_checkpoint(run / "checkpoint", {"round": 1, "step": 40})          # what the one-machine trainer writes
    (run / "metrics.jsonl").write_text('{"round": 1}\n')
    before_the_jvm(["jobs/train.py", "--config", DEMO, "--out", str(run), "--resume", *TINY],
                   f"error: {run}/checkpoint: state.json's position has no tokens: not a checkpoint a sync run can "
                   "resume (rnnlm generate and evaluate can use it)\n")


def test_evaluating_parameters_that_are_not_finite_is_refused(tmp_path):
    """It printed ppl=inf and exited 0."""
    tiny_checkpoint(tmp_path / "ck", {"round": 1}, nan=True)
    before_the_jvm(["jobs/evaluate.py", "--checkpoint", str(tmp_path / "ck"), "--data", HARBOUR],
                   f"error: {tmp_path / 'ck'}: the parameters hold NaN or infinite values: not a model to use\n")


def test_generating_from_a_checkpoint_holding_a_link_loop_is_one_line(tmp_path):
    """A symlink loop as params.npy: OSError (Too many levels of symbolic links), exit 1."""
    tiny_checkpoint(tmp_path / "ck", {"round": 1})
    os.remove(tmp_path / "ck" / "params.npy")
    os.symlink("params.npy", tmp_path / "ck" / "params.npy")
    before_the_jvm(["jobs/generate.py", "--checkpoint", str(tmp_path / "ck")],
                   f"error: {tmp_path / 'ck'}: params.npy is a symbolic link, refused (a checkpoint holds regular "
                   "files only)\n")


@pytest.fixture
def local_dirs(tmp_path, monkeypatch):
    """An executor's ``SPARK_LOCAL_DIRS``, where rnnlm.spark.filestore keeps a partition's residuals."""
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    return tmp_path


def test_residual_files_ignore_names_they_did_not_write(local_dirs):
    """A file ``0.x.feedback.npy`` in the run's directory: ValueError: invalid literal for int() in _prune,
    and the round's job aborted."""
    from rnnlm.spark import filestore
    d = filestore.root("run1")
    os.makedirs(d)
    foreign = ["0.x.feedback.npy", "0.1.feedback.npy.bak", "notes.txt", "0.1.a.b.npy", "00.1.feedback.npy"]
    for name in foreign:
        open(os.path.join(d, name), "wb").close()
    for seq in range(1, 6):
        ref = filestore.save("run1", seq, 0, {"feedback": np.full(4, seq, np.float32)})
    assert sorted(os.listdir(d)) == sorted(foreign + [f"0.{s}.feedback.npy" for s in (3, 4, 5)])
    assert filestore.load(ref, 0)["feedback"].tolist() == [5.0] * 4


@pytest.mark.parametrize("other", [np.full(4, 9, np.float32), np.zeros(5, np.float32), np.full(4, 5, np.float64)])
def test_a_foreign_file_under_a_residual_name_is_not_used(local_dirs, other):
    """Other numbers under the name a partition wrote were read as its residual, silently."""
    from rnnlm.spark import filestore
    ref = filestore.save("run2", 1, 3, {"feedback": np.full(4, 5, np.float32)})
    path = os.path.join(filestore.root("run2"), "3.1.feedback.npy")
    with open(path + ".x", "wb") as f:
        np.save(f, other)
    os.replace(path + ".x", path)
    assert filestore.load(ref, 3) is None                 # rebuilt from its lineage by the caller instead
