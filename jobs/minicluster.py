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

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm.hadoop.minicluster import (  # noqa: E402
    MiniCluster, MiniClusterError, build, hostname_not_on_loopback, missing_tools)


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="working directory: cluster files, conf/, minicluster.log")
    ap.add_argument("--build", action="store_true", help="fetch the jars and compile the launcher, then exit")
    ap.add_argument("--datanodes", type=int, default=2, choices=range(1, 5), metavar="{1..4}")
    ap.add_argument("--nodemanagers", type=int, default=2, choices=range(1, 5), metavar="{1..4}")
    ap.add_argument("--nm-memory-mb", type=int, default=3072, help="memory each NodeManager offers YARN")
    a = ap.parse_args(argv)
    problem = missing_tools()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if a.build:
        try:
            print(f"classpath {build()}")
        except MiniClusterError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if not a.dir:
        print("error: --dir is required (or --build)", file=sys.stderr)
        return 2
    if a.nm_memory_mb < 1024:
        print("error: --nm-memory-mb must be at least 1024 (a Spark container needs ~900 MB)", file=sys.stderr)
        return 2
    try:
        os.makedirs(a.dir, exist_ok=True)
    except OSError as e:
        print(f"error: --dir {a.dir}: {e.strerror}", file=sys.stderr)
        return 2
    warning = hostname_not_on_loopback()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    cluster = MiniCluster(a.dir, a.datanodes, a.nodemanagers, a.nm_memory_mb)
    try:
        cluster.start()
        print(cluster.endpoints.line(), flush=True)
        while cluster.proc.poll() is None:
            time.sleep(0.5)
        print(f"error: the cluster's JVM exited (code {cluster.proc.returncode}; log: {cluster.log_path})",
              file=sys.stderr)
        return 1
    except _Stop as e:
        print(f"stopping ({e})", file=sys.stderr)
        return 0
    except MiniClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):      # a second one must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
