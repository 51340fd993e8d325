"""Where a lineage of :mod:`rnnlm.spark.lineage` starts after a cut: what each partition held, kept
on the driver and fetched by a task only where its executor lacks the file it was collected from.

A cut (a checkpoint, or the lineage's depth) collects what the partitions hold to the driver. Sent
back as one broadcast per partition, it reached every executor whole: a task's closure names every
partition's broadcast, and an executor fetches each broadcast its tasks name. Yet the executor that
ran a partition's last round still has that partition's share in a file. So the new lineage's
:class:`Seed` names, per partition, that file (a :class:`~rnnlm.spark.filestore.Stored`) and the
driver's :class:`SeedServer`: a task reads the file, and only where it is not (the task landed on
another executor, the executor was lost, a checkpoint is being resumed) asks the driver for its own
partition's arrays, over the asynchronous mode's wire (HMAC-authenticated frames, never pickle).
Where the executors cannot reach the driver on a port of its own (a firewall that opens Spark's
pinned ports alone: :func:`unreachable` finds it once, by a probe job, before the first such seed),
the lineage starts from one broadcast per partition instead (:meth:`Seed.broadcast`), as before.
docs/design.md ("Rounds whose carryover stays in Spark") says what it saves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..server import wire
from . import filestore

CONNECT_S = 10.0            # s: a task's connect and each socket operation


class SeedError(RuntimeError):
    """A partition's seed could not be had from the driver, or was not what the lineage expects."""


def _spec(arrays: dict) -> tuple:
    """((name, dtype, shape), ...) of ``arrays``: what a fetched seed must match."""
    return tuple((name, np.asarray(a).dtype.str, tuple(np.shape(a))) for name, a in arrays.items())


@dataclass(frozen=True)
class Seed:
    """A lineage's start, pickled into its tasks (plain values; the arrays stay on the driver).

    ``host``, ``port``, ``secret``: the :class:`SeedServer` of this lineage (None with nothing held);
    ``specs``: pid -> what the partition holds (:func:`_spec`); ``files``: pid -> the file it was
    collected from (absent: none, as after a resume); ``carries``: pid -> the broadcast of its carry
    into the next round (``train.overlap``); ``shares``: pid -> a broadcast of what it holds, where
    the executors cannot reach the driver (:meth:`broadcast`)."""

    host: str | None
    port: int
    secret: bytes = field(repr=False)         # a task's function printed (a log, an error) does not show it
    specs: dict
    files: dict
    carries: dict
    shares: dict = field(default_factory=dict)

    @classmethod
    def broadcast(cls, held: dict, shares: dict, carries: dict) -> Seed:
        """Where the executors cannot reach the driver: ``shares``, pid -> a broadcast of ``held[pid]``
        (every executor fetches every one)."""
        return cls(None, 0, b"", {pid: _spec(h) for pid, h in held.items()}, {}, carries, shares)

    def __call__(self, item) -> tuple:
        """A corpus element ``(pid, tokens, starts)`` -> the lineage's first ``(pid, tokens, starts, held,
        carry)``."""
        pid, tokens, starts = item
        held = self.held(pid) if pid in self.specs else None
        carry = self.carries[pid].value if pid in self.carries else None
        return pid, tokens, starts, held, carry

    def held(self, pid: int) -> dict:
        """What partition ``pid`` held at the cut: its broadcast share, else its file on this host, else
        the driver's copy."""
        if pid in self.shares:
            return self.shares[pid].value
        ref = self.files.get(pid)
        found = None if ref is None else filestore.load(ref, pid)
        return found if found is not None else self.fetch(pid)

    def fetch(self, pid: int) -> dict:
        """Partition ``pid``'s arrays from the driver, checked against :attr:`specs` (a reply whose body
        is larger than theirs is refused before it is read)."""
        spec = self.specs[pid]
        limit = sum(np.dtype(d).itemsize * math.prod(s) for _, d, s in spec)
        where = f"{self.host}:{self.port}"
        try:
            conn = wire.connect(self.host, self.port, self.secret, limit, CONNECT_S, retry_s=CONNECT_S)
            try:
                conn.send("seed", {"pid": pid})
                kind, fields, arrays = conn.recv()
            finally:
                conn.close()
        except (OSError, wire.WireError) as e:
            raise SeedError(f"partition {pid}'s carryover could not be fetched from the driver at {where}: "
                            f"{type(e).__name__}: {e}") from None
        if kind != "seed" or fields != {"pid": pid} or _spec(arrays) != spec:
            raise SeedError(f"the driver at {where} answered {kind!r:.40} with {_spec(arrays)!r:.200} for partition "
                            f"{pid}'s carryover, expected {spec!r:.200}")
        return arrays


class SeedServer:
    """The driver's end for one lineage: what each partition held at the cut, served to its tasks.

    Parameters
    ----------
    held : dict of int -> dict of str -> array
        What each partition holds (not copied: the caller leaves it unchanged).
    host : str
        The address the executors reach (:func:`rnnlm.spark.session.bind_host`).
    log : callable
        A line per refusal (at most five of each kind a minute).
    """

    def __init__(self, held: dict, host: str, log):
        self.held = held
        largest = max((sum(np.asarray(a).nbytes for a in h.values()) for h in held.values()), default=0)
        self.server = wire.FrameServer(self._handle, wire.new_secret(), host, 0, max(largest, 1 << 10),
                                       timeout=CONNECT_S, log=log, max_connections=max(64, 4 * len(held)),
                                       idle=CONNECT_S).start()

    def seed(self, files: dict, carries: dict) -> Seed:
        """The lineage's :class:`Seed`: ``files`` (pid -> Stored) are read first where present."""
        host, port = self.server.address
        return Seed(host, port, self.server.secret, {pid: _spec(h) for pid, h in self.held.items()},
                    {pid: f for pid, f in files.items() if pid in self.held}, carries)

    def _handle(self, peer: str, kind: str, fields: dict, arrays: dict) -> tuple:
        pid = fields.get("pid")
        if kind != "seed" or set(fields) != {"pid"} or arrays or type(pid) is not int or pid not in self.held:
            return "refused", {"reason": f"not a partition's seed request: {kind!r:.40} {fields!r:.80}"}, {}
        return "seed", {"pid": pid}, self.held[pid]

    @property
    def bytes(self) -> tuple:
        """(bytes to the executors, bytes from them), handshakes included."""
        return self.server.bytes_sent, self.server.bytes_received

    def close(self) -> None:
        self.server.close()


def unseeded(carries: dict) -> Seed:
    """A lineage's start with nothing held (a fresh run): only ``carries``."""
    return Seed(None, 0, b"", {}, {}, carries)


@dataclass(frozen=True)
class Probe:
    """A task that connects to a driver's server and yields why it could not (nothing when it could)."""

    host: str
    port: int
    secret: bytes = field(repr=False)

    def __call__(self, it):
        try:       # a connection the server closes before its welcome (busy with the others) is tried again
            conn = wire.connect(self.host, self.port, self.secret, 1 << 10, CONNECT_S, retry_s=CONNECT_S)
            try:
                conn.send("ping")
                conn.recv()
            finally:
                conn.close()
        except (OSError, wire.WireError) as e:
            yield f"{type(e).__name__}: {e}"


def unreachable(data, host: str, log) -> str | None:
    """Why the executors that hold ``data``'s partitions cannot reach a server of the driver's on
    ``host`` (a port of its own), or None when each of them did; or why the driver cannot listen there."""
    try:          # a slot for every partition's probe at once (SeedServer's cap)
        server = wire.FrameServer(lambda *request: ("pong", {}, {}), wire.new_secret(), host, 0, 1 << 10,
                                  timeout=CONNECT_S, log=log, idle=CONNECT_S,
                                  max_connections=max(64, 4 * data.getNumPartitions())).start()
    except OSError as e:
        return f"the driver cannot listen on {host} ({e.strerror or e})"
    try:
        errors = data.mapPartitions(Probe(*server.address, server.secret)).collect()
    finally:
        server.close()
    return f"{server.address[0]}:{server.address[1]}: {errors[0]}" if errors else None
