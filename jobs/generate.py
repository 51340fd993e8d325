"""Sample text from a checkpoint.

    python jobs/generate.py --checkpoint DIR [--prime TEXT] [--length N]
                            [--temperature T] [--argmax] [--seed S]

DIR is a checkpoint or a training run's directory (the ``--out`` of train). A local DIR is read
with plain Python; any other Hadoop path (``hdfs://...``, or a path without a scheme while
``$HADOOP_CONF_DIR`` names HDFS as the default filesystem) through a local Spark JVM. Without
``--seed`` a new seed is drawn and printed (on stderr) so that ``--seed`` repeats the sample.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("generate", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
