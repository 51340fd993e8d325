"""Build what spark-submit ships to a cluster: dist/rnnlm.zip (--py-files) and, with --env,
a packed Python environment with NumPy (--archives ENV.tar.gz#env).

    python jobs/package.py [--out dist/rnnlm.zip] [--env dist/rnnlm-env.tar.gz]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.packaging import PackagingError, build_env, build_pyfiles  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dist/rnnlm.zip", help="the zip for --py-files (default: %(default)s)")
    ap.add_argument("--env", metavar="ENV.tar.gz",
                    help="also pack a virtual environment with NumPy (needs venv-pack: the cluster extra)")
    a = ap.parse_args(argv)
    print(build_pyfiles(a.out))
    if a.env:
        try:
            print(build_env(a.env))
        except PackagingError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
