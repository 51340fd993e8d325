"""Creating the SparkSession the jobs and tests share."""
from __future__ import annotations

import os
import sys

BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def get_spark(app: str = "rnnlm", master: str | None = None, conf: dict | None = None):
    """The active SparkSession, or a new one.

    Under ``spark-submit`` the master and properties come from its command line
    (SparkConf loads them); run as plain Python, ``master`` (default ``local[2]``)
    is used. Executors' BLAS threads follow ``spark.task.cpus`` unless set, so
    concurrent tasks do not oversubscribe the cores.
    """
    from pyspark import SparkConf
    from pyspark.sql import SparkSession
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    c = SparkConf()
    if master is not None or not c.contains("spark.master"):
        c.setMaster(master or "local[2]")
    if not c.contains("spark.app.name"):
        c.setAppName(app)
    for k, v in (conf or {}).items():
        c.set(k, str(v))
    if not c.contains("spark.ui.showConsoleProgress"):
        c.set("spark.ui.showConsoleProgress", "false")   # the trainer logs one line per round
    cpus = c.get("spark.task.cpus", "1")
    for var in BLAS_VARS:
        if not c.contains(f"spark.executorEnv.{var}"):
            c.set(f"spark.executorEnv.{var}", cpus)
    return SparkSession.builder.config(conf=c).getOrCreate()
