"""Creating the SparkSession the jobs and tests share; releasing what a run cached or broadcast
(:func:`release`); the helpers that must use PySpark's private names (each says why)."""
from __future__ import annotations

import logging
import os
import pickle
import re
import subprocess
import sys

from .launcher import launcher_property

BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# the driver JVM's heap when this process starts it and nothing else names one (conf/spark/local.properties'
# figure): Spark's own 1g fails a dense 20M-parameter round (2 x 80 MB task results through the JVM) now and then
DRIVER_MEMORY = "4g"


_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
LOG4J2 = {True: os.path.join(_DATA, "log4j2.properties"), False: os.path.join(_DATA, "log4j2-verbose.properties")}


def java_option(key: str, value: str) -> str:
    """``-Dkey=value`` as one word of an ``extraJavaOptions`` string, which Spark's launcher splits at
    whitespace outside quotes: a checkout under a path with a space ("/home/me/my projects") split the
    log4j path in two, and the JVM took its second half for the main class (every Spark command failed)."""
    word = f"-D{key}={value}"
    if not any(ch.isspace() or ch in "'\"\\" for ch in word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def get_spark(app: str = "rnnlm", master: str | None = None, conf: dict | None = None, quiet: bool = True):
    """The active SparkSession, or a new one.

    Under ``spark-submit`` the master and properties come from its command line (SparkConf loads
    them); run as plain Python, ``master`` (:func:`plain_master`: else the one ``$PYSPARK_SUBMIT_ARGS``
    or ``spark-defaults.conf`` names, else ``local[2]``). Executors' BLAS threads follow
    ``spark.task.cpus`` unless set, so concurrent tasks do not oversubscribe the cores. What the user
    set (``conf``, spark-submit's properties, ``--conf`` in ``$PYSPARK_SUBMIT_ARGS``,
    ``spark-defaults.conf``) is kept, for the keys set here as for the rest. The driver's JVM, when
    this call starts it, logs with ``rnnlm/data/log4j2.properties`` (``quiet``: warnings and errors
    only, no start-up INFO lines) or ``log4j2-verbose.properties`` (INFO), and has a heap of
    :data:`DRIVER_MEMORY` unless ``spark.driver.memory`` (``conf``, ``spark-defaults.conf``) or
    ``$SPARK_DRIVER_MEMORY`` names one: it is the launcher's last resort before Spark's 1g.
    """
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # spark-submit started the JVM and holds the master and properties (its gateway's port is the sign):
    # connected to it first, SparkConf() reads them, and the keys below are set only where the user set none
    # (a plain dict, it read as empty: spark.task.cpus as 1, the user's executorEnv and --name overwritten)
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    if submitted:
        from pyspark import SparkContext
        SparkContext._ensure_initialized()          # private, as _spark_default_logging's: nothing public yet
    c = SparkConf()

    def given(key: str) -> str | None:
        """The user's ``key``: in ``c`` (spark-submit's, or ``conf``), else where the launcher that plain
        Python starts reads it (``$PYSPARK_SUBMIT_ARGS``, ``spark-defaults.conf``), which ``c`` would override."""
        return c.get(key) if c.contains(key) else None if submitted else launcher_property(key)

    if master is not None or not submitted:
        c.setMaster(master if submitted else plain_master(master))
    if not submitted:
        os.environ.setdefault("SPARK_DRIVER_MEMORY", DRIVER_MEMORY)
    opts = given("spark.driver.extraJavaOptions") or ""
    if not submitted and "log4j2.configurationFile" not in opts:
        log4j = java_option("log4j2.configurationFile", f"file:{LOG4J2[quiet]}")
        c.set("spark.driver.extraJavaOptions", f"{opts} {log4j}".strip())
    if submitted and quiet and not c.contains("spark.log.level") and _spark_default_logging():
        c.set("spark.log.level", "WARN")        # a bare spark-submit: 3 INFO lines left of 44
    if given("spark.app.name") is None:
        c.setAppName(app)
    for k, v in (conf or {}).items():
        c.set(k, str(v))
    if given("spark.ui.showConsoleProgress") is None:
        c.set("spark.ui.showConsoleProgress", "false")   # the trainer logs one line per round
    cpus = given("spark.task.cpus") or "1"
    for var in BLAS_VARS:
        if given(f"spark.executorEnv.{var}") is None:
            c.set(f"spark.executorEnv.{var}", cpus)
    spark = SparkSession.builder.config(conf=c).getOrCreate()
    _quiet_when_the_jvm_ends(spark.sparkContext)
    return spark


def jvm_ended() -> bool:
    """Whether the JVM this process launched has exited under it (killed, crashed), waiting 2 s for it
    to: every call into it fails from then on. False where ``spark-submit`` launched it (this process is
    its child); a command that never imported PySpark (one of the core alone, where it may not be
    installed) started none."""
    context = getattr(sys.modules.get("pyspark"), "SparkContext", None)
    return _exited(getattr(getattr(context, "_gateway", None), "proc", None))


def _exited(proc) -> bool:
    """Whether ``proc`` (PySpark's JVM: ``SparkContext._gateway.proc``, private) has exited, waiting 2 s for
    it to: a JVM killed closes its sockets before it can be reaped, so a call refused comes first."""
    if proc is None:
        return False
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return False
    return True


class _QuietWhenTheJvmEnded(logging.Filter):
    """py4j logs each call the JVM's end cut short (``Exception while sending command.``, with its traceback,
    on the root logger, which it sets up to print): once the JVM has ended, the end is said in one line where
    the command ends (:func:`jvm_ended`), so these go."""

    def __init__(self, proc):
        super().__init__()
        self.proc = proc

    def filter(self, record) -> bool:
        return not (record.getMessage() == "Exception while sending command." and _exited(self.proc))


def _quiet_when_the_jvm_ends(sc) -> None:
    """No traceback when the JVM ends under this process: not py4j's (:class:`_QuietWhenTheJvmEnded`), nor
    PySpark's accumulator server's (a thread, ``sc._accumulatorServer``: private), which prints one (an
    EOFError) when the JVM's connection to it ends mid-message, unless the JVM lives on."""
    from pyspark import SparkContext
    server, proc = getattr(sc, "_accumulatorServer", None), getattr(SparkContext._gateway, "proc", None)
    if server is None or proc is None or getattr(server, "rnnlm_quiet", False):
        return
    said = server.handle_error

    def handle_error(request, address):
        if not _exited(proc):
            said(request, address)
    server.handle_error, server.rnnlm_quiet = handle_error, True
    root = logging.getLogger()
    for f in [f for f in root.filters if isinstance(f, _QuietWhenTheJvmEnded)]:
        root.removeFilter(f)            # a session's JVM before this one
    root.addFilter(_QuietWhenTheJvmEnded(proc))


def _spark_default_logging() -> bool:
    """Whether the driver's JVM (started by ``spark-submit``) logs with Spark's own INFO profile: the user
    gave no log4j2 configuration (a file, ``$SPARK_CONF_DIR``) that this package must leave alone.

    It uses PySpark's private gateway (``SparkContext._jvm``): the JVM exists, the SparkContext does
    not yet, and nothing public reaches log4j before it does.
    """
    from pyspark import SparkContext
    SparkContext._ensure_initialized()
    context = SparkContext._jvm.org.apache.logging.log4j.LogManager.getContext(False)
    source = context.getConfiguration().getConfigurationSource()
    location = source.getLocation() if source is not None else None
    return bool(location) and location.endswith("org/apache/spark/log4j2-defaults.properties")


def plain_master(master: str | None) -> str:
    """The master of a session that plain Python starts: ``master``, else the one the launcher reads
    (``--master`` in ``$PYSPARK_SUBMIT_ARGS``, ``spark.master`` there or in ``spark-defaults.conf``), else
    ``local[2]``."""
    return master or launcher_property("spark.master") or "local[2]"


_LOCAL_MASTER = re.compile(r"local(\[[^\]]*\])?|local-cluster\[[^\]]*\]")


def is_local_master(master: str) -> bool:
    """Whether every executor of ``master`` runs on this machine: ``local``, ``local[N]``, ``local-cluster[...]``."""
    return bool(_LOCAL_MASTER.fullmatch(master.strip()))


def bind_host(configured: str, master: str, driver_host: str | None) -> str:
    """The address a driver-side server (the parameter server, the direct result channel) listens
    on: ``configured`` (``server.host``) when set; loopback when every
    executor runs on this machine (``local``, ``local[N]``, ``local-cluster[...]``), so no other
    machine can reach the port; else ``spark.driver.host``, the address a cluster's executors
    (YARN containers, standalone or Kubernetes workers) already reach the driver at."""
    if configured:
        return configured
    if _LOCAL_MASTER.fullmatch(master.strip()):
        return "127.0.0.1"
    return driver_host or "127.0.0.1"


def job_errors() -> tuple:
    """What a failed Spark job raises on the driver: py4j's error, or what PySpark makes of it where a
    SparkSession runs (from PySpark 4 a Python task's failure is a ``PythonException``, a JVM's
    ``IllegalArgumentException`` its namesake: :mod:`pyspark.errors`)."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors.exceptions.captured import CapturedException
    return Py4JJavaError, CapturedException


def job_failure(text: str) -> str:
    """One line for a failed Spark job, from its error's text (a ``Py4JJavaError``'s): the last
    ``SomethingError: ...`` of the Python traceback it carries (its first line only names the py4j
    call), else the last ``Caused by:`` of the JVM's stack (a task's input that Hadoop failed to read), else
    Spark's reason for aborting the job; with a hint where memory is what failed."""
    # (py4j writes a Java exception raised on the driver as ": org.apache...Exception: why")
    lines = [x.strip().removeprefix(": ") for x in text.strip().splitlines() if x.strip()]
    causes = [x for x in lines if _cause(x) and "Py4JJavaError" not in x]
    # a task's JVM side that failed (Hadoop's reader): its root cause, where Spark says only that the worker crashed
    java = [c for x in lines if x.startswith("Caused by: ") and _cause(c := x.removeprefix("Caused by: "))]
    aborted = [x.split("Job aborted due to stage failure: ", 1)[1] for x in lines
               if "Job aborted due to stage failure: " in x]
    line = (causes[-1] if causes else java[-1] if java else aborted[0] if aborted else lines[0] if lines else "")[:300]
    if "OutOfMemoryError" in text or "TaskResultLost" in text:
        line += (" (a JVM's memory: raise spark.driver.memory, which in local mode holds the executors' "
                 "results too, or spark.executor.memory; plain python runs take $SPARK_DRIVER_MEMORY)")
    return line


def _cause(line: str) -> bool:
    """Whether a line of a failed job's text is an exception's ``Name: why`` other than Spark's or py4j's own."""
    return bool(re.match(r"^[\w.]*(Error|Exception): ", line)) and not line.startswith(("org.apache.spark", "py4j"))


def release(broadcasts=(), rdds=(), blocking: bool = False) -> None:
    """Drop ``rdds``' cached partitions and ``broadcasts`` (their copies everywhere, the driver's
    file included) from the executors.

    Each is an ask to every executor, answered once its blocks are gone. ``blocking`` waits for the
    answers: the releases of a run that ended or stopped between rounds do, since the session may
    stop next, and an executor told to stop with an ask unanswered makes the driver log "ERROR
    TransportResponseHandler: Still have 1 requests outstanding". Mid-run releases do not wait,
    nor do those of a failing run, whose executors may be gone. A blocking release that fails (an
    executor alive but silent for ``spark.rpc.askTimeout``; Spark logs it) is given up, and the
    rest go without waiting: a run that ended is not failed by its clean-up.
    """
    for drop in [*(r.unpersist for r in rdds), *(b.destroy for b in broadcasts)]:
        try:
            drop(blocking)
        except Exception:
            if not blocking:
                raise
            blocking = False


def broadcast_bytes(bc) -> int:
    """What a broadcast moves: PySpark writes the pickled value to a file the executors read."""
    path = getattr(bc, "_path", None)     # private: PySpark names the file nowhere public
    if path and os.path.exists(path):
        return os.path.getsize(path)
    return len(pickle.dumps(bc.value, protocol=pickle.HIGHEST_PROTOCOL))


def run_in_jvm(rdd) -> int:
    """Run ``rdd``'s job with its action in the JVM alone (a count), so that no Python worker reads
    its elements back: private, ``RDD.count`` would read each partition in Python."""
    return rdd._jrdd.count()


def jvm(sc):
    """The JVM's classes through py4j: private, and Hadoop's FileSystem and Path have no PySpark face."""
    return sc._jvm


def scala_context(sc):
    """The JVM's ``SparkContext`` (a py4j object): private, and PySpark has no face for its status store's
    tasks or ``killTaskAttempt``."""
    return sc._jsc.sc()


def hadoop_conf(sc):
    """The context's Hadoop ``Configuration`` (a py4j object): private, PySpark exposes none."""
    return sc._jsc.hadoopConfiguration()


def hadoop_splits(rdd) -> list:
    """``(path, start, length)`` of the file split each partition of ``rdd`` reads, in partition order, for an RDD
    straight from ``newAPIHadoopFile`` (a ``FileInputFormat``): private, PySpark exposes no partition."""
    out = []
    for part in rdd._jrdd.rdd().partitions():
        split = part.serializableHadoopSplit().value()
        out.append((split.getPath().toString(), split.getStart(), split.getLength()))
    return out


def spark_home() -> str:
    """Where PySpark's Spark lives (its ``bin/spark-class``): PySpark's own lookup is private."""
    from pyspark.find_spark_home import _find_spark_home
    return _find_spark_home()
