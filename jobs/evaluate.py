"""Perplexity of a checkpoint on a corpus (bits per character too for char models).

    spark-submit jobs/evaluate.py --checkpoint PATH --data PATH

The last line printed is exactly ``ppl=<number>``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm import cli  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--partitions", type=int, default=1,
                    help="streams evaluated in parallel (1 = the whole corpus as one stream)")
    ap.add_argument("--master", default=None)
    a = ap.parse_args(argv)
    return cli.guarded(lambda: cli.evaluate(a))


if __name__ == "__main__":
    sys.exit(main())
