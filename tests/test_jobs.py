"""The command-line jobs, run as a user would."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


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
    r = run("jobs/demo.py", "--set", f"data.train={tmp_path / 'none.txt'}")
    assert r.returncode == 2 and "No such file" in r.stderr
