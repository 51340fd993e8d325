"""Fetch the public corpora into data/, checksum-verified.

    python jobs/download_data.py [ptb] [tinyshakespeare] [--dest data] [--mirror DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.download import CORPORA, DownloadError, fetch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpora", nargs="*", help=f"any of {', '.join(CORPORA)} (default: all)")
    ap.add_argument("--dest", default="data")
    ap.add_argument("--mirror", default=None, help="copy from this folder instead of the network")
    a = ap.parse_args(argv)
    try:
        for c in a.corpora or list(CORPORA):
            fetch(c, a.dest, a.mirror)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
