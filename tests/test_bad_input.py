"""Bad input: one clear line on stderr, exit code 2, nothing already written lost."""
import argparse
import gzip
import os

import pytest

from rnnlm import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.hidden=8", "train.bptt=8", "train.batch=2", "train.rounds=1", "data.partitions=2"]


def train(out, *sets, config="conf/demo.toml", resume=False):
    a = argparse.Namespace(config=os.path.join(ROOT, config), set=list(TINY) + list(sets), out=str(out),
                           resume=resume, master=None, samples=0)
    return cli.guarded(lambda: cli.train(a))


def one_error(capsys, rc, *needles):
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    for n in needles:
        assert n in err, err
    return err


def demo(*extra):
    return [f"data.train={os.path.join(ROOT, 'rnnlm/data/harbour.txt')}", "data.valid=", *extra]


def test_missing_path(spark, tmp_path, capsys):
    one_error(capsys, train(tmp_path / "o", *demo(f"data.train={tmp_path}/nope.txt")), "does not exist", "nope.txt")
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


def test_empty_corpus(spark, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    one_error(capsys, train(tmp_path / "o", *demo(f"data.train={tmp_path}/empty.txt")), "corpus is empty")


def test_corpus_shorter_than_one_window(spark, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("tiny\n\nbits\n")
    for strategy in ("windows", "streams"):
        err = one_error(capsys, train(tmp_path / "o", *demo(f"data.train={tmp_path}/short.txt",
                                                            f"data.strategy={strategy}")))
        assert "fewer than" in err and "partition" in err


def test_undecodable_bytes_replace_or_fail(spark, tmp_path, capsys):
    raw = ("good words here and there. " * 40 + "\n\n").encode()
    (tmp_path / "bad.txt").write_bytes(raw + b"caf\xe9 \xff\xfe broken\n\n" + raw)
    one_error(capsys, train(tmp_path / "o1", *demo(f"data.train={tmp_path}/bad.txt", "data.encoding_errors=strict")),
              "undecodable bytes")
    assert train(tmp_path / "o2", *demo(f"data.train={tmp_path}/bad.txt")) == 0   # replaced with U+FFFD
    capsys.readouterr()


def test_gzip_corpus_is_read(spark, tmp_path, capsys):
    text = open(os.path.join(ROOT, "rnnlm/data/harbour.txt"), "rb").read()
    with gzip.open(tmp_path / "h.txt.gz", "wb") as f:
        f.write(text)
    assert train(tmp_path / "o", *demo(f"data.train={tmp_path}/h.txt.gz")) == 0
    assert "vocab 4" in capsys.readouterr().out          # the same ~45 characters as the plain text


@pytest.mark.parametrize("sets,needle", [
    (["model.hiden=3"], "unknown config key model.hiden"),
    (["train.rounds=two"], "train.rounds = 'two': expected int"),
    (["data.strategy=random"], "expected one of streams"),
])
def test_config_errors(spark, tmp_path, capsys, sets, needle):
    one_error(capsys, train(tmp_path / "o", *sets), needle)


def test_existing_run_is_not_overwritten_and_bad_resume_is_refused(spark, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, *demo()) == 0
    capsys.readouterr()
    before = {f: open(out / "checkpoint" / f, "rb").read() for f in os.listdir(out / "checkpoint")}
    metrics = open(out / "metrics.jsonl").read()
    one_error(capsys, train(out, *demo()), "already holds a run")
    one_error(capsys, train(out, *demo("model.hidden=12"), resume=True), "cannot resume: model.hidden")
    one_error(capsys, train(tmp_path / "fresh", *demo(), resume=True), "no checkpoint")
    after = {f: open(out / "checkpoint" / f, "rb").read() for f in os.listdir(out / "checkpoint")}
    assert after == before and open(out / "metrics.jsonl").read() == metrics
