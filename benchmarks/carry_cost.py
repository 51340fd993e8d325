"""What it costs a round to carry a model-sized array per partition from one round to the next.

    python benchmarks/carry_cost.py [--mb 18.6] [--rounds 12] [--master "local[2]"]

Tasks that sleep 0.3 s instead of training, 2 partitions, each round a job over the last
round's output, as the trainer's chained rounds (:mod:`rnnlm.spark.lineage`) run them. Per
way of carrying, the median of rounds 3..N of the round's time beyond the sleep:

* ``nothing``: the job alone (Spark's floor for a round of 2 tasks);
* ``cache``: the array inside the cached element, read by the task and written back (it
  crosses the Python/JVM boundary both ways; ``cache-read`` and ``cache-write`` one way each);
* ``files``: the element holds a reference and the array is a file on the executor
  (:mod:`rnnlm.spark.filestore`, as the trainer does since 2026-11-24).

18.6 MB is the PTB small model's float32 size, the error-feedback residual of the sparse preset.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SLEEP = 0.3
WAYS = ("nothing", "cache-read", "cache-write", "cache", "files")


def task(way: str, n: int, rnd: int, run: str):
    def go(it):
        from rnnlm.spark import filestore
        for pid, held in it:
            if way == "files" and held is not None:
                held = filestore.load(held, pid)["a"]
            time.sleep(SLEEP)
            if way in ("cache", "cache-write"):
                yield pid, (np.zeros(n, np.float32) if held is None else held + 1)
            elif way == "files":
                yield pid, filestore.save(run, rnd, pid, {"a": np.zeros(n, np.float32) if held is None else held + 1})
            else:
                yield pid, None
    return go


def measure(sc, way: str, n: int, rounds: int) -> float:
    from pyspark import StorageLevel
    from rnnlm.spark.session import release, run_in_jvm
    seed = (lambda i: (i, np.zeros(n, np.float32))) if way == "cache-read" else (lambda i: (i, None))
    prev = sc.parallelize([0, 1], 2).map(seed).persist(StorageLevel.MEMORY_AND_DISK)
    run_in_jvm(prev)
    first, times = prev, []
    for r in range(1, rounds + 1):
        src = first if way in ("cache-read", "cache-write") else prev     # one way only: from the seed
        t0 = time.perf_counter()
        out = src.mapPartitions(task(way, n, r, f"bench-{way}")).persist(StorageLevel.MEMORY_AND_DISK)
        run_in_jvm(out)
        times.append(time.perf_counter() - t0 - SLEEP)
        if prev is not first:
            release(rdds=[prev])
        prev = out
    return statistics.median(times[2:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=18.6, help="the array's size per partition (MB)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--master", default="local[2]")
    a = ap.parse_args(argv)
    from pyspark import SparkConf, SparkContext
    sc = SparkContext(conf=SparkConf().setMaster(a.master).setAppName("rnnlm-carry-cost")
                      .set("spark.ui.enabled", "false"))
    sc.setLogLevel("ERROR")
    n = int(a.mb * 1e6 / 4)
    print(f"# {a.master}, 2 partitions, {a.mb} MB per partition; seconds per round beyond the tasks' "
          f"{SLEEP} s, median of rounds 3..{a.rounds}")
    measure(sc, "files", n, 6)          # warms the JVM and the Python workers up
    for way in WAYS:
        print(f"{way:12s} {measure(sc, way, n, a.rounds):.3f}", flush=True)
    sc.stop()


if __name__ == "__main__":
    sys.exit(main())
