"""``benchmarks/gpu_check.py``'s driver, without a GPU: a device call is scarce, so what it runs, what it
parses and what it leaves behind when cut short are checked here (its phases run for real on the device)."""
import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402


def test_a_phase_finds_this_checkout_and_parses_only_its_standard_output(tmp_path):
    """``rnnlm`` is not installed on the device: kernels.py died on ModuleNotFoundError; a warning on standard
    error hid a phase's last line (its JSON) from the summary."""
    code = ("import json, os, sys; print('a warning', file=sys.stderr); "
            "print(json.dumps({'path0': os.environ['PYTHONPATH'].split(os.pathsep)[0]}))")
    out, _, err = gpu_check.phase(str(tmp_path), "probe", [sys.executable, "-c", code], 30)
    assert err is None and gpu_check.last_json(out) == {"path0": gpu_check.ROOT}
    assert (tmp_path / "probe.log").read_text().endswith("a warning\n")
    slow = [sys.executable, "-c", "import time; print(1, flush=True); time.sleep(30)"]
    out, _, err = gpu_check.phase(str(tmp_path), "slow", slow, 5)         # room for Python to start under load
    assert err == "over 5 s" and out == "1\n"


def test_the_summary_is_written_after_every_phase(tmp_path, monkeypatch):
    """It was written at the very end: a device call cut by its timeout left no summary at all."""
    outputs = {"tests": "96 passed, 98 deselected in 140.0s\n",
               "determinism": json.dumps({"word-lstm": "ok", "ffnn": "ok"}) + "\n",
               "kernels": "min_ratio_vs_torch=1.132\n"}
    seen = []

    def phase(out, name, cmd, timeout):
        if name not in outputs:
            raise KeyboardInterrupt                          # the device's timeout, as it were
        seen.append((name, (tmp_path / "out" / "summary.txt").read_text() if seen else None))
        return outputs[name], 1.0, None

    monkeypatch.setattr(gpu_check, "phase", phase)
    data = tmp_path / "data"
    data.mkdir()
    for f in ("ptb.train.txt", "ptb.valid.txt"):
        (data / f).write_text("a b\n")
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--device", "cpu", "--data", str(data), "--out", str(tmp_path / "out")])
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.startswith("gpu_check device=cpu graphs=off | tests 96 passed, 98 deselected | "
                              "determinism 2/2 bit-identical | kernels min ratio 1.132 (own B), ? (B=128)"), summary
    assert [name for name, _ in seen] == ["tests", "determinism", "kernels"]
    assert "tests 96 passed" in seen[1][1] and "determinism ?" in seen[1][1].replace("0/?", "?")
