"""Patwary et al.'s (2018) Zipf measurement: unique words U against tokens N in a round's batches.

    python benchmarks/zipf.py [--data data/ptb.train.txt] [--partitions 2] [--batch 10] [--bptt 20]

N runs from one partition's step (B x T tokens) to all partitions' K steps, as the
``streams`` strategy lays the corpus out (PTB small's shape by default); U is the number of
distinct ids among those tokens (inputs and targets), averaged over rounds. Prints U against
N and the least-squares exponent a of U ~ c N^a (Patwary et al. find a = 0.64).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    from rnnlm.core.strategies import Source
    from rnnlm.core.vocab import Vocab
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "data/ptb.train.txt"))
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--bptt", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args(argv)
    text = open(a.data, encoding="utf-8").read()
    ids = Vocab.build(text, "word").encode(text)
    parts = np.array_split(ids, a.partitions)
    sources = [Source("streams", p, np.array([0]), a.batch, a.bptt, partition=i) for i, p in enumerate(parts)]
    rows = []
    for steps in (1, 2, 5, 10, 20, 50, 100):
        for used in range(1, a.partitions + 1):
            us = []
            for r in range(1, a.rounds + 1):
                words = [np.concatenate([b.x.ravel(), b.y.ravel()])
                         for src in sources[:used] for b in src.round_batches(r, steps)]
                us.append(len(np.unique(np.concatenate(words))))
            rows.append((steps * used * a.batch * a.bptt, steps, used, float(np.mean(us))))
    print(f"{'N tokens':>9s} {'steps':>5s} {'parts':>5s} {'U unique':>9s}")
    for n, k, used, u in sorted(set(rows)):
        print(f"{n:9d} {k:5d} {used:5d} {u:9.1f}")
    n, u = np.array([r[0] for r in rows], float), np.array([r[3] for r in rows])
    slope, _ = np.polyfit(np.log(n), np.log(u), 1)
    print(f"zipf_exponent={slope:.3f}")


if __name__ == "__main__":
    sys.exit(main())
