"""Seed 001's comparison on Tiny Shakespeare: paragraphs vs windows vs sampled_windows.

    python benchmarks/strategies.py [--rounds 100] [--out runs/strategies]

Same model (1x128 char LSTM), same partitions (2), same local steps and batch for every
strategy; prints the training loss against characters seen and against all-reduces,
and the validation loss at the end. Per-round metrics go to ``<out>/<strategy>/metrics.jsonl``
for plotting (see notebooks/).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STRATEGIES = ("paragraphs", "windows", "sampled_windows")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs/strategies"))
    ap.add_argument("--train", default=os.path.join(ROOT, "data/tinyshakespeare.train.txt"))
    ap.add_argument("--valid", default=os.path.join(ROOT, "data/tinyshakespeare.valid.txt"))
    a = ap.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from rnnlm import config, session
    from rnnlm.trainer import Trainer
    spark = session.get_spark("rnnlm-strategies", "local[2]", {"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    results = {}
    for strategy in STRATEGIES:
        cfg = config.load(None, [
            f"data.train={a.train}", f"data.valid={a.valid}", "data.level=char", "data.partitions=2",
            f"data.strategy={strategy}", "data.window_stride=1", "data.sample_fraction=0.05",
            "model.cell=lstm", "model.hidden=128", "model.layers=1", "model.init_scale=0.08",
            "optim.name=adam", "optim.lr=0.003", "optim.clip_norm=5.0",
            "train.bptt=50", "train.batch=16", "train.grad_norm=token", f"train.local_steps={a.local_steps}",
            f"train.rounds={a.rounds}", f"train.eval_every={a.rounds}", "train.seed=1"])
        out = os.path.join(a.out, strategy)
        shutil.rmtree(out, ignore_errors=True)
        tr = Trainer(spark, cfg, out, log=lambda s: None)
        tr.run()
        results[strategy] = tr.metrics
        print(f"{strategy}: done, valid_loss {tr.metrics[-1]['valid_loss']:.3f}", flush=True)
    marks = [r for r in (10, 25, 50, 100, 200, 400) if r <= a.rounds]
    print("\n# training loss (nats/char, mean of the 5 rounds ending at the mark) by all-reduces")
    print(f"{'all-reduces':>12s} " + " ".join(f"{s:>16s}" for s in STRATEGIES))
    for r in marks:
        row = [sum(m["train_loss"] for m in results[s][max(0, r - 5):r]) / min(5, r) for s in STRATEGIES]
        print(f"{r:12d} " + " ".join(f"{v:16.3f}" for v in row))
    print("\n# characters seen (millions, all partitions) at those all-reduces")
    for r in marks:
        print(f"{r:12d} " + " ".join(f"{results[s][r - 1]['tokens'] / 1e6:16.2f}" for s in STRATEGIES))
    print("\n# final validation loss (nats/char)")
    print(json.dumps({s: round(results[s][-1]["valid_loss"], 4) for s in STRATEGIES}))


if __name__ == "__main__":
    sys.exit(main())
