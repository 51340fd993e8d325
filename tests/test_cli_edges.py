"""The command line's small edges: help text, a prime the model cannot read, a metric name mistyped,
the corpora's file mode."""
import dataclasses
import hashlib
import json
import os
import stat

import pytest

from rnnlm import config, download
from rnnlm.cli import tools
from rnnlm.cli.main import main, parser
from rnnlm.core.single import train

from conftest import HARBOUR


def test_generate_help_shows_each_default_once():
    text = " ".join(parser("generate").format_help().split())          # argparse wraps lines
    assert "text the sample continues (default: none) --length" in text, text
    assert "(default: )" not in text


def test_a_prime_outside_the_vocabulary_is_said(tmp_path, capsys):
    cfg = config.load(None, [f"data.train={HARBOUR}", "data.valid=", "data.level=char", "model.hidden=8",
                             "train.rounds=1", "train.bptt=8", "train.batch=2", "train.eval_every=0"])
    train(cfg, out=str(tmp_path / "ck"), log=lambda s: None)
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prime", "The", "--length", "5",
                 "--seed", "1"]) == 0
    assert "note:" not in capsys.readouterr().err          # every character known: nothing to say
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prime", "Thé ☃ é", "--length", "5",
                 "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert err == "note: --prime has 2 chars outside the model's vocabulary, read as its unknown token: 'é', '☃'\n"
    for n, more in ((10, ""), (11, " ...")):            # ten are shown, and whether there are more
        greek = "".join(chr(0x391 + i) for i in range(n))
        assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prime", greek, "--length", "1",
                     "--seed", "1"]) == 0
        shown = ", ".join(repr(c) for c in greek[:10])
        assert capsys.readouterr().err == (f"note: --prime has {n} chars outside the model's vocabulary, read as its "
                                           f"unknown token: {shown}{more}\n")
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prime", "Thé", "--length", "5",
                 "--argmax", "--temperature", "0.5"]) == 0
    assert capsys.readouterr().err == (
        "note: --prime has 1 char outside the model's vocabulary, read as its unknown token: 'é'\n"
        "note: --temperature does not change --argmax's text (the likeliest token at any temperature)\n")
    for t in ("0", "-1", "nan", "inf"):         # named by the option, before any checkpoint is read (none is here)
        assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--temperature", t]) == 2
        assert capsys.readouterr().err == (f"error: --temperature must be a number > 0 (--argmax takes the likeliest "
                                           f"token), not {float(t)}\n")


def test_a_mistyped_metric_gets_a_did_you_mean(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "tokens": 10, "syncs": 1, "wall_s": 1.0,
                                                   "train_loss": 3.0, "valid_ppl": 20.0}) + "\n")
    (run / "run.json").write_text(json.dumps({"config": config.load(None, []).to_dict()}))
    assert main(["plot", "--runs", str(run), "--y", "valid_pp", "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == "error: no run has 'valid_pp' in its metrics (did you mean valid_ppl?)\n"
    # each kind of figure with nothing to draw: one line saying why, no empty figure
    for kind, said in (("frontier", "no run has 'valid_ppl' against bytes per token as finite numbers in its metrics"),
                       ("sync", "no synchronous run with round timings")):
        assert main(["plot", "--runs", str(run), "--kind", kind, "--y", "valid_ppl", "--out",
                     str(tmp_path / "f.png")]) == 2
        assert capsys.readouterr().err == f"error: {said}\n"
    # train_ppl is drawn from train_loss: held, but not as a finite number
    (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "tokens": 10, "syncs": 1, "wall_s": 1.0,
                                                   "train_loss": None}) + "\n")
    assert main(["plot", "--runs", str(run), "--y", "train_ppl", "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == "error: no run has 'train_ppl' against tokens as finite numbers in its metrics\n"
    assert not (tmp_path / "f.png").exists()


def test_downloaded_corpora_are_readable_by_others_as_the_umask_allows(tmp_path, monkeypatch):
    """mkstemp makes 0600 files: a corpus fetched for a shared data/ directory was the fetcher's alone."""
    data = b"hello corpus\n"
    monkeypatch.setitem(download.CORPORA, "toy", {"toy.txt": ("https://example.invalid/toy.txt",
                                                              hashlib.sha256(data).hexdigest(), len(data))})
    monkeypatch.setattr(download, "CORPORA", {"toy": download.CORPORA["toy"]})     # `rnnlm download`: every one
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "toy.txt").write_bytes(data)
    old = os.umask(0o022)
    try:
        assert main(["download", "--dest", str(tmp_path / "data"), "--mirror", str(tmp_path / "mirror")]) == 0
    finally:
        os.umask(old)
    path = tmp_path / "data" / "toy.txt"
    assert path.read_bytes() == data and stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_unknown_tokens_keeps_order_and_counts_each_once():
    from rnnlm.core.vocab import Vocab
    v = Vocab.build("the cat sat\n", "word")
    assert tools.unknown_tokens(v, "the dog and the dog") == ["dog", "and"]


def run_dir(root, name, k, sent, sets=()):
    """A run directory as the trainer writes it (metrics.jsonl, run.json from a real configuration)."""
    d = root / name
    d.mkdir()
    lines = [{"round": r, "tokens": 100 * r, "syncs": r, "bytes_sent": sent * r, "bytes_broadcast": 0,
              "wall_s": float(r), "round_s": 1.0, "compute_s": 0.6 + 0.01 * k, "train_loss": 4.0 - r / 10,
              "valid_ppl": 50.0 - k - r} for r in (1, 2, 3)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    cfg = config.load(None, [f"train.local_steps={k}", *sets])
    (d / "run.json").write_text(json.dumps({"config": cfg.to_dict()}))
    return str(d)


def test_plots_name_every_k_plain_bytes_and_what_all_runs_send_alike(tmp_path):
    """`plot --kind sync` of K = 10 and 20 labelled only 10^1; the frontier's ticks read 4x10^2 .. 7x10^2;
    labels made of what differs hid that softmax and hidden were fp16 in every run."""
    import matplotlib
    matplotlib.use("Agg")
    from rnnlm import plots, runs
    fp16 = ("exchange.softmax=rows+fp16", "exchange.hidden=dense+fp16")
    rs = runs.load_all([run_dir(tmp_path, n, k, sent, (e, *fp16)) for n, k, sent, e in (
        ("a", 10, 40_000, "exchange.embed=rows"), ("b", 20, 50_000, "exchange.embed=rows"),
        ("c", 10, 70_000, "exchange.embed=dense"))])
    ax = plots.plot_sync_fraction(rs)
    ax.figure.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["10", "20"]
    ax = plots.plot_frontier(rs)
    ax.figure.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True) if t.get_text()]
    assert ticks and all(t.replace(".", "").isdigit() for t in ticks), ticks     # 400, 500, 600, 700
    assert ax.get_legend().get_title().get_text() == "all runs: softmax rows+fp16, hidden dense+fp16"
    ax = plots.plot_metric(rs, "tokens", "train_loss")
    assert ax.get_legend().get_title().get_text() == "all runs: softmax rows+fp16, hidden dense+fp16"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == runs.labels(rs)


def test_input_paths_checked_before_spark_leave_hadoops_brace_globs_to_it(tmp_path):
    from rnnlm.cli.checks import check_input
    from rnnlm.spark.corpus import CorpusError
    (tmp_path / "a.txt").write_text("x\n")
    check_input(str(tmp_path / "a.txt"), "data.train")
    check_input(str(tmp_path / "*.txt"), "data.train")                    # Python's glob matches
    check_input(str(tmp_path / "{b,c}.txt"), "data.train")                # Hadoop's alone: its to check
    for missing in ("b.txt", "*.csv"):
        with pytest.raises(CorpusError) as e:
            check_input(str(tmp_path / missing), "data.train")
        assert str(e.value) == f"data.train: input path does not exist: {tmp_path / missing}"


def test_a_used_out_is_refused_before_spark_unless_overwritten_or_a_dry_run(tmp_path):
    from rnnlm.cli.checks import check_train
    from rnnlm.spark.rundir import TrainingError
    cfg = config.load(None, [f"data.train={HARBOUR}", "data.valid="])
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 1}\n')
    for given in (str(out), f"file:{out}", f"file://{out}"):                   # a URI: named by its path
        with pytest.raises(TrainingError) as e:
            check_train(cfg, None, given, False, False, False)
        assert str(e.value).startswith(f"{out} already holds a run"), str(e.value)
    assert check_train(cfg, None, str(out), False, True, False) == cfg            # --overwrite
    assert check_train(cfg, None, str(out), False, False, True) == cfg            # --dry-run writes nothing
    assert (out / "metrics.jsonl").read_text() == '{"round": 1}\n'              # nothing touched


def test_demo_trains_the_embedded_default_and_prints_two_samples(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                          # the config's own checkout supplies its corpus
    assert main(["demo", "--set", "train.rounds=1", "--set", "model.hidden=8", "--set", "train.local_steps=2",
                 "--set", "train.seed=7", "--prime", "The sea"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("data.train: ") and lines[1].startswith("data.valid: ")   # found in the checkout
    assert lines[2].startswith("vocab ")
    heads = [s for s in out.splitlines() if s.startswith("--- sample")]
    # the run's seed fixes its samples too (they were seeds 1 and 2 whatever train.seed said)
    assert heads == ["--- sample (temperature 0.7, seed 7) ---", "--- sample (temperature 1.0, seed 8) ---"]
    assert all(out.split(h)[1].lstrip("\n").startswith("The sea") for h in heads)


@pytest.mark.parametrize("sets, message", [
    (["train.device=gpu"], "error: "),                                           # no CUDA here: a RuntimeError
    (["optim.name=sgd", "optim.lr=1e38", "optim.clip_norm=0"], "error: loss became"),   # FloatingPointError
    (["data.train=/dev/zero"], "error: /dev/zero is not a regular file"),       # read forever
])
def test_the_demo_says_what_stopped_it_in_one_line(capsys, sets, message, monkeypatch):
    """A traceback each: train.device = gpu without a GPU, a run that diverged, a corpus that never ends."""
    assert main(["demo", "--set", "train.rounds=2", "--set", "model.hidden=8", "--set", "train.local_steps=2",
                 *[a for x in sets for a in ("--set", x)]]) != 0
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err, err


def test_the_demo_names_the_text_it_could_not_read(capsys, tmp_path):
    """A strict decode said "'utf-8' codec can't decode byte 0xff in position 2", a directory "[Errno 21] Is a
    directory", neither naming the file; a FIFO blocked the demo."""
    (tmp_path / "bad.txt").write_bytes(b"ab\xffcd\n" * 100)
    os.mkfifo(tmp_path / "fifo.txt")
    for sets, said in (([f"data.train={tmp_path / 'bad.txt'}", "data.encoding_errors=strict"],
                        f"{tmp_path / 'bad.txt'} is not UTF-8 text (invalid start byte; data.encoding_errors = "
                        "'strict'): 'replace' reads such bytes as U+FFFD"),
                       ([f"data.train={tmp_path}"], f"{tmp_path} is a directory"),
                       ([f"data.train={tmp_path / 'fifo.txt'}"], f"{tmp_path / 'fifo.txt'} is not a regular file"),
                       ([f"data.train={tmp_path / 'none.txt'}"],        # was "[Errno 2] No such file or directory: ..."
                        f"{tmp_path / 'none.txt'}: No such file"),
                       (["data.train=data/none.txt"], "data/none.txt: No such file (rnnlm download fetches the "
                                                      "corpora the presets name)")):
        assert main(["demo", *[a for x in sets for a in ("--set", x)]]) == 2
        assert capsys.readouterr().err == f"error: {said}\n"


def test_a_text_larger_than_the_single_trainer_reads_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import os
    from rnnlm.core.single import read_text
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(1 << 30)                                       # sparse: nothing written
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1 << 20}[name])  # 4 GiB
    with pytest.raises(ValueError, match=r"big.txt: 1,073,741,824 bytes, more than the 256 MiB \(a sixteenth"):
        read_text(str(big))


def test_a_sample_without_a_seed_prints_the_one_it_drew_unless_argmax(tmp_path, capsys):
    cfg = config.load(None, [f"data.train={HARBOUR}", "data.valid=", "data.level=char", "model.hidden=8",
                             "train.rounds=1", "train.bptt=8", "train.batch=2", "train.eval_every=0"])
    train(cfg, out=str(tmp_path / "ck"), log=lambda s: None)
    base = ["generate", "--checkpoint", str(tmp_path / "ck"), "--length", "20"]
    assert main(base) == 0
    err = capsys.readouterr().err
    seed = int(err.split()[1])
    assert err == f"seed {seed} (--seed {seed} repeats this sample)\n"
    assert main(base + ["--argmax"]) == 0 and capsys.readouterr().err == ""
    assert main(base + ["--seed", "3"]) == 0 and capsys.readouterr().err == ""


def test_download_without_names_fetches_every_corpus(tmp_path, shared_data):
    """Every corpus, each file verified by its listed size and digest (PTB's and Tiny Shakespeare's)."""
    assert main(["download", "--dest", str(tmp_path / "d"), "--mirror", shared_data]) == 0
    assert sorted(os.listdir(tmp_path / "d")) == sorted(
        [n for files in download.CORPORA.values() for n in files] + ["tinyshakespeare.train.txt",
                                                                     "tinyshakespeare.valid.txt"])


def test_an_output_path_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """package --out and download --dest under a file or onto a directory: tracebacks, and a .zip.tmp
    left behind."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir.zip").mkdir()
    for out, why in ((tmp_path / "file" / "rnnlm.zip", f"{tmp_path / 'file'} is a file, not a directory"),
                     (tmp_path / "dir.zip", "Is a directory")):
        assert main(["package", "--out", str(out)]) == 2
        assert capsys.readouterr() == ("", f"error: cannot write {out}: {why}\n")
    assert sorted(os.listdir(tmp_path)) == ["dir.zip", "file"] and os.listdir(tmp_path / "dir.zip") == []
    assert main(["download", "ptb", "--dest", str(tmp_path / "file"), "--mirror", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --dest {tmp_path / 'file'} is a file, not a directory\n"
    assert (tmp_path / "file").read_text() == "x"
    assert main(["package", "--out", str(tmp_path / "ok" / "rnnlm.zip")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'ok' / 'rnnlm.zip'}\n"


def test_a_temporary_file_beside_the_output_is_this_process_own(tmp_path, capsys):
    """``package`` and the corpus split wrote ``<out>.tmp``, a name shared by every process: a second
    build of the same output on the same host wrote into the first one's file and renamed it away."""
    (tmp_path / "rnnlm.zip.tmp").write_text("another build's")
    assert main(["package", "--out", str(tmp_path / "rnnlm.zip")]) == 0 and capsys.readouterr().err == ""
    (tmp_path / "text.txt").write_text("first paragraph\n\nsecond paragraph\n")
    (tmp_path / "text.train.txt.tmp").write_text("another split's")
    download.split_train_valid(str(tmp_path / "text.txt"), 0.5)
    assert (tmp_path / "rnnlm.zip.tmp").read_text() == "another build's"
    assert (tmp_path / "text.train.txt.tmp").read_text() == "another split's"
    assert sorted(os.listdir(tmp_path)) == ["rnnlm.zip", "rnnlm.zip.tmp", "text.train.txt", "text.train.txt.tmp",
                                            "text.txt", "text.valid.txt"]


def test_a_build_or_split_interrupted_midway_leaves_no_part_of_its_file(tmp_path, monkeypatch):
    import zipfile
    from rnnlm import packaging

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(zipfile.ZipFile, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        packaging.build_pyfiles(str(tmp_path / "rnnlm.zip"))
    (tmp_path / "text.txt").write_text("first paragraph\n\nsecond paragraph\n")
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        download.split_train_valid(str(tmp_path / "text.txt"), 0.5)
    assert os.listdir(tmp_path) == ["text.txt"]


def test_a_line_break_in_a_name_cannot_forge_a_second_error_line(tmp_path, capsys):
    forged = tmp_path / "x\nerror: forged"
    forged.mkdir()
    assert main(["plot", "--runs", str(forged), "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}/x\\nerror: forged: not a run (no metrics.jsonl)\n"


def test_an_escape_or_a_bidi_override_in_a_name_is_shown_escaped(tmp_path, capsys):
    """ESC recoloured the terminal (or cleared it), U+202E printed the rest of the line reversed."""
    odd = tmp_path / "a\x1b[2Jb\u202ec"
    odd.mkdir()
    assert main(["plot", "--runs", str(odd), "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}/a\\x1b[2Jb\\u202ec: not a run (no metrics.jsonl)\n"


def test_plot_refuses_a_metrics_file_that_is_not_a_regular_file(tmp_path, capsys):
    """A FIFO named metrics.jsonl blocked ``plot`` until killed."""
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "metrics.jsonl")
    assert main(["plot", "--runs", str(tmp_path / "run"), "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'run' / 'metrics.jsonl'}: not a regular file\n"


@pytest.mark.parametrize("out", ["", " ", "/", "file:///", "hdfs://nn:8020/", "/.", "/tmp/..", "hdfs://nn:8020/.",
                                 "hdfs://nn:8020", "file:"])
def test_an_out_of_nothing_or_a_root_is_refused_before_spark(out):
    """An unset variable (``--out "$OUT"``) put run.json, metrics.jsonl and checkpoint/ in the root, and
    ``--overwrite`` deleted from there."""
    from rnnlm.cli.checks import check_train
    from rnnlm.spark.rundir import RunDir, TrainingError
    cfg = config.load(None, [f"data.train={HARBOUR}", "data.valid="])
    for overwrite, dry_run in ((False, False), (True, False), (False, True)):
        with pytest.raises(TrainingError, match="^--out (is empty|.*: a filesystem's root cannot be a run's dir)"):
            check_train(cfg, None, out, False, overwrite, dry_run)
    with pytest.raises(TrainingError):
        RunDir(out, fs=object())


def test_demo_out_replaces_a_checkpoint_and_refuses_anything_else(tmp_path, capsys, monkeypatch):
    """``demo --out`` replaced whatever was there: a run's directory, a folder of notes, ``.``."""
    monkeypatch.chdir(tmp_path)
    tiny = ["--set", "train.rounds=1", "--set", "model.hidden=8", "--set", "train.local_steps=1"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "ck", tmp_path / "link")
    for out in (mine, tmp_path / "file", tmp_path / "link", "."):
        assert main(["demo", "--out", str(out), *tiny]) == 2
        assert capsys.readouterr().err == (f"error: --out {out}: exists and is not a checkpoint; the demo replaces "
                                           "only a checkpoint (name a new directory)\n")
    assert (mine / "notes.txt").read_text() == "precious" and (tmp_path / "file").read_text() == "x"
    assert main(["demo", "--out", "", *tiny]) == 2
    assert capsys.readouterr().err == "error: --out is empty: name the checkpoint directory to write\n"
    assert main(["demo", "--out", str(tmp_path / "ck"), *tiny]) == 0              # a new path
    first = (tmp_path / "ck" / "params.npy").read_bytes()
    assert main(["demo", "--out", str(tmp_path / "ck"), *tiny, "--set", "train.seed=2"]) == 0   # a checkpoint: replaced
    assert (tmp_path / "ck" / "params.npy").read_bytes() != first
    run = tmp_path / "run"                          # a run's checkpoint (a run directory's, or its best)
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "MANIFEST.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert main(["demo", "--out", str(run / "checkpoint"), *tiny]) == 2
    assert capsys.readouterr().err == (f"error: --out {run / 'checkpoint'}: the checkpoint of the run in {run}, which "
                                       "its --resume reads; the demo replaces only a checkpoint of its own (name a "
                                       "new directory)\n")
    assert os.listdir(run / "checkpoint") == ["MANIFEST.json"]
    started = tmp_path / "started"                  # a run that has written its run.json, no metrics yet
    (started / "checkpoint").mkdir(parents=True)
    (started / "checkpoint" / "MANIFEST.json").write_text("{}")
    (started / "run.json").write_text("{}")
    assert main(["demo", "--out", str(started / "checkpoint"), *tiny]) == 2
    assert "the checkpoint of the run in" in capsys.readouterr().err
    os.symlink(tmp_path / "ck", tmp_path / "to-ck")  # a link to a checkpoint: the link would be replaced
    assert main(["demo", "--out", str(tmp_path / "to-ck"), *tiny]) == 2
    assert "exists and is not a checkpoint" in capsys.readouterr().err and os.path.islink(tmp_path / "to-ck")


@pytest.fixture
def checkpoint_dir(tmp_path):
    cfg = config.load(None, [f"data.train={HARBOUR}", "data.valid=", "data.level=char", "model.hidden=8",
                             "train.rounds=1", "train.bptt=8", "train.batch=2", "train.eval_every=0"])
    train(cfg, out=str(tmp_path / "ck"), log=lambda s: None)
    return str(tmp_path / "ck")


def test_a_reader_that_goes_away_or_a_full_disk_ends_generate_without_a_traceback(checkpoint_dir):
    """``generate ... | head -c 10`` ended in BrokenPipeError's traceback, ``> /dev/full`` in OSError's."""
    import subprocess
    import sys
    from conftest import ROOT
    cmd = [sys.executable, os.path.join(ROOT, "jobs", "generate.py"), "--checkpoint", checkpoint_dir,
           "--length", "20", "--seed", "1"]
    read, write = os.pipe()
    os.close(read)                                                     # the reader has gone, as head's does
    try:
        r = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
        assert (r.returncode, r.stderr) == (141, "")                   # 128 + SIGPIPE, as a shell reports it
        both = subprocess.run(cmd[:-2], stdout=write, stderr=write, timeout=120)    # 2>&1 | head; it says its seed
        assert both.returncode == 141
        failed = subprocess.run(cmd[:2] + ["--checkpoint", "/nonexistent"], stdout=write, stderr=subprocess.PIPE,
                                text=True, timeout=120)
        assert failed.returncode == 2 and failed.stderr.startswith("error: ")      # its own failure, not the pipe's
        failed = subprocess.run(cmd[:2] + ["--checkpoint", "/nonexistent"], stdout=write, stderr=write, timeout=120)
        assert failed.returncode == 2                       # its error line lost with the reader: still its code
    finally:
        os.close(write)
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, "error: cannot write to standard output: No space left on device\n")


def test_a_stream_without_a_descriptor_is_left_as_it_is(monkeypatch):
    """A test's capture (no file descriptor to point at /dev/null) is not guarded: it stays the stream."""
    import io
    import sys
    from rnnlm.cli import stdout
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stdout", captured)
    with stdout.guarded() as (out, _):
        assert sys.stdout is captured and not out.active
    assert sys.stdout is captured


def test_text_the_terminal_cannot_encode_is_escaped_and_weights_that_overflow_are_one_line(checkpoint_dir):
    """A prime holding bytes that were not UTF-8 (surrogates) ended in UnicodeEncodeError's traceback where
    standard output encodes strictly; a model whose weights overflow on the text printed three NumPy
    warnings, then "Probabilities contain NaN"."""
    import subprocess
    import sys
    import numpy as np
    from conftest import ROOT
    from rnnlm.core import checkpoint
    cmd = [sys.executable, os.path.join(ROOT, "jobs", "generate.py"), "--length", "3", "--seed", "1"]
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    r = subprocess.run(cmd + ["--checkpoint", checkpoint_dir, "--prime", "ab\udcff"], env=env, timeout=120,
                       capture_output=True, text=True, errors="surrogateescape")
    assert r.returncode == 0 and r.stdout.startswith("ab\\udcff"), (r.stdout, r.stderr)
    ascii_only = dict(os.environ, PYTHONIOENCODING="ascii")          # escaped in the stream's own encoding
    r = subprocess.run(cmd + ["--checkpoint", checkpoint_dir, "--prime", "caf\u00e9"], env=ascii_only, timeout=120,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("caf\\xe9"), (r.stdout, r.stderr)
    ck = checkpoint.load(checkpoint_dir)
    huge = os.path.join(os.path.dirname(checkpoint_dir), "huge")
    checkpoint.save(huge, dataclasses.replace(ck, params=np.full_like(ck.params, 3e38)))
    r = subprocess.run(cmd + ["--checkpoint", huge], timeout=120, capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (2, "error: the model's next-token scores are not finite (its weights "
                                           "overflow float32's range on this text): nothing to sample\n")


@pytest.mark.parametrize("command, option, value, said", [
    ("generate", "--length", "-1", "-1 is out of range [0, 1000000]"),
    ("generate", "--length", "1" + "0" * 13, "a number of 14 digits is out of range [0, 1000000]"),   # in memory
    ("generate", "--length", "1" + "0" * 400, "a number of 401 digits is out of range"),   # beyond a float's range
    ("generate", "--seed", "-1" + "0" * 400, "-a number of 401 digits is out of range"),
    ("generate", "--length", "9" * 5000, "expected an integer, got '" + "9" * 39),
    ("generate", "--seed", "-1", "-1 is out of range [0, inf]"),                  # NumPy's words, no option named
    ("generate", "--length", "1" + "0" * 11, "100000000000 is out of range [0, 1000000]"),   # 12 digits: shown
    ("generate", "--length", "1" + "0" * 12, "a number of 13 digits is out of range [0, 1000000]"),
    ("train", "--samples", "-1", "-1 is out of range [0, 1000]"),                 # taken as none
    ("minicluster", "--nm-memory-mb", "99999999999", "99999999999 is out of range [1024, 1048576]"),   # Java int
])
def test_a_count_out_of_its_range_is_refused_naming_the_option(capsys, command, option, value, said):
    with pytest.raises(SystemExit) as e:
        parser(command, prog=command).parse_args(["--checkpoint", "ck", option, value] if command == "generate"
                                                 else [option, value])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"{command}: error: argument {option}: {said}")


def test_a_count_at_its_ranges_edges_is_taken_and_the_defaults_are_the_documented_ones():
    for command, option, value in (("generate", "--length", 1_000_000), ("generate", "--length", 0),
                                   ("train", "--samples", 1000), ("train", "--samples", 0),
                                   ("minicluster", "--datanodes", 1), ("minicluster", "--datanodes", 4),
                                   ("minicluster", "--nodemanagers", 1), ("minicluster", "--nodemanagers", 4)):
        args = {"generate": ["--checkpoint", "ck"], "train": ["--config", "c.toml"]}.get(command, [])
        got = parser(command, prog=command).parse_args([*args, option, str(value)])
        assert getattr(got, option[2:].replace("-", "_")) == value, (option, value)
    assert parser("generate", prog="generate").parse_args(["--checkpoint", "ck"]).length == 300
    assert parser("train", prog="train").parse_args(["--config", "c.toml"]).samples == 1     # "a sample" (README)
    cluster = parser("minicluster", prog="minicluster").parse_args([])     # two of each, 3 GiB a NodeManager
    assert (cluster.datanodes, cluster.nodemanagers, cluster.nm_memory_mb) == (2, 2, 3072)


@pytest.mark.parametrize("option", ["--datanodes", "--nodemanagers"])
@pytest.mark.parametrize("value", ["0", "5"])
def test_a_minicluster_of_no_node_or_more_than_four_is_refused(capsys, option, value):
    with pytest.raises(SystemExit) as e:
        parser("minicluster", prog="minicluster").parse_args([option, value])
    assert e.value.code == 2
    assert (capsys.readouterr().err.splitlines()[-1]
            == f"minicluster: error: argument {option}: invalid choice: {value} (choose from 1, 2, 3, 4)")


def test_a_minicluster_without_a_directory_is_refused_before_anything_starts(capsys):
    assert main(["minicluster", "--datanodes", "1"]) == 2
    assert capsys.readouterr().err == "error: --dir is required (or --build)\n"


@pytest.mark.parametrize("command, given, missing", [
    ("train", [], "--config"),                      # else a run of the built-in defaults
    ("evaluate", ["--data", "t.txt"], "--checkpoint"),
    ("evaluate", ["--checkpoint", "ck"], "--data"),
    ("generate", [], "--checkpoint"),
    ("plot", ["--out", "f.png"], "--runs"),
    ("plot", ["--runs", "r"], "--out"),
])
def test_a_command_without_what_it_needs_is_refused_naming_it(capsys, command, given, missing):
    with pytest.raises(SystemExit) as e:
        main([command, *given])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"rnnlm {command}: error: the following arguments are required: {missing}", err


def test_a_standalone_master_that_does_not_answer_is_one_line_before_the_jvm(tmp_path, capsys, monkeypatch):
    """Spark tried an unreachable master for a minute, logged ~100 lines of stack traces, and the command
    ended on "a Spark job failed: ... Cannot call methods on a stopped SparkContext"."""
    import socket
    import time
    from rnnlm.cli.session import check_master
    monkeypatch.setattr("rnnlm.spark.session.get_spark", lambda *a, **k: pytest.fail("Spark was started"))
    # as in a process of its own (a test's shared session would be the one used, with its own master)
    monkeypatch.setattr("pyspark.sql.SparkSession.getActiveSession", lambda: None)
    with socket.socket() as s:            # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    rc = main(["train", "--config", "conf/demo.toml", "--out", str(tmp_path / "o"), "--master",
               f"spark://127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert (rc, err) == (2, f"error: the Spark master spark://127.0.0.1:{port} does not answer (127.0.0.1:{port}: "
                            "Connection refused): start it, or name another with --master\n")
    assert time.monotonic() - t0 < 10
    with socket.socket() as s:            # of standby masters, one that takes a connection is enough
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_master(f"spark://127.0.0.1:{port},127.0.0.1:{s.getsockname()[1]}")
    check_master("local[2]")
    with pytest.raises(Exception, match=r"\(127.0.0.1:x: not host:port\)"):
        check_master("spark://127.0.0.1:x")


def test_a_signal_just_after_the_jvm_started_still_stops_the_session(monkeypatch):
    """Between the JVM's start and the try that stops it (installing the handlers, the log level, the UI line)
    a Ctrl-C left the session to Spark's shutdown hooks, which log ERROR lines in local-cluster mode."""
    import types
    from pyspark.sql import SparkSession
    from rnnlm.cli import session as cli_session, signals
    stopped = []
    fake = types.SimpleNamespace(sparkContext=types.SimpleNamespace(setLogLevel=lambda level: None, uiWebUrl=None),
                                 stop=lambda: stopped.append(True))
    monkeypatch.setattr("rnnlm.spark.session.get_spark", lambda *a, **k: fake)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))

    def ctrl_c():
        raise KeyboardInterrupt
    monkeypatch.setattr(signals, "install", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        with cli_session.spark_session("test", "local[1]"):
            pass
    assert stopped == [True]


def test_a_url_python_cannot_parse_is_one_line_naming_it(tmp_path, capsys):
    """urlparse's "Invalid IPv6 URL" escaped plot and evaluate as a traceback, before Spark started."""
    bad = "webhdfs://[nn:9870/x"
    assert main(["plot", "--runs", bad, "--out", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == f"error: {bad}: not a path or a URL (Invalid IPv6 URL)\n"
    assert main(["evaluate", "--checkpoint", str(tmp_path / "none"), "--data", "hdfs://[nn/x"]) == 2
    assert capsys.readouterr().err == "error: hdfs://[nn/x: not a path or a URL (Invalid IPv6 URL)\n"


def test_a_namenode_that_never_answers_stops_the_read_not_the_plot(tmp_path, capsys, monkeypatch):
    """The WebHDFS client had no timeout: a server that took the connection and said nothing held
    ``rnnlm plot`` (and a notebook) for ever."""
    import socket
    from rnnlm import runs
    monkeypatch.setattr(runs, "WEBHDFS_TIMEOUT_S", 0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        assert main(["plot", "--runs", f"webhdfs://127.0.0.1:{port}/runs/x", "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: webhdfs://127.0.0.1:{port}/runs/x") and err.count("\n") == 1, err
    assert "timed out" in err.lower(), err


@pytest.mark.parametrize("master, taken", [
    ("local", True), ("local[2]", True), ("local[*]", True), ("local[4, 3]", True), ("local-cluster[2,1,1024]", True),
    ("yarn", True), ("spark://a:7077,b:7077", True), ("k8s://https://api:6443", True),
    ("bogus", False), ("local2", False), ("local[x]", False), ("local[0]", False), ("local[2] ", False),
    ("spark://", False), ("yarn-client", False), ("local-cluster[2,1]", False)])
def test_a_master_spark_cannot_parse_is_refused_before_its_jvm_starts(capsys, master, taken):
    """A typo printed Spark's Java stack trace, and then a line naming the JVM gateway or 'a Spark job'."""
    for command in ("train", "evaluate"):
        args = ["--config", "c.toml"] if command == "train" else ["--checkpoint", "ck", "--data", "d"]
        if taken:
            assert parser(command, prog=command).parse_args([*args, "--master", master]).master == master
            continue
        with pytest.raises(SystemExit) as e:
            parser(command, prog=command).parse_args([*args, "--master", master])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"{command}: error: argument --master: {master!r} is not a Spark master: local, local[N], local[*], "
            "local[N,F], local-cluster[W,C,MB], yarn, spark://HOST:PORT or k8s://URL")


@pytest.mark.parametrize("spread", [(220, 380), (40_000, 70_000), (1_300, 200_700), (1_300, 9_000_000)])
def test_the_frontiers_byte_labels_never_run_together(tmp_path, spread):
    """Over two decades (13 to 2,007 bytes a token) every minor tick was labelled: "30 40506070809100"."""
    import matplotlib
    matplotlib.use("Agg")
    from rnnlm import plots, runs
    rs = runs.load_all([run_dir(tmp_path, n, 10, sent) for n, sent in zip("ab", spread)])
    ax = plots.plot_frontier(rs)
    ax.figure.canvas.draw()
    shown = [t for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True) if t.get_text()]
    texts = [t.get_text() for t in shown]
    assert len(texts) >= 2 and all(t.replace(".", "").isdigit() for t in texts), texts
    assert len(set(texts)) == len(texts), texts                     # 2.2 .. 3.8 read 2, 2, 3, 3, 3
    boxes = sorted((t.get_window_extent().x0, t.get_window_extent().x1) for t in shown)
    assert all(b[0] > a[1] for a, b in zip(boxes, boxes[1:])), texts


def test_an_empty_corpus_or_a_directory_holding_one_is_refused_before_spark(tmp_path):
    """Both were said by Spark's read, after its JVM's 8-9 s; a missing path already was not."""
    import gzip
    from rnnlm.cli.checks import check_train
    from rnnlm.spark.corpus import CorpusError
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty.txt.gz").write_bytes(gzip.compress(b""))      # 20 bytes, none of them text
    (tmp_path / "none").mkdir()
    (tmp_path / "nested" / "sub").mkdir(parents=True)
    (tmp_path / "nested" / "a.txt").write_text("x\n")
    (tmp_path / "nested" / "_hidden").mkdir()                         # as _temporary: Hadoop skips it
    (tmp_path / ".hidden.txt").write_text("text\n")                   # text, but a name Hadoop skips
    for key, name, said in (("train", "empty.txt", "data.train: {p} is empty"),
                            ("valid", "empty.txt.gz", "data.valid: {p} is empty"),
                            ("train", "none", "data.train: {p} is empty"),
                            ("train", "empty*", "data.train: {p} is empty"),
                            ("train", ".hidden.txt", "data.train: {p}: Hadoop reads no file whose name starts with "
                                                     "_ or . (it takes them for its own, as _SUCCESS)"),
                            ("valid", "nested", f"{{p}}: {tmp_path}/nested/sub is a directory: a corpus directory is "
                                                f"read as its files, not its subdirectories (name them with a glob, "
                                                f"such as {tmp_path}/nested/*/*)")):
        p = str(tmp_path / name)
        cfg = config.load(None, [f"data.train={HARBOUR}", "data.valid=", f"data.{key}={p}"])
        with pytest.raises(CorpusError) as e:
            check_train(cfg, None, str(tmp_path / "run"), False, False, False)
        assert str(e.value) == said.format(p=p)
    (tmp_path / "nested" / "sub").rmdir()
    cfg = config.load(None, [f"data.train={tmp_path / 'nested'}", "data.valid="])
    assert check_train(cfg, None, str(tmp_path / "run"), False, False, False) == cfg    # a file with text
