"""The seeds' figures, reproduced from this project's runs (PNGs in docs/figures/).

    python benchmarks/figures.py [--only seed001,seed000,seed002,seed004] [--draw-only]
                                 [--out runs/figures] [--figures docs/figures]

Every training run is a ``jobs/train.py`` process (its own SparkSession, ``run.json``
and ``metrics.jsonl`` under ``<out>/<stage>/<run>``), sized so this 2-core machine
finishes a stage in minutes; ``--draw-only`` redraws from the runs already there.

``seed001``  Tiny Shakespeare, char LSTM 1x25 (the seed's size), 2 partitions, T=25:
             paragraphs / all windows / sampled windows / sampled paragraphs, loss
             against characters seen and against all-reduces (Figs. 3-4); paragraphs
             with K = 1, 5, 25 local steps per all-reduce at equal work (Fig. 5).
``seed000``  PTB small: training tokens/s against workers (1 partition on local[1],
             2 on local[2]) per exchange setting (Fig. 3); learning curves of the
             sampled softmax for several mu (Fig. 6).
``seed002``  unique words U against tokens N, log-log, with the fitted power law, on
             PTB and on Tiny Shakespeare's words (Fig. 1); no training.
``seed004``  the async ffnn (conf/nnlm_async.toml) through benchmarks/worker_failure.py:
             validation loss against time for 1, 2, 3 workers (Fig. 3) and with 2 of 3
             workers killed (Fig. 4).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STAGES = ("seed001", "seed000", "seed002", "seed004")
SHAKESPEARE = ("data/tinyshakespeare.train.txt", "data/tinyshakespeare.valid.txt")

# seed 001: 1x25 LSTM, T=25, B=16, 10 local steps a round; sampled strategies train on a sample
# holding about as many characters as those steps read (benchmarks/strategies.py's rule)
S001 = ["data.level=char", "data.partitions=2", "data.window_stride=1", "model.cell=lstm", "model.hidden=25",
        "model.layers=1", "model.init_scale=0.08", "optim.name=adam", "optim.lr=0.01", "optim.clip_norm=5.0",
        "train.bptt=25", "train.batch=16", "train.grad_norm=token", "train.seed=1", "train.checkpoint_every=0"]
S001_ROUNDS, S001_K = 150, 10
S001_KS = (1, 5, 25)          # Fig. 5: equal work, S001_ROUNDS * S001_K // 2 steps in all

# seed 000: PTB small (conf/ptb_word_small.toml) with these exchanges
EXCHANGES = {
    "dense": [],
    "rows": ["exchange.embed=rows", "exchange.softmax=rows", "exchange.frequent=0.02", "exchange.random=0.02",
             "exchange.seed_groups=one"],
    "rows + sampled softmax": ["exchange.embed=rows", "exchange.softmax=rows", "exchange.frequent=0.02",
                               "exchange.random=0.02", "exchange.seed_groups=one", "exchange.sampled_softmax=true"],
    "rows + 1-bit (sparse conf)": "conf/ptb_word_small_sparse.toml",
}
S000_ROUNDS = 14
MUS = (0.01, 0.03, 0.05, 0.2)
S000_MU_EPOCHS = 0.5


def train(out: str, config: str, sets: list, master: str = "local[2]") -> str:
    """Run ``jobs/train.py`` into a fresh ``out``; return ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [sys.executable, "jobs/train.py", "--config", config, "--out", out, "--samples", "0", "--master", master,
           *[x for s in sets for x in ("--set", s)]]
    with open(out + ".log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"), stdout=log,
                             stderr=log)
    if rc != 0:
        raise SystemExit(f"{out} failed, see {out}.log")
    print(f"  {os.path.relpath(out, ROOT)}", flush=True)
    return out


def run_seed001(out: str):
    per_part = len(open(os.path.join(ROOT, SHAKESPEARE[0]), encoding="utf-8").read()) / 2
    chars = S001_K * 16 * 25
    fractions = {"sampled_windows": chars / 25 / per_part, "sampled_paragraphs": chars / per_part}
    data = [f"data.train={SHAKESPEARE[0]}", f"data.valid={SHAKESPEARE[1]}"]
    for strategy in ("paragraphs", "windows", "sampled_windows", "sampled_paragraphs"):
        sampled = strategy in fractions
        train(os.path.join(out, "strategies", strategy), "conf/demo.toml", [
            *data, *S001, f"data.strategy={strategy}", f"data.sample_fraction={fractions.get(strategy, 1.0)}",
            f"train.local_steps={0 if sampled else S001_K}", f"train.rounds={S001_ROUNDS}",
            f"train.eval_every={S001_ROUNDS // 5}"])
    steps = S001_ROUNDS * S001_K // 2
    for k in S001_KS:
        train(os.path.join(out, "local_steps", f"K{k}"), "conf/demo.toml", [
            *data, *S001, "data.strategy=paragraphs", f"train.local_steps={k}", f"train.rounds={steps // k}",
            f"train.eval_every={max(1, steps // k // 5)}"])


def run_seed000(out: str):
    base = ["data.test=", "train.checkpoint_every=0"]
    for name, ex in EXCHANGES.items():
        conf = ex if isinstance(ex, str) else "conf/ptb_word_small.toml"
        sets = [] if isinstance(ex, str) else ex
        for workers in (1, 2):
            train(os.path.join(out, "speed", f"{name.split(' (')[0].replace(' ', '')}_{workers}w"), conf, [
                *base, *sets, "data.valid=", f"data.partitions={workers}", "train.local_steps=20",
                f"train.rounds={S000_ROUNDS}", "train.eval_every=0"], master=f"local[{workers}]")
    for mu in (None, *MUS):
        sets = EXCHANGES["rows + sampled softmax"] + [f"exchange.mu={mu}"] if mu is not None else EXCHANGES["rows"]
        train(os.path.join(out, "mu", "full_softmax" if mu is None else f"mu{mu}"), "conf/ptb_word_small.toml",
              [*base, *sets, f"train.epochs={S000_MU_EPOCHS}", "train.eval_every=10"])


def run_seed004(out: str):
    for fig in (3, 4):
        d = os.path.join(out, f"fig{fig}")
        shutil.rmtree(d, ignore_errors=True)
        rc = subprocess.call([sys.executable, "benchmarks/worker_failure.py", "--figure", str(fig), "--out", d],
                             cwd=ROOT)
        if rc != 0:
            raise SystemExit(f"benchmarks/worker_failure.py --figure {fig} failed")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(STAGES))
    ap.add_argument("--draw-only", action="store_true")
    ap.add_argument("--no-draw", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs/figures"))
    ap.add_argument("--figures", default=os.path.join(ROOT, "docs/figures"))
    a = ap.parse_args(argv)
    stages = [s for s in a.only.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise SystemExit(f"--only: unknown stage {bad[0]} (choose from {', '.join(STAGES)})")
    runners = {"seed001": run_seed001, "seed000": run_seed000, "seed004": run_seed004}
    if not a.draw_only:
        for s in stages:
            if s in runners:
                print(f"{s}: training", flush=True)
                runners[s](os.path.join(a.out, s))
    if not a.no_draw:
        from figures_draw import draw
        os.makedirs(a.figures, exist_ok=True)
        for s in stages:
            for path, summary in draw(s, os.path.join(a.out, s), a.figures):
                print(f"{s}: {os.path.relpath(path, ROOT)}  {json.dumps(summary)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
