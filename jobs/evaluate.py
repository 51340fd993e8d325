"""Perplexity of a checkpoint on a corpus (bits per character too for char models).

    spark-submit jobs/evaluate.py --checkpoint PATH --data PATH [--streams N] [--verbose]

PATH is a checkpoint or a training run's directory (the ``--out`` of train). It prints
``<data PATH>: loss L | ppl P [| bpc B]``, then exactly ``ppl=<number>`` as the last line.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("evaluate", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
