"""What Spark's launcher would read, read without a JVM: a property given to the launcher that plain
Python starts (``$PYSPARK_SUBMIT_ARGS``, the properties file, ``spark-defaults.conf``) and Spark's conf
directory. The session (:mod:`.session`) and Hadoop's default filesystem (:mod:`.hfs`) both ask it."""
from __future__ import annotations

import os
import re
import shlex

from ..core import files


def spark_conf_dir() -> str:
    """Spark's conf directory, which its launcher puts on the classpath before Hadoop's."""
    home = os.environ.get("SPARK_HOME") or _pyspark_home()
    return os.environ.get("SPARK_CONF_DIR") or (os.path.join(home, "conf") if home else "")


def launcher_property(key: str) -> str | None:
    """Spark property ``key`` as the launcher that plain Python starts would read it: ``--conf
    key=value`` in ``$PYSPARK_SUBMIT_ARGS`` (for ``spark.master`` its ``--master`` first, as the launcher
    takes it), else the properties file (``--properties-file`` there,
    else ``spark-defaults.conf`` in ``$SPARK_CONF_DIR``, else in ``$SPARK_HOME/conf``, PySpark's
    package directory where ``$SPARK_HOME`` is unset); None if none names it or they cannot be read."""
    try:
        args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    except ValueError:
        args = []
    value, props, defaults, flag_master = None, None, True, None
    for flag, arg in zip(args, args[1:] + [""]):
        if flag == "--master" or flag.startswith("--master="):
            flag_master = arg if flag == "--master" else flag[9:]
        elif flag in ("--conf", "-c") and arg.partition("=")[0].strip() == key:
            value = arg.partition("=")[2].strip()
        elif flag.startswith("--conf=") and flag[7:].partition("=")[0].strip() == key:
            value = flag[7:].partition("=")[2].strip()
        elif flag == "--properties-file":
            props, defaults = arg, "--load-spark-defaults" in args
    if key == "spark.master" and flag_master:
        return flag_master
    if value is not None:
        return value
    conf_dir = spark_conf_dir()
    paths = [props] if props else []
    if defaults and conf_dir:
        paths.append(os.path.join(conf_dir, "spark-defaults.conf"))
    for f in paths:                    # the properties file's value wins over spark-defaults.conf's
        found = _properties(f).get(key)
        if found is not None:
            return found
    return None


def _pyspark_home() -> str | None:
    """Where PySpark's launcher looks when ``$SPARK_HOME`` is unset (a pip-installed PySpark: its
    package directory), found without importing it."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("pyspark")
    except (ImportError, ValueError):       # no PySpark here (rnnlm demo's core alone): no launcher either
        return None
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def _properties(path: str) -> dict:
    """A Java properties file's ``key value`` / ``key=value`` / ``key: value`` lines (comments
    skipped, values trimmed as Spark trims them); empty if it cannot be read."""
    try:
        data = files.read_regular(path, 16 << 20)           # a FIFO there blocked every command's start
    except (OSError, ValueError):                           # missing, not a regular file, too large
        return {}
    lines = data.decode("utf-8", errors="replace").splitlines()
    out = {}
    for line in lines:
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        m = re.match(r"([^\s=:]+)\s*[=:\s]\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out
