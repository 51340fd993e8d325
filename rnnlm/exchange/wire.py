"""The parameter server's wire: authenticated binary frames over TCP, never pickle.

Elephas's parameter server unpickles what reaches it, so whoever reaches its port runs
code there. Here a frame is a JSON header and raw array bytes, decoded only once its MAC
has been checked::

    b"RNLM" | header_len u32 BE | body_len u64 BE | header | body | mac (32 bytes)

header: ``{"kind": str, "seq": int, "fields": {...}, "arrays": [[name, dtype, shape], ...]}``;
the arrays lie back to back in the body, C order, little-endian, dtypes from :data:`DTYPES`;
mac: HMAC-SHA256 over a direction byte (to the server, to the client) and all bytes before it.

Security: a per-run secret (:func:`new_secret`, handed to the tasks in their closure) MACs
two hellos: the server's carries a fresh random ``nonce_s``, the client's its ``nonce_c``
and ``nonce_s`` echoed. Later frames are MAC'd with the session key ``HMAC(secret,
b"rnnlm-session" + nonce_s + nonce_c)``, so nothing recorded on one connection passes on
another; ``seq`` must be the next in its direction (no replay or reordering within one);
the direction byte stops a frame from being reflected to its sender. Sizes are checked on
the fixed prefix before more is read (a hello has no body: a peer without the secret makes
the server allocate at most 4 KiB), the MAC before the JSON is parsed. A refused frame
raises :class:`WireError`; :class:`FrameServer` logs and counts it, drops that connection
and keeps serving. Not done: encryption (parameters travel in clear), per-peer limits.

Standard library and NumPy only: nothing to install on executors, no serialisation
framework that could be talked into building objects, a few hundred lines to audit.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import socket
import socketserver
import struct
import threading
import time

import numpy as np

MAGIC, MAX_HEADER = b"RNLM", 64 << 10
DTYPES = frozenset(("float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64", "bool"))
_SIZES = struct.Struct(">IQ")               # header_len, body_len (after the magic)
_HELLO_HEADER, _MAC = 4 << 10, 32           # a hello: a small header, no body
_TO_SERVER, _TO_CLIENT = b"\x01", b"\x02"
_CHUNK = 1 << 20                            # one socket write at most, each with its own timeout


class WireError(ValueError):
    """A refused frame; ``str(e)`` is one line. ``reason``: "mac", "truncated", "header", "size",
    "replay", "garbage", "dtype" or "handshake"."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {' '.join(str(detail).split())[:300]}")


def new_secret() -> bytes:
    """A run's secret: 32 random bytes from :mod:`secrets`."""
    return secrets.token_bytes(32)


def _checked(secret) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("the secret must be at least 16 bytes (see new_secret)")
    return secret


def _seal(key: bytes, direction: bytes, head: bytes, body: list) -> list:
    """The frame as byte pieces (magic, sizes and header; the body's pieces; the MAC). Checks nothing."""
    first = MAGIC + _SIZES.pack(len(head), sum(memoryview(p).nbytes for p in body)) + head
    mac = hmac.new(key, direction + first, hashlib.sha256)
    for p in body:
        mac.update(p)
    return [first, *body, mac.digest()]


def _decode(head, body, seq: int) -> tuple:
    """(kind, fields, arrays) of a header and body whose MAC has been checked."""
    try:
        h = json.loads(bytes(head).decode("utf-8"))
    except (ValueError, RecursionError) as e:       # RecursionError: deeply nested JSON
        raise WireError("header", f"not JSON ({type(e).__name__})") from None
    if not (isinstance(h, dict) and set(h) == {"kind", "seq", "fields", "arrays"} and isinstance(h["kind"], str)
            and type(h["seq"]) is int and isinstance(h["fields"], dict) and isinstance(h["arrays"], list)):
        raise WireError("header", "expected {kind: str, seq: int, fields: {}, arrays: []}")
    if h["seq"] != seq:
        raise WireError("replay", f"seq {h['seq']}, expected {seq}")
    specs, offset = [], 0
    for spec in h["arrays"]:
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and isinstance(spec[1], str)
                and isinstance(spec[2], list) and all(type(d) is int and d >= 0 for d in spec[2])):
            raise WireError("header", f"bad array {spec!r:.80}")
        if spec[1] not in DTYPES:
            raise WireError("dtype", f"array {spec[0]!r:.40} has dtype {spec[1]!r:.40}")
        dtype, n = np.dtype(spec[1]), math.prod(spec[2])
        specs.append((spec[0], dtype, spec[2], n, offset))
        offset += n * dtype.itemsize
    if len({s[0] for s in specs}) != len(specs) or offset != len(body):
        raise WireError("header", f"arrays take {offset} bytes of a {len(body)}-byte body, or repeat a name")
    arrays = {}
    for name, dtype, shape, n, offset in specs:
        try:      # read little-endian; astype: a writable, native-order copy that owns its memory
            arrays[name] = np.frombuffer(body, dtype.newbyteorder("<"), n, offset).reshape(shape).astype(dtype)
        except (ValueError, OverflowError) as e:     # e.g. a shape (0, 2**70)
            raise WireError("header", f"array {name!r:.40}: {e}") from None
    return h["kind"], h["fields"], arrays


class Conn:
    """One authenticated, framed connection (either side), after the handshake.

    Used by one thread at a time. ``timeout`` bounds each socket operation and a whole hello;
    between frames a client waits ``timeout`` for the reply, a server waits for an authenticated
    peer's next request without limit. ``bytes_sent``, ``bytes_received``: every byte on the
    socket, handshake included; ``peer``: the other side's address.
    """

    def __init__(self, sock, max_frame: int, timeout: float, server: bool):
        self.sock, self.max_frame, self.timeout, self.server = sock, int(max_frame), timeout, server
        self._out, self._in = (_TO_CLIENT, _TO_SERVER) if server else (_TO_SERVER, _TO_CLIENT)
        self.idle = None if server else timeout
        self._key, self._seq_out, self._seq_in, self.bytes_sent, self.bytes_received = None, 0, 0, 0, 0
        try:
            self.peer = "%s:%s" % sock.getpeername()[:2]
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # no Nagle delay on small replies
        except OSError:
            self.peer = "?"

    def send(self, kind: str, fields: dict | None = None, arrays: dict | None = None) -> int:
        """Write one frame (``fields``: JSON, NumPy scalars allowed; ``arrays``: name -> array) and
        return the bytes written. WireError "dtype" or "size", before anything is written, for a
        frame the other side would refuse."""
        return self._write(self._frame(kind, fields, arrays))

    def _frame(self, kind, fields, arrays) -> list:
        specs, body = [], []
        for name, a in (arrays or {}).items():
            a = np.asarray(a)
            if not isinstance(name, str) or a.dtype.name not in DTYPES:
                raise WireError("dtype", f"cannot send array {name!r:.40} of dtype {a.dtype}")
            specs.append([name, a.dtype.name, list(a.shape)])
            body.append(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))
        head = json.dumps({"kind": kind, "seq": self._seq_out, "fields": fields or {}, "arrays": specs},
                          separators=(",", ":"), default=np.generic.item).encode()    # NumPy scalars as numbers
        size = sum(b.nbytes for b in body)
        if len(head) > MAX_HEADER or size > self.max_frame:
            raise WireError("size", f"header {len(head)} bytes, body {size} (max {MAX_HEADER}, {self.max_frame})")
        return _seal(self._key, self._out, head, body)

    def _write(self, pieces: list) -> int:
        self._seq_out += 1
        if sum(memoryview(p).nbytes for p in pieces) < _CHUNK:
            pieces = [b"".join(pieces)]             # one segment, not a header alone then the arrays
        self.sock.settimeout(self.timeout)
        total = 0
        for p in pieces:
            view = memoryview(p).cast("B")
            while view:                             # sendall's timeout would bound the whole transfer
                k = self.sock.send(view[:_CHUNK])
                view, total, self.bytes_sent = view[k:], total + k, self.bytes_sent + k
        return total

    def recv(self) -> tuple:
        """Read one frame: ``(kind, fields, arrays)``, arrays name -> writable native-order copy.
        WireError: a refused frame (the connection is then unusable); ConnectionError: the peer
        closed the connection between frames; TimeoutError: no reply began within ``timeout``."""
        return self._recv(MAX_HEADER, self.max_frame)

    def _recv(self, max_header: int, max_body: int, deadline: float | None = None) -> tuple:
        magic = self._fill(4, True, deadline)
        if magic != MAGIC:
            raise WireError("garbage", f"magic {bytes(magic)!r}")
        sizes = self._fill(_SIZES.size, False, deadline)
        hlen, blen = _SIZES.unpack(sizes)
        if hlen > max_header or blen > max_body:      # refused before a byte more is read or allocated
            raise WireError("size", f"header {hlen} bytes, body {blen} (max {max_header}, {max_body})")
        view = memoryview(self._fill(hlen + blen + _MAC, False, deadline))
        mac = hmac.new(self._key, self._in + magic + sizes, hashlib.sha256)
        mac.update(view[:-_MAC])
        if not hmac.compare_digest(mac.digest(), bytes(view[-_MAC:])):      # before the header is parsed
            raise WireError("mac", f"{hlen}-byte header, {blen}-byte body")
        frame = _decode(view[:hlen], view[hlen:-_MAC], self._seq_in)
        self._seq_in += 1
        return frame

    def _fill(self, n: int, first: bool, deadline) -> bytearray:
        buf, got = bytearray(n), 0
        while got < n:          # EOF or timeout: between frames, the caller's; within a frame, "truncated"
            wait = (self.idle if first and not got else self.timeout) if deadline is None else \
                deadline - time.monotonic()
            try:
                if wait is not None and wait <= 0:
                    raise TimeoutError("the hello took too long")
                self.sock.settimeout(wait)
                k = self.sock.recv_into(memoryview(buf)[got:])
            except OSError as e:
                if first and not got:
                    raise
                raise WireError("truncated", f"{type(e).__name__} after {got} of {n} bytes") from None
            if not k and first and not got:
                raise ConnectionError(f"{self.peer} closed the connection")
            if not k:
                raise WireError("truncated", f"connection closed after {got} of {n} bytes")
            got, self.bytes_received = got + k, self.bytes_received + k
        return buf

    def close(self) -> None:
        """Shut the socket down (which wakes a thread blocked on it) and close it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _nonce(x):
    try:
        return bytes.fromhex(x) if isinstance(x, str) and len(x) == 32 else None
    except ValueError:
        return None


def _handshake(conn: Conn, secret: bytes) -> Conn:
    """Exchange hellos MAC'd with the secret, key the connection with the session key; or close it."""
    try:
        conn._key, mine = _checked(secret), secrets.token_bytes(16)
        if conn.server:
            conn.send("hello", {"v": 1, "nonce": mine.hex()})
        try:
            kind, f, _ = conn._recv(_HELLO_HEADER, 0, time.monotonic() + conn.timeout)
        except OSError as e:      # closed, reset or silent before its hello (as a client with the wrong secret is)
            if not conn.server:
                raise
            raise WireError("handshake", f"no hello from the client ({type(e).__name__})") from None
        want = ("nonce_s", "nonce_c") if conn.server else ("nonce",)
        theirs = [_nonce(f.get(k)) for k in want]
        if kind != "hello" or f.get("v") != 1 or None in theirs:
            raise WireError("handshake", f"expected a hello with {' and '.join(want)}")
        if conn.server and not hmac.compare_digest(theirs[0], mine):
            raise WireError("replay", "the hello answers another connection's nonce")
        if not conn.server:
            conn.send("hello", {"v": 1, "nonce_s": theirs[0].hex(), "nonce_c": mine.hex()})
        nonces = mine + theirs[1] if conn.server else theirs[0] + mine             # nonce_s + nonce_c
        conn._key = hmac.new(secret, b"rnnlm-session" + nonces, hashlib.sha256).digest()
        return conn
    except BaseException:
        conn.close()
        raise


def connect(host: str, port: int, secret: bytes, max_frame: int, timeout: float = 30.0) -> Conn:
    """Connect to a :class:`FrameServer` and authenticate. ``max_frame``: the largest frame body
    sent or accepted (bytes); ``timeout``: for each socket operation and reply (s)."""
    return _handshake(Conn(socket.create_connection((host, port), timeout), max_frame, timeout, False), secret)


def accept(sock, secret: bytes, max_frame: int, timeout: float = 30.0) -> Conn:
    """Authenticate the client of an accepted socket (server side); WireError if that fails."""
    return _handshake(Conn(sock, max_frame, timeout, True), secret)


class Client:
    """Request/response over one Conn; reconnects lazily after the connection drops.

    A call that fails (refused reply, closed connection, timeout) closes the connection
    and raises; the next call opens a new one. Requests are never retried: a push that
    reached the server before the connection dropped would be applied twice. Calls from
    several threads take turns. Arguments as for :func:`connect`.
    """

    def __init__(self, host: str, port: int, secret: bytes, max_frame: int, timeout: float = 30.0):
        self.host, self.port, self.secret, self.max_frame = host, port, _checked(secret), max_frame
        self.timeout = timeout
        self._conn, self._lock, self._done = None, threading.RLock(), [0, 0]

    bytes_sent = property(lambda self: self._done[0] + (self._conn.bytes_sent if self._conn else 0))
    bytes_received = property(lambda self: self._done[1] + (self._conn.bytes_received if self._conn else 0))

    def call(self, kind: str, fields: dict | None = None, arrays: dict | None = None) -> tuple:
        """Send a request (as :meth:`Conn.send`) and return the reply ``(kind, fields, arrays)``."""
        with self._lock:
            if self._conn is None:
                sock = socket.create_connection((self.host, self.port), self.timeout)
                self._conn = Conn(sock, self.max_frame, self.timeout, server=False)
                self._guard(_handshake, self._conn, self.secret)
            frame = self._conn._frame(kind, fields, arrays)   # an unsendable request leaves the connection be
            self._guard(self._conn._write, frame)
            return self._guard(self._conn.recv)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection (a later call reconnects)."""
        with self._lock:
            if self._conn is not None:
                self._done[0] += self._conn.bytes_sent
                self._done[1] += self._conn.bytes_received
                self._conn.close()
                self._conn = None


class FrameServer:
    """A threaded TCP server (socketserver.ThreadingTCPServer, daemon threads, one thread per
    connection) that authenticates each connection and calls ``handle`` for every request frame.

    ``handle(peer, kind, fields, arrays) -> (kind, fields, arrays)``, the reply, is called from
    the connections' threads concurrently. If it raises (or its reply cannot be sent), the
    server logs one line, counts it under ``refused["handler"]`` and closes that connection.
    ``host``: an address the executors reach (port 0: any free port); ``max_frame`` bounds each
    frame's body both ways (bytes); ``timeout`` a client's hello and each socket operation
    within a frame (s); ``log(line)`` reports each refusal (default ``print``). Attributes:
    ``address`` (bound host, port), ``refused`` (reason -> count), ``connections`` (accepted),
    ``bytes_received`` and ``bytes_sent`` (all connections, handshakes included).
    """

    def __init__(self, handle, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_frame: int = 256 << 20, timeout: float = 30.0, log=None):
        self.handle, self.secret, self.max_frame, self.timeout = handle, _checked(secret), max_frame, timeout
        self.log = print if log is None else log
        self.refused, self.connections, self._thread, self._closing = {}, 0, None, False
        self._lock, self._live, self._done = threading.Lock(), set(), [0, 0]
        # reuse_address: a restarted driver binds its port at once; daemon threads never hold the process up
        cls = type("TCPServer", (socketserver.ThreadingTCPServer,), {
            "allow_reuse_address": True, "daemon_threads": True,
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        self._server = cls((host, port), lambda request, _address, _server: self._serve(request))
        self.address = tuple(self._server.server_address[:2])

    def _serve(self, sock):
        conn = Conn(sock, self.max_frame, self.timeout, server=True)
        with self._lock:
            self.connections += 1
            self._live.add(conn)
        try:
            _handshake(conn, self.secret)
            while True:
                kind, fields, arrays = conn.recv()
                try:
                    frame = conn._frame(*self.handle(conn.peer, kind, fields, arrays))
                except Exception as e:              # the handler's bug must not stop the server
                    return self._refuse(conn.peer, "handler", f"handler: {kind!r:.40}: {type(e).__name__}: {e}")
                conn._write(frame)
        except WireError as e:
            self._refuse(conn.peer, e.reason, str(e))
        except OSError:
            pass                                    # the peer left, or close() shut the socket: nothing refused
        finally:
            conn.close()
            with self._lock:
                self._live.discard(conn)
                self._done[0] += conn.bytes_received
                self._done[1] += conn.bytes_sent

    def _refuse(self, peer: str, reason: str, line: str):
        if self._closing:                           # connections cut by close() are not their peers' doing
            return
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        self.log(" ".join(f"wire: refused {peer}: {line}".split()))

    def _total(self, i: int) -> int:
        with self._lock:
            return self._done[i] + sum(c.bytes_sent if i else c.bytes_received for c in self._live)

    bytes_received = property(lambda self: self._total(0))
    bytes_sent = property(lambda self: self._total(1))

    def start(self) -> "FrameServer":
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"wire-server-{self.address[1]}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, close the listening socket and every live connection."""
        self._closing = True
        if self._thread is not None:                # shutdown() waits for serve_forever: only if it runs
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        with self._lock:
            live = list(self._live)
        for conn in live:
            conn.close()
