"""A worker's side of the parameter server's protocol (:mod:`.paramserver` describes it whole): a
task attempt's hello, its pushes and the pulls their replies carry, its heartbeats on a second
connection, standing by once superseded, and its leave."""
from __future__ import annotations

import threading
import time

from ..exchange.frames import block_to_wire, one_line


def blocks_to_wire(blocks: dict) -> tuple:
    """``{"params.<slot>": Block}`` as (fields, arrays) for :mod:`rnnlm.server.wire` (no pickle)."""
    meta, arrays = {}, {}
    for name, b in blocks.items():
        slot = name.split(".", 1)[1]
        meta[slot], more = block_to_wire(slot, b)
        arrays.update(more)
    return {"blocks": meta}, arrays


def patch(layout, host, pulled: dict, arrays: dict) -> None:
    """Write a pull's rows (``{slot: "all" | "some"}`` with ``<slot>.rows`` and ``<slot>.ids``) into ``host``."""
    for slot in layout:
        how = pulled.get(slot.name)
        if how is None:
            continue
        view = host[slot.offset:slot.end].reshape(slot.shape[0], -1)                 # (R, C)
        rows = arrays[f"{slot.name}.rows"]
        if how == "all":
            view[...] = rows
        else:
            view[arrays[f"{slot.name}.ids"]] = rows


class WorkerClient:
    """A worker's side of the protocol: announce, push windows, heartbeat, finish.

    Parameters
    ----------
    address : (host, port)
    secret : bytes
        The run's secret (from the task's closure).
    pid : int
    sv : ServerConfig
    on_stuck : callable, optional
        Called with the server's reason, from the heartbeats' thread, when the server finds this attempt
        stuck (heartbeats, yet no window pushed: ``server.stall_factor``); the training thread may be
        blocked anywhere, so a Spark task ends its process there (:func:`rnnlm.spark.async_task.end_stuck`).
        None: the heartbeats stop (the server counts the attempt gone already).
    """

    def __init__(self, address, secret: bytes, pid: int, sv, layout, on_stuck=None):
        from . import wire
        self.pid, self.sv, self.layout, self.on_stuck = pid, sv, layout, on_stuck
        max_frame = int(sv.max_frame_mb * (1 << 20))
        # a window can take longer than the server keeps an idle connection (server_idle_s): a connection
        # idle for timeout_s is replaced before the next push rather than lost under it; one closed
        # before the server's welcome (a flood of other peers took its slot) is tried again for timeout_s
        self._rpc = wire.Client(address[0], address[1], secret, max_frame, timeout=max(60.0, sv.timeout_s),
                                max_idle=sv.timeout_s, retry_s=sv.timeout_s)
        self._beat = wire.Client(address[0], address[1], secret, 1 << 16, timeout=sv.timeout_s,
                                 max_idle=sv.timeout_s, retry_s=sv.timeout_s)
        self.lease, self.window, self.superseded = None, None, False
        self._stop, self._thread = threading.Event(), None

    @property
    def bytes(self) -> tuple:
        """(sent, received) on both connections."""
        return (self._rpc.bytes_sent + self._beat.bytes_sent, self._rpc.bytes_received + self._beat.bytes_received)

    def _call(self, kind, fields, arrays=None):
        reply = self._rpc.call(kind, fields, arrays)
        if reply[0] == "refused":
            raise RuntimeError(f"the parameter server refused {kind}: {reply[1].get('reason')}")
        return reply

    def hello(self) -> tuple:
        """Announce this attempt (again, after :meth:`standby` said resume): (first window to train, windows,
        version, parameters)."""
        self._end_heartbeats()
        _, f, a = self._call("hello", {"pid": self.pid})
        self.lease, self.window, self.superseded = f["lease"], f["window"], False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeats, args=(self.lease, self._stop),
                                        name=f"heartbeat-{self.pid}", daemon=True)
        self._thread.start()
        return f["window"], f["windows"], f["version"], a["params"]

    def _heartbeats(self, lease: int, stop: threading.Event):
        while not stop.wait(self.sv.heartbeat_s):
            try:
                kind, f, _ = self._beat.call("heartbeat", {"pid": self.pid, "lease": lease, "window": self.window})
            except (OSError, ValueError):
                continue          # the next push reports a dead server; a heartbeat only keeps us listed
            if kind == "stuck" and self.on_stuck is not None:
                self.on_stuck(one_line(f.get("reason"))[:300])
            if kind in ("stop", "stuck"):
                return            # superseded: the next push says so to the task

    def _end_heartbeats(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.sv.heartbeat_s + 1)
            self._thread = None

    def push(self, window: int, version: int, blocks: dict, host, **stats):
        """Push ``window``'s change and patch ``host`` (P,), the parameters pulled at ``version``,
        with the rows changed since: the new version, or None when superseded."""
        fields, arrays = blocks_to_wire(blocks)
        fields.update(stats, pid=self.pid, lease=self.lease, window=window, version=version)
        kind, f, a = self._call("push", fields, arrays)
        if kind == "stop":
            self.superseded = True
            return None
        patch(self.layout, host, f.get("pulled", {}), a)
        return f["version"]

    def training(self, window: int):
        """The window the heartbeats report (the server counts it as redone if this attempt dies)."""
        self.window = window

    def fail(self, error: str):
        """Tell the server this partition cannot go on (a non-finite loss): the driver stops the run."""
        self._call("failed", {"pid": self.pid, "lease": self.lease, "error": one_line(error)[:2000] or "failed"})

    def standby(self) -> bool:
        """After a push answered superseded: ask every ``heartbeat_s`` until the partition is finished (False:
        the task ends well) or its newest attempt is gone (True: say :meth:`hello` again and train on)."""
        self._end_heartbeats()
        while True:
            kind, _, _ = self._call("standby", {"pid": self.pid, "lease": self.lease})
            if kind in ("finished", "resume"):
                return kind == "resume"
            if kind != "wait":
                raise RuntimeError(f"the parameter server answered standby with {kind!r:.40}")
            time.sleep(self.sv.heartbeat_s)

    def close(self):
        """End the attempt: the heartbeats stop and, if it holds the partition's newest lease, the server hears that
        it goes (an attempt standing by takes over at once); a server that cannot be told is not waited for."""
        self._end_heartbeats()
        if self.lease is not None and not self.superseded:
            try:
                self._rpc.call("leave", {"pid": self.pid, "lease": self.lease})
            except (OSError, ValueError):
                pass
        self._rpc.close()
        self._beat.close()
