"""Run a real HDFS and YARN on this machine (loopback only) until Ctrl-C or SIGTERM.

    python jobs/minicluster.py --dir DIR [--datanodes 2] [--nodemanagers 2] [--nm-memory-mb 3072]
    python jobs/minicluster.py --build      # only fetch the jars (Maven) and compile, then exit

Prints one line once both are up:
``HADOOP_CONF_DIR=<dir> fs.defaultFS=<hdfs://...> webhdfs=<http://...> yarn=<host:port>``;
export that ``HADOOP_CONF_DIR`` and ``spark-submit --master yarn`` and ``hdfs://`` paths use
this cluster. The first start fetches Hadoop's jars with Maven (a few minutes, once).
HDFS is formatted at every start.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.cli.main import job  # noqa: E402


def main(argv=None) -> int:
    return job("minicluster", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
