"""The ``rnnlm`` command: installed by setup.cfg, its help and defaults, its errors before Spark
starts, a config's data found from any directory, generate's seed and plot's labels."""
import argparse
import configparser
import json
import os
import shutil
import re
import subprocess
import sys
from importlib import metadata

import pytest

import rnnlm
from rnnlm import config, plots
from rnnlm.cli import checks, main, parsers, tools
from rnnlm.core import checkpoint
from rnnlm.core.models import build as build_model
from rnnlm.core.vocab import Vocab

from conftest import HARBOUR, HARBOUR_VALID, ROOT


def help_text(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main.main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_setup_cfg_declares_the_rnnlm_console_script():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["options.entry_points"]["console_scripts"].split() == ["rnnlm", "=", "rnnlm.cli.main:main"]


def _installed_from_this_checkout():
    """The rnnlm distribution ``pip install -e`` made of this checkout (its ``direct_url.json``
    names it; the ``rnnlm.egg-info`` it leaves in the checkout does not), else None and why."""
    urls = []
    for dist in metadata.distributions(name="rnnlm"):
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        if url and os.path.realpath(url.removeprefix("file://")) == os.path.realpath(ROOT):
            return dist, ""
        urls.append(url or "not pip-installed")
    return None, f"the installed rnnlm is {', '.join(urls) or 'missing'}, not this checkout (pip install -e .)"


def test_pip_install_e_installs_the_rnnlm_command():
    """CI installs this checkout with ``pip install -e``: the script must then be there and run.
    (A venv that installed another checkout, as a worktree's, cannot tell.)"""
    dist, why = _installed_from_this_checkout()
    if dist is None:
        pytest.skip(why)
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"rnnlm": "rnnlm.cli.main:main"}
    exe = os.path.join(os.path.dirname(sys.executable), "rnnlm")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"rnnlm {rnnlm.__version__}\n"), r.stderr


SKIPPING = """
import pytest

def test_skipped_by_a_call():
    pytest.skip("../shared/data is not beside the checkout")

@pytest.mark.skipif(True, reason="a usable GPU is present")
def test_skipped_by_a_mark():
    pass

@pytest.mark.skipif(True, reason="no CUDA device / CuPy")
def test_cupy_kernels():
    pass

def test_runs():
    pass
"""


def test_ci_fails_every_skip_but_the_cuda_one(tmp_path):
    """tests/conftest.py's rule: where CI's ``RNNLM_REQUIRE_*`` is set, a skip fails unless it is the CuPy
    tests' "no CUDA device", whatever skipped it; a module skipped whole (a lost extra) is an error."""
    (tmp_path / "test_some.py").write_text(SKIPPING)
    (tmp_path / "test_lost_extra.py").write_text('import pytest\npytest.importorskip("rnnlm_no_such_extra")\n')
    lax = {k: v for k, v in os.environ.items() if not k.startswith("RNNLM_REQUIRE_")}
    summaries, skipped = [], []
    for env in (lax, dict(lax, RNNLM_REQUIRE_NETNS="1"), dict(lax, RNNLM_REQUIRE_HADOOP="1")):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "conftest", "-p", "no:cacheprovider",
                            "--continue-on-collection-errors", "test_some.py", "test_lost_extra.py"],
                           cwd=tmp_path, env=dict(env, PYTHONPATH=os.path.join(ROOT, "tests")),
                           capture_output=True, text=True, timeout=120)
        summaries.append(r.stdout.strip().splitlines()[-1].split(" in ")[0])
        skipped.append(sorted(re.findall(r"^SKIPPED \[1\] \S+ (.*)$", r.stdout, re.M)))
    assert summaries[0] == "1 passed, 4 skipped" and skipped[0] == [
        "../shared/data is not beside the checkout", "a usable GPU is present",
        "could not import 'rnnlm_no_such_extra': No module named 'rnnlm_no_such_extra'", "no CUDA device / CuPy"]
    # a skip by a mark fails in the test's setup: an error, as is the module's at collection
    assert summaries[1] == summaries[2] == "1 failed, 1 passed, 1 skipped, 2 errors", r.stdout
    assert skipped[1] == skipped[2] == ["no CUDA device / CuPy"]


def test_version_and_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == "rnnlm 0.1.0\n"
    top = help_text(capsys)
    for name in ("train", "evaluate", "generate", "plot", "download", "demo", "minicluster", "package"):
        assert re.search(rf"^    {name}\b", top, re.M), top


def test_every_option_has_help_and_every_default_is_shown(capsys):
    assert "--out PATH            run directory, any Hadoop path: run.json,\n" in help_text(capsys, "train")
    assert "(default: runs/latest)" in help_text(capsys, "train")
    for name in main.COMMANDS:
        ap = argparse.ArgumentParser(formatter_class=parsers.Formatter)
        getattr(parsers, name)(ap)
        text = " ".join(help_text(capsys, name).split())
        for action in ap._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.dest)
            if action.default not in (None, False, [], ""):
                assert f"(default: {action.default})" in text, (name, action.dest, text)


def test_each_command_says_what_it_does_and_rnnlm_alone_names_the_commands(capsys):
    assert help_text(capsys, "train").split("\n\n")[1] == "Train a language model on Spark."
    assert help_text(capsys, "plot").split("\n\n")[1] == "Draw runs' metrics (no Spark)."
    assert main.parser("evaluate").description == "Perplexity of a checkpoint on a text (Spark)."
    with pytest.raises(SystemExit) as e:           # no command: a usage error, not a traceback
        main.main([])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "rnnlm: error: the following arguments are required: COMMAND"


def test_a_command_after_one_a_signal_stopped_starts_afresh(tmp_path, monkeypatch, capsys):
    """A notebook (or a test) runs commands in one process: the signal that stopped one, and the Python logging
    it turned off, must not be the next one's (whose first Ctrl-C would then end the process at once, as a
    second)."""
    import logging
    import signal
    from rnnlm.cli import signals

    def signalled(a):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("the signal did not stop the command")
    monkeypatch.setattr(tools, "plot", signalled)
    plot = ["--runs", str(tmp_path), "--out", str(tmp_path / "f.png")]
    generate = ["--checkpoint", str(tmp_path / "none")]                  # a command that fails alone
    for stopped, then in ((lambda: main.main(["plot", *plot]), lambda: main.job("generate", generate)),   # jobs/*.py
                          (lambda: main.job("plot", plot), lambda: main.main(["generate", *generate]))):
        assert stopped() == 143
        assert signals.stopped() is not None and logging.root.manager.disable == logging.CRITICAL
        assert then() == 2
        assert signals.stopped() is None and logging.root.manager.disable == logging.NOTSET
    capsys.readouterr()


def test_jobs_use_the_same_parsers(capsys):
    """jobs/train.py (spark-submit's entry point) and ``rnnlm train`` accept the same options."""
    r = subprocess.run([sys.executable, "jobs/train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    options = set(re.findall(r"^  (--[a-z-]+)", r.stdout, re.M))
    assert options == set(re.findall(r"^  (--[a-z-]+)", help_text(capsys, "train"), re.M))
    assert {"--config", "--set", "--out", "--resume", "--overwrite", "--dry-run", "--master"} <= options


@pytest.mark.parametrize("key,hint", [
    ("train.round=3", "unknown config key train.round (did you mean train.rounds?)"),
    ("model.rounds=3", "unknown config key model.rounds (did you mean train.rounds?)"),
    ("trian.rounds=3", "unknown config section [trian] (did you mean train?)"),
    ("rounds=3", "--set 'rounds=3': expected section.key=value (did you mean train.rounds=3?)"),
])
def test_a_mistyped_key_suggests_the_right_one(key, hint):
    with pytest.raises(config.ConfigError) as e:
        config.load(None, [key])
    assert str(e.value).startswith(hint), e.value


def test_a_mistyped_key_in_a_file_suggests_the_right_one(tmp_path):
    (tmp_path / "c.toml").write_text("[optim]\nclip_nrom = 1.0\n")
    with pytest.raises(config.ConfigError, match=r"^unknown config key optim.clip_nrom \(did you mean "
                                                 r"optim.clip_norm\?\); known in \[optim\]: name, lr, "):
        config.load(str(tmp_path / "c.toml"))


def tiny_checkpoint(path, *sets):
    cfg = config.load(None, [f"data.train={HARBOUR}", "model.hidden=4", "train.bptt=4", "train.batch=2", *sets])
    vocab = Vocab.build(open(HARBOUR).read(), "char")
    cfg = config.replace(cfg, "model", vocab_size=len(vocab))
    ck = checkpoint.Checkpoint(params=build_model(cfg.model).init_params(1), config=cfg, vocab=vocab,
                               position={"round": 1, "tokens": 8, "bytes_sent": 0, "bytes_broadcast": 0,
                                         "wall_s": 0.0})
    checkpoint.save(str(path), ck)
    return cfg


def test_errors_before_the_jvm_starts_take_no_jvm(tmp_path):
    """Spark's JVM takes 13-16 s to start: each of these is found without it, one line on stderr (no
    Spark UI line, no JVM warning) and exit code 2, in an environment where no JVM can start (``JAVA_HOME`` names
    an empty directory, and no ``java`` is on the path): a command that needs one fails there on Java instead. (A
    2 s bound on each, once, failed under a load of 11 while each took ~0.5 s alone.)"""
    (tmp_path / "nojava").mkdir()
    no_jvm = dict(os.environ, JAVA_HOME=str(tmp_path / "nojava"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"round": 1}\n')
    tiny_checkpoint(tmp_path / "run" / "checkpoint")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"round": 1}\n')
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "MANIFEST.json").write_text("{")
    demo = os.path.join(ROOT, "conf", "demo.toml")
    tiny = ["--set", f"data.train={HARBOUR}", "--set", "model.hidden=4", "--set", "train.bptt=4",
            "--set", "train.batch=2", "--set", "data.valid="]
    cases = [
        (["jobs/train.py", "--config", demo, "--out", str(tmp_path / "used")],
         f"error: {tmp_path / 'used'} already holds a run (use --resume"),
        (["jobs/train.py", "--config", demo, "--out", str(tmp_path / "fresh"), "--resume"],
         f"error: --resume: no checkpoint at {tmp_path / 'fresh'}/checkpoint"),
        (["jobs/train.py", "--config", demo, "--out", str(tmp_path / "run"), "--resume", *tiny,
          "--set", "model.hidden=5"],
         "error: cannot resume: model.hidden is 5 here but 4 in"),
        (["jobs/train.py", "--config", demo, "--set", f"data.train={tmp_path}/none.txt"],
         f"error: data.train: input path does not exist: {tmp_path}/none.txt"),
        (["jobs/train.py", "--config", demo, "--set", "train.rouns=3"],
         "error: unknown config key train.rouns (did you mean train.rounds?)"),
        (["jobs/evaluate.py", "--checkpoint", str(tmp_path / "bad"), "--data", HARBOUR],
         f"error: {tmp_path / 'bad'}: MANIFEST.json"),
        (["jobs/evaluate.py", "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "none.txt")],
         f"error: --data: input path does not exist: {tmp_path}/none.txt"),
    ]
    control = subprocess.run([sys.executable, "jobs/train.py", "--config", demo, "--out", str(tmp_path / "fresh"),
                              "--set", "train.rounds=1"], cwd=ROOT, env=no_jvm, capture_output=True, text=True,
                             timeout=120)
    assert control.returncode == 2 and control.stderr.endswith(NO_JVM) and "Traceback" not in control.stderr, \
        control.stderr[-2000:]
    for argv, expected in cases:
        r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=no_jvm, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (argv, r.stderr[-2000:])
        assert r.stderr.startswith(expected) and r.stderr.count("\n") == 1, (argv, r.stderr[-2000:])


NO_JVM = ("error: Spark's JVM did not start: the lines above are Spark's own (it needs Java 17 or later, at "
          "$JAVA_HOME/bin/java or on the PATH, as spark-env.sh leaves them)\n")


def path_without_java(tmp_path) -> str:
    """A PATH of every command on this one but ``java`` (Spark's launcher needs the shell's tools)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for name in (os.listdir(d) if os.path.isdir(d) else []):
            if name != "java" and not (bin_ / name).exists():
                (bin_ / name).symlink_to(os.path.join(d, name))
    return str(bin_)


@pytest.mark.parametrize("case", ["no java", "a JVM that exits"])
def test_a_jvm_that_cannot_start_is_one_line_and_exit_code_2(tmp_path, case):
    """No Java (PySpark's launcher printed its shell errors, then a 40-line traceback, exit code 1), or a JVM that
    exits as it starts (here a thread stack too small for it): Spark's lines, one of ours last, and exit code 2."""
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env.update({"PATH": path_without_java(tmp_path)} if case == "no java" else
               {"JAVA_TOOL_OPTIONS": "-Xss1k", "JAVA_HOME": os.environ.get("JAVA_HOME", "")})
    r = subprocess.run([sys.executable, "jobs/train.py", "--config", os.path.join(ROOT, "conf", "demo.toml"),
                        "--out", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.endswith(NO_JVM) and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()
    # generate reads a checkpoint that is not local through Spark's Hadoop client
    r = subprocess.run([sys.executable, "jobs/generate.py", "--checkpoint", "hdfs://localhost:9/run"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.endswith(NO_JVM) and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_java_named_in_spark_env_sh_alone_starts_spark(tmp_path):
    """Spark's launcher reads $SPARK_CONF_DIR/spark-env.sh before it looks for Java, where clusters' edge nodes
    often set JAVA_HOME: a check of this shell's JAVA_HOME and PATH before Spark refused such a machine."""
    java = shutil.which("java")
    assert java, "the test needs Java on the PATH"
    home = os.path.dirname(os.path.dirname(os.path.realpath(java)))
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "spark-env.sh").write_text(f"export JAVA_HOME={home}\n")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env.update(PATH=path_without_java(tmp_path), SPARK_CONF_DIR=str(tmp_path / "conf"))
    r = subprocess.run([sys.executable, "jobs/train.py", "--config", os.path.join(ROOT, "conf", "demo.toml"),
                        "--out", str(tmp_path / "run"), "--samples", "0", "--set", "train.rounds=1",
                        "--set", "data.valid="], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "done: round 1" in r.stdout, r.stderr[-2000:]


def test_the_demo_config_finds_its_data_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = []
    cfg = checks.locate_data(config.load(os.path.join(ROOT, "conf", "demo.toml")),
                             os.path.join(ROOT, "conf", "demo.toml"), said.append)
    assert (cfg.data.train, cfg.data.valid) == (HARBOUR, HARBOUR_VALID)
    assert said[0] == (f"data.train: {HARBOUR} (rnnlm/data/harbour.txt in {ROOT}, the config's checkout; "
                       "not in the working directory)")
    # from the checkout itself nothing changes; a config outside a conf/ directory has no checkout
    monkeypatch.chdir(ROOT)
    assert checks.locate_data(config.load("conf/demo.toml"), "conf/demo.toml", said.append).data.train == \
        "rnnlm/data/harbour.txt"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text('[data]\ntrain = "rnnlm/data/harbour.txt"\n')
    with pytest.raises(checks.scan.CorpusError, match=f"^data.train: input path does not exist: {tmp_path}/rnnlm/"
                                                      r"data/harbour.txt$"):
        checks.locate_data(config.load("mine.toml"), "mine.toml", said.append)
    # a preset's corpus not fetched yet, from elsewhere: the key, both places looked in, how to fetch it
    (tmp_path / "other" / "conf").mkdir(parents=True)
    preset = shutil.copy(f"{ROOT}/conf/ptb_word_small.toml", tmp_path / "other" / "conf")
    with pytest.raises(checks.scan.CorpusError) as e:
        checks.locate_data(config.load(preset), preset)
    assert str(e.value) == (f"data.train: input path does not exist: {tmp_path}/data/ptb.train.txt (nor in "
                            f"{tmp_path}/other, the config's checkout): `rnnlm download ptb` fetches it into data/")
    assert len(said) == 2


def test_generate_draws_a_seed_prints_it_and_seed_repeats_it(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "ck")

    def sample(seed=None):
        a = argparse.Namespace(checkpoint=str(tmp_path / "ck"), prime="", length=60, temperature=1.0,
                               argmax=False, seed=seed)
        assert tools.generate(a) == 0
        return capsys.readouterr()

    first, second = sample(), sample()
    seeds = [int(re.fullmatch(r"seed (\d+) \(--seed \1 repeats this sample\)\n", x.err).group(1))
             for x in (first, second)]
    assert seeds[0] != seeds[1] and first.out != second.out
    again = sample(seeds[0])
    assert again.out == first.out and again.err == ""


def test_plot_labels_name_the_runs(tmp_path, monkeypatch, capsys):
    for name, k in (("a", 5), ("b", 10)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(
            {"round": r, "tokens": 100 * r, "syncs": r, "bytes_sent": 10 * r, "bytes_broadcast": 0, "wall_s": r,
             "train_loss": 4.0 - r}) + "\n" for r in (1, 2)))
        (tmp_path / name / "run.json").write_text(json.dumps(
            {"config": config.load(None, [f"train.local_steps={k}"]).to_dict()}))
    drawn = []
    monkeypatch.setattr(plots, "save", lambda ax, path: drawn.append(ax) or path)
    runs_ = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert main.main(["plot", "--runs", *runs_, "--labels", "PTB words", "Shakespeare chars",
                      "--out", str(tmp_path / "f.png")]) == 0
    assert [ln.get_label() for ln in drawn[0].get_lines()] == ["PTB words", "Shakespeare chars"]
    assert main.main(["plot", "--runs", *runs_, "--out", str(tmp_path / "f.png")]) == 0
    assert [ln.get_label() for ln in drawn[1].get_lines()] == ["local_steps=5", "local_steps=10"]
    capsys.readouterr()
    assert main.main(["plot", "--runs", *runs_, "--labels", "one", "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == "error: --labels: 1 labels for 2 runs (a, b)\n"
    # the sync fraction draws a line per codec, not per run: labels given for runs are refused, not dropped
    assert main.main(["plot", "--runs", *runs_, "--kind", "sync", "--labels", "A", "B",
                      "--out", str(tmp_path / "f.png")]) == 2
    assert capsys.readouterr().err == "error: --labels names runs; --kind sync draws one line per codec\n"
