"""The Spark RNN report's comparison on Tiny Shakespeare: paragraphs, windows, sampled windows, sampled paragraphs.

    python benchmarks/strategies.py [--rounds 100] [--out runs/strategies]

Same model (1x128 char LSTM), same partitions (2) and batch for every strategy, and about
the same characters per round: ``paragraphs`` and ``windows`` run ``--local-steps`` steps
per round; the sampled strategies train each round on their whole sample (the report's
iteration), with the fraction chosen so that the sample holds as many characters as those
steps read. Prints the training loss against characters seen and against all-reduces, and
the validation loss at the end. Per-round metrics go to ``<out>/<strategy>/metrics.jsonl``
for plotting (``python jobs/plot.py --runs <out> --x syncs``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STRATEGIES = ("paragraphs", "windows", "sampled_windows", "sampled_paragraphs")
B, T, PARTITIONS = 16, 50, 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs/strategies"))
    ap.add_argument("--train", default=os.path.join(ROOT, "data/tinyshakespeare.train.txt"))
    ap.add_argument("--valid", default=os.path.join(ROOT, "data/tinyshakespeare.valid.txt"))
    a = ap.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from rnnlm import config
    from rnnlm.spark import session
    from rnnlm.spark.trainer import Trainer
    spark = session.get_spark("rnnlm-strategies", "local[2]", {"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    results = {}
    per_part = len(open(a.train, encoding="utf-8").read()) / PARTITIONS     # characters per partition
    chars = a.local_steps * B * T                                            # per partition and round
    fractions = {"sampled_windows": chars / T / per_part,                    # windows at stride 1 ~ characters
                 "sampled_paragraphs": chars / per_part}
    for strategy in STRATEGIES:
        sampled = strategy in fractions
        cfg = config.load(None, [
            f"data.train={a.train}", f"data.valid={a.valid}", "data.level=char", f"data.partitions={PARTITIONS}",
            f"data.strategy={strategy}", "data.window_stride=1", f"data.sample_fraction={fractions.get(strategy, 1.0)}",
            "model.cell=lstm", "model.hidden=128", "model.layers=1", "model.init_scale=0.08",
            "optim.name=adam", "optim.lr=0.003", "optim.clip_norm=5.0",
            f"train.bptt={T}", f"train.batch={B}", "train.grad_norm=token",
            f"train.local_steps={0 if sampled else a.local_steps}",
            f"train.rounds={a.rounds}", f"train.eval_every={a.rounds}", "train.seed=1"])
        out = os.path.join(a.out, strategy)
        shutil.rmtree(out, ignore_errors=True)
        tr = Trainer(spark, cfg, out, log=lambda s: None)
        tr.run()
        results[strategy] = tr.metrics
        print(f"{strategy}: done, valid_loss {tr.metrics[-1]['valid_loss']:.3f}, "
              f"fraction {fractions.get(strategy, '-')}, wall {tr.metrics[-1]['wall_s']:.0f} s", flush=True)
    marks = [r for r in (10, 25, 50, 100, 200, 400) if r <= a.rounds]
    print("\n# training loss (nats/char, mean of the 5 rounds ending at the mark) by all-reduces")
    print(f"{'all-reduces':>12s} " + " ".join(f"{s:>18s}" for s in STRATEGIES))
    for r in marks:
        row = [sum(m["train_loss"] for m in results[s][max(0, r - 5):r]) / min(5, r) for s in STRATEGIES]
        print(f"{r:12d} " + " ".join(f"{v:18.3f}" for v in row))
    print("\n# characters seen (millions, all partitions) at those all-reduces")
    for r in marks:
        print(f"{r:12d} " + " ".join(f"{results[s][r - 1]['tokens'] / 1e6:18.3f}" for s in STRATEGIES))
    print("\n# final validation loss (nats/char)")
    print(json.dumps({s: round(results[s][-1]["valid_loss"], 4) for s in STRATEGIES}))


if __name__ == "__main__":
    sys.exit(main())
