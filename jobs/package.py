"""Build dist/rnnlm.zip, the file to pass to spark-submit --py-files.

    python jobs/package.py [--out dist/rnnlm.zip]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.packaging import build_pyfiles  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dist/rnnlm.zip")
    a = ap.parse_args(argv)
    print(build_pyfiles(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
