"""Hosts of our own on one machine: Linux network namespaces behind rate-limited links.

``NetCluster(hosts=3, rate="1gbit")`` creates one namespace per host (``10.77.0.1``,
``10.77.0.2``, ...; host 0 is the driver's) and one for a switch: a bridge with a veth pair
to every host. Each host's link is shaped in both directions with a token bucket (``tbf``:
the host's egress on its ``eth0``, its ingress on the switch's port), so a transfer between
two hosts crosses two shaped links and a host talking to several peers shares its one link,
as on a cluster's top-of-rack switch. ``spark_standalone()`` then runs a Spark standalone
master in host 0 and one worker per other host, each in its own namespace; a driver started
with :meth:`NetCluster.command` (host 0) reaches its executors only through the links.

Latency is not emulated: it needs ``sch_netem``, which kernels without its module (this one)
lack; the links then add only the veth pair's own (tens of microseconds).
:func:`rnnlm.spark.linkcost.predict` models latency instead, as a count of round trips.

Everything stays inside the namespaces created here, on the addresses assigned here; every
wait is bounded, and :meth:`close` (also on Ctrl-C, SIGTERM and errors, through ``with``)
kills what was started and deletes the namespaces, which deletes their links. Needs root and
iproute2 (``ip``, ``tc``): :func:`unavailable` says in one line why not, where it cannot run.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .spark.linkcost import parse_rate

SUBNET = "10.77.0"
_PREFIX = "rnnlm"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-")


class NetClusterError(RuntimeError):
    """A step of building or using the cluster failed; the message is one line."""


def unavailable() -> str | None:
    """None when namespaces and traffic control can be used here, else why not (one line)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"iproute2 is not installed ({', '.join(missing)} not on the PATH)"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip() or r.returncode}"
    try:
        r = _run(["ip", "-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1"], check=False)
        if r.returncode == 0:
            r = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "d0", "root",
                      "tbf", "rate", "1mbit", "burst", "32kb", "latency", "50ms"], check=False)
        if r.returncode != 0:
            return f"traffic control (tc tbf) is not available: {r.stderr.strip() or r.returncode}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(argv, check=True, timeout=30):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise NetClusterError(f"{' '.join(argv)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete namespaces an earlier cluster left behind (its process dead: killed with SIGKILL)."""
    r = _run(["ip", "netns", "list"], check=False)
    gone = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _kill_inside(name)              # its Spark JVMs run on in their own sessions, the namespace deleted
            _run(["ip", "netns", "del", name], check=False)
            gone.append(name)
    return gone


def _kill_inside(namespace: str) -> None:
    """SIGKILL every process still running in ``namespace``."""
    for pid in _run(["ip", "netns", "pids", namespace], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def burst_bytes(bits_per_s: float) -> int:
    """The token bucket's depth: 2 ms at the rate, at least 64 KB (one GSO segment must fit)."""
    return max(64 * 1024, int(bits_per_s / 8 * 0.002))


class NetCluster:
    """``hosts`` namespaces on a switch, each link shaped to ``rate`` (``None``: unshaped)."""

    def __init__(self, hosts: int, rate: str | None = None):
        if not 2 <= hosts <= 16:
            raise NetClusterError(f"hosts {hosts}: must be between 2 and 16")
        self.hosts = hosts
        self.tag = f"{_PREFIX}{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.rate = rate
        self.procs: list[subprocess.Popen] = []
        self.workdir = tempfile.mkdtemp(prefix="rnnlm-netcluster-")
        self.master_url: str | None = None
        self._made: list[str] = []

    @classmethod
    def attach(cls, tag: str, hosts: int) -> "NetCluster":
        """A handle on a running cluster's links (for :meth:`shape` from another process): owns nothing."""
        c = cls.__new__(cls)
        c.hosts, c.tag, c.switch = hosts, tag, f"{tag}-sw"
        c.names = [f"{tag}-h{i}" for i in range(hosts)]
        c.rate, c.procs, c._made, c.master_url = None, [], [], None
        c.workdir = None
        return c

    # ---- lifecycle
    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        sweep_stale()
        for ns in [self.switch, *self.names]:
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.names):
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                  "netns", self.switch])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", f"p{i}", "up"])
        self.shape(self.rate)
        return self

    def close(self):
        """Kill every process started here (their process groups), then delete the namespaces."""
        for p in self.procs:                # the group, whether or not its leader has exited
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self.procs.clear()
        for ns in reversed(self._made):
            _kill_inside(ns)                # what a group's leader left behind when it exited first
            _run(["ip", "netns", "del", ns], check=False)
        self._made.clear()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- the links
    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def shape(self, rate: str | None):
        """Set every link to ``rate`` in both directions (``None``: remove the shaping)."""
        bits = None if rate is None else parse_rate(rate)      # a rate that cannot be read leaves the links as they are
        for i, ns in enumerate(self.names):
            for where, dev in ((ns, "eth0"), (self.switch, f"p{i}")):
                _run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
                if bits is not None:
                    _run(["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                          "rate", f"{int(bits)}bit", "burst", str(burst_bytes(bits)), "latency", "200ms"])
        self.rate = rate

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per host, ``(bytes sent, bytes received)`` on its link so far, counted at the switch port."""
        out = []
        for i in range(self.hosts):
            base = f"/sys/class/net/p{i}/statistics"
            r = _run(["ip", "netns", "exec", self.switch, "cat", f"{base}/rx_bytes", f"{base}/tx_bytes"])
            rx, tx = (int(v) for v in r.stdout.split())
            out.append((rx, tx))          # the port receives what the host sends
        return out

    # ---- processes in a host
    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i``."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def spawn(self, i: int, argv: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        """Start ``argv`` in host ``i`` in its own process group (killed by :meth:`close`)."""
        f = open(os.path.join(self.workdir, log), "ab")
        p = subprocess.Popen(self.command(i, argv), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=env, start_new_session=True)
        f.close()
        self.procs.append(p)
        return p

    def measure(self, src: int, dst: int, nbytes: int, timeout: float = 120) -> float:
        """Bits per second of one TCP transfer of ``nbytes`` from host ``src`` to host ``dst``,
        timed by the receiver from its first chunk to its last (the bytes after the first)."""
        host, port = self.address(dst), 5999
        recv = subprocess.Popen(self.command(dst, [sys.executable, "-c", _RECEIVER, host, str(port), str(nbytes)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            send = _run(self.command(src, [sys.executable, "-c", _SENDER, host, str(port), str(nbytes)]),
                        timeout=timeout)
            out, err = recv.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise NetClusterError(f"a {nbytes}-byte transfer took longer than {timeout:.0f} s") from None
        finally:
            if recv.poll() is None:
                os.killpg(recv.pid, signal.SIGKILL)
                recv.wait()
        if recv.returncode != 0 or not out.strip():
            raise NetClusterError(f"the receiver failed: {err.strip() or send.stderr.strip()}")
        got, timed, seconds = out.split()
        if int(got) != nbytes:
            raise NetClusterError(f"the transfer ended after {got} of its {nbytes} bytes")
        if int(timed) == 0:
            raise NetClusterError(f"{nbytes} bytes arrived in one chunk: too few to time a link (send more)")
        return int(timed) * 8 / float(seconds)

    # ---- Spark standalone
    def spark_standalone(self, cores: int = 1, memory: str = "1500m", timeout: float = 90) -> str:
        """A Spark master in host 0 and a worker in every other host; returns the master's URL
        once every worker has registered."""
        from .spark.session import spark_home
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        master = self.address(0)
        env = dict(os.environ, SPARK_LOCAL_IP=master, SPARK_NO_DAEMONIZE="1",
                   PYSPARK_PYTHON=os.environ.get("PYSPARK_PYTHON", sys.executable))
        self.spawn(0, [spark_class, "org.apache.spark.deploy.master.Master", "--host", master, "--port", "7077",
                       "--webui-port", "8080"], "master.log", env)
        self.master_url = f"spark://{master}:7077"
        for i in range(1, self.hosts):
            wenv = dict(env, SPARK_LOCAL_IP=self.address(i), SPARK_WORKER_DIR=os.path.join(self.workdir, f"w{i}"))
            self.spawn(i, [spark_class, "org.apache.spark.deploy.worker.Worker", self.master_url,
                           "--host", self.address(i), "--cores", str(cores), "--memory", memory,
                           "--webui-port", str(8081 + i)], f"worker{i}.log", wenv)
        log = os.path.join(self.workdir, "master.log")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise NetClusterError(f"a Spark daemon exited (code {p.returncode}); see {self.workdir}")
            with open(log, errors="replace") as f:
                if f.read().count("Registering worker") >= self.hosts - 1:
                    return self.master_url
            time.sleep(0.5)
        raise NetClusterError(f"the workers did not register within {timeout:.0f} s; see {log}")


_RECEIVER = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen(1)
s.settimeout(60); c, _ = s.accept(); c.settimeout(60)
buf, got, t0, first = bytearray(1 << 20), 0, None, 0
while got < n:
    k = c.recv_into(buf)
    if not k:
        break
    if t0 is None:                         # the clock starts at the first chunk: its bytes came before it
        t0, first = time.perf_counter(), k
    got += k
print(got, got - first, time.perf_counter() - t0); c.sendall(b"k")
"""

_SENDER = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(100):                       # the receiver may not listen yet: 10 s at most
    try:
        c = socket.create_connection((host, port), timeout=60); break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("no receiver")
data, sent = b"x" * (1 << 20), 0
while sent < n:
    c.sendall(data[:n - sent]); sent += min(len(data), n - sent)
c.recv(1)
"""
