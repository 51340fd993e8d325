"""The command line's Spark side: its SparkSession (said while the JVM starts, stopped on the way
out, signals handled) and checkpoints read through Hadoop's client (pyspark is imported on use)."""
from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager

from ..core import checkpoint
from ..spark.hfs import HadoopFS, read_checkpoint as hfs_checkpoint
from . import signals


class SparkStartError(RuntimeError):
    """Spark's JVM did not start (no Java, or it exited as it started); one line."""


@contextmanager
def spark_session(app: str, master, verbose: bool = False, ui: bool = True, progress=None):
    """The SparkSession, stopped on the way out when this call started it (not a test's shared one);
    on a terminal (``progress``) the JVM's start is said while it takes its seconds.

    A job that ends without stopping it leaves Spark's shutdown hooks to stop it: in local-cluster
    mode its Worker then restarts the executors being killed and logs an ERROR and a stack trace
    for each ("Shutdown hooks cannot be modified during shutdown").
    """
    from pyspark import SparkContext
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql import SparkSession
    from ..spark.session import get_spark
    owned = SparkSession.getActiveSession() is None
    if owned:
        check_master(master)
    if owned and progress is not None:      # a line of its own: the JVM writes to the terminal as it starts
        progress.message(f"starting Spark ({master or 'local[2]'}) ...")
    # PySpark's gateway (private; nothing public says the JVM is up before the SparkContext is made)
    with signals.starting_jvm(lambda: SparkContext._gateway is not None):
        try:
            spark = get_spark(app, master, quiet=not verbose)
        except PySparkRuntimeError as e:        # no Java, or the JVM exited as it started: Spark's lines above say
            if "JAVA_GATEWAY_EXITED" not in str(e):    # which (its launcher reads spark-env.sh: no check here could)
                raise
            raise SparkStartError("Spark's JVM did not start: the lines above are Spark's own (it needs Java 17 "
                                  "or later, at $JAVA_HOME/bin/java or on the PATH, as spark-env.sh leaves them)"
                                  ) from None
    try:                       # from here on a signal, or anything, still stops the session it started
        signals.install()      # in place of PySpark's SIGINT handler (see .signals)
        signals.raise_held()
        spark.sparkContext.setLogLevel("INFO" if verbose else "WARN")
        if owned and ui and spark.sparkContext.uiWebUrl:      # Spark's own line is among the INFO ones silenced
            if progress is not None:
                progress.message(f"Spark UI {spark.sparkContext.uiWebUrl}")
            else:
                print(f"Spark UI {spark.sparkContext.uiWebUrl}", file=sys.stderr, flush=True)
        yield spark
    finally:
        if owned:
            if signals.stopped() is not None:
                stop_now(spark)
            else:
                spark.stop()


MASTER_TIMEOUT_S = 5.0      # s: the longest wait for a standalone master's address to take a connection


def check_master(master: str | None) -> None:
    """Refuse, before the JVM starts, a standalone master (``spark://host:port``, or several for standby
    masters) that takes a connection at none of its addresses: Spark tried for a minute, logged ~100 lines of
    stack traces, and the command ended on "Cannot call methods on a stopped SparkContext". Under
    ``spark-submit`` the JVM has already connected."""
    from ..spark.session import plain_master
    url = plain_master(master)
    if not url.startswith("spark://") or "PYSPARK_GATEWAY_PORT" in os.environ:
        return
    reasons = []
    for address in url[len("spark://"):].split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=MASTER_TIMEOUT_S).close()
            return
        except (ValueError, OverflowError):
            reasons.append(f"{address}: not host:port")
        except OSError as e:
            reasons.append(f"{address}: {e.strerror or e}")
    raise SparkStartError(f"the Spark master {url} does not answer ({'; '.join(reasons)}): start it, or name "
                          "another with --master")


def stop_now(spark) -> None:
    """Stop the session under running jobs (a signal, a training interrupted): Spark's log silenced and
    its jobs cancelled first, as what it logs of the tasks it drops is no news (a WARN and an ERROR per
    task whose Python worker went with it, a broadcast gone under a task's completion listener)."""
    try:
        spark.sparkContext.setLogLevel("OFF")
        spark.sparkContext.cancelAllJobs()
    except Exception:       # the JVM going too: the stop that follows says nothing more
        pass
    spark.stop()


def read_checkpoint(sc, path: str) -> checkpoint.Checkpoint:
    """Load a checkpoint directory, or the checkpoint of a run directory, from any Hadoop path; what
    Hadoop's client cannot read (an unknown scheme, an unreachable NameNode, permissions) is one line."""
    from ..spark.session import job_errors
    try:
        fs, path = HadoopFS(sc, path), path.rstrip("/")
        path = checkpoint.in_run(path, fs)
        path = fs.readable(path) or path          # <path>.old where a save is cut between its renames
        local = fs.local_path(path)
        if not fs.exists(path) or (local is not None and os.path.isfile(local)):
            raise checkpoint.CheckpointError(checkpoint.not_found(path, fs.exists(path)))
        return hfs_checkpoint(fs, path)
    except job_errors() as e:
        java = getattr(e, "java_exception", None)
        first = next(iter((str(java) if java is not None else str(e)).splitlines()), type(e).__name__)
        raise checkpoint.CheckpointError(f"cannot read {path}: {first}") from None
