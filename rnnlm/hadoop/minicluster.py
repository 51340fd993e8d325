"""A real HDFS and YARN on one machine: Hadoop's own test clusters, started in one JVM.

``MiniCluster(dir).start()`` runs ``MiniCluster.java`` (beside this file): a NameNode with
WebHDFS and two DataNodes (``MiniDFSCluster``, on 127.0.0.1), a ResourceManager and
NodeManagers (``MiniYARNCluster``, on the address the hostname resolves to: loopback where
``/etc/hosts`` says so; :func:`hostname_not_on_loopback` tells), every port chosen by the system. Once both are up it
writes a client configuration directory (``core-site.xml``, ``hdfs-site.xml``,
``yarn-site.xml``) for ``HADOOP_CONF_DIR``. Its HDFS is formatted at every start: a scratch
cluster for trying the YARN recipe and for the tests, not a place to keep data.

The first start fetches the jars with Maven (``pom.xml`` beside this file; Maven keeps its
own copy in ``~/.m2``) and compiles the launcher with ``javac`` into a cache directory,
``$RNNLM_HADOOP_CACHE`` or ``~/.cache/rnnlm/hadoop-<version>``; later starts reuse both.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import select
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

HADOOP_VERSION = "3.5.0"
_HERE = os.path.dirname(os.path.abspath(__file__))
_POM = os.path.join(_HERE, "pom.xml")
_SOURCE = os.path.join(_HERE, "MiniCluster.java")
_LOG4J = """log4j.rootLogger=WARN, stderr
log4j.appender.stderr=org.apache.log4j.ConsoleAppender
log4j.appender.stderr.Target=System.err
log4j.appender.stderr.layout=org.apache.log4j.PatternLayout
log4j.appender.stderr.layout.ConversionPattern=%d{HH:mm:ss} %p %c{1}: %m%n
"""


class MiniClusterError(RuntimeError):
    """The cluster cannot be built or started; the message is one line."""


def missing_tools() -> str | None:
    """None when Java and Maven are on the PATH, else one line naming what is missing."""
    missing = [t for t in ("java", "javac", "mvn") if shutil.which(t) is None]
    if not missing:
        return None
    return (f"the Hadoop minicluster needs Java 17 (java, javac) and Maven (mvn); not on the PATH: "
            f"{', '.join(missing)}")


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("RNNLM_HADOOP_CACHE") or os.path.join(base, "rnnlm", f"hadoop-{HADOOP_VERSION}")


def _digest(*paths: str) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def _run(cmd: list, what: str, timeout: float) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MiniClusterError(f"{what} took more than {timeout:.0f} s") from None
    if r.returncode != 0:
        lines = [x for x in (r.stdout + r.stderr).splitlines() if "ERROR" in x or "error" in x] or [""]
        raise MiniClusterError(f"{what} failed (exit {r.returncode}): {lines[0].strip()[:300]}")


def build(cache: str | None = None, timeout: float = 900) -> str:
    """Fetch the jars and compile the launcher once; return the Java classpath.

    Each output is made under a temporary name and renamed into place, so an interrupted
    build is redone and two builds at once do not see each other's halves.
    """
    problem = missing_tools()
    if problem:
        raise MiniClusterError(problem)
    cache = cache or cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
        return _build_in(cache, timeout)
    except OSError as e:             # the cache not writable: one line, as every other failure here
        raise MiniClusterError(f"cannot build in {cache}: {e.strerror or e}") from None


def _build_in(cache: str, timeout: float) -> str:
    jars = os.path.join(cache, f"jars-{_digest(_POM)}")
    if not os.path.isdir(jars):
        tmp = tempfile.mkdtemp(prefix="jars.", dir=cache)
        try:
            _run(["mvn", "-q", "-B", "-f", _POM, "dependency:copy-dependencies", f"-DoutputDirectory={tmp}"],
                 "fetching the Hadoop jars with Maven", timeout)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _rename_into_place(tmp, jars)
    classes = os.path.join(cache, f"classes-{_digest(_POM, _SOURCE)}")
    if not os.path.isdir(classes):
        tmp = tempfile.mkdtemp(prefix="classes.", dir=cache)
        try:
            _run(["javac", "-cp", os.path.join(jars, "*"), "-d", tmp, _SOURCE], "compiling MiniCluster.java", timeout)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _rename_into_place(tmp, classes)
    return f"{classes}{os.pathsep}{os.path.join(jars, '*')}"


def _rename_into_place(tmp: str, dest: str) -> None:
    try:
        os.rename(tmp, dest)
    except OSError:   # another build finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)


def java_home() -> str:
    """``$JAVA_HOME``, or the JDK the ``java`` on the PATH belongs to: YARN starts every
    container with ``$JAVA_HOME/bin/java``, so the NodeManagers must know it."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    return os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("java"))))


def hostname_not_on_loopback() -> str | None:
    """None when this machine's hostname resolves to loopback, else one line saying where
    YARN will listen: MiniYARNCluster binds its NodeManagers to the hostname's address
    (HDFS is always on 127.0.0.1)."""
    name = socket.gethostname()
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(name, None)}
    except OSError:
        return None     # unresolvable: Hadoop falls back to localhost
    outside = sorted(a for a in addrs if not ipaddress.ip_address(a).is_loopback)
    if not outside:
        return None
    return (f"the hostname {name} resolves to {', '.join(outside)}: YARN's NodeManagers listen there, "
            "reachable from that network (map the hostname to 127.0.0.1 in /etc/hosts to keep them local)")


@dataclass(frozen=True)
class Endpoints:
    """Where the running cluster answers."""

    conf_dir: str      # for HADOOP_CONF_DIR
    fs_default: str    # hdfs://localhost:PORT
    webhdfs: str       # http://localhost:PORT (the NameNode's HTTP address)
    yarn: str          # the ResourceManager, localhost:PORT
    yarn_web: str      # its REST API and UI, http://localhost:PORT

    def line(self) -> str:
        return (f"HADOOP_CONF_DIR={self.conf_dir} fs.defaultFS={self.fs_default} "
                f"webhdfs={self.webhdfs} yarn={self.yarn}")


class MiniCluster:
    """HDFS and YARN in one JVM, on loopback, in the working directory ``dir``.

    Parameters
    ----------
    dir : str
        Holds the cluster's files (``dfs/``, ``target/``), the client configuration
        (``conf/``) and the JVM's log (``minicluster.log``).
    datanodes, nodemanagers : int
        HDFS replicates to ``min(2, datanodes)``.
    nm_memory_mb, nm_vcores : int
        What each NodeManager offers YARN. Neither is enforced (containers are plain
        processes), and the capacity scheduler places containers by memory alone: the
        defaults fit an ApplicationMaster and two 512 MB executors on a 2-core machine.
    """

    def __init__(self, dir: str, datanodes: int = 2, nodemanagers: int = 2,
                 nm_memory_mb: int = 3072, nm_vcores: int = 2, heap_mb: int = 1024):
        self.dir = os.path.abspath(dir)
        self.args = ["--datanodes", str(datanodes), "--nodemanagers", str(nodemanagers),
                     "--nm-memory-mb", str(nm_memory_mb), "--nm-vcores", str(nm_vcores)]
        self.heap_mb = heap_mb
        self.proc: subprocess.Popen | None = None
        self.endpoints: Endpoints | None = None

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "minicluster.log")

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default ``os.environ``) with ``HADOOP_CONF_DIR`` pointing at this cluster."""
        return dict(os.environ if base is None else base, HADOOP_CONF_DIR=self.endpoints.conf_dir)

    def start(self, timeout: float = 180) -> "MiniCluster":
        if re.search(r'["\\\x00-\x1f\x7f]', self.dir):
            # the launcher writes its ready line's JSON without escaping: such a name would not read back whole
            raise MiniClusterError(f"--dir {self.dir!r}: a quote, a backslash or a control character in the path")
        classpath = build()
        log4j = os.path.join(self.dir, "log4j.properties")
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(log4j, "w") as f:
                f.write(_LOG4J)
        except OSError as e:
            raise MiniClusterError(f"--dir {self.dir}: {e.strerror or e}") from None
        env = dict(os.environ, JAVA_HOME=java_home())
        env.pop("HADOOP_CONF_DIR", None)   # the cluster must not read a client configuration
        with open(self.log_path, "ab") as log:
            # a session of its own: Ctrl-C reaches the launcher, which stops the cluster in order
            self.proc = subprocess.Popen(
                ["java", f"-Xmx{self.heap_mb}m", f"-Dlog4j.configuration=file:{log4j}", "-cp", classpath,
                 "MiniCluster", "--dir", self.dir, *self.args],
                cwd=self.dir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True)
        try:
            kind, rest = self._answer(timeout)
            if kind != "ready":
                raise MiniClusterError(f"the cluster did not start: {rest} (log: {self.log_path})")
            try:
                ready = json.loads(rest)
            except ValueError:
                raise MiniClusterError(f"the cluster's ready line is not JSON: {rest[:200]!r} "
                                       f"(log: {self.log_path})") from None
            self.endpoints = Endpoints(**{k: v for k, v in ready.items() if k in Endpoints.__annotations__})
        except BaseException:
            self.stop()
            raise
        return self

    def stop_datanode(self, i: int, timeout: float = 60) -> None:
        """Stop DataNode ``i`` (0-based) as a crash would: its blocks are not handed over."""
        self._command(f"stop-datanode {i}", timeout)

    def restart_datanode(self, i: int, timeout: float = 120) -> None:
        """Start DataNode ``i`` again, on its old ports and storage, after :meth:`stop_datanode`."""
        self._command(f"restart-datanode {i}", timeout)

    def stop(self, timeout: float = 60) -> None:
        """Shut both clusters down (closing the JVM's stdin is its signal) and wait; kill it
        if it has not exited within ``timeout`` seconds."""
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------ protocol
    def _command(self, cmd: str, timeout: float) -> None:
        if self.proc is None:
            raise MiniClusterError("the cluster is not running")
        self.proc.stdin.write(cmd.encode() + b"\n")
        self.proc.stdin.flush()
        kind, rest = self._answer(timeout)
        if kind != "ok":
            raise MiniClusterError(f"{cmd}: {rest}")

    def _answer(self, timeout: float) -> tuple[str, str]:
        """The JVM's next protocol line as (kind, rest); bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        out = self.proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MiniClusterError(f"no answer from the cluster in {timeout:.0f} s (log: {self.log_path})")
            ready, _, _ = select.select([out], [], [], min(left, 1.0))
            if ready:
                line = out.readline().decode(errors="replace").strip()
                if not line:
                    raise MiniClusterError(f"the cluster's JVM exited (code {self.proc.wait()}; "
                                           f"log: {self.log_path})")
                kind, _, rest = line.partition(" ")
                return kind, rest
