"""The parameter server's wire: authenticated frames, and every way a frame is refused without stopping the server."""
import json
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest

from conftest import wait_for
from rnnlm.server import wire

MAX_FRAME = 1 << 20


def handle(peer, kind, fields, arrays):
    if kind == "boom":
        raise RuntimeError("the handler failed\non two lines")
    if kind == "sum":
        return "sum", {"total": float(arrays["x"].sum())}, {}
    return kind, fields, arrays                                  # echo


@pytest.fixture
def secret():
    return wire.new_secret()


@pytest.fixture
def server(secret):
    logs = []
    s = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=2.0, log=logs.append).start()
    s.logs = logs
    yield s
    s.close()


def serves(server, secret):
    """A fresh authenticated client still gets correct answers."""
    c = wire.Client(*server.address, secret, MAX_FRAME, timeout=2.0)
    try:
        kind, fields, arrays = c.call("sum", {}, {"x": np.arange(10, dtype=np.int64)})
        return kind == "sum" and fields == {"total": 45.0} and arrays == {}
    finally:
        c.close()


def refused_once(server, secret, reason):
    wait_for(lambda: server.refused.get(reason, 0) >= 1)
    assert server.refused == {reason: 1}
    assert len(server.logs) == 1 and "\n" not in server.logs[0] and reason in server.logs[0], server.logs
    assert serves(server, secret)
    assert server.refused == {reason: 1}


def raw(server):
    s = socket.socket()                                      # not socket.create_connection: not recorded
    s.settimeout(2.0)
    s.connect(server.address)
    return s


def _recv(sock, n: int) -> bytes:
    chunk = sock.recv(n)
    if not chunk:                                            # (a closed socket's recv returns b"" at once: spun)
        raise EOFError("the server closed the connection before a whole frame")
    return chunk


def read_frame(sock):
    """One frame's bytes, read without checking anything, and its header."""
    prefix = b""
    while len(prefix) < 16:
        prefix += _recv(sock, 16 - len(prefix))
    hlen, blen = struct.unpack(">IQ", prefix[4:])
    rest = b""
    while len(rest) < hlen + blen + 32:
        rest += _recv(sock, hlen + blen + 32 - len(rest))
    return prefix + rest, json.loads(rest[:hlen])


def closed_after_at_most_a_hello(sock) -> None:
    """``sock`` closed by the server: after the server's hello, or at once where it was evicted before its
    thread sent one (under load; this waited for the hello, and spun on the closed socket)."""
    try:
        assert read_frame(sock)[1]["kind"] == "hello"
    except EOFError:
        return
    assert sock.recv(1) == b""


def frame(key, direction, header, body=b""):
    return b"".join(wire._seal(key, direction, json.dumps(header).encode(), [body]))


class Recorder:
    """A socket that keeps what was sent and received."""

    def __init__(self, sock):
        self.sock, self.sent, self.received = sock, bytearray(), bytearray()

    def send(self, data):
        k = self.sock.send(data)
        self.sent += bytes(data[:k])
        return k

    def recv_into(self, view):
        k = self.sock.recv_into(view)
        self.received += bytes(view[:k])
        return k

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.fixture
def recorded(monkeypatch):
    """wire.connect's sockets, recorded."""
    sockets, create = [], socket.create_connection

    def create_connection(*args, **kwargs):
        sockets.append(Recorder(create(*args, **kwargs)))
        return sockets[-1]
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return sockets


def test_round_trip_through_a_server(server, secret, recorded):
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((3, 4)).astype(np.float32), "ids": np.array([5, -1, 7], np.int32),
              "half": np.array([0.5, -2.0, 65504.0], np.float16), "empty": np.zeros((0, 3)),
              "mask": np.array([[True], [False]]), "big_endian": np.arange(4, dtype=">f8"),
              "scalar": np.int64(7), "column": np.arange(12, dtype=np.int16).reshape(3, 4)[:, 1]}
    fields = {"pid": 3, "name": "w", "loss": np.float32(0.25), "nested": {"a": [1, 2.5, None]}}
    c = wire.Client(*server.address, secret, MAX_FRAME, timeout=2.0)
    kind, f, a = c.call("echo", fields, arrays)
    assert kind == "echo" and f == {"pid": 3, "name": "w", "loss": 0.25, "nested": {"a": [1, 2.5, None]}}
    assert list(a) == list(arrays)
    for name, want in arrays.items():
        got = a[name]
        assert got.dtype == np.dtype(want.dtype.name) and got.dtype.isnative and got.shape == np.shape(want)
        assert np.array_equal(got, want) and got.flags.writeable and got.flags.owndata, name
    assert c.call("sum", None, {"x": np.ones((2, 2), np.float32)}) == ("sum", {"total": 4.0}, {})
    # a body of exactly max_frame passes both ways
    kind, _, a = c.call("echo", {}, {"x": np.zeros(MAX_FRAME, np.uint8)})
    assert a["x"].shape == (MAX_FRAME,)
    wait_for(lambda: (server.bytes_received, server.bytes_sent) == (c.bytes_sent, c.bytes_received))
    assert c.bytes_sent > MAX_FRAME and c.bytes_received > MAX_FRAME
    assert (c.bytes_sent, c.bytes_received) == (len(recorded[0].sent), len(recorded[0].received))
    assert server.connections == 1 and server.refused == {} and server.logs == []
    c.close()


def test_conn_counts_and_refuses_an_unsendable_array(server, secret):
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    before = conn.bytes_sent
    n = conn.send("echo", {"a": 1}, {"x": np.ones(3, np.float32)})
    assert conn.bytes_sent - before == n > 16 + 12 + 32                 # prefix, body, MAC and a header
    before = conn.bytes_sent
    for bad, reason, line in (
            (np.ones(2, np.complex64), "dtype", re.escape("dtype: cannot send array 'x' of dtype complex64")),
            (np.array(["a"]), "dtype", re.escape("dtype: cannot send array 'x' of dtype <U1")),
            (np.array([None]), "dtype", re.escape("dtype: cannot send array 'x' of dtype object")),
            (np.zeros(MAX_FRAME + 1, np.uint8), "size",
             rf"size: header \d+ bytes, body {MAX_FRAME + 1} \(max {wire.MAX_HEADER}, {MAX_FRAME}\)")):
        with pytest.raises(wire.WireError) as e:
            conn.send("echo", {}, {"x": bad})
        assert e.value.reason == reason and re.fullmatch(line, str(e.value)), (reason, str(e.value))
    assert conn.bytes_sent == before
    kind, fields, arrays = conn.recv()                       # the connection is still in step
    assert fields == {"a": 1} and np.array_equal(arrays["x"], np.ones(3))
    conn.close()
    assert server.refused == {}


def test_wrong_secret_is_refused_at_the_handshake(server, secret):
    c = wire.Client(*server.address, wire.new_secret(), MAX_FRAME, timeout=2.0)
    with pytest.raises(wire.WireError) as e:                # the server's hello does not check out
        c.call("sum", {}, {"x": np.ones(2)})
    assert e.value.reason == "mac" and "\n" not in str(e.value)
    refused_once(server, secret, "handshake")                # ...and the server sees no hello


def test_client_hello_with_the_wrong_secret(server, secret):
    with raw(server) as s:
        _, hello = read_frame(s)
        nonce = hello["fields"]["nonce"]
        s.sendall(frame(wire.new_secret(), wire._TO_SERVER, {"kind": "hello", "seq": 0, "arrays": [], "fields": {
            "v": 1, "nonce_s": nonce, "nonce_c": "00" * 16}}))
        refused_once(server, secret, "mac")


def test_the_servers_hello_reflected_back(server, secret):
    with raw(server) as s:
        hello, _ = read_frame(s)
        s.sendall(hello)
        refused_once(server, secret, "mac")                  # the direction byte differs


@pytest.mark.parametrize("data, reason", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "garbage"),
    (wire.MAGIC + struct.pack(">IQ", 5 << 10, 0), "size"),       # a hello header is small
    (wire.MAGIC + struct.pack(">IQ", 10, 1), "size"),            # a hello has no body
    (wire.MAGIC + struct.pack(">IQ", 10, 0) + b'{"kin', "truncated"),
    (wire.MAGIC + b"\0\0", "truncated"),
    (wire.MAGIC, "truncated"),                                   # closed where the sizes begin
    (wire.MAGIC + struct.pack(">IQ", 10, 0), "truncated"),       # ...where the header begins
    (b"", "handshake"),                                          # connected and left
])
def test_refused_before_the_handshake(server, secret, data, reason):
    with raw(server) as s:
        s.sendall(data)
        if reason != "garbage":
            s.shutdown(socket.SHUT_WR)
        refused_once(server, secret, reason)


def test_silent_peers_time_out(secret):
    logs = []
    # a hello's deadline of 0.5 s: what the silent peers run out of, room for the real ones on a loaded machine
    server = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=0.2, handshake=0.5,
                              log=logs.append).start()
    c = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    c.sock.sendall(wire.MAGIC + b"\0")                       # and nothing more
    wait_for(lambda: server.refused.get("truncated") == 1)
    with raw(server):                                        # connected, never says hello
        wait_for(lambda: server.refused.get("handshake") == 1)
    with raw(server) as s:                                   # a hello trickled out, each byte within the timeout
        hung_up = False
        for byte in wire.MAGIC + struct.pack(">IQ", 40, 0) + bytes(40):
            try:
                s.send(bytes([byte]))
            except OSError:
                hung_up = True                               # the hello's deadline passed
                break
            time.sleep(0.05)
        assert hung_up
        wait_for(lambda: server.refused.get("truncated") == 2)
    time.sleep(0.3)                                          # an authenticated peer may idle between frames
    assert serves(server, secret) and len(logs) == 3
    c.close()
    server.close()


@pytest.mark.parametrize("sizes", [(wire.MAX_HEADER + 1, 0), (10, MAX_FRAME + 1), (10, 1 << 62)])
def test_oversized_frames_after_the_handshake(server, secret, sizes):
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    conn.sock.sendall(wire.MAGIC + struct.pack(">IQ", *sizes))        # the announced bytes never come
    refused_once(server, secret, "size")
    with pytest.raises(ConnectionError):
        conn.recv()
    conn.close()


def test_a_frame_replayed_on_the_same_connection(server, secret, recorded):
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    rec = recorded[0]
    start = len(rec.sent)
    conn.send("echo", {"n": 1}, {"x": np.ones(2)})
    request = bytes(rec.sent[start:])
    assert conn.recv()[1] == {"n": 1}
    conn.sock.sendall(request)                              # MAC-valid, but seq 1 again
    refused_once(server, secret, "replay")
    with pytest.raises(ConnectionError):
        conn.recv()
    conn.close()


def test_a_frame_recorded_on_another_connection(server, secret, recorded):
    a = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    start = len(recorded[0].sent)
    a.send("echo", {"n": 1}, {})
    request = bytes(recorded[0].sent[start:])
    b = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    b.sock.sendall(request)                                  # seq 1 is what b's server expects next
    refused_once(server, secret, "mac")                      # ...but it was MAC'd with a's session key
    assert a.recv()[1] == {"n": 1}
    a.close()
    b.close()


def test_a_reordered_frame(server, secret):
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    # seq 1 is what the server expects next: a frame that skips it
    conn.sock.sendall(frame(conn._key, wire._TO_SERVER, {"kind": "echo", "seq": 2, "fields": {}, "arrays": []}))
    refused_once(server, secret, "replay")


def test_a_recorded_conversation_replayed_on_a_new_connection(server, secret, recorded):
    c = wire.Client(*server.address, secret, MAX_FRAME, timeout=2.0)
    assert c.call("sum", {}, {"x": np.arange(3)})[1] == {"total": 3.0}
    c.close()
    conversation = bytes(recorded[0].sent)
    with raw(server) as s:
        s.sendall(conversation)
        refused_once(server, secret, "replay")               # its hello echoes the old connection's nonce
        read_frame(s)                                        # the new connection's hello...
        assert s.recv(1) == b""                              # ...and no answer to the request
    assert server.connections == 3


@pytest.mark.parametrize("spec, body, reason", [
    ([["x", "complex64", [2]]], bytes(16), "dtype"),
    ([["x", "object", [1]]], bytes(8), "dtype"),
    ([["x", "<f4", [1]]], bytes(4), "dtype"),
    ([["x", "float32", [3]]], bytes(8), "header"),           # sizes do not add up to the body
    ([["x", "float32", [1]]], bytes(8), "header"),
    ([["x", "float32", [-1]]], b"", "header"),
    # a negative size in the middle: the sizes add up to the body, b takes -16 bytes and c overlaps a
    ([["a", "float32", [8]], ["b", "float32", [-1, 4]], ["c", "float32", [4]]], bytes(32), "header"),
    ([["x", "float32", [1]], ["x", "float32", [1]]], bytes(8), "header"),
    ([["x", "float32", [0, 1 << 70]]], b"", "header"),
    ([["x", "float32"]], b"", "header"),
    ([["x", "float32", [1.5]]], bytes(6), "header"),         # a float dimension: frombuffer's TypeError
    ([[5, "float32", [1]]], bytes(4), "header"),             # a name that is not a string
    ([["x", ["float32"], [1]]], bytes(4), "header"),         # a dtype that is not one (unhashable)
    # a size of 6,000 digits: its message raised ValueError (int to str), which killed the connection's thread
    ([["x", "float32", [10 ** 15] * 400]], bytes(4), "header"),
])
def test_mac_valid_frames_with_bad_arrays(server, secret, spec, body, reason):
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    conn.sock.sendall(frame(conn._key, wire._TO_SERVER, {"kind": "echo", "seq": 1, "fields": {}, "arrays": spec},
                            body))
    refused_once(server, secret, reason)


@pytest.mark.parametrize("header", [b"not json", b"[1, 2]", b'{"kind": "x", "seq": 1, "fields": {}}',
                                    b'{"kind": "x", "seq": true, "fields": {}, "arrays": []}', b"[" * 5000])
def test_mac_valid_frames_with_bad_headers(server, secret, header):
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    conn.sock.sendall(b"".join(wire._seal(conn._key, wire._TO_SERVER, header, [])))
    refused_once(server, secret, "header")


def test_a_frame_with_a_flipped_bit(server, secret):
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    header = {"kind": "echo", "seq": 1, "fields": {}, "arrays": [["x", "float64", [2]]]}
    body = np.array([1.5, -2.0], "<f8").tobytes()
    conn.sock.sendall(frame(conn._key, wire._TO_SERVER, header, body))      # a frame made by hand passes...
    assert np.array_equal(conn.recv()[2]["x"], [1.5, -2.0])
    tampered = bytearray(frame(conn._key, wire._TO_SERVER, dict(header, seq=2), body))
    tampered[-40] ^= 1                                       # ...with a bit of its body flipped, it does not
    conn.sock.sendall(tampered)
    refused_once(server, secret, "mac")


def test_a_handler_that_raises(server, secret):
    c = wire.Client(*server.address, secret, MAX_FRAME, timeout=2.0)
    with pytest.raises(ConnectionError):
        c.call("boom")
    refused_once(server, secret, "handler")
    assert "RuntimeError" in server.logs[0]
    sent = c.bytes_sent
    assert c.call("sum", {}, {"x": np.arange(4)})[1] == {"total": 6.0}      # reconnected
    assert c.bytes_sent > sent and server.connections == 3
    c.close()


def pair(secret, timeout=2.0, max_frame=1024):
    listener = socket.create_server(("127.0.0.1", 0))
    out = {}
    t = threading.Thread(target=lambda: out.update(conn=wire.accept(listener.accept()[0], secret, max_frame, timeout)))
    t.start()
    client = wire.connect(*listener.getsockname(), secret, max_frame, timeout)
    t.join()
    listener.close()
    return client, out["conn"]


def test_eof_between_frames_is_a_connection_error_and_within_a_frame_truncated(secret):
    client, server = pair(secret)
    server.send("x", {"i": 1})
    assert client.recv() == ("x", {"i": 1}, {})
    assert client.bytes_received == server.bytes_sent and client.bytes_sent == server.bytes_received
    server.close()
    with pytest.raises(ConnectionError):
        client.recv()
    client.close()
    client, server = pair(secret)
    server.sock.sendall(wire.MAGIC + struct.pack(">IQ", 10, 0) + b"{")
    server.close()
    with pytest.raises(wire.WireError) as e:
        client.recv()
    assert e.value.reason == "truncated"
    client.close()


def test_close_does_not_hang_on_live_connections(secret):
    logs = []
    s = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, log=logs.append).start()
    c = wire.connect(*s.address, secret, MAX_FRAME, timeout=2.0)
    c.send("echo", {}, {})
    c.recv()
    silent = raw(s)
    wait_for(lambda: s.connections == 2)
    t = time.monotonic()
    s.close()
    assert time.monotonic() - t < 1.5
    with pytest.raises(ConnectionError):
        c.recv()
    with pytest.raises(OSError):
        wire.connect(*s.address, secret, MAX_FRAME, timeout=1.0)
    assert logs == [] and s.refused == {}
    silent.close()
    c.close()


def test_a_connection_accepted_as_the_server_closes_is_closed_with_it(secret, monkeypatch):
    """A connection's thread put it among the live ones: accepted just before close(), it was missed,
    and its peer could still say hello and be served by a closed server."""
    s = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=2.0, log=lambda *_: None).start()
    entered, closed, serve, result = threading.Event(), threading.Event(), s._serve, {}

    def late(conn):                                  # its thread starts only after close()
        entered.set()
        closed.wait(5)
        serve(conn)

    def client():
        try:
            result["conn"] = wire.connect(*s.address, secret, MAX_FRAME, timeout=2.0)
        except (OSError, wire.WireError) as e:
            result["error"] = e
    monkeypatch.setattr(s, "_serve", late)
    t = threading.Thread(target=client)
    t.start()
    assert entered.wait(3)
    s.close()
    closed.set()
    t.join(10)
    assert "error" in result, "served after close()"
    assert s.refused == {}


def test_idle_peers_hold_at_most_the_pending_slots_and_the_oldest_make_room(secret):
    """300 idle peers once made 302 threads; now at most max_pending (default max_connections, 64) await
    their hello at a time, and each one beyond closes the oldest, so none keeps a client with the secret out."""
    logs = []
    server = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=10.0, log=logs.append).start()
    base = threading.active_count()
    peers = []
    try:
        for _ in range(70):                                  # connected, silent: each holds its slot a while
            peers.append(raw(server))
        wait_for(lambda: server.connections == 70 and server.refused.get("pending") == 6 and len(logs) == 5)
        wait_for(lambda: threading.active_count() <= base + 64)
        assert server.refused == {"pending": 6} and all("pending" in x for x in logs), logs
        for s in peers[:6]:                                  # the oldest six were closed
            closed_after_at_most_a_hello(s)
        assert serves(server, secret)
        wait_for(lambda: server.refused == {"pending": 7})                    # its connection made room too
    finally:
        for s in peers:
            s.close()
        server.close()


def test_a_client_with_the_secret_gets_in_while_idle_peers_fill_the_pending_slots(secret):
    server = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=10.0, log=lambda *_: None,
                              max_connections=2).start()
    a, b = raw(server), raw(server)
    try:
        wait_for(lambda: server.connections == 2)
        conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
        conn.send("echo", {"n": 1})
        assert conn.recv()[1] == {"n": 1}
        closed_after_at_most_a_hello(a)                      # the oldest made room
        wait_for(lambda: server.refused == {"pending": 1})
        conn.close()
    finally:
        a.close()
        b.close()
        server.close()


def test_accept_failing_for_lack_of_descriptors_is_retried_with_growing_pauses(secret, monkeypatch):
    """With the file descriptor limit reached, accept() fails while the connection stays pending: retrying
    at once spun the accept loop. It waits instead, from 50 ms doubling to 1 s, and recovers."""
    import errno
    logs, calls, failing, real = [], [], threading.Event(), socket.socket.accept
    server = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=2.0, log=logs.append).start()
    port = server.address[1]

    def accept(self):
        if failing.is_set() and self.getsockname()[1] == port:
            calls.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")
        return real(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    failing.set()
    pending = raw(server)
    try:
        time.sleep(1.0)
        n = len(calls)
        assert 3 <= n <= 7, n                                # 0, .05, .15, .35, .75 s: five, not thousands
        assert server.refused == {"accept": n} or server.refused == {"accept": n + 1}
        assert len(logs) == 1 and "EMFILE" in logs[0], logs
        failing.clear()
        wait_for(lambda: server.connections == 1, timeout=2.0)      # the next try takes the pending one
        assert serves(server, secret)
    finally:
        pending.close()
        server.close()


def test_a_frame_trickled_after_the_handshake_times_out(secret):
    """Each byte within the per-operation timeout kept a connection (and its thread) forever; a frame that
    has begun must now end within the timeout plus a second per MiB."""
    logs = []
    server = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=0.3, log=logs.append).start()
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=2.0)
    t0, hung_up = time.monotonic(), None
    for byte in wire.MAGIC + struct.pack(">IQ", 40, 0) + bytes(72):
        try:
            conn.sock.send(bytes([byte]))
        except OSError:
            hung_up = time.monotonic() - t0
            break
        time.sleep(0.05)
    assert hung_up is not None and hung_up < 2.0, hung_up
    wait_for(lambda: server.refused == {"truncated": 1})
    assert len(logs) == 1 and "truncated" in logs[0]
    assert serves(server, secret)
    conn.close()
    server.close()


def test_an_authenticated_connection_idle_between_frames_is_closed(secret):
    logs = []
    server = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=0.3, log=logs.append).start()
    conn = wire.connect(*server.address, secret, MAX_FRAME, timeout=3.0)
    t0 = time.monotonic()       # before the last frame: the server's idle clock starts after it
    conn.send("echo", {"n": 1})
    assert conn.recv()[1] == {"n": 1}
    with pytest.raises(ConnectionError):                    # the server hung up: idle 2 x timeout by default
        conn.recv()
    assert 0.6 <= time.monotonic() - t0 < 3.0
    wait_for(lambda: server.closed_idle == 1)
    assert server.refused == {} and logs == []              # an idle client is not at fault
    conn.close()
    server.close()


def test_a_client_replaces_a_connection_idle_longer_than_max_idle(server, secret):
    c = wire.Client(*server.address, secret, MAX_FRAME, timeout=2.0, max_idle=1.0)
    assert c.call("sum", {}, {"x": np.arange(3)})[1] == {"total": 3.0}
    assert c.call("sum", {}, {"x": np.arange(4)})[1] == {"total": 6.0}
    time.sleep(1.2)
    assert c.call("sum", {}, {"x": np.arange(5)})[1] == {"total": 10.0}
    assert server.connections == 2 and server.refused == {}
    c.close()


@pytest.mark.parametrize("version, kind, nonce, refused", [
    (wire.VERSION, "hello", "00" * 16, False), (wire.VERSION - 1, "hello", "00" * 16, True),
    (wire.VERSION, "hi", "00" * 16, True), (wire.VERSION, "hello", "00" * 15, True),
    (wire.VERSION, "hello", "0g" * 16, True), (wire.VERSION, "hello", [0] * 32, True)])
def test_a_client_hello_of_another_version_or_kind_is_refused(server, secret, version, kind, nonce, refused):
    """A hello MAC'd with the run's secret and answering the server's nonce, but of another version or
    kind, or whose own nonce is not 16 bytes in hex, gets no welcome (the first: the same hello at this
    version does)."""
    with raw(server) as s:
        _, hello = read_frame(s)
        s.sendall(frame(secret, wire._TO_SERVER, {"kind": kind, "seq": 0, "arrays": [], "fields": {
            "v": version, "nonce_s": hello["fields"]["nonce"], "nonce_c": nonce}}))
        if refused:
            refused_once(server, secret, "handshake")
        else:
            assert read_frame(s)[1]["kind"] == "welcome" and server.refused == {}


@pytest.mark.parametrize("key, ok", [(b"k" * 16, True), (b"k" * 15, False), ("k" * 32, False)])
def test_a_secret_is_at_least_16_bytes(key, ok):
    if ok:
        wire.Client("127.0.0.1", 1, key, MAX_FRAME).close()
    else:
        with pytest.raises(ValueError, match="the secret must be at least 16 bytes"):
            wire.Client("127.0.0.1", 1, key, MAX_FRAME)


def test_the_cap_on_bytes_in_flight_is_taken_and_given_back():
    """A server's bodies in flight: taken up to the limit, a take that does not fit waits until a body
    is given back (or its time ends), and a closed cap takes nothing."""
    cap = wire._InFlight(100)
    soon = lambda: time.monotonic() + 0.05       # noqa: E731
    assert cap.take(60, soon()) and cap.used == 60
    assert not cap.take(50, soon()) and cap.used == 60                 # 110 > 100: no room in its time
    got = []
    waiting = threading.Thread(target=lambda: got.append(cap.take(50, time.monotonic() + 5.0)))
    waiting.start()
    time.sleep(0.05)
    assert got == []                                                   # still waiting for room
    cap.give(60)
    waiting.join(5.0)
    assert got == [True] and cap.used == 50
    assert cap.take(50, soon()) and cap.used == 100 and not cap.take(1, soon())
    cap.give(100)
    cap.close()
    assert cap.used == 0 and not cap.take(1, soon())


def test_bytes_are_counted_on_both_sides_as_the_sockets_carried_them(server, secret, recorded):
    """Every byte a client's sockets carried, handshakes included and over a reconnection, is in its
    counts, and the server counts the same bytes the other way (live connections and ended ones)."""
    c = wire.Client(*server.address, secret, MAX_FRAME, timeout=2.0)
    c.call("sum", {}, {"x": np.arange(100, dtype=np.int64)})
    c.close()                                                   # the next call reconnects
    c.call("echo", {"a": 1}, {"y": np.ones(7)})
    sent, received = sum(len(r.sent) for r in recorded), sum(len(r.received) for r in recorded)
    assert len(recorded) == 2 and sent > 800 and (c.bytes_sent, c.bytes_received) == (sent, received)
    wait_for(lambda: (server.bytes_received, server.bytes_sent) == (sent, received))    # one live, one ended
    c.close()
    wait_for(lambda: server.connections == 2 and (server.bytes_received, server.bytes_sent) == (sent, received))


def test_authenticated_connections_beyond_the_cap_are_refused_until_one_closes(secret):
    logs = []
    s = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=2.0, log=logs.append, max_connections=1).start()
    try:
        first, second = (wire.Client(*s.address, secret, MAX_FRAME, timeout=2.0) for _ in range(2))
        assert first.call("echo", {"n": 1})[1] == {"n": 1}
        with pytest.raises((wire.WireError, OSError)):
            second.call("echo", {"n": 2})                       # no welcome: the one slot is taken
        wait_for(lambda: s.refused.get("busy") == 1)
        first.close()

        def answered():
            try:
                return second.call("echo", {"n": 3})[1] == {"n": 3}
            except (wire.WireError, OSError):                  # before the server saw the first one go
                return False
        wait_for(answered, timeout=5.0)
        assert set(s.refused) == {"busy"}
    finally:
        s.close()


def test_a_body_of_max_frame_and_a_header_of_64_kib_pass_one_byte_more_does_not(secret):
    """The bounds themselves are inside them, on both sides: what one side may send, the other takes."""
    client, server = pair(secret)                               # max_frame 1024
    body = np.zeros(1024, np.uint8)
    server.send("x", {}, {"b": body})
    assert np.array_equal(client.recv()[2]["b"], body)
    with pytest.raises(wire.WireError, match="^size: header 64 bytes, body 1025 "):
        server.send("x", {}, {"b": np.zeros(1025, np.uint8)})
    pad = (64 << 10) - len(json.dumps({"kind": "x", "seq": 2, "fields": {"p": ""}, "arrays": []},
                                      separators=(",", ":")))
    server.send("x", {"p": "a" * pad})                          # a header of exactly 64 KiB
    assert len(client.recv()[1]["p"]) == pad
    with pytest.raises(wire.WireError, match="^size: header 65537 bytes"):
        server.send("x", {"p": "a" * (pad + 1)})
    key = server._key                                           # what a peer that skips the check sends
    server.sock.sendall(b"".join(wire._seal(key, wire._TO_CLIENT, b"x" * ((64 << 10) + 1), [])))
    with pytest.raises(wire.WireError, match="^size: header 65537 bytes, body 0 "):
        client.recv()
    client.close()
    server.close()


def test_a_large_frame_may_take_longer_than_timeout_at_the_minimum_rate(secret):
    """A frame, once begun, has ``timeout`` plus a second per MiB: a 2 MiB body arriving in 0.6 s is
    taken with a 0.3 s timeout (each piece within it), not cut as truncated."""
    client, server = pair(secret, timeout=0.3, max_frame=4 << 20)
    body = np.arange(2 << 20, dtype=np.uint8)
    data = b"".join(bytes(p) for p in server.encode("big", {}, {"b": body}))
    server._seq_out += 1
    got = {}
    reader = threading.Thread(target=lambda: got.update(frame=client.recv()))
    reader.start()
    for i in range(0, len(data), 256 << 10):
        server.sock.sendall(data[i:i + (256 << 10)])
        time.sleep(0.075)
    reader.join(5.0)
    assert np.array_equal(got["frame"][2]["b"], body)
    client.close()
    server.close()


def test_a_body_as_large_as_the_whole_cap_is_served_and_every_byte_given_back(secret):
    """``max_in_flight`` bytes fit in flight (one more is refused as "size" at once), and a closed
    connection leaves the cap at 0: a byte lost either way would shrink or grow it for good."""
    s = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=2.0, log=[].append, max_in_flight=1000).start()
    try:
        c = wire.Client(*s.address, secret, MAX_FRAME, timeout=2.0)
        assert c.call("sum", {}, {"x": np.ones(125)})[1] == {"total": 125.0}         # 1000 bytes
        assert c.call("sum", {}, {"x": np.ones(1)})[1] == {"total": 1.0}
        with pytest.raises((wire.WireError, OSError)):
            c.call("sum", {}, {"x": np.ones(1001, np.uint8)})
        wait_for(lambda: s.refused == {"size": 1})
        c.close()
        wait_for(lambda: s.connections == 1 and not s._live)
        assert s.in_flight.used == 0
    finally:
        s.close()


def test_both_sides_send_without_nagles_delay_and_secrets_are_32_bytes(secret):
    client, server = pair(secret)
    assert client.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert server.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert len(wire.new_secret()) == 32 and wire.new_secret() != wire.new_secret()
    client.close()
    server.close()


def test_a_server_with_no_pending_slots_asked_for_keeps_one(secret):
    """``max_pending=0`` would evict from an empty table (StopIteration in the accept loop): it means 1."""
    s = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=2.0, log=[].append, max_pending=0).start()
    try:
        assert s.max_pending == 1 and serves(s, secret)
    finally:
        s.close()


def test_a_frame_that_stops_midway_is_truncated_not_a_timeout(secret):
    """A reply that began and then stalled is a refused frame ("truncated"), not the silence between
    frames (TimeoutError), which a caller may wait through: wherever in the frame it stalls."""
    for partial in (wire.MAGIC[:2], wire.MAGIC + b"\0\0", wire.MAGIC + struct.pack(">IQ", 10, 0) + b"{"):
        client, server = pair(secret, timeout=0.5)          # the handshake's deadline too
        server.sock.sendall(partial)
        with pytest.raises(wire.WireError) as e:
            client.recv()
        assert e.value.reason == "truncated" and "TimeoutError" in str(e.value), str(e.value)
        client.close()
        server.close()


def test_a_frames_time_counts_from_its_first_byte(secret):
    """The magic's first byte begins a frame: its other three, each within the per-operation timeout, once
    stretched a frame to four timeouts before its deadline started."""
    client, server = pair(secret, timeout=0.3)

    def trickle():
        for byte in wire.MAGIC:
            server.sock.send(bytes([byte]))
            time.sleep(0.25)
    t = threading.Thread(target=trickle)
    t0 = time.monotonic()
    t.start()
    with pytest.raises(wire.WireError) as e:
        client.recv()
    took = time.monotonic() - t0
    assert e.value.reason == "truncated" and took < 0.7, (took, str(e.value))     # was 1.05
    t.join()
    client.close()
    server.close()


def test_thread_slots_are_given_back_by_every_connection_that_ends(secret):
    """A server of 3 thread slots (1 authenticated, 1 pending, 1 on its way out) serves connection
    after connection, garbage peers among them, and counts no slot still taken once they have gone:
    a slot lost per connection would refuse every client ("busy") after the third."""
    s = wire.FrameServer(handle, secret, max_frame=MAX_FRAME, timeout=2.0, log=[].append, max_connections=1,
                         max_pending=1).start()
    try:
        for i in range(6):
            if i % 2:
                with raw(s) as peer:
                    peer.sendall(b"GET / HTTP/1.1\r\n\r\n")
                wait_for(lambda: s.refused.get("garbage") == (i + 1) // 2)
            else:
                assert serves(s, secret)
            wait_for(lambda: not s._live)
        assert s._active == 0 and s.refused == {"garbage": 3}
    finally:
        s.close()


def test_a_server_on_ipv6_loopback_serves_and_names_its_peers(secret):
    """Over IPv6 a peer's address is a 4-tuple: only its host and port name it in the logs."""
    logs = []
    s = wire.FrameServer(handle, secret, host="::1", max_frame=MAX_FRAME, timeout=2.0, log=logs.append).start()
    try:
        assert s.address[0] == "::1" and serves(s, secret)
        with socket.create_connection(s.address[:2]) as peer:
            port = peer.getsockname()[1]
            peer.sendall(b"GET / HTTP/1.1\r\n\r\n")
            wait_for(lambda: s.refused == {"garbage": 1})
        assert logs[0].startswith(f"wire: refused ::1:{port}: garbage: "), logs
    finally:
        s.close()


class FakeClock:
    """``time`` for wire's retries: ``sleep`` advances ``monotonic`` at once and is recorded."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


def closing_listener(secret, serve_from=None):
    """A listener that closes each connection before its welcome (the first mid-frame: "truncated", the
    rest at once: ConnectionError) and authenticates the ``serve_from``-th on; and the accepted count."""
    listener, count = socket.create_server(("127.0.0.1", 0)), [0]

    def run():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            count[0] += 1
            if serve_from is not None and count[0] >= serve_from:
                wire.accept(sock, secret, MAX_FRAME, 2.0)
                return
            if count[0] == 1:
                sock.sendall(wire.MAGIC[:2])
            sock.close()
    threading.Thread(target=run, daemon=True).start()
    return listener, count


def test_connect_retries_a_connection_closed_before_its_welcome_with_doubling_pauses(secret, monkeypatch):
    """Pauses from 0.05 s doubling to 1 s, each drawn from [half, all] of it, until ``retry_s`` would be
    passed: then the last error. A connection cut mid-frame ("truncated") is retried as one closed is."""
    clock = FakeClock()
    monkeypatch.setattr(wire, "time", clock)
    draws = []
    monkeypatch.setattr(wire.random, "uniform", lambda lo, hi: draws.append((lo, hi)) or lo)   # the shortest
    waits = [p / 2 for p in (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0)]
    end = 0.0
    for w in waits[:7]:
        end += w                                # seven pauses fit exactly: the eighth would pass retry_s
    listener, count = closing_listener(secret)
    with pytest.raises(ConnectionError):
        wire.connect(*listener.getsockname(), secret, MAX_FRAME, timeout=2.0, retry_s=end)
    assert clock.sleeps == waits[:7] and count[0] == 8 and set(draws) == {(0.5, 1.0)}
    listener.close()

    clock.sleeps.clear()
    listener, count = closing_listener(secret, serve_from=3)
    conn = wire.connect(*listener.getsockname(), secret, MAX_FRAME, timeout=2.0, retry_s=10.0)
    assert clock.sleeps == waits[:2] and count[0] == 3
    conn.close()
    listener.close()


def test_connect_raises_at_once_what_the_server_said_that_does_not_check_out(server, monkeypatch):
    """Another secret's hello is an answer, not a busy server: retrying would not change it."""
    clock = FakeClock()
    monkeypatch.setattr(wire, "time", clock)
    with pytest.raises(wire.WireError) as e:
        wire.connect(*server.address, wire.new_secret(), MAX_FRAME, timeout=2.0, retry_s=10.0)
    assert e.value.reason == "mac" and clock.sleeps == []


def test_a_servers_documented_defaults(secret):
    """``idle`` 2 x ``timeout``, ``max_in_flight`` 2 x ``max_frame``, ``handshake`` the shorter of
    ``timeout`` and HANDSHAKE_S, ``max_pending`` ``max_connections``, port 0 any free port."""
    a = wire.FrameServer(handle, secret, max_frame=1000, timeout=3.0, max_connections=7)
    b = wire.FrameServer(handle, secret, timeout=1.0)
    try:
        assert (a.idle, a.in_flight.limit, a.handshake, a.max_pending) == (6.0, 2000, 3.0, 7)
        assert b.handshake == 1.0 and b.max_frame == 256 << 20 and wire.HANDSHAKE_S == 5.0
        assert 0 != a.address[1] != b.address[1] != 0
    finally:
        a.close()
        b.close()


def test_a_reply_to_a_peer_that_reads_slowly_ends_within_the_frames_time(secret, monkeypatch):
    """Each send had its own timeout, the reply none: a peer that read just fast enough to keep the sends going
    held the server's thread, and its request's bytes in flight, for as long as it liked (an hour for 256 MiB)."""
    accept = socket.socket.accept

    def small_buffers(self):                        # so that the reply cannot sit whole in the kernel's buffers
        conn, address = accept(self)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        return conn, address
    monkeypatch.setattr(socket.socket, "accept", small_buffers)
    server = wire.FrameServer(handle, secret, max_frame=4 << 20, timeout=0.5, log=lambda s: None).start()
    try:
        conn = wire.connect(*server.address, secret, 4 << 20, timeout=2.0)
        conn.send("echo", {}, {"x": np.zeros(1 << 19, np.float32)})       # 2 MiB back: within 2.5 s
        start, got, chunk = time.monotonic(), 0, b"x"
        conn.sock.settimeout(5.0)
        while chunk and got < 3 << 20:             # 320 kB/s, a read every 0.05 s: the reply would take 6.6 s
            chunk = conn.sock.recv(16384)
            got += len(chunk)
            time.sleep(0.05)
        took = time.monotonic() - start
        assert not chunk and got < 2 << 20 and took < 4.5, (got, took)       # closed by the server in time
    finally:
        server.close()
