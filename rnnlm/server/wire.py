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
and keeps serving. A frame, once begun, must end within ``timeout`` plus a second per MiB
(a peer cannot hold a connection by trickling bytes); the server closes a connection idle
between frames for ``idle`` seconds.

Availability: a connection must authenticate within :data:`HANDSHAKE_S` (or ``timeout`` if
shorter); connections still awaiting their hello have their own slots (``max_pending``), and
when those are full the oldest is closed to make room, so idle or garbage connections cannot
keep a client with the secret out; authenticated connections have ``max_connections`` slots
that no peer without the secret can take. The server ends the handshake with a ``welcome``
frame: until a client has it, nothing it sent was served, so :func:`connect` and
:class:`Client` retry a connection closed before it with growing pauses (``retry_s``). The
bodies of frames being read or served are capped across connections (``max_in_flight``), and
refusals are logged at most a few lines per reason a minute (:class:`LogLimit`). Not done:
encryption (parameters travel in clear), per-peer limits.

Standard library and NumPy only: nothing to install on executors, no serialisation
framework that could be talked into building objects, a few hundred lines to audit.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import json
import math
import random
import re
import secrets
import socket
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
_MIN_RATE = 1 << 20                         # bytes/s a frame must average, beyond ``timeout``, once begun
_BACKLOG = 128                              # connections the kernel queues before accept()
_ACCEPT_POLL = 0.05                         # s: how often the accept loop looks for close()
_MAX_PAUSE = 1.0                            # s: the longest wait after accept() fails (no descriptor left)
HANDSHAKE_S = 5.0                           # s: the longest a connection may take to authenticate (server)
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0        # s: a client's first and longest pause between attempts to connect
VERSION = 2                                 # of the handshake (2: the server's welcome ends it)
# C0 and C1 controls, DEL, line and paragraph separators, bidi and zero-width format characters
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


class WireError(ValueError):
    """A refused frame or connection; ``str(e)`` is one line. ``reason``: "mac", "truncated",
    "header", "size", "replay", "garbage", "dtype", "handshake", "memory" (no room among the bytes
    in flight in time), "busy" (no slot for one more authenticated connection), "pending" (closed
    while awaiting its hello, to make room for a newer connection) or "closing" (the server is)."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {_one_line(detail)[:300]}")


def _one_line(text) -> str:
    """``text`` as one printable line: control, separator and bidi characters become spaces, runs of
    whitespace one space (a peer's text cannot forge a log line or recolour a terminal); the rule of
    :func:`rnnlm.exchange.frames.one_line`, kept here so that this module imports nothing of the project."""
    return " ".join(_UNPRINTABLE.sub(" ", str(text)).split())


class LogLimit:
    """A log that a flood of refusals cannot flood: at most ``burst`` lines of each ``kind`` (a small,
    fixed set of names) in each ``period`` seconds; the lines held back are counted, and said in one
    line (``name: N more refusal lines ...``) when that kind's next period begins or at :meth:`flush`.
    Thread-safe; every line is made one printable line."""

    def __init__(self, log, name: str = "wire", burst: int = 5, period: float = 60.0, clock=time.monotonic):
        self.log, self.name, self.burst, self.period, self.clock = log, name, burst, period, clock
        self._lock, self._periods, self._held = threading.Lock(), {}, collections.Counter()

    def __call__(self, kind: str, line: str) -> None:
        now, lines = self.clock(), []
        with self._lock:
            start, n = self._periods.get(kind, (now, 0))
            if now - start >= self.period:
                start, n = now, 0
                lines += self._release([kind])
            if n < self.burst:
                lines.append(line)
            else:
                self._held[kind] += 1
            self._periods[kind] = (start, n + 1)
        for x in lines:
            self.log(_one_line(x))

    def flush(self) -> None:
        """Say how many lines were held back since they were last said."""
        with self._lock:
            lines = self._release(sorted(self._held))
        for x in lines:
            self.log(_one_line(x))

    def _release(self, kinds) -> list:
        # under self._lock
        held = {k: self._held.pop(k) for k in kinds if self._held.get(k)}
        if not held:
            return []
        counts = ", ".join(f"{k} {n}" for k, n in held.items())
        return [f"{self.name}: {sum(held.values())} more refusal lines were not logged ({counts}; at most "
                f"{self.burst} of each kind in {self.period:g} s)"]


class _InFlight:
    """The bytes of frame bodies a server holds at once, across its connections: a frame's body is
    taken from ``limit`` before it is read and given back once its reply is sent."""

    def __init__(self, limit: int):
        self.limit, self.used, self.closed = int(limit), 0, False
        self._room = threading.Condition()

    def take(self, n: int, deadline: float) -> bool:
        """Wait until ``n`` bytes fit (or ``deadline``, or :meth:`close`); whether they were taken."""
        with self._room:
            fits = self._room.wait_for(lambda: self.closed or self.used + n <= self.limit,
                                       max(0.0, deadline - time.monotonic()))
            if not fits or self.closed:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._room:
            self.used -= n
            self._room.notify_all()

    def close(self) -> None:
        with self._room:
            self.closed = True
            self._room.notify_all()


def new_secret() -> bytes:
    """A run's secret: 32 random bytes from :mod:`secrets`."""
    return secrets.token_bytes(32)


def _checked(secret) -> bytes:
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("the secret must be at least 16 bytes (see new_secret)")
    return secret


def _head(kind: str, seq: int, fields: dict | None, arrays: dict | None) -> bytes:
    """A frame's JSON header (NumPy scalars among ``fields`` as numbers)."""
    specs = [[name, np.asarray(a).dtype.name, list(np.shape(a))] for name, a in (arrays or {}).items()]
    return json.dumps({"kind": kind, "seq": seq, "fields": fields or {}, "arrays": specs},
                      separators=(",", ":"), default=np.generic.item).encode()


def frame_bytes(kind: str, seq: int, fields: dict | None = None, arrays: dict | None = None) -> int:
    """The bytes of the frame :meth:`Conn.encode` makes of these: magic, sizes, header, body, MAC.
    A frame received re-measures exactly (JSON numbers decode and encode to the same text)."""
    body = sum(np.asarray(a).nbytes for a in (arrays or {}).values())
    return len(MAGIC) + _SIZES.size + len(_head(kind, seq, fields, arrays)) + body + _MAC


def client_hello_bytes() -> int:
    """The bytes of a client's hello (:meth:`Conn.handshake`): its first frame on a connection."""
    return frame_bytes("hello", 0, {"v": VERSION, "nonce_s": "0" * 32, "nonce_c": "0" * 32})


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
        if offset > len(body):      # said here, not printed: a product of 400 dimensions has thousands of digits
            raise WireError("header", f"arrays take more than the {len(body)}-byte body")
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
    """One framed connection (either side), authenticated by :meth:`handshake` before any other frame.

    Used by one thread at a time. ``timeout`` bounds each socket operation and a whole hello;
    a frame, once begun, must end within ``timeout`` plus a second per MiB. Between frames
    :meth:`recv` waits ``idle`` for the next one to begin (default: ``timeout`` for a client's
    reply, no limit for a server), then raises TimeoutError. ``in_flight`` (a server's): the cap
    its frames' bodies are taken from before they are read (:meth:`release` gives the last one
    back). ``bytes_sent``, ``bytes_received``: every byte on the socket, handshake included;
    ``peer``: the other side's address.
    """

    def __init__(self, sock, max_frame: int, timeout: float, server: bool, idle: float | None = None,
                 in_flight: _InFlight | None = None):
        self.sock, self.max_frame, self.timeout, self.server = sock, int(max_frame), timeout, server
        self._out, self._in = (_TO_CLIENT, _TO_SERVER) if server else (_TO_SERVER, _TO_CLIENT)
        self.idle = idle if server else timeout
        self._key, self._seq_out, self._seq_in, self.bytes_sent, self.bytes_received = None, 0, 0, 0, 0
        self.in_flight, self.held = in_flight, 0
        self.evicted = self.authenticated = False        # a FrameServer's bookkeeping of its slots
        try:
            self.peer = "%s:%s" % sock.getpeername()[:2]
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # no Nagle delay on small replies
        except OSError:
            self.peer = "?"

    def send(self, kind: str, fields: dict | None = None, arrays: dict | None = None) -> int:
        """Write one frame (``fields``: JSON, NumPy scalars allowed; ``arrays``: name -> array) and
        return the bytes written. WireError "dtype" or "size", before anything is written, for a
        frame the other side would refuse."""
        return self.write(self.encode(kind, fields, arrays))

    def encode(self, kind: str, fields: dict | None = None, arrays: dict | None = None) -> list:
        """The next frame as byte pieces for :meth:`write`, nothing written yet: a frame that cannot be
        sent (WireError "dtype" or "size") leaves the connection usable. It carries the next sequence
        number, so write it before encoding another."""
        body = []
        for name, a in (arrays or {}).items():
            a = np.asarray(a)
            if not isinstance(name, str) or a.dtype.name not in DTYPES:
                raise WireError("dtype", f"cannot send array {name!r:.40} of dtype {a.dtype}")
            body.append(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))
        head = _head(kind, self._seq_out, fields, arrays)
        size = sum(b.nbytes for b in body)
        if len(head) > MAX_HEADER or size > self.max_frame:
            raise WireError("size", f"header {len(head)} bytes, body {size} (max {MAX_HEADER}, {self.max_frame})")
        return _seal(self._key, self._out, head, body)

    def write(self, pieces: list) -> int:
        """Write a frame from :meth:`encode`; the bytes written. Like a frame received, it must end within
        ``timeout`` plus a second per MiB (TimeoutError): a peer that reads just fast enough to keep
        each send going held the thread, and the bytes in flight of its request, for as long as it liked."""
        self._seq_out += 1
        size = sum(memoryview(p).nbytes for p in pieces)
        if size < _CHUNK:
            pieces = [b"".join(pieces)]             # one segment, not a header alone then the arrays
        deadline = time.monotonic() + self.timeout + size / _MIN_RATE
        total = 0
        for p in pieces:
            view = memoryview(p).cast("B")
            while view:                             # sendall's timeout would bound each send, not the frame
                wait = min(self.timeout, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"the frame took too long to send ({total} of {size} bytes)")
                self.sock.settimeout(wait)
                k = self.sock.send(view[:_CHUNK])
                view, total, self.bytes_sent = view[k:], total + k, self.bytes_sent + k
        return total

    def recv(self) -> tuple:
        """Read one frame: ``(kind, fields, arrays)``, arrays name -> writable native-order copy.
        WireError: a refused frame (the connection is then unusable); ConnectionError: the peer
        closed the connection between frames; TimeoutError: no reply began within ``timeout``."""
        return self._recv(MAX_HEADER, self.max_frame)

    def _recv(self, max_header: int, max_body: int, deadline: float | None = None) -> tuple:
        first = self._fill(1, True, deadline)
        if deadline is None:        # begun with its first byte: it must end in time, however slowly the rest trickle in
            deadline = time.monotonic() + self.timeout
        magic = first + self._fill(3, False, deadline)
        if magic != MAGIC:
            raise WireError("garbage", f"magic {bytes(magic)!r}")
        sizes = self._fill(_SIZES.size, False, deadline)
        hlen, blen = _SIZES.unpack(sizes)
        if hlen > max_header or blen > max_body:      # refused before a byte more is read or allocated
            raise WireError("size", f"header {hlen} bytes, body {blen} (max {max_header}, {max_body})")
        deadline += (hlen + blen) / _MIN_RATE
        self._take(blen, deadline)
        try:
            return self._read(magic, sizes, hlen, blen, deadline)
        except BaseException:
            self.release()
            raise

    def _take(self, blen: int, deadline: float) -> None:
        """Take a body's bytes from the server's cap on bytes in flight, waiting within the frame's time."""
        if self.in_flight is None or not blen:
            return
        if blen > self.in_flight.limit:
            raise WireError("size", f"body {blen} bytes, more than all frames in flight may hold "
                                    f"({self.in_flight.limit})")
        if not self.in_flight.take(blen, deadline):
            raise WireError("memory", f"no room for a {blen}-byte body within its time: {self.in_flight.used} of "
                                      f"{self.in_flight.limit} bytes in flight")
        self.held = blen

    def release(self) -> None:
        """Give back the body of the frame last received to the cap on bytes in flight (if any)."""
        if self.held:
            self.in_flight.give(self.held)
            self.held = 0

    def _read(self, magic, sizes, hlen: int, blen: int, deadline: float) -> tuple:
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
                    raise TimeoutError("the frame took too long")
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

    def handshake(self, secret: bytes, within: float | None = None, admit=None) -> "Conn":
        """Exchange hellos MAC'd with the secret, key the connection with the session key, and end with
        the server's ``welcome``; or close it. ``within``: seconds the server gives the client's hello
        (default ``timeout``); ``admit()``, called by a server once the client's hello checks out, raises
        WireError to refuse the connection. A client that got no welcome was served nothing."""
        try:
            self._key, mine = _checked(secret), secrets.token_bytes(16)
            if self.server:
                self.send("hello", {"v": VERSION, "nonce": mine.hex()})
            deadline = time.monotonic() + (self.timeout if within is None else within)
            theirs = self._hello(deadline)
            if self.server and not hmac.compare_digest(theirs[0], mine):
                raise WireError("replay", "the hello answers another connection's nonce")
            if not self.server:
                self.send("hello", {"v": VERSION, "nonce_s": theirs[0].hex(), "nonce_c": mine.hex()})
            nonces = mine + theirs[1] if self.server else theirs[0] + mine             # nonce_s + nonce_c
            self._key = hmac.new(secret, b"rnnlm-session" + nonces, hashlib.sha256).digest()
            if self.server:
                if admit is not None:
                    admit()
                self.send("welcome")
            elif self._recv(_HELLO_HEADER, 0, time.monotonic() + self.timeout)[0] != "welcome":
                raise WireError("handshake", "expected the server's welcome")
            return self
        except BaseException:
            self.close()
            raise

    def _hello(self, deadline: float) -> list:
        """The other side's nonces (the server's; the client's and the server's echoed) from its hello."""
        try:
            kind, f, _ = self._recv(_HELLO_HEADER, 0, deadline)
        except OSError as e:      # closed, reset or silent before its hello (as a client with the wrong secret is)
            if not self.server:
                raise
            raise WireError("handshake", f"no hello from the client ({type(e).__name__})") from None
        want = ("nonce_s", "nonce_c") if self.server else ("nonce",)
        theirs = [_nonce(f.get(k)) for k in want]
        if kind != "hello" or f.get("v") != VERSION or None in theirs:
            raise WireError("handshake", f"expected a version {VERSION} hello with {' and '.join(want)}")
        return theirs

    def shut(self) -> None:
        """Shut the socket down from another thread: the one using it wakes and closes it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Shut the socket down (which wakes a thread blocked on it) and close it."""
        self.shut()
        self.sock.close()


def _nonce(x):
    try:
        return bytes.fromhex(x) if isinstance(x, str) and len(x) == 32 else None
    except ValueError:
        return None


def connect(host: str, port: int, secret: bytes, max_frame: int, timeout: float = 30.0,
            retry_s: float = 0.0) -> Conn:
    """Connect to a :class:`FrameServer` and authenticate. ``max_frame``: the largest frame body
    sent or accepted (bytes); ``timeout``: for each socket operation and reply (s); ``retry_s``:
    for how long a connection that the server accepted, then closed or reset before its welcome
    (a server busy with a flood), is tried again, after pauses from 0.05 s doubling to 1 s. A
    connection refused or timed out (nothing listens, a firewall) is not; the last error is raised."""
    end, pause = time.monotonic() + retry_s, _RETRY_FIRST
    while True:
        sock = socket.create_connection((host, port), timeout)
        try:
            return Conn(sock, max_frame, timeout, False).handshake(secret)
        except (ConnectionError, WireError) as e:
            if isinstance(e, WireError) and e.reason != "truncated":
                raise                               # the server answered, and what it said does not check out
            wait = pause * random.uniform(0.5, 1.0)
            if time.monotonic() + wait > end:
                raise
            time.sleep(wait)
            pause = min(_RETRY_MAX, 2 * pause)


def accept(sock, secret: bytes, max_frame: int, timeout: float = 30.0) -> Conn:
    """Authenticate the client of an accepted socket (server side) and welcome it; WireError if that fails."""
    return Conn(sock, max_frame, timeout, True).handshake(secret)


class Client:
    """Request/response over one Conn; reconnects lazily after the connection drops.

    A call that fails (refused reply, closed connection, timeout) closes the connection
    and raises; the next call opens a new one. Requests are never retried: a push that
    reached the server before the connection dropped would be applied twice. So a
    connection left unused for more than ``max_idle`` seconds (less than the server's
    ``idle``, after which it closes the connection) is replaced before the next request
    rather than risked. Opening a connection is retried for ``retry_s`` (:func:`connect`):
    nothing was sent then. Calls from several threads take turns. Other arguments as for
    :func:`connect`.
    """

    def __init__(self, host: str, port: int, secret: bytes, max_frame: int, timeout: float = 30.0,
                 max_idle: float | None = None, retry_s: float = 0.0):
        self.host, self.port, self.secret, self.max_frame = host, port, _checked(secret), max_frame
        self.timeout, self.max_idle, self.retry_s = timeout, max_idle, retry_s
        self._conn, self._lock, self._done, self._used = None, threading.RLock(), [0, 0], 0.0

    bytes_sent = property(lambda self: self._done[0] + (self._conn.bytes_sent if self._conn else 0))
    bytes_received = property(lambda self: self._done[1] + (self._conn.bytes_received if self._conn else 0))

    def call(self, kind: str, fields: dict | None = None, arrays: dict | None = None) -> tuple:
        """Send a request (as :meth:`Conn.send`) and return the reply ``(kind, fields, arrays)``."""
        with self._lock:
            if self._conn is not None and self.max_idle is not None and \
                    time.monotonic() - self._used > self.max_idle:
                self.close()                    # the server may be closing it this very moment
            if self._conn is None:
                self._conn = connect(self.host, self.port, self.secret, self.max_frame, self.timeout, self.retry_s)
            frame = self._conn.encode(kind, fields, arrays)    # an unsendable request leaves the connection be
            self._guard(self._conn.write, frame)
            reply = self._guard(self._conn.recv)
            self._used = time.monotonic()
            return reply

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
    """A threaded TCP server (one daemon thread per connection) that authenticates each connection
    and calls ``handle`` for every request frame.

    ``handle(peer, kind, fields, arrays) -> (kind, fields, arrays)``, the reply, is called from
    the connections' threads concurrently. If it raises (or its reply cannot be sent), the
    server logs one line, counts it under ``refused["handler"]`` and closes that connection.
    ``host``: an address the executors reach (port 0: any free port); ``max_frame`` bounds each
    frame's body both ways (bytes); ``timeout`` each socket operation within a frame (s);
    ``handshake`` how long a connection may take to send its hello (default ``timeout`` or
    :data:`HANDSHAKE_S`, the shorter); ``idle`` how long an authenticated connection may wait
    between frames before it is closed (default ``2 * timeout``; counted in ``closed_idle``, not
    logged: a client that idles is not at fault).

    Slots: ``max_pending`` connections may await their hello at once (default
    ``max_connections``): the next closes the oldest of them (``refused["pending"]``), so a flood
    of idle peers delays a client with the secret by a retry or two; only one that opens more than
    ``max_pending`` connections within the round trip of its handshake closes it, every retry, until
    it gives up (docs/async.md, "Slots").
    ``max_connections`` connections may be authenticated at once: one more is closed before its
    welcome (``refused["busy"]``, logged once until an authenticated one ends); a client retries
    either. Threads: one per connection, at most ``max_connections + 2 * max_pending`` (the
    closed ones on their way out included); one more connection is closed on accept (``"busy"``).
    Bytes: the bodies of the frames being read or served take at most ``max_in_flight`` bytes
    together (default ``2 * max_frame``); a frame waits for room within its own time, else is
    refused (``refused["memory"]``; a body larger than the whole cap, at once: ``"size"``).

    ``log(line)`` reports refusals, at most five lines of each reason a minute
    (:class:`LogLimit`; default ``print``). When accept() fails (``EMFILE``: no file descriptor
    left) the server waits, longer each time up to a second, instead of spinning on the pending
    connection (``refused["accept"]``, logged once until an accept succeeds). Attributes:
    ``address`` (bound host, port), ``refused`` (reason -> count), ``connections`` (accepted and
    served), ``closed_idle``, ``in_flight`` (``limit``, ``used``), ``bytes_received``
    and ``bytes_sent`` (all connections, handshakes included).
    """

    def __init__(self, handle, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_frame: int = 256 << 20, timeout: float = 30.0, log=None, max_connections: int = 64,
                 idle: float | None = None, max_pending: int | None = None, handshake: float | None = None,
                 max_in_flight: int | None = None):
        self.handle, self.secret, self.max_frame, self.timeout = handle, _checked(secret), max_frame, timeout
        self.idle, self.max_connections = 2 * timeout if idle is None else idle, max_connections
        self.max_pending = max(1, max_connections if max_pending is None else max_pending)
        self.handshake = min(timeout, HANDSHAKE_S) if handshake is None else handshake
        self.in_flight = _InFlight(2 * max_frame if max_in_flight is None else max_in_flight)
        self.log = print if log is None else log
        self._say = LogLimit(self.log)
        self.refused, self.connections, self.closed_idle, self._thread = {}, 0, 0, None
        self._lock, self._live, self._done, self._active = threading.Lock(), set(), [0, 0], 0
        self._pending, self._authenticated = {}, 0                # awaiting their hello, oldest first
        self._stop, self._quiet = threading.Event(), set()        # reasons logged once per episode
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # create_server sets SO_REUSEADDR: a restarted driver binds its port at once
        self._listener = socket.create_server((host, port), family=family, backlog=_BACKLOG)
        self._listener.settimeout(_ACCEPT_POLL)
        self.address = tuple(self._listener.getsockname()[:2])

    # ------------------------------------------------------------ accepting
    def _accept_loop(self):
        pause = 0.0
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                pause = self._accept_failed(e, pause)
                continue
            pause = 0.0
            with self._lock:
                self._quiet.discard("accept")
            self._admit(sock)

    def _accept_failed(self, e: OSError, pause: float) -> float:
        # the pending connection keeps the listener ready: retrying at once would spin (EMFILE)
        pause = min(_MAX_PAUSE, 2 * pause or _ACCEPT_POLL)
        self._refuse("?", "accept", f"accept: {errno.errorcode.get(e.errno, e.errno)} ({e.strerror or e}); "
                                    f"waiting {pause:g} s", once=True)
        self._stop.wait(pause)
        return pause

    def _admit(self, sock):
        """Serve an accepted socket in a thread of its own, in a pending slot (the oldest pending
        connection makes room if there is none); refused when every thread slot is taken."""
        conn = Conn(sock, self.max_frame, self.timeout, server=True, idle=self.idle, in_flight=self.in_flight)
        with self._lock:        # threads: the authenticated, the pending, and as many closed ones on their way out
            admitted = self._active < self.max_connections + 2 * self.max_pending
            self._active += admitted
            oldest = None
            if admitted:
                if len(self._pending) >= self.max_pending:
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]
                    oldest.evicted = True
                self._pending[conn] = None
                self.connections += 1
                self._live.add(conn)                # here, not in its thread: close() may come first
        if oldest is not None:
            oldest.shut()                           # its thread wakes, counts it and closes it
        if not admitted:
            conn.close()
            self._refuse(conn.peer, "busy", f"busy: {self.max_connections + 2 * self.max_pending} connections "
                                            "open (the cap); the next refusals are counted, not logged, until one "
                                            "closes", once=True)
            return
        try:
            threading.Thread(target=self._serve, args=(conn,), name=f"wire-conn-{self.address[1]}",
                             daemon=True).start()
        except RuntimeError as e:                   # no thread to be had: refused like an excess connection
            self._release(conn)
            conn.close()
            self._refuse(conn.peer, "busy", f"busy: cannot start a thread ({e})", once=True)

    def _welcome(self, conn):
        """Move ``conn``, whose hello checked out, from the pending slots to the authenticated ones."""
        with self._lock:
            self._pending.pop(conn, None)
            if self._stop.is_set():
                raise WireError("closing", "the server is closing")
            if conn.evicted:
                raise WireError("pending", "closed while awaiting its hello, for a newer connection")
            if self._authenticated >= self.max_connections:
                raise WireError("busy", f"{self.max_connections} authenticated connections open (the cap)")
            self._authenticated += 1
            conn.authenticated = True

    def _release(self, conn):
        with self._lock:
            self._live.discard(conn)
            self._active -= 1
            self._pending.pop(conn, None)
            if conn.authenticated:
                self._authenticated -= 1
                self._quiet.discard("busy")         # a slot is free: the next refusal is news

    # ------------------------------------------------------------ serving
    def _serve(self, conn):
        try:
            conn.handshake(self.secret, self.handshake, lambda: self._welcome(conn))
            while self._request(conn):
                pass
        except (WireError, OSError) as e:
            if conn.evicted:
                self._refuse(conn.peer, "pending", f"pending: closed while awaiting its hello, for a newer "
                                                   f"connection ({self.max_pending} may wait at once)")
            elif isinstance(e, WireError) and not self._stop.is_set():
                self._refuse(conn.peer, e.reason, str(e), once=e.reason == "busy")
            # else the peer left, or close() shut the socket or came before its hello: nothing refused
        finally:
            conn.close()
            conn.release()
            with self._lock:
                self._live.discard(conn)
                self._done[0] += conn.bytes_received
                self._done[1] += conn.bytes_sent
            self._release(conn)

    def _request(self, conn) -> bool:
        """Serve one request; False when the connection is to be closed. The request's body counts
        among the bytes in flight until its reply is sent."""
        try:
            kind, fields, arrays = conn.recv()
        except TimeoutError:                        # idle since its last reply: its slot is worth more
            with self._lock:
                self.closed_idle += 1
            return False
        try:
            try:
                frame = conn.encode(*self.handle(conn.peer, kind, fields, arrays))
            except Exception as e:                  # the handler's bug must not stop the server
                self._refuse(conn.peer, "handler", f"handler: {kind!r:.40}: {type(e).__name__}: {e}")
                return False
            conn.write(frame)
            return True
        finally:
            conn.release()

    def _refuse(self, peer: str, reason: str, line: str, once: bool = False):
        if self._stop.is_set():                     # connections cut by close() are not their peers' doing
            return
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            quiet = once and reason in self._quiet
            if once:
                self._quiet.add(reason)
        if not quiet:
            self._say(reason, f"wire: refused {peer}: {line}")

    def _total(self, i: int) -> int:
        with self._lock:
            return self._done[i] + sum(c.bytes_sent if i else c.bytes_received for c in self._live)

    bytes_received = property(lambda self: self._total(0))
    bytes_sent = property(lambda self: self._total(1))

    def start(self) -> "FrameServer":
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._accept_loop, name=f"wire-server-{self.address[1]}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, close the listening socket and every live connection."""
        self._stop.set()
        if self._thread is not None:                # wakes within _ACCEPT_POLL (or a pause after EMFILE)
            self._thread.join()
            self._thread = None
        self._listener.close()
        self.in_flight.close()
        with self._lock:
            live = list(self._live)
        for conn in live:
            conn.close()
        self._say.flush()
