"""The command-line jobs, run as a user would."""
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pyspark
import pytest

from rnnlm.core import checkpoint
from rnnlm.core.model import RNNLM

from conftest import HARBOUR, ROOT, TINY, core_nll, held_out_tokens, metrics, set_options, tensorboard_scalars

pytestmark = pytest.mark.slow          # each test runs jobs/*.py, a Spark session of its own


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"))


def run_all(*commands):
    """Commands (argument lists) side by side, as completed processes in their order: JVMs start in parallel."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for c in commands]
    outputs = [p.communicate(timeout=300) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outputs)]


def sets(*items):
    return set_options(*TINY, *items)


def test_demo_then_generate(tmp_path):
    ck = str(tmp_path / "ck")
    r = run("jobs/demo.py", "--out", ck, "--set", "train.rounds=4", "--set", "train.eval_every=2")
    assert r.returncode == 0, r.stderr
    assert "valid_loss" in r.stdout and "--- sample" in r.stdout
    g1 = run("jobs/generate.py", "--checkpoint", ck, "--prime", "The", "--length", "30", "--seed", "5")
    g2 = run("jobs/generate.py", "--checkpoint", ck, "--prime", "The", "--length", "30", "--seed", "5")
    assert g1.returncode == 0 and g1.stdout == g2.stdout and g1.stdout.startswith("The")


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    r = run("jobs/demo.py", "--set", "model.hiden=3")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "model.hiden" in r.stderr
    r = run("jobs/generate.py", "--checkpoint", str(tmp_path / "missing"))
    assert r.returncode == 2 and "checkpoint not found" in r.stderr
    (tmp_path / "plain.txt").write_text("text\n")
    r = run("jobs/generate.py", "--checkpoint", str(tmp_path / "plain.txt"))
    assert r.returncode == 2 and f"not a checkpoint: {tmp_path}/plain.txt is a file" in r.stderr, r.stderr
    r = run("jobs/demo.py", "--set", f"data.train={tmp_path / 'none.txt'}")
    assert r.returncode == 2 and "No such file" in r.stderr


def test_evaluate_needs_only_the_checkpoint_and_agrees_with_the_training_log(tmp_path):
    held = tmp_path / "held.txt"          # several paragraphs: a layout by partitions would cut it in two
    shutil.copy(HARBOUR, held)
    test = tmp_path / "test.txt"
    shutil.copy(held, test)
    r = run("jobs/train.py", "--config", "conf/demo.toml", "--out", str(tmp_path / "run"), "--samples", "0",
            *sets("train.rounds=4", "data.partitions=2", f"data.valid={held}", f"data.test={test}"),
            "--log", f"tensorboard:{tmp_path / 'tb'}")
    assert r.returncode == 0, r.stderr[-2000:]
    logged = metrics(tmp_path / "run")[-1]
    # every metrics line in TensorBoard's event file too (tests/test_trackers.py has the rest)
    assert tensorboard_scalars(tmp_path / "tb")["valid_ppl"] == [(4, pytest.approx(logged["valid_ppl"], rel=1e-6))]
    # what the training log says, from the core model alone: the last checkpoint's mean NLL of the text's tokens
    ck = checkpoint.load(str(tmp_path / "run" / "checkpoint"))
    total, count = core_nll(RNNLM(ck.config.model), ck.params, [held_out_tokens(ck.vocab, str(held))])
    assert count == 6091 and logged["valid_loss"] == pytest.approx(total / count, rel=1e-9)
    # another machine: the checkpoint alone, elsewhere; the training run's test file is gone
    shutil.copytree(tmp_path / "run" / "checkpoint", tmp_path / "moved")
    test.unlink()
    # a checkpoint, or the run directory holding it, this one through a bare spark-submit (no properties
    # file: Spark's own INFO profile, whose 44 start-up lines the job turns down to the SparkContext's first 3)
    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    *evaluated, two, one = run_all(*([*launcher, "jobs/evaluate.py", "--checkpoint", str(tmp_path / w), "--data",
                                      str(held)] for launcher, w in (([sys.executable], "moved"), ([submit], "run"))),
                                   [sys.executable, "jobs/evaluate.py", "--checkpoint", str(tmp_path / "moved"),
                                    "--data", str(held), "--streams", "2"],
                                   [sys.executable, "jobs/evaluate.py", "--checkpoint", str(tmp_path / "moved"),
                                    "--data", "rnnlm/data/harbour_valid.txt", "--streams", "3"])
    for e in evaluated:
        assert e.returncode == 0, e.stderr[-2000:]
        last = e.stdout.strip().splitlines()[-1]
        assert last.startswith("ppl=") and float(last[4:]) == round(logged["valid_ppl"], 4), (last, logged)
        scored = f"loss {logged['valid_loss']:.4f} | ppl {logged['valid_ppl']:.4f} | bpc {logged['valid_bpc']:.4f}"
        assert f"{held}: {scored}" in e.stdout, e.stdout
    assert len([x for x in (e.stdout + e.stderr).splitlines() if " INFO " in x]) <= 3, e.stderr   # spark-submit's
    assert two.returncode == 0 and two.stdout.strip().splitlines()[-1] != last   # two streams, two zero states
    # a text of one paragraph is one stream, whatever was asked: said, not silently
    assert one.returncode == 0 and ("note: --streams 3: rnnlm/data/harbour_valid.txt holds 1 paragraph, scored as "
                                    "1 stream") in one.stdout, one.stdout
    # the characters the training text lacks (its ':' and 'N', 2 of the 707 and the paragraph's end) are said
    train_chars, text = set(open(HARBOUR).read()), open(os.path.join(ROOT, "rnnlm/data/harbour_valid.txt")).read()
    assert sum(c not in train_chars for c in text) == 2 and len(text) == 707
    assert "note: 2 of 708 tokens (0.3%) read as '\ufffd', the checkpoint's unknown token\n" in one.stdout
    assert "read as" not in evaluated[0].stdout                 # its own training text: none
    samples = [run("jobs/generate.py", "--checkpoint", str(tmp_path / where), "--length", "40", "--seed", "2")
               for where in ("run", "run/checkpoint")]
    assert samples[0].returncode == 0 and samples[0].stdout == samples[1].stdout and len(samples[0].stdout) > 30


def signalled_after_three_rounds(out, sig, *items, args=(), group: bool = False):
    """Train into ``out``, send ``sig`` once three rounds are written (``group``: to the command's process
    group, as ``timeout`` and schedulers do); (exit code, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "jobs/train.py", "--config", "conf/demo.toml", "--out", str(out),
                             "--samples", "0", *args, *sets(*items)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"), start_new_session=group)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len(open(out / "metrics.jsonl").readlines()) >= 3:
                break
            time.sleep(0.05)
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        log, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, log, err


def test_a_second_ctrl_c_inside_a_round_stops_at_once_with_one_line(tmp_path):
    """The first Ctrl-C asks for a checkpoint after the round, the second to stop now. It used to
    reach the driver blocked on the round's job, take that job off the run's books and destroy its
    broadcasts under its running tasks (an ERROR and a stack trace per task), and the close that
    followed cancelled nothing: it waited out the round, here hours of local steps."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "jobs/train.py", "--config", "conf/demo.toml", "--out", str(out),
                             "--samples", "0", *sets("train.local_steps=10000000", "data.valid=")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONUNBUFFERED="1"))
    try:
        line = "-"
        while line and " rounds" not in line:       # the start line: the corpus is read, round 1 comes next
            line = proc.stdout.readline()
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        log, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert line and proc.returncode == 130, (line, err[-2000:])
    assert "stopping after this round with a checkpoint (Ctrl-C again to stop now)" in log
    lines = [x for x in err.strip().splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted in round 1; "), err[-2000:]
    assert "Traceback" not in err and "ERROR" not in err, err[-3000:]
    assert took < 30, took                      # the job cancelled, not waited out


def test_sigterm_checkpoints_and_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    """SIGTERM (kill, timeout, a scheduler) gets Ctrl-C's grace (the same stop request: test_startup checks
    each one's exit code): the round ends, a checkpoint is written, exit 143, no traceback and no ERROR;
    resumed, the run ends exactly where an uninterrupted one does, and one MLflow run holds both starts'
    rounds (a resume started a second one)."""
    store = f"file:{tmp_path / 'mlruns'}"           # MLflow's own store, on disk: both starts log there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    common = ("train.rounds=40", "data.valid=")
    ref = run("jobs/train.py", "--config", "conf/demo.toml", "--out", str(tmp_path / "ref"), "--samples", "0",
              *sets(*common))
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "run"
    rc, log, err = signalled_after_three_rounds(out, signal.SIGTERM, *common, args=("--log", "mlflow"))
    assert rc == 143, err[-2000:]
    assert "SIGTERM: stopping after this round with a checkpoint (SIGTERM again to stop now)" in log
    assert "Traceback" not in err and "ERROR" not in err, err[-3000:]
    lines = [x for x in err.strip().splitlines() if x.startswith("error: ")]
    done = [m["round"] for m in metrics(out)]
    assert lines == [f"error: interrupted after round {done[-1]}; its checkpoint is in {out}/checkpoint "
                     "(--resume continues)"], err
    assert 3 <= checkpoint.load(str(out)).position["round"] == done[-1] < 40
    r = run("jobs/train.py", "--config", "conf/demo.toml", "--out", str(out), "--samples", "0", "--resume",
            "--log", "mlflow", *sets(*common))
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = checkpoint.load(str(tmp_path / "ref")), checkpoint.load(str(out))
    assert b.position["round"] == 40 and np.array_equal(a.params, b.params)
    assert [m["train_loss"] for m in metrics(out)] == [m["train_loss"] for m in metrics(tmp_path / "ref")]
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=store)
    (logged,) = client.search_runs([client.get_experiment_by_name("rnnlm").experiment_id])
    steps = {h.step for h in client.get_metric_history(logged.info.run_id, "train_loss")}
    assert logged.info.status == "FINISHED" and steps == set(range(1, 41)), (logged, steps)
    info = json.loads((out / "run.json").read_text())       # one record: the first start, then the resume
    assert len(info["resumed"]) == 1 and info["started"] <= info["resumed"][0]


def test_sigterm_to_the_process_group_still_stops_after_the_round_with_a_checkpoint(tmp_path):
    """``timeout`` and schedulers signal the command's whole process group: Spark's JVM and its Python workers
    died with it, the round failed, and the run ended with no checkpoint of its last rounds (and PySpark's
    accumulator server printed an EOFError's traceback). The JVM now has a session of its own, so the stop is
    the same as for a SIGTERM to the command alone."""
    out = tmp_path / "run"
    rc, log, err = signalled_after_three_rounds(out, signal.SIGTERM, "train.rounds=400", "data.valid=", group=True)
    assert rc == 143, err[-2000:]
    assert "SIGTERM: stopping after this round with a checkpoint (SIGTERM again to stop now)" in log
    assert "Traceback" not in err and "ERROR" not in err and "Exception" not in err, err[-3000:]
    done = [m["round"] for m in metrics(out)]
    assert [x for x in err.strip().splitlines() if x.startswith("error: ")] == [
        f"error: interrupted after round {done[-1]}; its checkpoint is in {out}/checkpoint (--resume continues)"], err
    assert 3 <= checkpoint.load(str(out)).position["round"] == done[-1] < 400


def test_spark_jvm_killed_under_a_run_ends_it_in_one_line(tmp_path):
    """Spark's JVM killed (the OOM killer, a crash): every call into it failed, the clean-up's too, and the
    run ended in six chained tracebacks after PySpark's own EOFError; now one line says what ended it."""
    from rnnlm.cli.signals import children
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "jobs/train.py", "--config", "conf/demo.toml", "--out", str(out),
                             "--samples", "0", *sets("train.rounds=400", "data.valid=")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"))
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and
                                              len(open(out / "metrics.jsonl").readlines()) >= 3):
            time.sleep(0.05)
        (jvm,) = children(proc.pid)
        os.kill(jvm, signal.SIGKILL)
        log, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Exception" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == ("error: Spark's JVM ended under this command (killed, or out of memory: "
                                            "the system's log says which); a run's --resume continues from its "
                                            "last checkpoint"), err[-3000:]


def _mb(pattern, text):
    return float(re.search(pattern + r" ([0-9.]+) MB", text).group(1))


def test_dry_run_prints_the_model_and_a_rounds_bytes_and_writes_nothing(tmp_path):
    sparse = ("exchange.embed=rows+fp16", "exchange.softmax=rows", "exchange.frequent=0.1", "exchange.random=0.05",
              "train.global_batch=9")      # 9 // 2: TINY's batch of 4
    d = run("jobs/train.py", "--config", "conf/demo.toml", "--out", str(tmp_path / "dry"), "--dry-run",
            "--bandwidth", "100mbit", "--latency", "2ms", *sets("data.partitions=2", *sparse))
    assert d.returncode == 0, d.stderr[-2000:]
    assert not (tmp_path / "dry").exists()
    assert "train.global_batch = 9 on 2 partitions: train.batch = 4 streams each, 8 in all" in d.stdout, d.stdout
    # Spark's start-up INFO lines are silenced; --verbose brings them back
    assert "INFO" not in d.stderr and "log4j profile" not in d.stderr, d.stderr
    r = run("jobs/train.py", "--config", "conf/demo.toml", "--out", str(tmp_path / "real"), "--samples", "0",
            "--verbose", *sets("data.partitions=2", "train.rounds=4", *sparse))
    assert r.returncode == 0 and " INFO " in r.stderr
    header = next(x for x in r.stdout.splitlines() if x.startswith("vocab "))   # "vocab 47 | params 1,234 | ..."
    assert header.split(" | ")[1] in d.stdout             # the same parameter count
    m, *later = metrics(tmp_path / "real")
    # everything that travels, exactly: round 1's results (blocks, Adam's averaged state, hidden
    # states, pickling) and the broadcasts of rounds 2-4 (the rows the round before changed, Adam's
    # averaged state), their median
    broadcast = statistics.median(x["round_bytes_broadcast"] for x in later)
    assert f"partitions send {m['round_bytes_sent']:,} bytes" in d.stdout, (d.stdout, m)
    assert all(x["executors"] == 1 for x in (m, *later))         # local mode: the driver's JVM alone
    assert (f"the driver broadcasts {broadcast:,} bytes, each executor a copy (the median of rounds 2-4; round 1: "
            f"{m['round_bytes_broadcast']:,})") in d.stdout, (d.stdout, later)
    params = int(header.split("params ")[1].split(" ")[0].replace(",", ""))
    assert _mb("dense float32's", d.stdout) == round(2 * params * 4 / 1e6, 3)
    # the link: 96% of 100 Mbit/s carries payload; all results come in, (P + 1) / 2 = 1.5 broadcasts go out
    payload = 100e6 / 8 * 0.96
    line = d.stdout.splitlines()[-1]
    assert line.startswith("at 100mbit (latency 2ms) per host link: sync "), line
    assert f"results into the driver {m['round_bytes_sent'] / payload:.2f} s" in line, line
    assert f"broadcast out {1.5 * broadcast / payload:.2f} s" in line, line
    # the parts add up: what is coded and the rest; sync is the larger of the overhead and half of it + the wire
    blocks = sum(v for k, v in m.items() if k.startswith("block_bytes."))
    assert (f"the change as coded here {blocks:,} bytes, the rest {m['round_bytes_sent'] - blocks:,} "
            "(optimizer state") in d.stdout, d.stdout
    sync, overhead, half, wire, down, up, latency = map(float, re.search(
        r"sync ([0-9.]+) s per round, the larger of the overhead measured here \(([0-9.]+) s\) and half of it "
        r"plus the wire \(([0-9.]+) \+ ([0-9.]+) s: results into the driver ([0-9.]+) s, broadcast out ([0-9.]+) s, "
        r"latency ([0-9.]+) s;", line).groups())
    assert abs(sync - max(overhead, half + wire)) <= 0.011 and abs(wire - (down + up + latency)) <= 0.011, line


def test_dry_run_link_options_are_checked_before_spark_starts():
    for args, message in ((["--dry-run", "--bandwidth", "fast"], "error: bandwidth 'fast': expected a number"),
                          (["--dry-run", "--bandwidth", "0gbit"], "error: bandwidth '0gbit': must be > 0"),
                          (["--dry-run", "--latency", "1ms"], "error: --latency needs --bandwidth"),
                          (["--bandwidth", "1gbit"], "error: --bandwidth and --latency go with --dry-run"),
                          (["--dry-run", "--bandwidth", "1gbit", "--latency", "soon"], "error: latency 'soon'")):
        r = run("jobs/train.py", "--config", "conf/demo.toml", *args)
        assert r.returncode == 2 and r.stderr.startswith(message) and len(r.stderr.splitlines()) == 1, (args, r.stderr)
