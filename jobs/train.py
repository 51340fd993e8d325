"""Train a language model on Spark.

    spark-submit jobs/train.py --config conf/NAME.toml [--set section.key=value ...]
                               [--out PATH] [--resume | --overwrite] [--verbose]
                               [--dry-run [--bandwidth 1gbit [--latency 1ms]]]

Also runs as plain ``python jobs/train.py ...`` (Spark local mode, ``--master``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("train", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
