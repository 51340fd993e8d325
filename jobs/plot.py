"""Plot runs: a metric against tokens, all-reduces, bytes or wall time; or the frontier.

    python jobs/plot.py --runs DIR [DIR ...] [--x tokens|syncs|bytes|wall] [--y train_loss|valid_ppl|...]
                        [--kind metric|frontier|sync] [--pick best|final] [--labels NAME ...]
                        --out FIG.png|.svg|.pdf

A DIR is a run (the ``--out`` of train) or a folder of runs; ``webhdfs://host:port/path``
reads from HDFS (``pip install -e ".[hdfs]"``). No Spark is started.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("plot", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
