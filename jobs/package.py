"""Build what spark-submit ships to a cluster: dist/rnnlm.zip (--py-files) and, with --env,
a packed Python environment with NumPy (--archives ENV.tar.gz#env).

    python jobs/package.py [--out dist/rnnlm.zip] [--env dist/rnnlm-env.tar.gz]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("package", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
