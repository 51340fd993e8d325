"""The direct result channel (``train.results = "direct"``): a round's tasks send their
contributions to the driver as authenticated frames (the async mode's wire, never pickle), not
through Spark's result path.

The driver merges them in partition order as they arrive (``treeAggregate``'s numbers wherever
that one merges on the driver), takes each partition's once, and recomputes through Spark a
partition that never arrived, giving the channel up for the rounds submitted from then on. Owned
by :class:`rnnlm.spark.allreduce.AllReduce`; docs/design.md ("Results sent straight to the
driver") says why and how.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..core.optim import make_optimizer
from ..core.strategies import CARRY_STATE
from ..exchange.aggregate import Aggregate
from ..exchange.frames import Expected, Malformed, contribution_from_wire, contribution_to_wire
from ..exchange.round import OPT, PARAMS
from ..server import wire

CONNECT_S = 10.0           # a task's connect and each socket operation (s)
HELLO_BYTES = wire.client_hello_bytes()


class ChannelError(RuntimeError):
    """A round's contributions could not be merged (the driver out of memory), or some never came
    even through Spark: the round cannot go on (the trainer stops, saying which round)."""


@dataclass(frozen=True)
class Sink:
    """What a task holds to send its contribution: plain values (pickled into the task)."""

    host: str
    port: int
    secret: bytes = field(repr=False)         # a task's function printed (a log, an error) does not show it
    round: int
    max_frame: int

    def add(self, agg: Aggregate) -> bool:
        """Send partition ``pid``'s leaf ``agg`` and wait for the driver's answer; whether it was taken.
        Never raises for the network: a partition the driver lacks is recomputed through Spark."""
        (pid,) = agg.local
        fields, arrays = contribution_to_wire(pid, agg)
        fields["round"] = self.round
        try:
            conn = wire.connect(self.host, self.port, self.secret, self.max_frame, CONNECT_S, retry_s=CONNECT_S)
        except (OSError, wire.WireError):
            return False
        try:
            conn.send("contribution", fields, arrays)
            kind, _, _ = conn.recv()
            return kind == "taken"
        except (OSError, wire.WireError):
            return False
        finally:
            conn.close()


class Inbox:
    """One round's contributions, merged in partition order: partition p once 0..p-1 are merged."""

    def __init__(self, partitions: int):
        self.leaves, self.next, self.agg, self.partitions = {}, 0, Aggregate(), partitions
        self.closed, self.error = False, None
        self._lock, self._merging = threading.Lock(), threading.Lock()

    def put(self, pid: int, leaf: Aggregate) -> bool:
        """Keep ``leaf``; False when a copy is in already or the round has closed."""
        with self._lock:
            if self.closed or pid in self.leaves or pid < self.next:
                return False
            self.leaves[pid] = leaf
            return True

    def close(self) -> None:
        """Take nothing more."""
        with self._lock:
            self.closed = True

    def drain(self) -> None:
        """Merge what is in, in order (one merger at a time). A merge that fails (out of memory) is
        kept in ``error`` and stops the merging: the round cannot be taken."""
        with self._merging:
            while self.error is None:
                with self._lock:
                    leaf = self.leaves.get(self.next)
                if leaf is None:
                    return
                try:
                    self.agg = self.agg.merge(leaf)
                except Exception as e:
                    self.error = f"{type(e).__name__}: {e}"
                    return
                with self._lock:
                    del self.leaves[self.next]
                    self.next += 1

    @property
    def missing(self) -> set:
        with self._lock:
            return set(range(self.next, self.partitions)) - set(self.leaves)


class Channel:
    """The driver's end: a frame server for the run and an :class:`Inbox` per round in flight.

    Parameters
    ----------
    expect : Expected
        What a contribution must look like (:func:`rnnlm.exchange.frames.contribution_from_wire`).
    host : str
        The address the executors reach (:func:`rnnlm.spark.session.bind_host`).
    log : callable
        A line per refusal (at most five of each kind a minute) and when the channel is given up.
    max_frame : int
        The largest contribution (:func:`max_frame_bytes`); the frames being read at once hold at most
        one per partition and one more (the server's cap on bytes in flight). Beyond the cap, each open
        round's inbox holds the contributions that arrived before a lower partition's (decoded, as
        large as their frames), and its float64 sum: under ``train.overlap`` two rounds are open, so
        up to about twice the partitions' contributions besides the cap.
    """

    def __init__(self, expect: Expected, host: str, log, max_frame: int):
        self.expect, self.log, self.max_frame = expect, log, max_frame
        self._lock, self._inboxes, self.broken, self.taken = threading.Lock(), {}, None, 0
        self._merger = ThreadPoolExecutor(1, thread_name_prefix="rnnlm-merge")   # after the task has its answer
        self._secret = wire.new_secret()
        self._say = wire.LogLimit(log, "direct results")
        self.server = wire.FrameServer(self._handle, self._secret, host, 0, max_frame, timeout=10.0, log=log,
                                       max_connections=max(64, 4 * expect.partitions), idle=10.0,
                                       max_in_flight=(expect.partitions + 1) * max_frame).start()

    def sink(self, rnd: int) -> Sink:
        """Open round ``rnd``'s inbox; what its tasks send through."""
        with self._lock:
            self._inboxes[rnd] = Inbox(self.expect.partitions)
        return Sink(*self.server.address, self._secret, rnd, self.max_frame)

    def take(self, rnd: int, recompute) -> Aggregate:
        """Round ``rnd``'s merged contributions, its job done. ``recompute(missing)`` returns the
        leaves of the partitions that never arrived, computed through Spark; the channel is then
        given up for the rounds submitted from then on."""
        with self._lock:
            box = self._inboxes[rnd]
        try:
            missing = box.missing
            if missing:
                for a in recompute(missing):
                    box.put(next(iter(a.local)), a)         # a partition already in is not taken twice
                if self.broken is None:
                    self.broken = f"partitions {sorted(missing)} of round {rnd} did not arrive"
                    self.log(f"warning: the direct result channel failed ({self.broken}); recomputed through "
                             "Spark, and the rounds submitted from now on send their results through Spark")
        finally:
            with self._lock:
                del self._inboxes[rnd]
            box.close()
        box.drain()
        if box.error or box.missing:
            raise ChannelError(f"merging the contributions failed: {box.error}" if box.error
                               else f"no contribution from partitions {sorted(box.missing)}")
        return box.agg

    def _handle(self, peer: str, kind: str, fields: dict, arrays: dict) -> tuple:
        rnd = fields.get("round")
        with self._lock:
            box = self._inboxes.get(rnd) if type(rnd) is int else None
        if kind != "contribution" or box is None:
            return "late", {}, {}        # a retried task's copy after its round closed: the numbers are in
        try:
            pid, leaf = contribution_from_wire(fields, arrays, self.expect)
        except Malformed as e:
            self._say("contribution", f"direct results: refused a contribution from {peer}: {e}")
            return "refused", {"reason": str(e)}, {}
        # what crossed to the driver: the task's hello and this frame, the connection's first after it
        leaf.wire_bytes = HELLO_BYTES + wire.frame_bytes(kind, 1, fields, arrays)
        if not box.put(pid, leaf):
            return ("late" if box.closed else "duplicate"), {}, {}
        with self._lock:
            self.taken += 1
        self._merger.submit(box.drain)
        return "taken", {}, {}

    def close(self) -> None:
        """Stop serving; drop the rounds never taken (cancelled jobs)."""
        self.server.close()
        self._say.flush()
        self._merger.shutdown(wait=True)
        with self._lock:
            self._inboxes.clear()


def expected(cfg, model) -> Expected:
    """What a contribution of this run (``cfg`` resolved, ``model`` built from it) must hold."""
    layout, t = model.layout, cfg.train
    slots = tuple(make_optimizer(cfg.optim).slots)
    blocks = {PARAMS + s.name: tuple(s.shape) for s in layout}
    if t.optim_state == "average":
        blocks.update({OPT + k: (layout.size,) for k in slots})
    state = tuple(model.zero_state(t.batch).shape) if cfg.data.strategy in CARRY_STATE else None
    return Expected(blocks, cfg.data.partitions, model.V, state, slots if t.optim_state == "local" else None,
                    layout.size, cfg.model.dtype)


def max_frame_bytes(expect: Expected) -> int:
    """The largest contribution: every block's rows whole in the model's dtype with their int32 ids
    and a float32 scale pair each, the carried state and optimizer slots, the words, and 1 MiB."""
    item = np.dtype(expect.dtype).itemsize
    blocks = sum(item * int(np.prod(s)) + 12 * s[0] for s in expect.blocks.values())
    state = int(np.prod(expect.state)) if expect.state else 0
    return blocks + item * (state + len(expect.opt or ()) * expect.size) + 4 * expect.vocab + (1 << 20)
