"""Synchronisation cost and scaling of the Spark trainer on the ptb-small model.

    python benchmarks/spark_sync.py [--rounds 4] [--steps 1,5,20,50] [--data data/ptb.train.txt]
                                    [--exchange dense,sparse] [--bytes-at 2,4,8] [--profile]
                                    [--batch 20] [--masters "local[2];local-cluster[2,1,2048]"] [--overlap 0,1,e]
                                    [--results spark,direct]

Part 1, per master (``--masters``: ``local[2]`` and ``local-cluster[2,1,2048]``) and local_steps K:
the fraction of a round spent outside local computation, ``1 - compute_s / round_s``
(compute_s: the slowest task's training time; round_s: the driver's wall time for
broadcast + tasks + treeAggregate + update), median over rounds after the first.

``--profile`` adds, per row, where the round's time goes (the metrics' ``phase.*``, see
:func:`rnnlm.spark.trainer.round_phases`), median over rounds after the first: the driver's
``prepare`` (broadcasts), ``launch`` (job submitted to the first task running), the slowest
task's ``view``, ``steps`` and ``encode``, ``collect`` (last task done to the aggregate on the
driver), ``apply``; and ``between`` rounds (metrics file, log line).

Part 2: training tokens/s with 2 partitions on ``local[2]`` against 1 partition on
``local[1]`` (same per-partition batch, K=20), and their ratio.

``--overlap`` lists the ``train.overlap`` settings part 1 compares (default 0): with 1, round
r+1 computes while round r's result travels and is applied, and ``round_s`` is the time
from one round's result to the next's; ``e`` is 1 with ``train.eager = true``. ``--results``
lists the ``train.results`` settings it compares (default spark): ``direct`` sends the
contributions to the driver as frames (:mod:`rnnlm.spark.channel`).

``--exchange`` names the settings compared (``EXCHANGES``: ``dense`` ships every
change as float32, ``sparse`` is conf/ptb_word_small_sparse.toml's exchange and
re-basing).
Each master runs in its own process (one SparkContext per process).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASES = ("phase.prepare_s", "phase.launch_s", "phase.view_s", "phase.steps_s", "phase.encode_s",
          "phase.collect_s", "phase.apply_s", "phase.between_s")
EXCHANGES = {"dense": "conf/ptb_word_small.toml", "sparse": "conf/ptb_word_small_sparse.toml"}   # their [exchange]


def sweep(master, partitions, steps, rounds, data_path, out_json, exchange="dense", batch=20, overlap="0",
          results="spark"):
    """Run in a child process: train a few rounds per K on one corpus load."""
    from rnnlm import config
    from rnnlm.spark import session
    from rnnlm.spark.corpus import load_corpus
    from rnnlm.spark.trainer import Trainer
    spark = session.get_spark("rnnlm-bench", master, {"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    base = config.load(os.path.join(ROOT, "conf/ptb_word_small.toml"),
                       [f"data.train={data_path}", "data.valid=", "data.test=", f"data.partitions={partitions}",
                        f"train.batch={batch}",   # 20: the ptb-small shape of benchmarks/kernels.py
                        "train.eval_every=0", "train.checkpoint_every=0", f"train.overlap={int(overlap != '0')}",
                        f"train.eager={str(overlap == 'e').lower()}", f"train.results={results}"])
    preset = config.load(os.path.join(ROOT, EXCHANGES[exchange]))
    base = config.replace(base, "exchange", **preset.exchange.__dict__)
    base = config.replace(base, "train", rebase_every=preset.train.rebase_every,
                          rebase_fraction=preset.train.rebase_fraction)
    data = load_corpus(spark.sparkContext, base)
    rows = []
    for k in steps:
        cfg = config.replace(base, "train", local_steps=k, rounds=rounds, epochs=0.0)
        with tempfile.TemporaryDirectory() as out:
            tr = Trainer(spark, cfg, out, log=lambda s: None)
            tr.run(data=data)
            ms = tr.metrics[1:]                       # the first round warms up workers and caches
            frac = statistics.median(1 - m["compute_s"] / m["round_s"] for m in ms)
            tok_s = sum(m["tokens"] - p["tokens"] for p, m in zip(tr.metrics, ms)) / sum(m["round_s"] for m in ms)
            rows.append({"master": master, "partitions": partitions, "local_steps": k, "exchange": exchange,
                         "overlap": overlap, "results": results,
                         "round_s": statistics.median(m["round_s"] for m in ms),
                         "compute_s": statistics.median(m["compute_s"] for m in ms),
                         "sync_fraction": frac, "tokens_per_s": tok_s,
                         "bytes_per_round": statistics.median(m["round_bytes_sent"] for m in ms),
                         "broadcast_per_round": statistics.median(m["round_bytes_broadcast"] for m in ms),
                         "unique_words": statistics.median(m["unique_words"] for m in ms),
                         **{k: statistics.median(m[k] for m in ms) for k in PHASES if all(k in m for m in ms)}})
    spark.stop()
    with open(out_json, "w") as f:
        json.dump(rows, f)


def child(master, partitions, steps, rounds, data_path, exchange="dense", batch=20, overlap="0", results="spark"):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    subprocess.run([sys.executable, __file__, "--child", master, str(partitions), ",".join(map(str, steps)),
                    str(rounds), data_path, path, exchange, str(batch), str(overlap), results],
                   check=True, env=env, cwd=ROOT)
    with open(path) as f:
        rows = json.load(f)
    os.remove(path)
    return rows


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, master, parts, steps, rounds, data_path, out, exchange, batch, overlap, results = sys.argv
        return sweep(master, int(parts), [int(s) for s in steps.split(",")], int(rounds), data_path, out, exchange,
                     int(batch), overlap, results)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", default="1,5,20,50")
    ap.add_argument("--data", default=os.path.join(ROOT, "data/ptb.train.txt"))
    ap.add_argument("--exchange", default="dense,sparse", help=f"any of {', '.join(EXCHANGES)}")
    ap.add_argument("--no-scaling", action="store_true", help="skip part 2")
    ap.add_argument("--profile", action="store_true", help="part 1 also splits each round into its phases")
    ap.add_argument("--bytes-at", default="", help="only part 3: bytes per round at these partition counts "
                    "(e.g. 2,4,8; K=20, local[2]: bytes are measured at pickling, whatever the master)")
    ap.add_argument("--batch", type=int, default=20, help="streams per partition (the presets' is 10)")
    ap.add_argument("--masters", default="local[2];local-cluster[2,1,2048]",
                    help="part 1's masters, separated by ';'")
    ap.add_argument("--overlap", default="0", help="part 1's train.overlap settings (e.g. 0,1; e: 1 and eager)")
    ap.add_argument("--results", default="spark", help="part 1's train.results settings (e.g. spark,direct)")
    a = ap.parse_args(argv)
    if a.bytes_at:
        print(f"{'P':>3s} {'exchange':8s} {'MB sent':>8s} {'MB bcast':>8s} {'unique words':>12s}")
        for p in (int(x) for x in a.bytes_at.split(",")):
            for ex in a.exchange.split(","):
                r, = child("local[2]", p, [20], a.rounds, a.data, ex, a.batch)
                print(f"{p:3d} {ex:8s} {r['bytes_per_round'] / 1e6:8.2f} {r['broadcast_per_round'] / 1e6:8.2f} "
                      f"{r['unique_words']:12.0f}", flush=True)
        return
    steps = [int(s) for s in a.steps.split(",")]
    exchanges = a.exchange.split(",")
    print("# sync fraction = 1 - compute_s / round_s (median over rounds 2..N); MB sent by workers and "
          "broadcast per round")
    names = [k[len("phase."):-2] for k in PHASES] if a.profile else []
    print(f"{'master':26s} {'exchange':8s} {'ov':>2s} {'results':>7s} {'K':>3s} {'round_s':>8s} {'compute_s':>9s} "
          f"{'sync':>6s} {'MB sent':>8s} {'MB bcast':>8s}" + "".join(f" {n:>8s}" for n in names))
    for master in a.masters.split(";"):
        for ex, ov, res in ((ex, ov, res) for ex in exchanges for ov in a.overlap.split(",")
                            for res in a.results.split(",")):
            for r in child(master, 2, steps, a.rounds, a.data, ex, a.batch, ov, res):
                phases = "".join(f" {r.get(k, float('nan')):8.3f}" for k in PHASES[:len(names)])
                print(f"{master:26s} {ex:8s} {ov:>2s} {res:>7s} {r['local_steps']:3d} {r['round_s']:8.3f} "
                      f"{r['compute_s']:9.3f} {100 * r['sync_fraction']:5.1f}% {r['bytes_per_round'] / 1e6:8.2f} "
                      f"{r['broadcast_per_round'] / 1e6:8.2f}{phases}", flush=True)
    if a.no_scaling:
        return
    for ex in exchanges:
        two = child("local[2]", 2, [20], a.rounds + 1, a.data, ex, a.batch)
        one = child("local[1]", 1, [20], a.rounds + 1, a.data, ex, a.batch)
        r2, r1 = two[0]["tokens_per_s"], one[0]["tokens_per_s"]
        print(f"# scaling at K=20, {ex}: local[1] x 1 partition {r1:.0f} tok/s, "
              f"local[2] x 2 partitions {r2:.0f} tok/s, ratio {r2 / r1:.3f}", flush=True)
        print(f"scaling_2_vs_1[{ex}]={r2 / r1:.3f}")


if __name__ == "__main__":
    sys.exit(main())
