"""Train a language model on Spark.

    spark-submit jobs/train.py --config conf/NAME.toml [--set section.key=value ...]
                               [--out PATH] [--resume | --overwrite] [--verbose]
                               [--dry-run [--bandwidth 1gbit [--latency 1ms]]]

Also runs as plain ``python jobs/train.py ...`` (Spark local mode, ``--master``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm import cli  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default="runs/latest", help="output directory, any Hadoop path")
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    again.add_argument("--overwrite", action="store_true",
                       help="start again in an --out that holds a run (deletes its metrics, run.json, checkpoint)")
    ap.add_argument("--master", default=None, help="Spark master when not run by spark-submit")
    ap.add_argument("--samples", type=int, default=1, help="text samples to print at the end")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved configuration, the parameter count and the bytes a round moves "
                         "(measured on four rounds in a scratch directory, then deleted); keep and write nothing")
    ap.add_argument("--bandwidth", default=None, metavar="RATE",
                    help="with --dry-run: predict a round's sync time on host links of this rate (100mbit, 1gbit)")
    ap.add_argument("--latency", default=None, metavar="TIME", help="with --bandwidth: one-way link latency (1ms)")
    ap.add_argument("--verbose", action="store_true", help="Spark's INFO logging (silenced by default)")
    a = ap.parse_args(argv)
    return cli.guarded(lambda: cli.train(a))


if __name__ == "__main__":
    sys.exit(main())
