"""Availability (issue 34): peers without the secret can neither stop nor starve a run, frames in flight
are capped across connections, refusal logs cannot be flooded, and what a peer sends is printed as one
line. Real sockets on loopback throughout; one real async run through Spark under a flood."""
import re
import select
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest

from rnnlm import config
from rnnlm.cli import make_trainer
from rnnlm.core.layout import Layout
from rnnlm.exchange import plan
from rnnlm.exchange.aggregate import Aggregate
from rnnlm.exchange.blocks import Block
from rnnlm.exchange.frames import Expected, Malformed, contribution_from_wire, contribution_to_wire, printable
from rnnlm.exchange.round import Carry
from rnnlm.server import wire
from rnnlm.server.paramserver import ParameterServer, server_in_flight
from rnnlm.server.worker import WorkerClient
from rnnlm.spark.channel import Channel
from conftest import metrics, wait_for

GARBAGE = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
MiB = 1 << 20


def echo(peer, kind, fields, arrays):
    return kind, fields, arrays


class Flood:
    """Peers without the secret, from a thread until :meth:`stop`: ``idle`` connections that never say
    hello kept open (each one the server closes is opened again), and a garbage connection between."""

    def __init__(self, address, idle: int = 20, pause: float = 0.002):
        self.address, self.idle, self.pause = address, idle, pause
        self.held, self.opened, self._stop = [], 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Flood":
        self._top_up()                               # all in place before the caller goes on
        self._thread.start()
        return self

    def _top_up(self):
        readable, _, _ = select.select(self.held, [], [], 0)
        for s in readable:                           # the server's hello, or its hang-up
            try:
                closed = not s.recv(1 << 16)
            except OSError:
                closed = True
            if closed:
                self.held.remove(s)
                s.close()
        while len(self.held) < self.idle:
            self.held.append(socket.create_connection(self.address, timeout=2.0))
            self.opened += 1

    def _run(self):
        while not self._stop.is_set():
            try:
                self._top_up()
                with socket.create_connection(self.address, timeout=2.0) as g:
                    g.sendall(GARBAGE)
                self.opened += 1
            except OSError:
                pass                                 # refused or reset: the server is busy or gone
            time.sleep(self.pause)

    def stop(self):
        self._stop.set()
        self._thread.join()
        for s in self.held:
            s.close()


# --------------------------------------------------------------- connection slots and retries
def test_idle_and_garbage_peers_cannot_keep_a_client_with_the_secret_out():
    """Idle peers once held all of a server's slots, and every client with the secret was closed on
    accept; now pending connections have their own slots, the oldest make room, and a client retries."""
    secret, logs = wire.new_secret(), []
    server = wire.FrameServer(echo, secret, max_frame=1 << 16, timeout=10.0, log=logs.append,
                              max_connections=4).start()
    flood = Flood(server.address, idle=12).start()
    try:
        # a fresh connection each time, while the flood goes on: 12 calls at least, and on until it has
        # opened 30 (a loaded machine runs its thread less often between the calls)
        i, deadline = 0, time.monotonic() + 60
        while i < 12 or (flood.opened <= 30 and time.monotonic() < deadline):
            c = wire.Client(*server.address, secret, 1 << 16, timeout=2.0, retry_s=10.0)
            kind, fields, arrays = c.call("echo", {"i": i}, {"x": np.arange(i % 12)})
            assert (kind, fields) == ("echo", {"i": i}) and np.array_equal(arrays["x"], np.arange(i % 12))
            c.close()
            i += 1
        assert flood.opened > 30
    finally:
        flood.stop()
        server.close()
    assert server.refused.get("pending", 0) > 0 and server.refused.get("garbage", 0) > 0, server.refused
    assert "handler" not in server.refused


def test_a_peer_that_never_says_hello_is_closed_after_the_handshake_deadline(monkeypatch):
    """A connection awaiting its hello held its slot for the whole ``timeout``; now for HANDSHAKE_S at most."""
    monkeypatch.setattr(wire, "HANDSHAKE_S", 0.3)
    secret = wire.new_secret()
    server = wire.FrameServer(echo, secret, max_frame=1 << 16, timeout=10.0, log=lambda *_: None).start()
    try:
        with socket.create_connection(server.address, timeout=5.0) as s:
            t0, got = time.monotonic(), b""
            while True:
                chunk = s.recv(4096)                 # the server's hello, then its hang-up
                if not chunk:
                    break
                got += chunk
            assert got.startswith(wire.MAGIC) and time.monotonic() - t0 < 2.0
        wait_for(lambda: server.refused == {"handshake": 1})
        c = wire.Client(*server.address, secret, 1 << 16, timeout=10.0)
        time.sleep(0.5)                              # a client with the secret is not held to it between frames
        assert c.call("echo", {"n": 1})[1] == {"n": 1}
        c.close()
    finally:
        server.close()


def test_a_client_beyond_the_authenticated_cap_is_closed_before_its_welcome_and_retries():
    """The authenticated slots are the secret's holders' alone; one beyond them is closed before its
    welcome, so it was served nothing and may try again: with ``retry_s`` it gets in once a slot frees."""
    secret, logs = wire.new_secret(), []
    server = wire.FrameServer(echo, secret, max_frame=1 << 16, timeout=5.0, log=logs.append,
                              max_connections=2).start()
    a = wire.connect(*server.address, secret, 1 << 16, timeout=2.0)
    b = wire.connect(*server.address, secret, 1 << 16, timeout=2.0)
    idle = [socket.create_connection(server.address) for _ in range(3)]   # two pending slots: one made room
    try:
        for _ in range(3):
            with pytest.raises(ConnectionError):
                wire.connect(*server.address, secret, 1 << 16, timeout=2.0)
        wait_for(lambda: server.refused.get("busy") == 3)
        assert sum("busy" in line for line in logs) == 1, logs      # logged once until a slot frees
        threading.Timer(0.3, a.close).start()
        t0 = time.monotonic()
        c = wire.connect(*server.address, secret, 1 << 16, timeout=2.0, retry_s=5.0)
        assert 0.2 < time.monotonic() - t0 < 3.0
        c.send("echo", {"n": 2})
        assert c.recv()[1] == {"n": 2}
        b.send("echo", {"n": 3})
        assert b.recv()[1] == {"n": 3}
        c.close()
    finally:
        for s in idle:
            s.close()
        b.close()
        server.close()
    assert server.refused["busy"] >= 3 and server.refused["pending"] >= 2, server.refused


def test_an_async_run_completes_every_window_under_a_flood_of_idle_and_garbage_peers(spark, tmp_path):
    """20 idle unauthenticated connections at the server's start ended a run in 9.6 s ("closed the
    connection"); now the run completes with every window applied once while idle and garbage peers keep
    coming, and the refusals are counted, their lines limited."""
    cfg = config.load(None, [
        "data.train=rnnlm/data/harbour.txt", "data.level=char", "model.cell=lstm", "model.hidden=16",
        "optim.name=adam", "optim.lr=0.01", "train.bptt=8", "train.batch=4", "train.grad_norm=token",
        "train.eval_every=0", "server.heartbeat_s=0.2", "server.timeout_s=15", "data.partitions=2",
        "train.mode=async", "train.push_every=2", "train.rounds=4"])
    lines, floods = [], []

    def log(line):
        lines.append(line)
        found = re.search(r"\| server ([\d.]+):(\d+) ", line)
        if found:                                    # the server listens; the workers are not started yet
            floods.append(Flood((found.group(1), int(found.group(2))), idle=20).start())
    tr = make_trainer(spark, cfg, str(tmp_path / "run"), log=log)
    try:
        tr.run()
    finally:
        for f in floods:
            f.stop()
    m = metrics(tmp_path / "run")
    assert floods and floods[0].opened > 40
    assert tr.server.done == [4, 4] and m[-1]["syncs"] == 8 and sum(x["pushes"] for x in m) == 8
    assert m[-1]["windows_lost"] == 0 and m[-1].get("refused_duplicate", 0) == 0
    assert m[-1].get("attempts_retried", 0) == 0                     # no task failed and was retried
    # the bytes of pushes in flight: at most one per worker and one more, each the model and a little
    assert 3 * tr.params.nbytes < tr.frames.in_flight.limit < 3 * (tr.params.nbytes + (1 << 17))
    refused = m[-1]["refused_wire"]
    assert refused.get("pending", 0) >= 10 and refused.get("garbage", 0) >= 10, refused
    said = [x for x in lines if x.startswith("wire: refused")]
    assert len(said) <= 5 * len(refused), said


# ------------------------------------------------------------------------ bytes in flight
def _announce(server, secret, body: int):
    """An authenticated connection that announces a ``body``-byte frame, then trickles it."""
    conn = wire.connect(*server.address, secret, 1 << 30, timeout=5.0)
    conn.sock.sendall(wire.MAGIC + struct.pack(">IQ", 10, body) + b"{")
    return conn


def test_frames_in_flight_are_capped_across_connections():
    """Four authenticated connections announcing 64 MiB frames made the server allocate all four (34 to
    290 MB, held 3 s); now their bodies share ``max_in_flight``: one is read, the others wait their turn."""
    secret = wire.new_secret()
    server = wire.FrameServer(echo, secret, max_frame=8 * MiB, timeout=5.0, log=lambda *_: None,
                              max_in_flight=8 * MiB).start()
    tracemalloc.start()
    try:
        conns = [_announce(server, secret, 8 * MiB) for _ in range(4)]
        wait_for(lambda: tracemalloc.get_traced_memory()[0] > 8 * MiB)     # one body is being read
        time.sleep(0.3)                              # time for the other three to be, were they not capped
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert 8 * MiB < peak < 12 * MiB, peak / MiB
        for c in conns:
            c.close()                                # truncated: each gives its bytes back (or never took them)
        wait_for(lambda: server.refused.get("truncated") == 4)
        c = wire.Client(*server.address, secret, 8 * MiB, timeout=5.0)
        x = np.arange(MiB, dtype=np.float64)         # a full frame still fits
        assert np.array_equal(c.call("echo", {}, {"x": x})[2]["x"], x)
        c.close()
    finally:
        tracemalloc.stop()
        server.close()
    assert server.refused == {"truncated": 4}


LAYOUT = Layout([("embed", (6, 3)), ("W1", (4, 3)), ("b1", (4,)), ("Wo", (6, 4)), ("bo", (6,))])


def test_the_parameter_servers_cap_refuses_frames_larger_than_its_pushes_before_reading_them():
    """The async server's cap is what its workers push at once (the model per worker, and one more): a
    64 MiB announcement under the default 256 MiB frame is refused at once, nothing allocated; pushes pass."""
    sv = config.load(None, ["server.heartbeat_s=0.1"]).server
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float32), sv, 3, 2, log=lambda *_: None)
    secret, max_frame = wire.new_secret(), int(sv.max_frame_mb * MiB)
    cap = server_in_flight(LAYOUT, 4, 2, max_frame)
    assert 3 * 4 * LAYOUT.size < cap < 3 * (4 * LAYOUT.size + (1 << 17))
    frames = wire.FrameServer(ps.handle, secret, max_frame=max_frame, timeout=5.0, log=lambda *_: None,
                              max_in_flight=cap).start()
    client = WorkerClient(frames.address, secret, 0, sv, LAYOUT)
    tracemalloc.start()
    try:
        conns = [_announce(frames, secret, 64 * MiB) for _ in range(4)]
        wait_for(lambda: frames.refused.get("size") == 4)
        assert tracemalloc.get_traced_memory()[1] < 4 * MiB
        tracemalloc.stop()
        first, windows, version, host = client.hello()
        blocks, _, _ = plan.encode(LAYOUT, np.ones(LAYOUT.size, np.float32), config.load(None).exchange,
                                   np.array([1]), 1, 1, 0, 2)
        assert client.push(0, version, blocks, host, tokens=1) == 1 and ps.done == [1, 0]
        for c in conns:
            c.close()
    finally:
        tracemalloc.stop()
        client.close()
        frames.close()


# ------------------------------------------------------------------------------ refusal logs
def test_log_limit_holds_back_a_flood_and_says_how_many():
    now, lines = [0.0], []
    say = wire.LogLimit(lines.append, "wire", burst=3, period=60.0, clock=lambda: now[0])
    for i in range(10):
        say("garbage", f"refused {i}")
    say("mac", "refused m\nerror: forged \x1b[31mred")
    assert lines == ["refused 0", "refused 1", "refused 2", "refused m error: forged [31mred"]
    now[0] = 60.0                                   # a period is [start, start + 60): the next begins here
    say("garbage", "refused 10")
    assert lines[4:] == ["wire: 7 more refusal lines were not logged (garbage 7; at most 3 of each kind in 60 s)",
                         "refused 10"]
    say.flush()
    assert len(lines) == 6
    for i in range(5):
        say("mac", f"m{i}")
    say.flush()
    assert lines[6:] == ["m0", "m1", "m2", "wire: 2 more refusal lines were not logged (mac 2; at most 3 of each "
                                           "kind in 60 s)"]       # mac's own period began at 60 s


def test_two_hundred_garbage_connections_log_five_lines_and_count_every_one():
    """Every refused connection logged a line (200 garbage connections, 200 lines in 0.5 s)."""
    secret, logs = wire.new_secret(), []
    server = wire.FrameServer(echo, secret, max_frame=1 << 16, timeout=2.0, log=logs.append).start()
    try:
        for _ in range(200):
            with socket.create_connection(server.address, timeout=2.0) as s:
                s.sendall(GARBAGE)
                while s.recv(4096):                  # the server's hello, then its hang-up: refused
                    pass
        wait_for(lambda: server.refused.get("garbage") == 200)
        assert len(logs) == 5 and all("wire: refused" in x and "garbage" in x for x in logs), logs
    finally:
        server.close()
    assert logs[5:] == ["wire: 195 more refusal lines were not logged (garbage 195; at most 5 of each kind in 60 s)"]


def test_the_parameter_servers_refusals_are_limited_too():
    lines = []
    sv = config.load(None).server
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float32), sv, 3, 2, log=lines.append)
    for i in range(50):
        assert ps.handle("p", "hello\n\x1b[2J", {"pid": 7 + i}, {})[0] == "refused"
    assert ps.totals["refused_protocol"] == 50
    assert len(lines) == 5 and all(printable(x) and x.startswith("parameter server: refused") for x in lines), lines


# -------------------------------------------------------------------- what a peer's text may hold
@pytest.mark.parametrize("error", ["diverged\nerror: forged second line", "diverged \x1b[2J\x1b[31mred",
                                   "diverged\u2028forged", "diverged\u202egnirts desrever"])
def test_a_failure_report_that_would_print_as_more_than_itself_is_refused(error):
    sv = config.load(None).server
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float32), sv, 3, 2, log=lambda *_: None)
    lease = ps.handle("t", "hello", {"pid": 1}, {})[1]["lease"]
    kind, fields, _ = ps.handle("t", "failed", {"pid": 1, "lease": lease, "error": error}, {})
    assert kind == "refused" and "printable" in fields["reason"] and ps.failures == []
    assert ps.handle("t", "failed", {"pid": 1, "lease": lease, "error": "loss became nan"}, {})[0] == "ok"
    assert ps.failures == ["partition 1: loss became nan"]
    with pytest.raises(Malformed, match="one line without control characters"):
        contribution_from_wire({"pid": 0, "error": error}, {}, EXPECT)


def test_a_worker_sends_its_failure_as_one_printable_line():
    sv = config.load(None, ["server.heartbeat_s=0.1"]).server
    ps = ParameterServer(LAYOUT, np.zeros(LAYOUT.size, np.float32), sv, 3, 2, log=lambda *_: None)
    secret = wire.new_secret()
    frames = wire.FrameServer(ps.handle, secret, log=lambda *_: None).start()
    client = WorkerClient(frames.address, secret, 1, sv, LAYOUT)
    try:
        client.hello()
        client.fail("cuda error\n  at line 3:\x1b[0m out of memory")
    finally:
        client.close()
        frames.close()
    assert ps.failures == ["partition 1: cuda error at line 3: [0m out of memory"]
    fields, arrays = contribution_to_wire(2, Aggregate.contribution(0.0, {}, {2: Carry(error="a\nb\x1b[1m")}))
    assert fields["error"] == "a b [1m" and contribution_from_wire(fields, arrays, EXPECT)[1].errors() == [
        "partition 2: a b [1m"]


SHAPES = {"params.E": (8, 3), "params.b": (5,), "opt.m": (29,)}
EXPECT = Expected(SHAPES, partitions=3, vocab=8, state=(1, 2, 4, 2), opt=("m",), size=29)


def _leaf(pid: int, codec: str = "f32") -> Aggregate:
    rng = np.random.default_rng(pid)
    blocks = {"params.E": Block(rng.normal(size=(3, 3)).astype(np.float32), (8, 3), np.array([1, 4, 6], np.int32)),
              "params.b": Block(rng.normal(size=5).astype(np.float32), (5,)),
              "opt.m": Block(rng.normal(size=29).astype(np.float32), (29,), None, codec)}
    carry = Carry(state=rng.normal(size=(1, 2, 4, 2)).astype(np.float32),
                  opt={"t": 7, "m": rng.normal(size=29).astype(np.float32)})
    return Aggregate.contribution(10.0, blocks, {pid: carry}, words=[1, 5], tokens=10, loss_sum=25.0, steps=4)


def _poison(key, index, value=np.nan):
    def change(fields, arrays):
        arrays[key] = arrays[key].copy()
        arrays[key].reshape(-1)[index] = value
    return change


@pytest.mark.parametrize("change, what", [
    (_poison("opt.m.data", 3), "opt.m holds non-finite values"),
    (_poison("opt.m.data", 0, np.inf), "opt.m holds non-finite values"),
    (_poison("carry.state", 5), "the hidden state holds non-finite values"),
    (_poison("carry.opt.m", 28, -np.inf), "optimizer slot m holds non-finite values"),
])
def test_a_contribution_with_non_finite_state_is_refused(change, what):
    """The averaged optimizer state was applied with NaN (only the parameters were checked, after averaging)."""
    fields, arrays = contribution_to_wire(0, _leaf(0))
    contribution_from_wire(fields, arrays, EXPECT)                  # healthy as sent
    change(fields, arrays)
    with pytest.raises(Malformed, match=re.escape(f"partition 0: {what}")):
        contribution_from_wire(fields, arrays, EXPECT)


def test_a_non_finite_optimizer_block_is_refused_in_every_codec():
    for codec in ("fp16", "bf16", "int8"):
        fields, arrays = contribution_to_wire(0, _leaf(0, codec))
        contribution_from_wire(fields, arrays, EXPECT)
        data = arrays["opt.m.data"] = arrays["opt.m.data"].copy()
        if codec == "int8":                  # int8 values and a finite scale, whose product overflows float32
            arrays["opt.m.scale"] = np.full_like(arrays["opt.m.scale"], 3e38)
            data[...] = 127
        else:                                # infinity as float16, and as bfloat16's bits
            data.reshape(-1)[0] = 0x7F80 if codec == "bf16" else np.inf
        with pytest.raises(Malformed, match="opt.m holds non-finite values"):
            contribution_from_wire(fields, arrays, EXPECT)


def test_the_channels_refusals_are_limited_and_its_poisoned_contributions_never_taken():
    lines = []
    ch = Channel(EXPECT, "127.0.0.1", lines.append, max_frame=1 << 20)
    try:
        sink = ch.sink(1)
        conn = wire.connect(sink.host, sink.port, sink.secret, 1 << 20)
        fields, arrays = contribution_to_wire(1, _leaf(1))
        arrays["opt.m.data"] = np.full_like(arrays["opt.m.data"], np.nan)
        for _ in range(12):
            conn.send("contribution", dict(fields, round=1), arrays)
            kind, reply, _ = conn.recv()
            assert (kind, reply) == ("refused", {"reason": "partition 1: opt.m holds non-finite values"})
        conn.close()
        assert ch.taken == 0
    finally:
        ch.close()
    said = [x for x in lines if "direct results" in x]
    assert len(said) == 6 and said[-1].startswith("direct results: 7 more refusal lines were not logged"), said
