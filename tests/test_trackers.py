"""``train --log``: every metrics line in TensorBoard's event files (read back by TensorBoard's own
reader) and in MLflow (read back by MLflow's client from its store); a tracker that fails stops
itself, not the run."""
import json
import os
import subprocess
import sys
import zlib

import pytest

from rnnlm import config, trackers
from rnnlm.spark.trainer import Trainer

from conftest import ROOT, TINY, tensorboard_scalars, train_cmd


def test_crc32c_is_castagnolis():
    # the check value of CRC-32C (RFC 3720, B.4), and not zlib's CRC-32
    assert trackers.crc32c(b"123456789") == 0xE3069283 != zlib.crc32(b"123456789")


def test_an_event_file_starts_with_its_version_at_step_0_and_a_second_writer_shares_the_directory(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    d = tmp_path / "tb"
    first = trackers.TensorBoard(str(d), log=print)
    first.line({"round": 3, "train_loss": 2.5, "rebased": True})
    first.close(True)
    second = trackers.TensorBoard(str(d), log=print)          # a resumed run writes beside the first file
    second.close(True)
    events = [Event.FromString(r) for r in RawEventFileLoader(first.path).Load()]   # TensorBoard's reader
    assert (events[0].step, events[0].file_version) == (0, "brain.Event:2")
    assert (events[1].step, events[1].session_log.status) == (3, events[1].session_log.START)
    assert events[2].step == 3 and [(v.tag, v.simple_value) for v in events[2].summary.value] == [("train_loss", 2.5)]
    assert os.path.exists(second.path)


def test_a_value_past_float32s_range_is_written_as_infinite_and_the_tracker_goes_on(tmp_path):
    """A perplexity of a loss above 88.7 is finite in float64 and not in float32: struct refused it, and the
    tracker switched itself off at the run's most telling line."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    said = []
    tb = trackers.TensorBoard(str(tmp_path / "tb"), log=said.append)
    tb.line({"round": 1, "valid_loss": 90.0, "valid_ppl": 1.2e39, "lr": -1e300})
    tb.line({"round": 2, "valid_loss": 5.0})
    tb.close(True)
    events = [Event.FromString(r) for r in RawEventFileLoader(tb.path).Load()]
    assert [[(v.tag, v.simple_value) for v in e.summary.value] for e in events[2:]] == [
        [("valid_loss", 90.0), ("valid_ppl", float("inf")), ("lr", float("-inf"))], [("valid_loss", 5.0)]]
    assert not tb.broken and said == []


def test_a_tensorboard_directory_that_cannot_be_one_is_one_line(tmp_path):
    """Said before Spark starts when the path is a file; where it cannot be made, when the tracker starts."""
    (tmp_path / "file").write_text("x")
    r = subprocess.run(train_cmd(tmp_path / "run") + ["--log", f"tensorboard:{tmp_path / 'file'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr.strip()) == (2, f"error: --log tensorboard: {tmp_path / 'file'} is not a directory")
    with pytest.raises(trackers.TrackerError, match=r"^--log tensorboard: cannot write .*/file/tb/events\.out\."
                                                    r"tfevents\..*: Not a directory$"):
        trackers.TensorBoard(str(tmp_path / "file" / "tb"))


def test_a_run_started_again_drops_its_earlier_event_files_and_nothing_else(tmp_path):
    """--overwrite deletes the earlier run's metrics; its event files in OUT/tensorboard stayed, and
    TensorBoard drew both runs' curves as one. A directory named (--log tensorboard:DIR) is the user's."""
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    kept = ["events.out.tfevents.1.h.2.other", "notes.txt"]
    for name in ["events.out.tfevents.1.h.1.rnnlm", *kept]:
        (out / "tensorboard" / name).write_text("earlier")
    [again] = trackers.start(trackers.parse(["tensorboard"], str(out), overwrite=True), None, str(out))
    # not before the run has started (a corpus error, Ctrl-C while it is read): then the earlier run stays
    assert len(os.listdir(out / "tensorboard")) == 4
    again.line({"round": 1, "train_loss": 1.0})
    again.close(True)
    assert sorted(os.listdir(out / "tensorboard")) == sorted([os.path.basename(again.path), *kept])
    named = tmp_path / "mine"
    named.mkdir()
    (named / "events.out.tfevents.1.h.1.rnnlm").write_text("another run's")
    [tb] = trackers.start(trackers.parse([f"tensorboard:{named}"], str(out), overwrite=True), None, str(out))
    tb.line({"round": 1, "train_loss": 1.0})             # the run has started: still nothing of the user's goes
    tb.close(True)
    assert len(os.listdir(named)) == 2


def test_a_resumed_run_replaces_the_rounds_it_trains_again_in_tensorboard(tmp_path):
    """A resume trains the rounds after its checkpoint again: the earlier file's rounds past it stayed,
    and TensorBoard drew both runs' values at those steps."""
    import time
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    d = str(tmp_path / "tb")
    first = trackers.TensorBoard(d)
    for r in (1, 2, 3):
        first.line({"round": r, "train_loss": float(r)})
    first.close(True)
    time.sleep(1.1)                                   # the next file's name (its time in seconds) sorts after
    again = trackers.TensorBoard(d)                   # resumed from the checkpoint of round 1
    for r in (2, 3):
        again.line({"round": r, "train_loss": 10.0 * r})
    again.close(True)
    acc = EventAccumulator(d)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train_loss")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


@pytest.mark.parametrize("out, where", [("file:{tmp}/run", "{tmp}/run/tensorboard"),
                                        ("file://localhost{tmp}/run", "{tmp}/run/tensorboard")])
def test_tensorboard_goes_where_hadoop_puts_a_local_out(tmp_path, out, where):
    """``file:/x`` and ``file://localhost/x`` are /x to Hadoop: the event files went to ./file:/x/tensorboard
    and ./localhost/x/tensorboard."""
    [(kind, (directory, _))] = trackers.parse(["tensorboard"], out.format(tmp=tmp_path))
    assert directory == where.format(tmp=tmp_path)


def test_tensorboard_refuses_an_out_that_hadoop_puts_on_hdfs(tmp_path, monkeypatch):
    (tmp_path / "core-site.xml").write_text("<configuration><property><name>fs.defaultFS</name>"
                                            "<value>hdfs://nn:8020</value></property></configuration>")
    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))
    for out in ("hdfs:/user/me/run", "runs/x"):
        with pytest.raises(trackers.TrackerError, match=f"^--log tensorboard: --out {out} is not a local directory"):
            trackers.parse(["tensorboard"], out)
        # a directory named is taken wherever the run writes
        named = str(tmp_path / "tb")
        assert trackers.parse([f"tensorboard:{named}"], out) == [("tensorboard", (named, False))]


def _mlflow_run(store: str, name: str):
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("rnnlm")
    (run,) = client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'")
    return client, run


def test_an_mlflow_store_the_client_refuses_says_what_to_set(tmp_path, monkeypatch):
    """mlflow-skinny (the extra) with no MLFLOW_TRACKING_URI tries MLflow's default, a SQLite file it cannot
    open; MLflow 3 refuses a local directory without MLFLOW_ALLOW_FILE_STORE. Each failure's words were cut
    before MLflow's own remedy, and no line said what to set; the run goes on either way."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cfg = config.load(None, [])
    for uri, hint in ((None, "MLFLOW_TRACKING_URI names no tracking server: set it to one's http://HOST:PORT; "
                             "MLflow's default, a SQLite file, needs the full mlflow package)"),
                      (f"file:{tmp_path / 'mlruns'}", "MLflow 3 keeps runs in a local directory only with "
                                                      "MLFLOW_ALLOW_FILE_STORE=true; a tracking server's "
                                                      "http://HOST:PORT needs nothing more)")):
        if uri is None:
            monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        else:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        said = []
        t = trackers.MLflow(cfg, str(tmp_path / "run"), log=said.append)
        assert t.broken and len(said) == 1 and said[0].startswith("warning: --log mlflow failed, no more lines go "
                                                                  "there (metrics.jsonl has them): "), said
        assert said[0].endswith(f" ({hint}"), said
        t.line({"round": 1, "train_loss": 2.0})           # the run goes on: the tracker takes lines, says nothing
        assert len(said) == 1


def test_every_metrics_line_reaches_tensorboard_and_mlflow(spark, tmp_path, monkeypatch):
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")     # MLflow's own store, on disk
    cfg = config.load(None, [*TINY, "data.train=rnnlm/data/harbour.txt", "data.valid=rnnlm/data/harbour_valid.txt",
                             "train.rounds=3", "train.eval_every=2"])
    out = str(tmp_path / "run")
    parsed = trackers.parse(["tensorboard", "mlflow"], out)
    assert parsed == [("tensorboard", (os.path.join(out, "tensorboard"), False)), ("mlflow", "")]
    sinks = trackers.start(parsed, cfg, out, log=print)
    tr = Trainer(spark, cfg, out, log=lambda s: None, sinks=sinks)
    tr.run()
    for t in sinks:
        t.close(True)
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["round"] for m in lines] == [1, 2, 3]

    tb = tensorboard_scalars(os.path.join(out, "tensorboard"))
    assert tb["train_loss"] == [(m["round"], pytest.approx(m["train_loss"], rel=1e-6)) for m in lines]
    assert tb["valid_ppl"] == [(m["round"], pytest.approx(m["valid_ppl"], rel=1e-6)) for m in lines
                               if "valid_ppl" in m] and len(tb["valid_ppl"]) == 2
    assert "rebased" not in tb and "round" not in tb          # flags and the step itself are not scalars

    client, run = _mlflow_run(store, "run")
    assert run.info.status == "FINISHED" and run.data.tags["rnnlm.out"] == out
    assert run.data.params["model.hidden"] == "16" and run.data.params["train.rounds"] == "3"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted((h.step, h.value) for h in history) == [(m["round"], m["train_loss"]) for m in lines]


def test_a_tracker_that_fails_says_so_once_and_the_run_goes_on(spark, tmp_path):
    cfg = config.load(None, [*TINY, "data.train=rnnlm/data/harbour.txt", "train.rounds=2", "train.eval_every=0"])
    said = []
    tb = trackers.TensorBoard(str(tmp_path / "tb"), log=said.append)
    tb.f.close()                  # every write fails from now on
    tr = Trainer(spark, cfg, str(tmp_path / "run"), log=lambda s: None, sinks=[tb])
    assert tr.run()["round"] == 2
    tb.close(True)
    assert len(said) == 1 and said[0].startswith("warning: --log tensorboard failed, no more lines go there "
                                                 "(metrics.jsonl has them): ValueError: ")


def test_a_tensorboard_tracker_broken_by_a_full_disk_still_closes_its_file(tmp_path):
    said = []
    tb = trackers.TensorBoard(str(tmp_path / "tb"), log=said.append)

    def full(data):
        raise OSError(28, "No space left on device")
    tb.f.write = full
    tb.line({"round": 1, "train_loss": 3.0})
    tb.close(True)
    assert tb.broken and len(said) == 1 and tb.f.closed


def test_a_tensorboard_file_whose_first_record_cannot_be_written_is_one_line(tmp_path):
    """A full disk or a quota at the first record (the file version) raised OSError through the command as a
    traceback, once Spark had started. A process that may write no byte (RLIMIT_FSIZE 0) shows it."""
    code = ("import resource, signal\nfrom rnnlm import trackers\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nresource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
            f"try:\n    trackers.TensorBoard({str(tmp_path / 'tb')!r})\n"
            "except trackers.TrackerError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith(f"--log tensorboard: cannot write {tmp_path / 'tb'}/events.out.tfevents.") and \
        r.stdout.endswith(": File too large\n"), r.stdout


def test_a_broken_mlflow_tracker_still_ends_its_run_with_the_trainings_status(tmp_path, monkeypatch):
    """Once a request had failed, close() sent nothing: MLflow's exit hook ended the run as FINISHED, a
    failed training's too."""
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    said = []
    t = trackers.MLflow(config.load(None, []), str(tmp_path / "run"), log=said.append)
    try:
        def unavailable(*args, **kwargs):
            raise ConnectionError("503 Service Unavailable")
        monkeypatch.setattr(t.mlflow, "log_metrics", unavailable)
        t.line({"round": 1, "train_loss": 3.0})
        assert t.broken and len(said) == 1
        t.close(False)
        assert _mlflow_run(store, "run")[1].info.status == "FAILED" and len(said) == 1
    finally:
        if t.mlflow.active_run() is not None:      # not left to this process's other tests
            t.mlflow.end_run()


def test_a_tracker_that_cannot_start_ends_the_ones_started_before_it(tmp_path, monkeypatch):
    """MLflow started, then TensorBoard refused: the MLflow run was left active (MLflow's exit hook ended
    it FINISHED, for a command that failed)."""
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "file").write_text("x")
    parsed = [("mlflow", ""), ("tensorboard", (str(tmp_path / "file" / "tb"), False))]
    import mlflow
    try:
        with pytest.raises(trackers.TrackerError, match="Not a directory"):
            trackers.start(parsed, config.load(None, []), str(tmp_path / "run"), log=lambda s: None)
        assert mlflow.active_run() is None
        assert _mlflow_run(store, "run")[1].info.status == "FAILED"
    finally:
        if mlflow.active_run() is not None:      # not left to this process's other tests
            mlflow.end_run()


@pytest.mark.parametrize("out", ["run", "it's", "both'\""])
def test_a_resumed_run_goes_on_in_its_mlflow_run(tmp_path, monkeypatch, out):
    """A resume started a second MLflow run of the same name: the first, FAILED, held the rounds up to
    the interruption, the second those from the checkpoint on."""
    from mlflow import MlflowClient
    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = str(tmp_path / out)
    monkeypatch.chdir(tmp_path)            # "other" named as runs/latest is: relative, matched by where it is

    def session(where, rounds, losses, resume, ok):
        t = trackers.MLflow(config.load(None, [f"train.rounds={rounds}"]), where, log=pytest.fail, resume=resume)
        for r, loss in losses:
            t.line({"round": r, "train_loss": loss})
        t.close(ok)
        return t.run.info.run_id

    first = session(out, 3, [(1, 4.0), (2, 3.0), (3, 2.0)], resume=False, ok=False)     # interrupted after round 3
    session("other", 3, [(1, 9.0)], resume=False, ok=True)                                # another run, started later
    again = session(out + "/", 4, [(2, 3.0), (3, 2.0), (4, 1.0)], resume=True, ok=True)   # round 1's checkpoint
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("rnnlm").experiment_id])
    assert again == first and {r.data.tags["rnnlm.out"] for r in runs} == {out, str(tmp_path / "other")}
    run = client.get_run(first)
    assert run.info.status == "FINISHED" and run.data.tags["rnnlm.out"] == out
    assert run.data.params["train.rounds"] == "3" and run.data.tags["rnnlm.resumed.train.rounds"] == "4"
    assert [k for k in run.data.tags if k.startswith("rnnlm.resumed.")] == ["rnnlm.resumed.train.rounds"]
    history = sorted((h.step, h.value) for h in client.get_metric_history(first, "train_loss"))
    assert history == [(1, 4.0), (2, 3.0), (2, 3.0), (3, 2.0), (3, 2.0), (4, 1.0)]
    assert session(out, 4, [(1, 5.0)], resume=False, ok=True) != first     # started again (--overwrite): a new run


@pytest.mark.parametrize("args,message", [
    (["--log", "wandb"], "error: --log 'wandb': expected one of tensorboard[:DIR], mlflow"),
    (["--log", "mlflow:http://x"], "error: --log 'mlflow:http://x': expected one of tensorboard[:DIR], mlflow"),
    (["--log", "tensorboard", "--out", "hdfs://nn:8020/runs/x"],
     "error: --log tensorboard: --out hdfs://nn:8020/runs/x is not a local directory; name one: "
     "--log tensorboard:DIR"),
    (["--log", "mlflow", "--dry-run"], "error: --log goes with training, not --dry-run"),
])
def test_a_bad_log_option_is_one_line_before_spark_starts(tmp_path, args, message):
    cmd = train_cmd(tmp_path / "run") + args
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stderr.strip()) == (2, message)
    assert not (tmp_path / "run").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_tensorboard_close_that_fails_is_said_once(tmp_path):
    """A quota or an NFS server says so at close(): the last records were not written."""
    said = []
    tb = trackers.TensorBoard(str(tmp_path / "tb"), log=said.append)
    tb.line({"round": 1, "train_loss": 3.0})
    real = tb.f.close

    def refused():
        real()
        raise OSError(122, "Disk quota exceeded")
    tb.f.close = refused
    tb.close(True)
    assert tb.broken and said == ["warning: --log tensorboard failed, no more lines go there (metrics.jsonl has "
                                  "them): OSError: [Errno 122] Disk quota exceeded"]
