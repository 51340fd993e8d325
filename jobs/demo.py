"""Train the demo model on one machine and print samples.

    python jobs/demo.py [--config conf/demo.toml] [--set section.key=value ...] [--out DIR]

From any working directory: the config's relative data paths are read from its checkout.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("demo", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
