"""Bad input: one clear line on stderr, exit code 2, nothing already written lost."""
import argparse
import gzip
import json
import os
import re

import numpy as np
import pytest

from rnnlm.core import backend, checkpoint
from rnnlm import cli, config
from rnnlm.core.model import RNNLM

from conftest import HARBOUR, HARBOUR_VALID, ROOT, metrics

# smaller than conftest.TINY: test_evaluate_overflowing_perplexity_is_not_a_traceback needs a model this small
SMALL_RUN = ["model.hidden=8", "train.bptt=8", "train.batch=2", "train.rounds=1", "data.partitions=2"]


def train(out, *sets, config="conf/demo.toml", resume=False, overwrite=False):
    a = argparse.Namespace(config=os.path.join(ROOT, config), set=list(SMALL_RUN) + list(sets), out=str(out),
                           resume=resume, overwrite=overwrite, master=None, samples=0, dry_run=False, verbose=False)
    return cli.guarded(lambda: cli.train(a))


def one_error(capsys, rc, *needles):
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    for n in needles:
        assert n in err, err
    return err


def demo(*extra):
    return [f"data.train={HARBOUR}", "data.valid=", *extra]


def test_missing_path(spark, tmp_path, capsys):
    one_error(capsys, train(tmp_path / "o", *demo(f"data.train={tmp_path}/nope.txt")), "does not exist", "nope.txt")
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


def test_empty_corpus(spark, tmp_path, capsys):
    """Named: an empty validation text said "the corpus is empty", which reads as the training text."""
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    for key in ("train", "valid"):
        one_error(capsys, train(tmp_path / key, *demo(f"data.{key}={tmp_path}/empty.txt")),
                  f"{tmp_path}/empty.txt is empty")


def test_corpus_shorter_than_one_window(spark, tmp_path, capsys):
    # 2 paragraphs, one per partition (not fewer than data.partitions): partition 0 holds "tiny\n\n"
    (tmp_path / "short.txt").write_text("tiny\n\nbits\n")
    for strategy, short in (("windows", "one window of 9"), ("streams", "2 streams of 9")):
        err = one_error(capsys, train(tmp_path / "o", *demo(f"data.train={tmp_path}/short.txt",
                                                            f"data.strategy={strategy}")))
        assert err == (f"error: {tmp_path}/short.txt: partition 0: partition has 6 tokens, fewer than {short} "
                       f"(strategy {strategy}, bptt 8, batch 2)")


def test_a_corpus_of_fewer_paragraphs_than_partitions_says_so(spark, tmp_path, capsys):
    (tmp_path / "one.txt").write_text("just one paragraph\nof two lines\n" * 20)
    err = one_error(capsys, train(tmp_path / "o", *demo(f"data.train={tmp_path}/one.txt")))
    assert err == (f"error: {tmp_path}/one.txt: 1 paragraph, fewer than data.partitions = 2 (data.paragraphs = "
                   "\"line\" splits at every line)")


def test_undecodable_bytes_replace_or_fail(spark, tmp_path, capsys):
    raw = ("good words here and there. " * 40 + "\n\n").encode()
    (tmp_path / "bad.txt").write_bytes(raw + b"caf\xe9 \xff\xfe broken\n\n" + raw)
    why = ("undecodable bytes (data.encoding_errors = 'strict'; Hadoop reads them as U+FFFD, so a text holding "
           "that character itself reads so too: 'replace' takes it)")
    err = one_error(capsys, train(tmp_path / "o1", *demo(f"data.train={tmp_path}/bad.txt",
                                                         "data.encoding_errors=strict")))
    assert err == f"error: data.train: {tmp_path}/bad.txt: 1 paragraph holds {why}"
    err = one_error(capsys, train(tmp_path / "o3", *demo(f"data.valid={tmp_path}/bad.txt",
                                                         "data.encoding_errors=strict", "data.paragraphs=line")))
    assert err == f"error: data.valid: {tmp_path}/bad.txt: 1 line holds {why}"      # held-out text too
    (tmp_path / "bad.txt").write_bytes(raw + b"caf\xe9\n" + raw + b"\xff\n\n" + raw)
    err = one_error(capsys, train(tmp_path / "o4", *demo(f"data.train={tmp_path}/bad.txt",
                                                         "data.encoding_errors=strict")))
    assert err == f"error: data.train: {tmp_path}/bad.txt: 2 paragraphs hold {why}"
    assert train(tmp_path / "o2", *demo(f"data.train={tmp_path}/bad.txt")) == 0   # replaced with U+FFFD
    capsys.readouterr()


def test_gzip_corpus_is_read(spark, tmp_path, capsys):
    text = open(HARBOUR, "rb").read()
    with gzip.open(tmp_path / "h.txt.gz", "wb") as f:
        f.write(text)
    assert train(tmp_path / "o", *demo(f"data.train={tmp_path}/h.txt.gz")) == 0
    distinct = len(set(text.decode())) + 1                # every character of the text, and U+FFFD
    assert f"vocab {distinct} |" in capsys.readouterr().out


@pytest.mark.parametrize("sets,needle", [
    (["model.hiden=3"], "unknown config key model.hiden"),
    (["train.rounds=two"], "train.rounds = 'two': expected int"),
    (["data.strategy=random"], "expected one of streams"),
    (["data.vocab_size=1"], "data.vocab_size must be 0 (no cap) or > 2"),
    (["train.seed=-1"], "train.seed = -1 is out of range: a run takes train.seed in [0, 9223372036854775807]"),
    (["optim.beta1=1"], "optim.beta1 = 1.0 is out of range: a run takes optim.beta1 in [0, 1)"),
    (["train.rounds=0", "train.epochs=0"], "set train.rounds or train.epochs"),
    (["data.strategy=sampled_windows", "train.local_steps=5"], "contradicts data.strategy"),
    (["optim.schedule=plateau", "data.valid="], "set data.valid"),
    (["optim.schedule=plateau", "train.eval_every=0"], "optim.schedule = 'plateau' decays when the validation loss "
     "stops improving, which train.eval_every = 0 measures only once the run has ended: set train.eval_every"),
])
def test_config_errors(spark, tmp_path, capsys, sets, needle):
    # caught before the corpus is read: the training path does not exist
    one_error(capsys, train(tmp_path / "o", *sets, f"data.train={tmp_path}/absent.txt"), needle)


@pytest.mark.skipif(backend.gpu_available(), reason="a usable GPU is present")
def test_gpu_without_cupy_is_one_line(spark, tmp_path, capsys, monkeypatch):
    """On the executors: with a local master running them in this Python the command line refuses before
    the JVM (tests/test_continue.py); executors in another Python check for themselves."""
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/gpu-env/bin/python")      # the session's executors stay as they are
    err = one_error(capsys, train(tmp_path / "o", *demo("train.device=gpu")), "device='gpu'")
    assert "partition 0" in err


def test_one_diverging_partition_in_a_deep_tree_is_one_line(spark, tmp_path, capsys):
    # 8 partitions and depth 2: treeAggregate merges on executors before the driver (3 + 3 + 2)
    sets = (*demo(), "data.partitions=8", "train.tree_depth=2", "train.checkpoint_every=1", "model.hidden=8",
            "train.bptt=4", "train.batch=2", "train.local_steps=2", "data.paragraphs=line")
    out = tmp_path / "run"
    assert train(out, *sets) == 0
    capsys.readouterr()
    ck = checkpoint.load(str(out / "checkpoint"))
    ck.hidden[5] = np.nan                 # partition 5 carries a poisoned state into round 2; the rest are healthy
    checkpoint.save(str(out / "checkpoint"), ck)
    before = {f: (out / "checkpoint" / f).read_bytes() for f in os.listdir(out / "checkpoint")}
    err = one_error(capsys, train(out, *sets, "train.rounds=2", resume=True),
                    "round 2: partition 5: loss became nan", "last good checkpoint is kept")
    assert "partition 4" not in err
    assert {f: (out / "checkpoint" / f).read_bytes() for f in os.listdir(out / "checkpoint")} == before


def test_evaluate_overflowing_perplexity_is_not_a_traceback(spark, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, *demo()) == 0
    ck = checkpoint.load(str(out / "checkpoint"))
    views = RNNLM(ck.config.model).layout.views(ck.params)
    views["Wo"] *= 1e5                     # confidently wrong: losses in the thousands of nats
    # trained on a GPU: scored here all the same (--device auto), as it was not (train.device = "gpu")
    ck.config = config.replace(ck.config, "train", device="gpu")
    checkpoint.save(str(out / "checkpoint"), ck)
    capsys.readouterr()
    held = HARBOUR_VALID
    a = argparse.Namespace(checkpoint=str(out / "checkpoint"), data=held, streams=None, master=None, verbose=False,
                           device="auto")
    assert cli.guarded(lambda: cli.evaluate(a)) == 0
    result, last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert last == "ppl=inf"
    # named by the file scored (it was "test_loss ..." whatever the file)
    number = r"[0-9]+\.[0-9]{4}"
    assert re.fullmatch(rf"{re.escape(held)}: loss {number} \| ppl inf \| bpc {number}", result), result
    if not backend.gpu_available():
        a.device = "gpu"
        one_error(capsys, cli.guarded(lambda: cli.evaluate(a)),       # said before any task tries it
                  "--device gpu but this machine has no CuPy or no CUDA device, and the master local[2] runs every "
                  "executor here")
        a.device = "auto"
    # --streams has data.eval_streams' range (beyond it Hadoop cut the file into 1-byte splits, or py4j raised)
    for streams in (10_001, 2 ** 31):
        a = argparse.Namespace(checkpoint=str(out / "checkpoint"), data=held, streams=streams, master=None,
                               verbose=False, device="auto")
        one_error(capsys, cli.guarded(lambda: cli.evaluate(a)), f"--streams: data.eval_streams = {streams} is out of "
                  "range: a run takes data.eval_streams in [1, 10000]")
    # streams that score nothing (one token each: one-character lines at character level, split by line)
    # are an error, not "ppl=1.0000"
    from rnnlm.spark.corpus import CorpusError, evaluate_rdd
    ones = spark.sparkContext.parallelize([(pid, np.array([3], np.int32), np.array([0])) for pid in range(2)], 2)
    with pytest.raises(CorpusError, match="^the held-out text scores no token: each of its streams is shorter"):
        evaluate_rdd(spark.sparkContext, config.replace(ck.config, "train", device="cpu"), ck.params, ones)


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


def test_a_run_stopped_before_its_first_checkpoint_says_so_and_starts_again_with_overwrite(spark, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 1, "train_loss": 3.0}\n{"round": 2, "train_loss": 2.9}\n')
    (out / "run.json").write_text("{}")
    err = one_error(capsys, train(out, *demo(), resume=True), "holds metrics but no checkpoint")
    assert err.endswith("start it again with --overwrite"), err
    one_error(capsys, train(out, *demo()), "already holds a run", "--overwrite to start it again")
    assert train(out, *demo(), overwrite=True) == 0
    assert [m["round"] for m in metrics(out)] == [1]      # the old lines are gone
    assert json.loads((out / "run.json").read_text())["resumed"] == []
    assert checkpoint.load(str(out)).position["round"] == 1


def test_generate_from_an_unreadable_hadoop_path_is_one_line():
    """A non-local checkpoint path goes through Hadoop's client: its failure is one line too."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_GATEWAY_PORT", "HADOOP_CONF_DIR")}
    r = subprocess.run([sys.executable, "jobs/generate.py", "--checkpoint", "nofs://nowhere/run"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert errors == ['error: cannot read nofs://nowhere/run: org.apache.hadoop.fs.UnsupportedFileSystemException: '
                      'No FileSystem for scheme "nofs"'], r.stderr


def test_resume_with_a_hidden_state_the_configuration_does_not_carry_is_one_line(spark, tmp_path, capsys):
    """A hidden.npy of another shape ended --resume in an executor's 286-line traceback."""
    out = tmp_path / "run"
    assert train(out, *demo()) == 0
    capsys.readouterr()
    ck = checkpoint.load(str(out / "checkpoint"))
    want = list(ck.hidden.shape)
    ck.hidden = ck.hidden[..., :1]                       # the states of another batch size
    checkpoint.save(str(out / "checkpoint"), ck)
    before = {f: (out / "checkpoint" / f).read_bytes() for f in os.listdir(out / "checkpoint")}
    one_error(capsys, train(out, *demo(), "train.rounds=2", resume=True),
              f"hidden.npy is float32{want[:-1] + [1]}, the configuration needs float32{want}")
    assert {f: (out / "checkpoint" / f).read_bytes() for f in os.listdir(out / "checkpoint")} == before
    ck.hidden = np.zeros(want[1:], np.float32)           # one stream's state, as the one-machine trainer saves
    checkpoint.save(str(out / "checkpoint"), ck)
    one_error(capsys, train(out, *demo(), "train.rounds=2", resume=True),
              "holds one stream's hidden state (a one-machine run's), not one per partition")


def test_a_corpus_made_on_windows_trains_as_its_unix_copy(spark, tmp_path, capsys):
    """With CRLF line ends the corpus was one paragraph: "the corpus has 1 paragraphs, fewer than
    data.partitions=2"."""
    text = open(HARBOUR, "rb").read()
    (tmp_path / "crlf.txt").write_bytes(text.replace(b"\n", b"\r\n"))
    assert train(tmp_path / "o", *demo(f"data.train={tmp_path}/crlf.txt")) == 0
    assert f"vocab {len(set(text.decode())) + 1} |" in capsys.readouterr().out      # no \r among them


def test_a_corpus_directory_holding_a_subdirectory_is_one_line(spark, tmp_path, capsys):
    d = tmp_path / "corpus"
    (d / "2024").mkdir(parents=True)
    (d / "a.txt").write_bytes(open(HARBOUR, "rb").read())
    one_error(capsys, train(tmp_path / "o", *demo(f"data.train={d}")), f"{d}/2024 is a directory",
              f"such as {d}/*/*")
    assert not (tmp_path / "o" / "metrics.jsonl").exists()
