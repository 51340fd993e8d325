"""Run loading (rnnlm.runs), the figures (rnnlm.plots) and jobs/plot.py."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from rnnlm import config, plots, runs
from rnnlm.cli import main
from conftest import ROOT


def make_run(root, name, lines, sets=(), info=True, raw_tail=""):
    """A run directory as the trainer writes it: metrics.jsonl and run.json from a real config."""
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + raw_tail)
    cfg = config.load(None, list(sets))
    if info:
        (d / "run.json").write_text(json.dumps({"config": cfg.to_dict(), "master": "local[2]"}))
    return d


def line(r, tokens, sent, bcast, wall, loss, **more):
    return {"round": r, "tokens": tokens, "syncs": r, "bytes_sent": sent, "bytes_broadcast": bcast,
            "wall_s": wall, "train_loss": loss, **more}


LINES = [line(1, 100, 10, 5, 1.0, 4.0), line(2, 200, 20, 10, 2.0, 3.5, valid_ppl=30.0),
         line(3, 300, 30, 15, 3.5, 3.0), line(4, 400, 40, 20, 4.0, 2.9, valid_ppl=25.0)]


def test_load_reads_metrics_config_and_drops_a_line_cut_short(tmp_path):
    d = make_run(tmp_path, "a", LINES, ["train.local_steps=7"], raw_tail='{"round": 5, "tok')
    r = runs.load(str(d))
    assert r.metrics == LINES                                      # the half-written line is not a point
    assert r.config["train"]["local_steps"] == 7 and r.info["master"] == "local[2]"
    assert runs.load(f"file://{d}").metrics == LINES


def test_config_comes_from_the_checkpoint_for_runs_without_run_json(tmp_path):
    d = make_run(tmp_path, "old", LINES, info=False)
    (d / "checkpoint").mkdir()
    (d / "checkpoint" / "config.json").write_text(config.load(None, ["train.local_steps=9"]).to_json())
    assert runs.load(str(d)).config["train"]["local_steps"] == 9


def test_not_a_run_is_a_one_line_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(runs.RunError, match="no metrics.jsonl"):
        runs.load(str(tmp_path / "empty"))
    with pytest.raises(runs.RunError, match="no such directory"):
        runs.load(str(tmp_path / "missing"))
    with pytest.raises(runs.RunError, match="use webhdfs://<namenode>:<http port>/x"):
        runs.load("hdfs://nn:8020/x")
    d = make_run(tmp_path, "partial", [], raw_tail='{"round": 1')
    with pytest.raises(runs.RunError, match="no complete line"):
        runs.load(str(d))


def test_load_all_finds_runs_in_a_folder_and_labels_them_by_their_config(tmp_path):
    make_run(tmp_path / "sweep", "x1", LINES, ["train.local_steps=1", "exchange.embed=rows"])
    make_run(tmp_path / "sweep", "x2", LINES, ["train.local_steps=10", "exchange.embed=rows"])
    make_run(tmp_path / "sweep", "x3", LINES, ["train.local_steps=10", "exchange.embed=dense"])
    (tmp_path / "sweep" / "not_a_run").mkdir()
    rs = runs.load_all([str(tmp_path / "sweep")])
    assert [r.name for r in rs] == ["x1", "x2", "x3"]
    assert runs.differing(rs) == ["exchange.embed", "train.local_steps"]
    assert runs.labels(rs) == ["local_steps=1, embed=rows", "local_steps=10, embed=rows",
                               "local_steps=10, embed=dense"]
    # keys that do not separate runs are left out of the labels
    assert runs.labels(rs[:2]) == ["local_steps=1", "local_steps=10"]
    with pytest.raises(runs.RunError, match="no metrics"):
        runs.load_all([str(tmp_path / "sweep" / "not_a_run")])


def test_runs_with_one_config_are_named_by_their_folders(tmp_path):
    rs = [runs.load(str(make_run(tmp_path, n, LINES))) for n in ("seed_a", "seed_b")]
    assert runs.labels(rs) == ["seed_a", "seed_b"]
    # a run without a recorded configuration is named by its folder; the others by their differences
    rs = [runs.load(str(make_run(tmp_path, "k1", LINES, ["train.local_steps=1"]))),
          runs.load(str(make_run(tmp_path, "k2", LINES, ["train.local_steps=2"]))),
          runs.load(str(make_run(tmp_path, "unknown", LINES, info=False)))]
    assert runs.labels(rs) == ["local_steps=1", "local_steps=2", "unknown"]


def test_runs_are_found_two_levels_deep_and_no_deeper(tmp_path):
    make_run(tmp_path / "all" / "a", "r1", LINES)
    make_run(tmp_path / "all", "r0", LINES)
    make_run(tmp_path / "all" / "b" / "c", "r3", LINES)        # three levels down
    assert [r.name for r in runs.load_all([str(tmp_path / "all")])] == ["r1", "r0"]
    assert [r.name for r in runs.load_all([str(tmp_path / "all" / "b")])] == ["r3"]


def test_labels_name_keys_by_rank_shorten_values_and_tell_repeats_apart(tmp_path):
    def load(name, *sets):
        return runs.load(str(make_run(tmp_path, name, LINES, sets)))
    # each of the three keys alone splits the runs in two; all three are needed: ordered as a reader names runs
    rs = [load("m1", "train.mode=async", "model.cell=rnn", "data.strategy=windows"),
          load("m2", "train.mode=sync", "model.cell=rnn", "data.strategy=streams"),
          load("m3", "train.mode=sync", "model.cell=lstm", "data.strategy=windows"),
          load("m4", "train.mode=sync", "model.cell=lstm", "data.strategy=streams")]
    assert runs.distinguishing(rs[1:]) == ["model.cell", "data.strategy"]
    assert runs.distinguishing(rs) == ["train.mode", "model.cell", "data.strategy"]
    # one key splits them as well as another: the one ranked first (exchange before optim)
    pair = [load("p1", "optim.lr=0.5", "exchange.mu=0.1"), load("p2", "optim.lr=0.25", "exchange.mu=0.2")]
    assert runs.distinguishing(pair) == ["exchange.mu"]
    pair = [load("q1", "data.min_count=1", "exchange.mu=0.1"), load("q2", "data.min_count=2", "exchange.mu=0.2")]
    assert runs.distinguishing(pair) == ["exchange.mu"]                # though data.* sorts first
    # a key name two sections share keeps its section; floats short; paths by their last part
    lr = [load("l1", "optim.lr=0.1", "server.lr=0.5", "data.train=/d/ptb/train.txt"),
          load("l2", "optim.lr=0.25", "server.lr=0.75", "data.train=/")]
    assert runs.labels(lr, ["optim.lr", "server.lr", "data.train", "train.seed"]) == [
        "optim.lr=0.1, server.lr=0.5, train=train.txt, seed=1234", "optim.lr=0.25, server.lr=0.75, train=/, seed=1234"]
    # repeats of one setting among others: the folder name goes in front
    twice = [load("s1", "train.seed=1"), load("s2", "train.seed=1"), load("s3", "train.seed=2")]
    assert runs.labels(twice) == ["s1: seed=1", "s2: seed=1", "s3: seed=2"]


def test_a_webhdfs_namenode_that_refuses_is_one_line_naming_the_path_and_the_clients_error():
    with pytest.raises(runs.RunError) as e:
        runs.load("webhdfs://127.0.0.1:1/x")                       # nothing listens on port 1 of loopback
    msg = str(e.value)
    assert msg.startswith("webhdfs://127.0.0.1:1/x/metrics.jsonl: HTTPConnectionPool(") and "\n" not in msg, msg
    assert "Connection refused" in msg, msg


def test_a_metrics_file_left_as_old_by_a_crash_is_read(tmp_path):
    d = make_run(tmp_path, "a", LINES)
    os.rename(d / "metrics.jsonl", d / "metrics.jsonl.old")
    assert runs.load(str(d)).metrics == LINES


def test_series_are_the_metrics_lines_holding_the_value(tmp_path):
    r = runs.load(str(make_run(tmp_path, "a", LINES)))
    xs, ys = plots.series(r, "bytes", "valid_ppl")
    assert xs.tolist() == [30, 60] and ys.tolist() == [30.0, 25.0]
    xs, ys = plots.series(r, "wall", "train_loss")
    assert xs.tolist() == [1.0, 2.0, 3.5, 4.0] and ys.tolist() == [4.0, 3.5, 3.0, 2.9]
    assert plots.series(r, "syncs", "train_ppl")[1][0] == pytest.approx(np.exp(4.0))
    odd = [line(1, 100, 0, 0, 1.0, float("nan"), valid_ppl=float("inf")), line(2, 200, 0, 0, 2.0, 3.0, valid_ppl=9.0)]
    bad = runs.load(str(make_run(tmp_path, "bad", odd)))
    assert plots.series(bad, "tokens", "train_loss")[0].tolist() == [200]          # NaN left out
    assert plots.series(bad, "tokens", "valid_ppl")[1].tolist() == [9.0]          # inf left out
    with pytest.raises(ValueError, match="x must be"):
        plots.series(r, "epochs", "train_loss")


def test_lines_without_a_training_loss_are_no_points(tmp_path):
    """An async run's line that counts no push carries no train_loss (it once said 0.0): no point, not zero."""
    bare = {k: v for k, v in line(5, 400, 50, 25, 4.5, 0.0).items() if k != "train_loss"}
    r = runs.load(str(make_run(tmp_path, "async", LINES + [dict(bare, pushes=0)])))
    assert plots.series(r, "tokens", "train_loss")[1].tolist() == [4.0, 3.5, 3.0, 2.9]
    assert plots.series(r, "syncs", "train_ppl")[0].tolist() == [1, 2, 3, 4]
    ax = plots.plot_metric([r], "wall", "train_loss")
    assert list(ax.get_lines()[0].get_xdata()) == [1.0, 2.0, 3.5, 4.0]


def test_plot_metric_draws_each_runs_points_with_its_label(tmp_path):
    a = make_run(tmp_path, "a", LINES, ["train.local_steps=5"])
    other = [dict(m, tokens=m["tokens"] * 2, train_loss=m["train_loss"] - 1) for m in LINES]
    b = make_run(tmp_path, "b", other, ["train.local_steps=20"])
    ax = plots.plot_metric(runs.load_all([str(a), str(b)]), "tokens", "train_loss")
    got = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert got == {"local_steps=5": ([100, 200, 300, 400], [4.0, 3.5, 3.0, 2.9]),
                   "local_steps=20": ([200, 400, 600, 800], [3.0, 2.5, 2.0, 1.9])}
    ax = plots.plot_metric(runs.load_all([str(a)]), "tokens", "train_loss", smooth=2)     # trailing means
    xs, ys = ax.get_lines()[0].get_data()
    assert list(xs) == [200, 300, 400] and np.allclose(ys, [3.75, 3.25, 2.95])


def test_frontier_marks_the_points_no_other_run_beats_on_both(tmp_path):
    # (bytes per token, best valid ppl): A (1, 50) front, B (2, 40) front, C (3, 45) beaten by B,
    # D (4, 30) front, E (2, 40.5) beaten by B
    specs = {"A": (1, 50), "B": (2, 40), "C": (3, 45), "D": (4, 30), "E": (2, 40.5)}
    dirs = []
    for i, (name, (bpt, ppl)) in enumerate(specs.items()):
        ms = [line(1, 100, 50 * bpt, 50 * bpt, 1.0, 5.0, valid_ppl=ppl + 10),
              line(2, 200, 100 * bpt, 100 * bpt, 2.0, 4.0, valid_ppl=ppl)]
        dirs.append(str(make_run(tmp_path, name, ms, [f"train.seed={i}"])))
    rows = plots.frontier(runs.load_all(dirs), "valid_ppl", "best", labels=list(specs))
    assert [(r["label"], r["bytes_per_token"], r["value"], r["pareto"]) for r in rows] == [
        ("A", 1, 50, True), ("B", 2, 40, True), ("C", 3, 45, False), ("D", 4, 30, True), ("E", 2, 40.5, False)]
    final = plots.frontier(runs.load_all(dirs[:1]), "valid_ppl", "final")
    assert final[0]["value"] == 50
    ax = plots.plot_frontier(runs.load_all(dirs), labels=list(specs))
    front = [ln for ln in ax.get_lines() if ln.get_label() == "Pareto front"][0]
    assert list(front.get_xdata()) == [1, 2, 4] and list(front.get_ydata()) == [50, 40, 30]


def test_sync_fraction_is_the_median_share_outside_compute_per_codec(tmp_path):
    def timed(pairs):
        return [line(i + 1, 100 * (i + 1), 0, 0, float(i), 3.0, round_s=r, compute_s=c)
                for i, (r, c) in enumerate(pairs)]
    # the first round (warm-up) is left out: medians of 1 - c/r over rounds 2..
    d1 = make_run(tmp_path, "k1", timed([(9, 1), (1.0, 0.2), (1.0, 0.4), (1.0, 0.3)]), ["train.local_steps=1"])
    d2 = make_run(tmp_path, "k10", timed([(9, 1), (2.0, 1.8), (2.0, 1.6)]), ["train.local_steps=10"])
    d3 = make_run(tmp_path, "k1r", timed([(9, 1), (1.0, 0.5)]),
                  ["train.local_steps=1", "exchange.embed=rows+fp16", "exchange.softmax=rows+fp16"])
    d4 = make_run(tmp_path, "k1again", timed([(9, 1), (1.0, 0.9)]), ["train.local_steps=1", "train.seed=5"])
    d5 = make_run(tmp_path, "k1soft", timed([(9, 1), (1.0, 0.1)]),
                  ["train.local_steps=1", "exchange.softmax=rows+fp16"])
    asynchronous = make_run(tmp_path, "async", LINES, ["train.mode=async"])       # no round timings
    got = plots.sync_fractions(runs.load_all([str(d) for d in (d1, d2, d3, d4, d5, asynchronous)]))
    sparse, soft = "embed rows+fp16, softmax rows+fp16, hidden dense", "embed dense, softmax rows+fp16, hidden dense"
    assert got.keys() == {"dense", sparse, soft}
    # K=1 dense: the median of run k1 (0.7) averaged with the repeat k1again (0.1)
    assert [(k, round(f, 6)) for k, f in got["dense"]] == [(1, 0.4), (10, 0.15)]
    assert [(k, round(f, 6)) for k, f in got[sparse]] == [(1, 0.5)]
    assert [(k, round(f, 6)) for k, f in got[soft]] == [(1, 0.9)]


def test_runs_of_another_model_or_corpus_are_not_averaged_into_one_sync_fraction(tmp_path):
    """A PTB run's 0.159 and the character demo's 0.581 at the same K and codec were drawn as one point, 0.370:
    a round's cost depends on the model, the corpus, the partitions and the batch as much as on K."""
    def timed(r, c):
        return [line(i + 1, 100 * (i + 1), 0, 0, float(i), 3.0, round_s=r, compute_s=c) for i in range(3)]
    a = make_run(tmp_path, "small", timed(1.0, 0.8), ["train.local_steps=5", "model.hidden=16"])
    b = make_run(tmp_path, "large", timed(1.0, 0.4), ["train.local_steps=5", "model.hidden=256"])
    again = make_run(tmp_path, "large2", timed(1.0, 0.2), ["train.local_steps=5", "model.hidden=256", "train.seed=3"])
    got = plots.sync_fractions(runs.load_all([str(a), str(b), str(again)]))
    d = config.load(None, [])                 # the defaults: no corpus named, the rest as make_run wrote them
    rest = f"{d.data.partitions} partitions, batch {d.train.batch}"
    ls = {k: [(x, round(f, 6)) for x, f in v] for k, v in got.items()}
    assert not d.data.train and ls == {f"dense; lstm {d.model.layers}x16, {rest}": [(5, 0.2)],
                                       f"dense; lstm {d.model.layers}x256, {rest}": [(5, 0.7)]}, ls
    assert list(plots.sync_fractions(runs.load_all([str(b), str(again)]))) == ["dense"]     # one setting: as before


def test_save_picks_the_format_from_the_suffix(tmp_path):
    r = runs.load(str(make_run(tmp_path, "a", LINES)))
    for ext, magic in ((".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")):
        p = plots.save(plots.plot_metric([r]), str(tmp_path / f"f{ext}"))
        assert open(p, "rb").read(5).startswith(magic)
    with pytest.raises(ValueError, match="suffix"):
        plots.save(plots.plot_metric([r]), str(tmp_path / "f.jpg"))


# a disk that fills at 4,000 bytes: the file-size limit, its signal ignored so that the write fails with EFBIG
_FULL_DISK = """import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))
from rnnlm.cli.main import main
sys.exit(main(["plot", "--runs", sys.argv[1], "--out", sys.argv[2]]))
"""


@pytest.mark.parametrize("ext", ["png", "svg", "pdf"])
def test_a_figure_that_cannot_be_written_leaves_the_one_there_whole(tmp_path, ext):
    run = make_run(tmp_path, "a", LINES)
    out = tmp_path / "figs" / f"f.{ext}"
    plots.save(plots.plot_metric([runs.load(str(run))]), str(out))
    before = out.read_bytes()
    assert len(before) > 4000
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(run), str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"error: --out {out}: ") and r.stderr.count("\n") == 1, r.stderr
    assert out.read_bytes() == before and os.listdir(out.parent) == [out.name]        # no part-written file left


def plot_job(*args):
    return subprocess.run([sys.executable, "jobs/plot.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_plot_job_writes_a_png_and_refuses_a_folder_without_metrics(tmp_path):
    a = make_run(tmp_path, "a", LINES, ["train.local_steps=5"])
    b = make_run(tmp_path, "b", LINES, ["train.local_steps=6"])
    out = tmp_path / "fig.png"
    r = plot_job("--runs", str(a), str(b), "--x", "bytes", "--y", "valid_ppl", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "nothing").mkdir()
    bad = plot_job("--runs", str(tmp_path / "nothing"), "--out", str(tmp_path / "g.png"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no metrics.jsonl" in bad.stderr
    assert not (tmp_path / "g.png").exists()
    none = plot_job("--runs", str(a), "--y", "test_ppl", "--out", str(tmp_path / "h.png"))
    assert none.returncode == 2 and "test_ppl" in none.stderr and none.stderr.count("\n") == 1
    jpg = plot_job("--runs", str(a), "--out", str(tmp_path / "h.jpg"))
    assert jpg.returncode == 2 and "suffix" in jpg.stderr


def svg_texts(path) -> list:
    """The texts of an SVG figure: matplotlib draws each as paths after a comment holding it."""
    return re.findall(r"<!-- (.*?) -->", open(path).read())


def test_plot_command_draws_the_x_axis_kind_pick_and_scale_asked_for(tmp_path, capsys):
    timed = [dict(m, round_s=1.0, compute_s=0.25 * i) for i, m in enumerate(LINES)]
    a = str(make_run(tmp_path, "a", timed, ["train.local_steps=5"]))
    b = str(make_run(tmp_path, "b", LINES, ["train.local_steps=6"]))

    def drawn(*args):
        out = tmp_path / "fig.svg"
        assert main.main(["plot", "--runs", a, b, *args, "--out", str(out)]) == 0
        assert capsys.readouterr().out == f"{out}\n"
        return svg_texts(out)
    by_bytes = drawn("--x", "bytes", "--y", "valid_ppl")                  # bytes 30 and 60: ticks in bytes
    assert "bytes sent + broadcast" in by_bytes and "validation perplexity" in by_bytes
    assert "tokens seen (all partitions)" not in by_bytes and {"30 B", "60 B"} <= set(by_bytes), by_bytes
    linear, log = drawn(), drawn("--log-x")                                # tokens 100 .. 400
    assert "tokens seen (all partitions)" in linear and {"100", "400"} <= set(linear), linear
    assert "$\\mathdefault{10^{2}}$" in log and "100" not in log, log
    front = drawn("--kind", "frontier", "--y", "valid_ppl", "--labels", "A", "B")
    assert {"Pareto front", "bytes sent + broadcast per training token", "best validation perplexity", "A",
            "B"} <= set(front)
    assert "final validation perplexity" in drawn("--kind", "frontier", "--y", "valid_ppl", "--pick", "final")
    sync = drawn("--kind", "sync")
    assert {"sync fraction: 1 - compute_s / round_s", "local steps between all-reduces (K; 0 = one pass)",
            "dense"} <= set(sync) and "training loss (nats/token)" not in sync


def test_real_runs_plot_from_what_the_trainer_wrote(spark, tiny_cfg, tmp_path):
    from rnnlm.spark.trainer import Trainer
    outs = []
    for k in (2, 3):
        cfg = config.replace(tiny_cfg, "train", local_steps=k, rounds=3)
        out = str(tmp_path / f"k{k}")
        Trainer(spark, cfg, out, log=lambda s: None).run()
        outs.append(out)
    rs = runs.load_all(outs)
    info = rs[0].info
    assert info["master"] == "local[2]" and info["partitions"] == 2 and info["versions"]["numpy"] == np.__version__
    assert info["config"]["model"]["vocab_size"] > 0 and info["config"]["train"]["local_steps"] == 2
    ax = plots.plot_metric(rs, "syncs", "train_loss")
    for ln, run in zip(ax.get_lines(), rs):
        assert list(ln.get_ydata()) == [m["train_loss"] for m in run.metrics]
        assert list(ln.get_xdata()) == [1, 2, 3]
    assert [ln.get_label() for ln in ax.get_lines()] == ["local_steps=2", "local_steps=3"]
    assert [k for k, _ in plots.sync_fractions(rs)["dense"]] == [2, 3]


def test_webhdfs_without_the_hdfs_package_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "hdfs", None)      # as if not installed: the import fails
    with pytest.raises(runs.RunError, match=r'paths need the hdfs package: pip install -e "\.\[hdfs\]"'):
        runs.load("webhdfs://namenode:9870/user/me/runs/x")
    with pytest.raises(runs.RunError, match="unknown scheme"):
        runs.load("ftp://host/x")


def test_the_bytes_axis_reads_in_megabytes_and_gigabytes(tmp_path):
    big = [line(r, 100 * r, 10 ** 8 * r, 5 * 10 ** 7 * r, float(r), 4.0 - r / 2) for r in (1, 2, 3, 4)]
    ax = plots.plot_metric([runs.load(str(make_run(tmp_path, "a", big)))], "bytes")
    ax.figure.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert "200 MB" in ticks and "400 MB" in ticks and not any("e" in t for t in ticks), ticks
    assert ax.xaxis.get_major_formatter()(2.5e9) == "2.5 GB"
    log = plots.plot_metric([runs.load(str(tmp_path / "a"))], "bytes", log_x=True)
    assert log.xaxis.get_major_formatter()(1e8) == "100 MB"


def test_relative_paths_in_rnnlm_runs_are_read_from_the_given_root():
    assert runs.env_paths("runs/a, /abs/b,,webhdfs://nn:9870/r,file:///x", "/repo") == [
        "/repo/runs/a", "/abs/b", "webhdfs://nn:9870/r", "file:///x"]


@pytest.mark.parametrize("tail", ["5\n", "[1, 2]\n", "null\n", '"round"\n'])
def test_a_line_that_is_not_a_table_ends_the_record_as_a_cut_line_does(tmp_path, tail):
    """A metrics line of JSON that is not a table (an edit, a disk's garbage) reached the plots as a
    point, where ``m.get`` raised AttributeError: a traceback from ``rnnlm plot``."""
    d = make_run(tmp_path, "a", LINES, raw_tail=tail + json.dumps(line(5, 500, 50, 25, 5.0, 2.8)) + "\n")
    assert runs.load(str(d)).metrics == LINES
    plots.save(plots.plot_metric(runs.load_all([str(d)]), y="valid_ppl"), str(tmp_path / "p.png"))


@pytest.mark.parametrize("config_", [5, [1], {"train": 5, "model": {"hidden": 8}}])
def test_a_run_json_whose_config_is_not_sections_is_read_for_what_it_holds(tmp_path, config_):
    """``{"config": 5}`` in run.json reached ``flat_config`` (AttributeError: 'int' object has no
    attribute 'items'): a traceback from ``rnnlm plot`` on two runs."""
    a, b = (make_run(tmp_path, n, LINES, info=False) for n in "ab")
    (a / "run.json").write_text(json.dumps({"config": config_}))
    r = runs.load(str(a))
    assert r.config == ({"model": {"hidden": 8}} if isinstance(config_, dict) else {})
    assert runs.differing([r, runs.load(str(b))]) == (["model.hidden"] if isinstance(config_, dict) else [])
    plots.save(plots.plot_metric(runs.load_all([str(a), str(b)]), y="valid_ppl"), str(tmp_path / "p.png"))


def _run(lines, cfg=None):
    """A run as the figures read one: its metrics lines and its configuration."""
    return types.SimpleNamespace(metrics=lines, config=cfg)


def test_a_label_holding_a_dollar_sign_is_drawn_as_written(tmp_path):
    """``--labels '$x^$'`` (or a run folder so named) started matplotlib's math text, whose parse error
    stopped the figure."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in LINES))
    ax = plots.plot_metric(runs.load_all([str(d)]), labels=["$x^$ run"])
    ax.legend()
    assert plots.save(ax, str(tmp_path / "p.png")) == str(tmp_path / "p.png")


def test_smoothing_takes_trailing_windows_and_leaves_short_series_alone():
    xs, ys = np.arange(4.0), np.array([4.0, 2.0, 6.0, 0.0])
    assert [a.tolist() for a in plots.smoothed(xs, ys, 4)] == [[3.0], [3.0]]          # one whole window
    assert [a.tolist() for a in plots.smoothed(xs, ys, 5)] == [xs.tolist(), ys.tolist()]
    assert [a.tolist() for a in plots.smoothed(xs, ys, 1)] == [xs.tolist(), ys.tolist()]
    assert [a.tolist() for a in plots.smoothed(xs, ys, 2)] == [[1.0, 2.0, 3.0], [3.0, 4.0, 3.0]]


def test_a_diverged_runs_perplexity_is_capped_not_an_overflow():
    xs, ys = plots.series(_run([line(1, 100, 0, 0, 1.0, 800.0), line(2, 200, 0, 0, 2.0, 2.0)]), "tokens", "train_ppl")
    assert ys.tolist() == [math.exp(709.0), math.exp(2.0)]


def test_what_every_run_sends_alike_is_said_once():
    def run(**ex):
        return _run([], {"exchange": ex})
    assert plots.shared_exchange([run(softmax="rows+fp16", embed="rows"), run(softmax="rows+fp16")]) == \
        "all runs: softmax rows+fp16"
    assert plots.shared_exchange([run(softmax="rows+fp16", hidden="dense+fp16"),
                                  run(softmax="rows+fp16", hidden="dense+fp16")]) == \
        "all runs: softmax rows+fp16, hidden dense+fp16"
    assert plots.shared_exchange([run(), run(embed="dense")]) is None                  # plain dense: nothing to say
    assert plots.shared_exchange([run(embed="rows"), run(embed="rows+fp16")]) is None
    assert plots.shared_exchange([_run([], None), _run([], None)]) is None             # no configuration
    assert plots.shared_exchange([]) is None


def test_the_caption_stays_with_automatic_labels_given_explicitly():
    """The notebook passes labels=runs.labels(rs): the legend then dropped what every run sends alike, and two
    runs of rows+fp16 softmax read as if their traffic were plain float32."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rs = [runs.Run(f"/r/{k}", LINES, {"exchange": {"softmax": "rows+fp16"}, "train": {"local_steps": k}}, {})
          for k in (2, 5)]
    for labels, title in ((None, "all runs: softmax rows+fp16"), (runs.labels(rs), "all runs: softmax rows+fp16"),
                          (["mine", "yours"], "")):
        fig, ax = plt.subplots()
        plots.plot_metric(rs, "tokens", "train_loss", ax=ax, labels=labels)
        assert ax.get_legend().get_title().get_text() == title, labels
        plt.close(fig)


def test_bytes_per_token_and_the_pick_come_from_the_whole_run():
    lines = [line(1, 100, 100, 50, 1.0, 5.0, valid_ppl=60.0), line(2, 200, 150, 150, 2.0, 4.0, valid_ppl=45.0),
             line(3, 400, 300, 500, 3.0, 3.9, valid_ppl=50.0)]
    assert plots.bytes_per_token(_run(lines)) == 2.0                                   # the last line's totals
    best, final = (plots.frontier([_run(lines)], "valid_ppl", pick, labels=["r"])[0]["value"]
                   for pick in ("best", "final"))
    assert (best, final) == (45.0, 50.0)


def test_a_point_is_beaten_by_one_as_good_on_both_and_better_on_one():
    assert plots.pareto([(1, 5), (1, 5)]) == [True, True]            # equal points beat neither
    assert plots.pareto([(1, 5), (2, 5)]) == [True, False]           # as good, and cheaper
    assert plots.pareto([(2, 4), (2, 5)]) == [True, False]           # as cheap, and better


def test_a_codec_names_the_settings_that_change_what_travels():
    assert plots.codec({"exchange": {}}) == "dense"
    ex = {"embed": "rows+onebit", "mu": 0.5, "sampled_softmax": False}
    assert plots.codec({"exchange": ex}) == "embed rows+onebit, softmax dense, hidden dense"       # mu: sampled only
    assert "mu 0.5" in plots.codec({"exchange": dict(ex, sampled_softmax=True)})
    defaults = dataclasses.asdict(config.ExchangeConfig())
    default = dict(ex, **{k: v for k, v in defaults.items() if k not in ("embed", "softmax", "hidden")})
    assert plots.codec({"exchange": default}) == "embed rows+onebit, softmax dense, hidden dense"  # defaults unsaid


def test_rounds_without_both_timings_are_left_out_of_the_sync_fraction():
    lines = [line(1, 100, 0, 0, 1.0, 3.0, round_s=9.0, compute_s=1.0), line(2, 200, 0, 0, 2.0, 3.0, round_s=2.0),
             line(3, 300, 0, 0, 3.0, 3.0, compute_s=1.0, round_s=0.0), line(4, 400, 0, 0, 4.0, 3.0, round_s=2.0,
                                                                            compute_s=0.5)]
    assert plots.sync_fraction(_run(lines)) == 0.75
    old = _run(lines, {"train": {}})                                   # a configuration without local_steps: K = 0
    assert plots.sync_fractions([old]) == {"dense": [(0, 0.75)]}
    assert plots.sync_fractions([_run(lines, {"train": {"local_steps": 2 ** 64}})]) == {}     # once a traceback
    ax = plots.plot_sync_fraction([old])
    assert ax.get_ylim() == (0.0, 1.0)


@pytest.mark.parametrize("bad", ["abc", None, True, 10 ** 400, [1, 2], float("nan"), "missing"])
def test_a_damaged_field_is_no_point_never_a_traceback(tmp_path, capsys, bad):
    """A metrics line read from a file may hold anything where a count should be: its point is not drawn
    (a string, a missing key or an integer of 400 digits was a traceback; null drew at NaN, true at 1)."""
    damaged = [dict(m) for m in LINES]
    for m in damaged[2:]:
        for key in ("tokens", "bytes_sent", "compute_s", "train_loss"):
            if bad == "missing":
                m.pop(key, None)
            else:
                m[key] = bad
    d = make_run(tmp_path, "a", [dict(m, round_s=2.0, compute_s=1.0) for m in damaged[:2]] + damaged[2:])
    run = runs.load(str(d))
    xs, ys = plots.series(run)
    assert xs.tolist() == [100, 200] and ys.tolist() == [4.0, 3.5]
    assert plots.frontier([run], "train_loss") == []          # its last line has no byte count
    assert plots.sync_fraction(run) == 0.5                      # the first round is left out anyway
    for kind in ("metric", "frontier", "sync"):
        code = main.main(["plot", "--runs", str(d), "--kind", kind, "--y", "train_loss",
                          "--out", str(tmp_path / "f.png")])
        err = capsys.readouterr().err
        assert (code, err) == ((0, "") if kind != "frontier" else
                               (2, "error: no run has 'train_loss' against bytes per token as finite numbers "
                                   "in its metrics\n"))


def test_a_metric_that_is_never_finite_is_said_so_not_taken_for_a_slip(tmp_path, capsys):
    d = make_run(tmp_path, "a", [dict(m, train_loss=float("inf")) for m in LINES])
    assert main.main(["plot", "--runs", str(d), "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == "error: no run has 'train_loss' against tokens as finite numbers in its metrics\n"


def test_a_run_that_sent_nothing_stays_on_the_frontiers_axis(tmp_path):
    """One machine's run sends 0 bytes per token: on a log axis its point (on the front) was not drawn."""
    import matplotlib
    matplotlib.use("Agg")
    one = make_run(tmp_path, "one", [line(1, 100, 0, 0, 1.0, 4.0, valid_ppl=40.0)], ["train.local_steps=1"])
    many = make_run(tmp_path, "many", [line(1, 100, 500, 500, 1.0, 4.0, valid_ppl=30.0)], ["train.local_steps=9"])
    ax = plots.plot_frontier(runs.load_all([str(one), str(many)]))
    assert ax.get_xscale() == "symlog"
    lo, hi = ax.get_xlim()
    assert lo <= 0 < 10 <= hi


def test_run_files_that_cannot_be_read_are_one_line_naming_them(tmp_path):
    """A file past its size bound (checked before it is read), a file the system refuses (a link loop
    here; a file without permission alike), a run.json nested deeper than Python's parser goes."""
    big = make_run(tmp_path, "big", LINES)
    with open(big / "metrics.jsonl", "r+b") as f:
        f.truncate(runs.MAX_METRICS + 1)                    # sparse: nothing written
    with pytest.raises(runs.RunError, match=r"metrics.jsonl: 268,435,457 bytes, more than the 256 MiB a run's "
                                            r"metrics.jsonl is read up to$"):
        runs.load(str(big))
    loop = tmp_path / "loop"
    loop.mkdir()
    os.symlink(loop / "metrics.jsonl", loop / "metrics.jsonl")
    with pytest.raises(runs.RunError, match=r"loop/metrics.jsonl: Too many levels of symbolic links$"):
        runs.load(str(loop))
    deep = make_run(tmp_path, "deep", LINES)
    (deep / "run.json").write_text('{"config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert runs.load(str(deep)).config == {}
    for other in ("[1, 2]", "null", '"run"'):         # JSON, but not a table: as if it had none
        (deep / "run.json").write_text(other)
        assert runs.load(str(deep)).config == {}, other


def test_runs_in_a_folder_that_cannot_be_read_are_said_to_be_left_out(tmp_path, capsys):
    """They were left out without a word: a figure of fewer runs than the folder holds, unexplained."""
    make_run(tmp_path / "all", "good", LINES)
    make_run(tmp_path / "all", "empty", [])
    (make_run(tmp_path / "all", "garbage", []) / "metrics.jsonl").write_bytes(bytes(range(256)))
    (make_run(tmp_path / "all", "writing", []) / "metrics.jsonl").write_text('{"round": 1, "tok')
    (tmp_path / "all" / "notes").mkdir()                        # no run at all: nothing to say
    skipped = []
    assert [r.name for r in runs.load_all([str(tmp_path / "all")], skipped)] == ["good"]
    # a whole first line that is no metrics line was called "no complete line yet", as a line being written is
    assert skipped == [f"{tmp_path / 'all' / 'empty'}: metrics.jsonl holds no complete line yet",
                       f"{tmp_path / 'all' / 'garbage'}: metrics.jsonl's first line is not a metrics line (a JSON "
                       "table)", f"{tmp_path / 'all' / 'writing'}: metrics.jsonl holds no complete line yet"]
    assert main.main(["plot", "--runs", str(tmp_path / "all"), "--out", str(tmp_path / "f.png")]) == 0
    assert capsys.readouterr().err == "".join(f"warning: left out {s}\n" for s in skipped)


def test_a_run_named_beside_others_that_has_no_line_yet_is_left_out_and_said(tmp_path, capsys):
    """A run still before its first line (run.json, no metrics.jsonl) stopped a plot of several runs,
    though a run in progress can be plotted."""
    make_run(tmp_path, "good", LINES)
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "run.json").write_text("{}")
    make_run(tmp_path, "empty", [])
    named = [str(tmp_path / n) for n in ("good", "started", "empty")]
    assert main.main(["plot", "--runs", *named, "--out", str(tmp_path / "f.png")]) == 0
    assert capsys.readouterr().err == (
        f"warning: left out {tmp_path / 'started'}: a run with no metrics line yet (run.json, no metrics.jsonl)\n"
        f"warning: left out {tmp_path / 'empty'}: metrics.jsonl holds no complete line yet\n")
    assert main.main(["plot", "--runs", *named[1:], "--out", str(tmp_path / "g.png")]) == 2   # nothing to draw
    assert capsys.readouterr().err == (f"error: {tmp_path / 'started'}: a run with no metrics line yet (run.json, "
                                       "no metrics.jsonl)\n")
    with pytest.raises(runs.RunError):
        runs.load_all(named)                                  # no list to say it in: refused, as before


def test_values_too_far_apart_for_an_axis_are_one_line(tmp_path, capsys, recwarn):
    """Two finite x values at -1.7e308 and 1.7e308 (a damaged or hand-edited metrics file): matplotlib's
    tick locator raised "arange: cannot compute length" through the command as a traceback."""
    run = tmp_path / "r1"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 1, "tokens": -1.7e308, "train_loss": 1.0}\n'
                                       '{"round": 2, "tokens": 1.7e308, "train_loss": 2.0}\n')
    assert main.main(["plot", "--runs", str(run), "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot draw the figure: ") and err.count("\n") == 1, err
    assert not (tmp_path / "p.png").exists()
    assert [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)] == []     # nor NumPy's
