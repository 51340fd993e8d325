"""Fetch the public corpora into data/, checksum-verified.

    python jobs/download_data.py [ptb] [tinyshakespeare] [--dest data] [--mirror DIR]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("download", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
