"""The GPU check: everything the GPU half must show, in one device call, ending in one summary line.

    python benchmarks/gpu_check.py --data DIR --out DIR [--device gpu] [--quick]

``DIR`` holds ``ptb.train.txt``, ``ptb.valid.txt`` (``../shared`` does not travel to the device:
copy them into a git-ignored folder and carry it). Phases, each a subprocess with its own time
limit, each writing ``OUT/<phase>.log``:

1. ``tests``: the core tests on this device's array module (``-k cupy``; ``-k numpy`` with
   ``--device cpu``), which need no Spark.
2. ``determinism``: every mode trained twice from one seed must end bit-identical (word and
   character input, LSTM and tanh RNN, full and sampled softmax, dropout, the feed-forward model),
   and a run carried through the host between two calls (as a checkpoint is) must equal one that
   was not.
3. ``kernels``, ``kernels128``, ``sampled``: ``benchmarks/kernels.py`` at the shapes' own B and
   at B = 128 beside PyTorch (cuDNN on a GPU), and the sampled softmax's step against the full one.
4. ``ptb``, ``torch_ptb``: one PTB-small epoch with the core's single-process trainer (B = 20, as
   Zaremba et al.) and with PyTorch on the same device, training wall time and valid perplexity
   (and rnnlm's evaluation of PTB valid timed from CUDA graphs and eagerly, the sums compared).

On the device (the corpus, test set included, and nvmath-python's wheel for the device's Python 3.12
copied into git-ignored folders first, as ``../shared`` stays here and the device has no network)::

    mkdir -p .device/data && cp ../shared/data/ptb.{train,valid,test}.txt .device/data/
    pip download nvmath-python==1.0.0 --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d .whl
    grep -qx /.device/ .git/info/exclude || echo /.device/ >> .git/info/exclude   # and /.whl/ likewise
    run: pip install -q --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \
         python3 benchmarks/gpu_check.py --data .device/data --out $OUT
         (carry .device and .whl, timeout_s 480: --limit-s 420 and a minute for the rest)

Without nvmath-python no step is captured as a CUDA graph (the figures are the eager path's): on a GPU
the check stops before its first phase unless ``--eager`` says that is meant.

One PTB run alone (``docs/results.md``'s 39-epoch medium figure; its last line is a JSON object):
``gpu_check.py --phase ptb --device gpu --data DIR --out DIR --model medium --epochs 39 [--seed N]
[--set model.biases=two]`` (``--set``: a config override, as ``rnnlm train``'s).

The last line printed is the summary; ``OUT/summary.txt`` holds it too. ``--device cpu`` runs the
same phases on NumPy (a check of the script itself where no GPU is lent); ``--quick`` shortens
every phase (the kernels' windows, the epoch to a tenth).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CORE_TESTS = ["tests/test_backend.py", "tests/test_optim.py", "tests/test_ffnn.py", "tests/test_gradients.py",
              "tests/test_local.py", "tests/test_model.py", "tests/test_sampled_softmax.py", "tests/test_gpu_step.py"]


# ------------------------------------------------------------------ phases run in a subprocess
def determinism(device: str) -> dict:
    """{case: "ok" or what differed}: each mode's run twice, and carried through the host."""
    import numpy as np
    from rnnlm.config import ExchangeConfig, ModelConfig, OptimConfig
    from rnnlm.core import backend, sampled
    from rnnlm.core.local import train_steps
    from rnnlm.core.models import build
    from rnnlm.core.optim import make_optimizer
    from rnnlm.core.strategies import StreamBlock
    from rnnlm.exchange.plan import SoftmaxSampler

    xp = backend.get_xp(device)
    ids = (np.random.default_rng(0).zipf(1.3, 40000) % 5000).astype(np.int32)
    cases = {
        "word-lstm": (dict(cell="lstm", vocab_size=5000, embed=64, hidden=96, layers=2), False),
        "word-lstm-dropout": (dict(cell="lstm", vocab_size=5000, embed=64, hidden=96, layers=2, dropout=0.3), False),
        "word-lstm-sampled": (dict(cell="lstm", vocab_size=5000, embed=64, hidden=96, layers=2), True),
        "word-rnn": (dict(cell="rnn", vocab_size=5000, embed=64, hidden=96, layers=1), False),
        "char-lstm-onehot": (dict(cell="lstm", vocab_size=65, embed=0, hidden=128, layers=2, dropout=0.2), False),
        "ffnn": (dict(cell="ffnn", vocab_size=5000, embed=32, hidden=64, context=3), False),
    }
    K, B, T = 8, 16, 20
    opt = make_optimizer(OptimConfig(name="momentum", lr=0.5))
    out = {}
    for name, (mc, samp) in cases.items():
        m = build(ModelConfig(**mc), xp=xp)
        V = mc["vocab_size"]
        toks = ids % V
        block = StreamBlock(toks, B, T)
        presence = sampled.presence(toks, T, V) if samp else None

        def call(p, st, state, k):
            sets = SoftmaxSampler(V, ExchangeConfig(), 1, k, 0, 1, presence=presence) if samp else None
            drop = backend.rng_for(xp, 1, k, 0) if mc.get("dropout") else None
            return train_steps(m, opt, p, st, block.batches(k * K, K), state, lr=0.5, clip_norm=1.0,
                               dropout_rng=drop, softmax_sets=sets)

        def run(through_host: bool):
            p = m.init_params(1)
            st = opt.init_state(p)
            r = call(p, st, m.zero_state(B), 0)
            state = r.state
            if through_host:                 # what a checkpoint and a resume do to every array
                p = xp.asarray(backend.to_numpy(p))
                st = {k: (v if k == "t" else xp.asarray(backend.to_numpy(v))) for k, v in st.items()}
                state = xp.asarray(backend.to_numpy(state))
            r = call(p, st, state, 1)
            return [backend.to_numpy(a) for a in (r.params, r.state, *(v for k, v in sorted(st.items()) if k != "t"))]

        a, b, c = run(False), run(False), run(True)
        diffs = [float(np.abs(x.astype(np.float64) - y).max()) for x, y in zip(a, b) if not np.array_equal(x, y)]
        diffs_c = [float(np.abs(x.astype(np.float64) - y).max()) for x, y in zip(a, c) if not np.array_equal(x, y)]
        out[name] = ("ok" if not diffs and not diffs_c else
                     f"repeat differs by {max(diffs, default=0):.3g}, resumed by {max(diffs_c, default=0):.3g}")
    return out


def ptb_epoch(device: str, data: str, epochs: float, model: str = "small", seed: int = 1, overrides=()) -> dict:
    """PTB small (or medium) for ``epochs`` with the core's single-process trainer: training wall time, valid ppl,
    the time of one evaluation of PTB valid (on a GPU from graphs and eagerly, whose sums must be the same), test ppl
    where ``DIR/ptb.test.txt`` is there and the run is the full 13 (medium: 39) epochs."""
    import math

    from rnnlm import config
    from rnnlm.core import single
    from rnnlm.core.local import evaluate
    from rnnlm.core.metrics import EVAL_BPTT
    sets = [f"data.train={os.path.join(data, 'ptb.train.txt')}", f"data.valid={os.path.join(data, 'ptb.valid.txt')}",
            "data.test=", "data.partitions=1", "train.batch=20", "train.max_streams=0", f"train.epochs={epochs}",
            "train.eval_every=0", f"train.device={device}", f"train.seed={seed}", *overrides]
    cfg = config.load(os.path.join(ROOT, "conf", f"ptb_word_{model}.toml"), sets)
    t0 = time.perf_counter()
    m = single.train(cfg, out=None, log=lambda s: print(s, flush=True))
    got = {"train_wall_s": m["wall_s"], "valid_ppl": m.get("valid_ppl"), "epoch": m["epoch"]}
    valid = m["vocab"].encode(single.read_text(os.path.join(data, "ptb.valid.txt")))
    sums = []
    for graphed in (True, False) if device == "gpu" else (False,):     # PTB valid as one stream
        t1 = time.perf_counter()
        sums.append(evaluate(m["model"], m["params"], valid, 1, EVAL_BPTT, cuda_graphs=graphed))
        got["valid_eval_s" if graphed else "valid_eval_eager_s"] = round(time.perf_counter() - t1, 2)
    if len(sums) == 2:
        got["valid_eval_same"] = sums[0] == sums[1]
    test = os.path.join(data, "ptb.test.txt")
    if epochs >= (13 if model == "small" else 39) and os.path.isfile(test):
        ids = m["vocab"].encode(single.read_text(test))
        s, n = evaluate(m["model"], m["params"], ids, 1, EVAL_BPTT)
        got["test_ppl"] = round(math.exp(s / n), 2)
    got["total_s"] = round(time.perf_counter() - t0, 1)
    return got


# ------------------------------------------------------------------ the driver
def phase(out: str, name: str, cmd: list, timeout: float) -> tuple:
    """Run ``cmd`` (with this checkout first on its ``PYTHONPATH``: ``rnnlm`` is not installed on the device);
    return (its standard output, seconds, None or why it failed). Both streams go to OUT/name.log; only
    the standard output is parsed (a warning on standard error must not hide a phase's last line)."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        stdout, stderr, err = r.stdout, r.stderr, None if r.returncode == 0 else f"exit {r.returncode}"
    except subprocess.TimeoutExpired as e:
        stdout, stderr = (b.decode(errors="replace") if isinstance(b, bytes) else b or "" for b in (e.stdout, e.stderr))
        err = f"over {timeout:.0f} s"
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(stdout + stderr)
    s = time.perf_counter() - t0
    print(f"# {name}: {s:.0f} s{'' if err is None else ', ' + err}", flush=True)
    return stdout, s, err


def last_json(text: str) -> dict:
    """The JSON object a phase printed last, or {}."""
    try:
        got = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
    return got if isinstance(got, dict) else {}


def last(pattern: str, text: str, default="?"):
    found = re.findall(pattern, text)
    return found[-1] if found else default


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a folder with ptb.train.txt and ptb.valid.txt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--limit-s", type=float, default=420.0,
                    help="the whole check's time: each phase gets at most what is left; under 20 s left, it is skipped")
    ap.add_argument("--eager", action="store_true", help="on a GPU, go on without CUDA graphs (no nvmath-python)")
    ap.add_argument("--phase", choices=("determinism", "ptb"), help=argparse.SUPPRESS)   # the subprocesses
    ap.add_argument("--epochs", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=("small", "medium"), default="small", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)   # the ptb phase's config
    a = ap.parse_args(argv)
    if a.phase == "determinism":
        print(json.dumps(determinism(a.device)))
        return 0
    if a.phase == "ptb":
        print(json.dumps(ptb_epoch(a.device, a.data, a.epochs, a.model, a.seed, a.set)))
        return 0
    for f in ("ptb.train.txt", "ptb.valid.txt"):
        if not os.path.isfile(os.path.join(a.data, f)):
            print(f"gpu_check: {os.path.join(a.data, f)} is missing (copy PTB there and carry the folder)",
                  file=sys.stderr)
            return 2
    graphs = "off"
    if a.device == "gpu":
        from rnnlm.core import backend
        graphs = "on" if backend.graphs_available(backend.get_xp("gpu")) else "off"
        if graphs == "off" and not a.eager:
            print("gpu_check: no CUDA graphs here (nvmath-python is not importable: see this script's docstring "
                  "for its wheel); --eager runs the eager path's figures instead", file=sys.stderr)
            return 2
    os.makedirs(a.out, exist_ok=True)
    py, me = sys.executable, os.path.abspath(__file__)
    q = a.quick
    secs = ["--seconds", "1" if q else "3", "--rounds", "2"]
    epochs = "0.1" if q else "1"
    dev = ["--device", a.device]
    kernels = [py, "benchmarks/kernels.py", *dev, *secs]
    kernels_eager = [*kernels, "--no-graphs", "--shapes", "ptb-small,char-lstm"]
    select = "cupy or test_gpu_step" if a.device == "gpu" else "numpy"
    # each phase's limit: about twice what it took on an H200 (docs/results.md), the tests' more as they grow
    runs = {
        "tests": ([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, *CORE_TESTS], 210),
        "determinism": ([py, me, "--phase", "determinism", *dev, "--data", a.data, "--out", a.out], 60),
        "kernels": (kernels, 90),
        "kernels128": ([*kernels, "--batch", "128"], 90),
        "kernels_eager": (kernels_eager if a.device == "gpu" else [py, "-c", "pass"], 60),
        "sampled": ([py, "benchmarks/kernels.py", *dev, *secs, "--sampled", "0.05"], 60),
        "ptb": ([py, me, "--phase", "ptb", *dev, "--data", a.data, "--out", a.out, "--epochs", epochs], 60),
        "torch_ptb": ([py, "benchmarks/torch_ptb.py", "--device", "cuda" if a.device == "gpu" else "cpu",
                       "--epochs", epochs, "--evals-per-epoch", "1", "--data", a.data], 60),
    }
    if a.device == "cpu":               # the same phases on NumPy take longer: a check of the script, untimed
        runs = {name: (cmd, 10 * limit) for name, (cmd, limit) in runs.items()}
    got, failed, full, start = {name: "" for name in runs}, [], {}, time.perf_counter()
    for name, (cmd, limit) in runs.items():
        left = a.limit_s - (time.perf_counter() - start)
        if left < 20:
            failed.append(f"{name} (skipped: --limit-s)")
            continue
        text, _, err = phase(a.out, name, cmd, min(limit, left))
        got[name] = text
        if err:
            failed.append(f"{name} ({err})")
        write_summary(a, graphs, epochs, got, full, failed)      # what is known so far, should the call be cut
    ptb = last_json(got["ptb"])
    # Zaremba's 13 epochs with the test set, where one epoch's time says they fit in what is left
    left = a.limit_s - (time.perf_counter() - start)
    if isinstance(ptb.get("train_wall_s"), float) and ptb.get("total_s") and not q:
        need = 13 * ptb["train_wall_s"] + 2 * (ptb["total_s"] - ptb["train_wall_s"]) + 15
        if need * 1.15 < left:
            text, _, err = phase(a.out, "ptb13", [py, me, "--phase", "ptb", *dev, "--data", a.data, "--out", a.out,
                                                  "--epochs", "13"], left - 5)
            full = last_json(text)
            if err:
                failed.append(f"ptb13 ({err})")
        else:
            print(f"# ptb13: skipped, needs ~{need:.0f} s, {left:.0f} s left", flush=True)
    print(write_summary(a, graphs, epochs, got, full, failed))
    return 1 if failed else 0


def write_summary(a, graphs: str, epochs: str, got: dict, full: dict, failed: list) -> str:
    """The one summary line of what the phases printed so far, written to OUT/summary.txt."""
    det, ptb = last_json(got["determinism"]), last_json(got["ptb"])
    tests = last(r"(\d+ passed[^\n]*?) in ", got["tests"])
    ratio, ratio128 = (last(r"min_ratio_vs_torch=([\d.]+)", got[k]) for k in ("kernels", "kernels128"))
    speedup = last(r"min_sampled_speedup=([\d.]+)", got["sampled"])
    torch_s, torch_ppl = (last(p, got["torch_ptb"]) for p in (r"train_wall_s ([\d.]+)", r"valid_ppl ([\d.]+)"))
    same = sum(v == "ok" for v in det.values())
    ppl = ptb.get("valid_ppl")
    ppl = f"{ppl:.1f}" if isinstance(ppl, float) else "?"
    summary = (f"gpu_check device={a.device} graphs={graphs} | tests {tests} | determinism {same}/{len(det) or '?'} "
               "bit-identical"
               f"{'' if same == len(det) else ' ' + json.dumps(det)} | kernels min ratio {ratio} (own B), "
               f"{ratio128} (B=128) | sampled speed-up {speedup} | PTB-small {epochs} epoch: rnnlm "
               f"{ptb.get('train_wall_s', '?')} s valid {ppl}, torch {torch_s} s valid {torch_ppl}"
               f"{' | PTB-small 13 epochs: ' + json.dumps(full) if full else ''}"
               f"{' | failed: ' + ', '.join(failed) if failed else ''}")
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
