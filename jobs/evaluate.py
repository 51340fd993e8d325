"""Perplexity of a checkpoint on a corpus (bits per character too for char models).

    spark-submit jobs/evaluate.py --checkpoint PATH --data PATH [--streams N] [--verbose]

PATH is a checkpoint or a training run's directory (the ``--out`` of train). The last
line printed is exactly ``ppl=<number>``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm import cli  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint, or a run directory (train's --out)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--streams", "--partitions", dest="streams", type=int, default=None,
                    help="contiguous streams evaluated in parallel (default: the checkpoint's "
                         "data.eval_streams, as in its training log; 1 = the whole text as one stream)")
    ap.add_argument("--master", default=None)
    ap.add_argument("--verbose", action="store_true", help="Spark's INFO logging (silenced by default)")
    a = ap.parse_args(argv)
    return cli.guarded(lambda: cli.evaluate(a))


if __name__ == "__main__":
    sys.exit(main())
