"""The asynchronous mode's parameter server (its workers' side: :mod:`.worker`).

After Deyringer et al., "Parallelization of Neural Network Training for NLP with Hogwild!"
(lock-free updates), and Tai and Xu (2014), "Distributed Training of Neural Network Language
Models" (a parameter server with AdaGrad, re-sharding and recovery). The server holds the master
parameters; each worker (one long-running Spark task per partition) trains ``train.push_every``
local steps (a **window**), pushes its change in the exchange blocks of
:mod:`rnnlm.exchange.plan` (the same groups and codecs as the synchronous all-reduce) and
continues from the parameters the reply carries (its pull). There is no barrier between workers.

Updates (``[server]``):

``update = "add"``      the change is added to the parameters
``update = "adagrad"``  per parameter, ``acc += change^2`` and the parameters move by
                        ``lr * change / (sqrt(acc) + eps)`` (Tai and Xu 2014: plain SGD diverged
                        with several workers, AdaGrad's per-parameter rates did not)
``lock = false``        Hogwild!: pushes are applied concurrently, without a lock on the
                        parameters; a pull may see a push half applied
``lock = true``         one push or pull at a time touches the parameters
``staleness = divide``  a change computed on parameters k versions old is divided by
                        1 + k (DynSGD)

**Shards and at-most-once.** A partition's data is cut into windows (ranges of
``push_every`` steps); a window is the unit of work the server accounts for
(Tai and Xu's shard). The server records, per partition, the next window it will
apply; a push for any other window (a retried task repeating work its previous
attempt already pushed) is refused, so no window's update is applied twice.
Each task attempt announces itself (``hello``) and gets a **lease**; a newer
lease supersedes an older one, whose pushes are then refused (a zombie attempt
cannot apply anything). A retried task resumes at the first window not applied.
Heartbeats (a second connection, every ``heartbeat_s``) tell the server which
window a worker trains; a worker silent for ``timeout_s`` is reported lost. They prove
life, not progress: one heard from that has had no window accepted for ``stall_factor``
times the slowest window of the run (and ``timeout_s``) is reported **stuck**, and its
next heartbeat's answer ends it (a Spark task then fails and is retried).

A superseded attempt does not fail (Spark would count that against ``spark.task.maxFailures``
although nothing went wrong, as when a speculative copy takes over): it **stands by**, asking
every ``heartbeat_s`` (``standby``), until the server answers ``finished`` (every window of the
partition applied: the task ends well; if the newer attempt ended first, Spark has killed this
one already) or ``resume`` (the newer attempt is gone: it said so with ``leave`` as it ended, or
was reported lost), when it says hello again and trains on from the first window not applied.
So a partition always has an attempt that can finish it, even where Spark starts no other while
one still runs.

Bookkeeping (which window was applied, the version) is under a small lock even
in Hogwild! mode: only the parameter arithmetic runs unlocked.
"""
from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..exchange.blocks import Block
from ..exchange.frames import STAT_MAX, Malformed, block_from_wire, is_int, printable, real
from .wire import LogLimit

_NO_LOCK = contextlib.nullcontext()


class Refused(Malformed):
    """A request the protocol refuses (bad pid, malformed blocks); the message is one line."""


class Stalled(RuntimeError):
    """The driver waited ``server.timeout_s`` for a push being applied (an apply that hangs); one line."""


def _count(fields: dict, key: str) -> int:
    v = fields.get(key, 0)
    if not (is_int(v) and 0 <= v <= STAT_MAX):
        raise Refused(f"{key} must be an integer in [0, 2**53]")
    return v


def _amount(fields: dict, key: str) -> float:
    x = real(fields.get(key, 0.0))
    if x is None or not 0 <= x <= STAT_MAX:
        raise Refused(f"{key} must be a finite number in [0, 2**53]")
    return x


@dataclass(frozen=True)
class PushStats:
    """What a pushed window trained, checked (the driver's metrics add these up)."""

    tokens: int
    loss_sum: float
    steps: int

    @classmethod
    def of(cls, fields: dict) -> "PushStats":
        """The statistics of a push's fields; :class:`Refused` for any that is not a plain number in range."""
        _amount(fields, "compute_s")            # sent, not counted: checked all the same
        return cls(_count(fields, "tokens"), _amount(fields, "loss_sum"), _count(fields, "steps"))


def blocks_from_wire(layout, fields: dict, arrays: dict, f32=np.float32) -> list:
    """Check a pushed change against ``layout`` and decode it: ``[(slot, ids or None, values (n, C))]``;
    ``f32``: the dtype of an ``f32`` block's values (the model's).

    Raises :class:`Refused` for anything that does not describe exactly this
    model's slots in a known codec, with row ids sorted, unique and in range, every
    array in the shape its codec gives those rows, and finite values
    (:func:`rnnlm.exchange.frames.block_from_wire`). Shapes are checked before anything is
    decoded, so decoding allocates at most the slot's size.
    """
    meta = fields.get("blocks")
    if not isinstance(meta, dict) or set(meta) != set(layout.slots):
        raise Refused("push does not name exactly the model's parameter slots")
    expected = {f"{s}.{k}" for s, m in meta.items() for k in ("data", "ids", "scale")}
    if not set(arrays) <= expected:
        raise Refused(f"push carries unknown arrays: {sorted(set(arrays) - expected)[:3]}")
    try:
        blocks = [(slot, block_from_wire(slot.name, slot.shape, meta[slot.name], arrays, f32)) for slot in layout]
    except Malformed as e:
        raise Refused(str(e)) from None
    return [(slot, b.ids, _decoded(slot, b)) for slot, b in blocks]


def _decoded(slot, b: Block):
    n, C = b.rows, slot.size // slot.shape[0]
    try:        # the shapes were checked: this only guards against a codec's own surprises
        values = b.decode().reshape(n, C)          # (n, C)
    except (ValueError, IndexError, TypeError) as e:
        raise Refused(f"{slot.name}: payload does not decode to {n} rows of {C}: {e}") from None
    if not np.isfinite(values).all():
        raise Refused(f"{slot.name}: non-finite values")
    return values


class ParameterServer:
    """The master parameters and the protocol's state; :meth:`handle` serves one request.

    Parameters
    ----------
    layout : Layout
    params : float array (P,)
        Initial parameters (copied).
    sv : ServerConfig
    windows : int
        Windows per partition in the whole run.
    partitions : int
    state : dict, optional
        From :meth:`snapshot` (a checkpoint): resumes the parameters, AdaGrad's
        accumulator, the version and each partition's progress.
    log : callable
    """

    def __init__(self, layout, params, sv, windows: int, partitions: int, state: dict | None = None, log=print):
        self.layout, self.sv, self.windows, self.P, self.log = layout, sv, windows, partitions, log
        state = state or {}
        self.params = np.array(params, copy=True)
        self.acc = np.array(state["acc"]) if "acc" in state else (
            np.zeros_like(self.params) if sv.update == "adagrad" else None)
        self.version = int(state.get("version", 0))
        self.done = list(state.get("done", [0] * partitions))     # per partition: the next window to apply
        self.started = list(self.done)                            # per partition: window last reported training
        self.lease = [0] * partitions
        self.last_seen = [None] * partitions
        self.lost = [False] * partitions                          # the newest attempt is gone (silent, or left)
        self.resuming = [None] * partitions                       # when a standing-by attempt was told to resume
        # progress, not only life: when the newest attempt last said hello or had a window accepted, the lease
        # found stuck (heard from, yet no window for stall_factor x the slowest; 0: none), the slowest window,
        # and the partitions whose stuck attempt was told so and has had no successor say hello since
        self.progress_at: list = [None] * partitions
        self.stuck_lease = [0] * partitions
        self.slowest_s = 0.0
        self.told_stuck: set = set()
        self.totals = collections.Counter(state.get("totals", {}))
        self.window = collections.Counter()                       # since the last drain()
        self.staleness = collections.Counter()
        self._book = threading.Condition()                        # bookkeeping, never the parameter arithmetic
        self._in_flight, self._frozen = 0, False                  # pushes reserved but not yet applied
        self.applied = self.version                               # pushes whose change has landed
        self.counted = self.version                               # pushes reported by drain()
        self._claims: set = set()                                 # claim numbers of pushes not yet landed
        # per partition: (the version its copy was last given, the pushes landed in that copy): Hogwild! lands
        # pushes out of order, so a copy can hold pushes claimed above its version (its own, say)
        self._holds: dict = {}
        # per slot and row: the claim number of the last push that changed it, so a pull sends only
        # the rows changed since the worker's previous pull (it patches the copy it keeps)
        self.stamps = {slot.name: np.zeros(slot.shape[0], np.int64) for slot in layout}
        self.failures: list = []                                  # a worker's or an apply's error: the run stops
        self._params_lock = threading.Lock() if sv.lock else None
        # lock-free: a row block's gather-change-scatter holds its slot (NumPy has no in-place scatter-add at speed)
        self._rows_locks = {} if sv.lock else {slot.name: threading.Lock() for slot in layout}
        self._say = LogLimit(log, "parameter server")             # refusals: a flood of them is not logged

    def flush_log(self) -> None:
        """Say how many refusal lines the log held back (at the end of a run: a flood's count is not lost)."""
        self._say.flush()

    # ------------------------------------------------------------ protocol
    def handle(self, peer: str, kind: str, fields: dict, arrays: dict) -> tuple:
        """Serve one request (for :class:`rnnlm.server.wire.FrameServer`): ``(kind, fields, arrays)``.

        A request the protocol refuses is answered ``("refused", {"reason": ...})``, counted
        (``refused_protocol``) and logged (at most five lines a minute: :class:`~rnnlm.server.wire.LogLimit`);
        nothing of it is applied.
        """
        try:
            return self._serve(kind, fields, arrays)
        except Refused as e:
            with self._book:
                self.totals["refused_protocol"] += 1
            self._say("protocol", f"parameter server: refused {kind!r:.40} from {peer}: {e}")
            return "refused", {"reason": str(e)}, {}

    def _serve(self, kind, fields, arrays):
        pid = fields.get("pid")
        if not is_int(pid) or not 0 <= pid < self.P:
            raise Refused(f"request {kind!r:.40} names no partition of this run (pid {pid!r:.40})")
        if kind == "hello":
            return self._hello(pid)
        lease = fields.get("lease")
        if not is_int(lease):
            raise Refused(f"request {kind!r:.40} needs a lease (an integer from hello), not {lease!r:.40}")
        with self._book:
            if self.lease[pid] == 0:         # lease 0 would match a partition that never said hello
                raise Refused(f"partition {pid} has not said hello")
            if not 0 < lease <= self.lease[pid]:
                raise Refused(f"lease {lease!r:.40} of partition {pid} was never issued")
            if kind == "heartbeat" and lease == self.stuck_lease[pid]:   # even once superseded: it must end
                self.told_stuck.add(pid)
                return "stuck", {"reason": "no window pushed for longer than server.stall_factor allows, though "
                                           "heartbeats arrive"}, {}
            if lease != self.lease[pid]:     # nor does a superseded attempt keep the partition's worker seen
                return self._standby(pid) if kind == "standby" else self._superseded()
            self.last_seen[pid] = time.monotonic()
        if kind == "heartbeat":
            return self._heartbeat(pid, fields)
        if kind == "push":
            return self._push(pid, lease, fields, arrays)
        if kind == "failed":
            return self._failed(pid, fields)
        if kind == "leave":
            return self._leave(pid)
        if kind == "standby":
            raise Refused(f"standby: lease {lease} is partition {pid}'s newest, not a superseded one")
        raise Refused(f"unknown request {kind!r:.40}")

    def _superseded(self):
        # under self._book
        self.totals["refused_superseded"] += 1
        return "stop", {"reason": "superseded by a newer attempt of this partition"}, {}

    def _standby(self, pid):
        """A superseded attempt's question (under self._book): ``finished`` when every window of the partition
        is applied, ``resume`` when the newest attempt is gone (it left, or was reported lost) to one attempt only
        (two would both say hello, and the first train a window for nothing), else ``wait``."""
        if self.done[pid] >= self.windows:
            return "finished", {}, {}
        now, told = time.monotonic(), self.resuming[pid]
        if not self.lost[pid] or (told is not None and now - told <= self.sv.timeout_s):
            return "wait", {}, {}       # one attempt resumes (another once it has not said hello for timeout_s)
        self.resuming[pid] = now
        return "resume", {}, {}

    def _leave(self, pid):
        """The newest attempt ends (a task ending, well or not): one standing by resumes at once rather than after
        ``timeout_s`` of silence; counted nowhere (a worker that says it goes is not lost)."""
        with self._book:
            self.lost[pid] = True
        return "ok", {}, {}

    def _hello(self, pid):
        with self._book:
            self.lease[pid] += 1
            if self.lease[pid] > 1:
                self.totals["attempts_retried"] += 1
                # the window the previous attempt was training when it stopped is trained again
                self.totals["windows_redone"] += max(0, self.started[pid] - self.done[pid] + 1)
            self.started[pid] = self.done[pid]
            self.last_seen[pid], self.lost[pid], self.resuming[pid] = time.monotonic(), False, None
            self.progress_at[pid] = self.last_seen[pid]
            self.told_stuck.discard(pid)
            lease, window = self.lease[pid], self.done[pid]
        with self._params_lock or _NO_LOCK:       # Hogwild!: possibly mid-update (resent by the next pull)
            with self._book:
                version = self._mark()
                self._holds[pid] = (version, self.applied)
            params = self.params.copy()
        return "hello", {"lease": lease, "window": window, "windows": self.windows, "version": version}, \
            {"params": params}

    def _heartbeat(self, pid, fields):
        w = fields.get("window")
        if w is None:
            return "ok", {}, {}
        if not is_int(w) or not 0 <= w <= self.windows:     # windows: an attempt that found nothing left to do
            raise Refused(f"heartbeat: window {w!r:.40} is not in [0, {self.windows}]")
        with self._book:
            self.started[pid] = max(self.started[pid], w)
        return "ok", {}, {}

    def _failed(self, pid, fields):
        error = fields.get("error")
        if not isinstance(error, str) or not 0 < len(error) <= 2000 or not printable(error):
            raise Refused("failed: the error must be a string of 1 to 2000 printable characters on one line")
        with self._book:
            self.failures.append(f"partition {pid}: {error[:300]}")
            self._book.notify_all()
        return "ok", {}, {}

    def _mark(self) -> int:
        """The watermark: the largest n such that every push claimed as 1..n has landed (Hogwild! lands
        out of order). Under self._book."""
        return min(self._claims) - 1 if self._claims else self.version

    def _pull(self, pid: int, lease: int, since: int) -> tuple:
        """(watermark, fields, arrays): the rows changed by pushes claimed after ``since``.

        The worker patches its copy with them; rows a push still in flight changes carry a
        stamp above the watermark, so they are sent again by the next pull. The copy then holds every
        push landed by now, some perhaps claimed above the watermark: its next push's staleness counts
        from them (:meth:`_behind`).
        """
        meta, arrays = {}, {}
        with self._params_lock or _NO_LOCK:     # locked: whole pushes only; lock-free (Hogwild!): rows as they are
            with self._book:
                mark = self._mark()
                if lease == self.lease[pid]:        # a superseded attempt's copy is not the partition's
                    self._holds[pid] = (mark, self.applied)
                changed = {slot.name: np.flatnonzero(self.stamps[slot.name] > since) for slot in self.layout}
            for slot in self.layout:
                ids = changed[slot.name]
                if ids.size == 0:
                    continue
                view = self.params[slot.offset:slot.end].reshape(slot.shape[0], -1)       # (R, C)
                if ids.size == slot.shape[0]:
                    meta[slot.name] = "all"
                    arrays[f"{slot.name}.rows"] = view.copy()
                else:
                    meta[slot.name] = "some"
                    arrays[f"{slot.name}.ids"] = ids.astype(np.int32)
                    arrays[f"{slot.name}.rows"] = view[ids]
        return mark, {"pulled": meta}, arrays

    def _push(self, pid, lease, fields, arrays):
        w, base = self._push_position(fields)
        stats = PushStats.of(fields)
        decoded = blocks_from_wire(self.layout, fields, arrays, self.params.dtype)    # before anything is reserved
        self._check_squares(decoded)
        with self._book:
            self._book.wait_for(lambda: not self._frozen)
            if lease != self.lease[pid]:     # a newer attempt said hello while this push was decoded
                return self._superseded()
            applied = w == self.done[pid]
            if not applied:
                self.totals["refused_duplicate" if w < self.done[pid] else "refused_out_of_order"] += 1
            else:
                now = time.monotonic()
                self.slowest_s = max(self.slowest_s, now - self.progress_at[pid])
                self.progress_at[pid] = now
                if self.stuck_lease[pid] == lease:   # it was slow, not stuck: unless a standby was told to resume,
                    self.stuck_lease[pid] = 0        # it is the partition's attempt again
                    self.lost[pid] = self.resuming[pid] is not None
                self.done[pid] += 1          # reserved: no other push of this window can be applied
                self.started[pid] = max(self.started[pid], min(self.done[pid], self.windows - 1))   # the next
                self.version += 1
                claim = self.version
                self._claims.add(claim)
                self._in_flight += 1
        if applied:
            self._land(pid, w, base, decoded, claim, stats)
        version, pulled, arrays = self._pull(pid, lease, base)
        with self._book:
            self.window["pulls"] += 1
        return "pushed", dict(pulled, applied=applied, version=version, next=self.done[pid]), arrays

    def _check_squares(self, decoded) -> None:
        """AdaGrad sums each value's square: a value past the square root of the type's largest number
        (1.8e19 in float32) makes the sum infinite by itself, the parameter stops moving (its rate 1 / inf)
        and every later checkpoint is one the loader refuses. Such a push is refused before it is reserved.
        (Values each below it can still overflow the running sum over many pushes: not checked here.)"""
        if self.sv.update != "adagrad":
            return
        most = math.sqrt(float(np.finfo(self.params.dtype).max))
        for slot, _, values in decoded:
            largest = float(np.abs(values).max()) if values.size else 0.0
            if largest >= most:
                raise Refused(f"{slot.name}: a value of {largest:.3g} squares past "
                              f"{self.params.dtype.name}'s largest number (AdaGrad sums squares)")

    def _push_position(self, fields) -> tuple:
        """(window, version) of a push: a window of this run, a version this server has issued."""
        w, base = fields.get("window"), fields.get("version")
        if not is_int(w) or not is_int(base):
            raise Refused("push needs an integer window and version")
        if not 0 <= w < self.windows:
            raise Refused(f"window {w!r:.40} is not one of this run's {self.windows} windows")
        if not 0 <= base <= self.version:
            raise Refused(f"version {base!r:.40} is not one this server has issued (0..{self.version})")
        return w, base

    def _land(self, pid, w, base, decoded, claim: int, stats: PushStats):
        """Apply a reserved push; its staleness is counted against the pushes applied by then."""
        stale = 0
        with self._params_lock or _NO_LOCK:     # locked: a pull sees the push with its bookkeeping, or neither
            try:
                with self._book:
                    stale = self._behind(pid, base)
                self.apply(decoded, 1.0 / (1 + stale) if self.sv.staleness == "divide" else 1.0)
            except Exception as e:
                with self._book:
                    self.failures.append(f"server: applying partition {pid}'s window {w} failed: {e}")
                raise
            finally:
                self._landed(claim, decoded, stale, stats)

    def _behind(self, pid: int, base: int) -> int:
        """The pushes landed since the copy a push of ``pid`` computed on, given as ``base``: the copy held
        those landed when it was given (the watermark alone would count pushes landed above it, its own
        previous push among them, as missing from it). Under self._book."""
        given, held = self._holds.get(pid, (None, base))
        return max(0, self.applied - (held if given == base else base))

    def _landed(self, claim: int, decoded, stale: int, stats: PushStats):
        """Mark a push landed and count its statistics in one critical section, so a snapshot (which waits
        for no push in flight) drains exactly the pushes its parameters hold. The push is released first:
        whatever follows, a snapshot never waits for it."""
        with self._book:
            self._in_flight -= 1
            self._claims.discard(claim)
            self.applied += 1
            self._book.notify_all()
            for slot, ids, _ in decoded:
                st = self.stamps[slot.name]
                if ids is None:
                    np.maximum(st, claim, out=st)
                else:
                    st[ids] = np.maximum(st[ids], claim)
            self.staleness[stale] += 1
            self.window["tokens"] += stats.tokens
            self.window["loss_sum"] += stats.loss_sum
            self.window["steps"] += stats.steps
            self.window["pushes"] += 1

    def apply(self, decoded, scale: float):
        """The update rule (``server.update``: add, or AdaGrad's step) on the parameters, for a push's
        decoded rows (:func:`blocks_from_wire`) weighted by ``scale``; a reserved push lands through it,
        under the parameters' lock where ``server.lock`` asks for one.

        Lock-free (Hogwild!), a dense change is added in place, so two pushes landing at the same instant
        can overwrite each other's value of an element (the occasional overwrites Hogwild! allows); a row
        block is gathered, changed and scattered back under its slot's lock: unlocked, a push landing on
        the same rows meanwhile was overwritten whole.

        Raises FloatingPointError where the sum leaves the parameters' range (finite pushes can add up
        past it): the push's failure stops the run before a checkpoint holds them."""
        for slot, ids, values in decoded:
            R = slot.shape[0]
            view = self.params[slot.offset:slot.end].reshape(R, -1)             # (R, C)
            acc = self.acc[slot.offset:slot.end].reshape(R, -1) if self.sv.update == "adagrad" else None
            values = values.astype(view.dtype, copy=False)    # a codec's float32, in a float64 model's type
            with np.errstate(over="raise", invalid="raise"):
                try:
                    if ids is None:
                        self._step(view, acc, values, scale)
                        continue
                    with self._rows_locks.get(slot.name, _NO_LOCK):
                        rows, rows_acc = view[ids], None if acc is None else acc[ids]       # (n, C) copies
                        self._step(rows, rows_acc, values, scale)
                        view[ids] = rows
                        if acc is not None:
                            acc[ids] = rows_acc
                except FloatingPointError as e:
                    raise FloatingPointError(f"{slot.name}: the server's parameters left {view.dtype.name}'s "
                                             f"range ({e}): the run diverged") from None

    def _step(self, view, acc, values, scale: float) -> None:
        """The update rule, in place on ``view`` (and AdaGrad's sums of squares ``acc``)."""
        if acc is None:
            view += values * scale
            return
        acc += values * values
        view += (self.sv.lr * scale) * values / (np.sqrt(acc) + self.sv.eps)

    # -------------------------------------------------------------- driver
    def wait(self, pushes: int, timeout: float) -> int:
        """Block until ``pushes`` pushes were applied since the last :meth:`drain` (or ``timeout``)."""
        with self._book:
            self._book.wait_for(lambda: self.window["pushes"] >= pushes, timeout)
            return self.window["pushes"]

    def drain(self) -> dict:
        """The counters since the last drain (pushes, pulls, tokens, loss_sum, steps, staleness) and
        ``syncs``, the pushes counted by all drains so far."""
        with self._book:
            return self._drain()

    def _drain(self) -> dict:
        # under self._book
        self.counted += self.window["pushes"]
        out = dict(self.window, staleness=dict(sorted(self.staleness.items())), syncs=self.counted)
        self.window.clear()
        self.staleness.clear()
        return out

    def check_workers(self, now: float | None = None) -> list:
        """Partitions whose worker went silent for ``timeout_s``, or whose heartbeats arrive but which has had
        no window accepted for ``stall_factor`` times the slowest window seen (at least ``timeout_s``): stuck,
        told so by its heartbeats' answers (it ends, and Spark retries its task). A silent worker is reported
        once until an attempt says hello; a stuck attempt once (again only if a window of its own came since)."""
        now = time.monotonic() if now is None else now
        newly = []
        with self._book:
            stall = max(self.sv.timeout_s, self.sv.stall_factor * self.slowest_s)
            for pid in range(self.P):
                seen = self.last_seen[pid]
                if seen is None or self.done[pid] >= self.windows:
                    continue
                silent = now - seen > self.sv.timeout_s
                if silent and not self.lost[pid]:
                    self.lost[pid] = True
                    self.totals["workers_lost"] += 1
                    newly.append((pid, f"worker silent for {self.sv.timeout_s:g} s, reported lost"))
                elif (not silent and self.stuck_lease[pid] != self.lease[pid] and self.sv.stall_factor
                      and self.slowest_s and now - self.progress_at[pid] > stall):
                    # heard from (again, perhaps, after a silence that reported it lost), yet no window
                    self.stuck_lease[pid], self.lost[pid] = self.lease[pid], True
                    self.totals["workers_stuck"] += 1
                    newly.append((pid, f"worker heard from but no window pushed for {now - self.progress_at[pid]:.3g} "
                                       f"s, past {stall:.3g} s (server.stall_factor {self.sv.stall_factor:g} x the "
                                       f"slowest window, {self.slowest_s:.3g} s; at least server.timeout_s), reported "
                                       "stuck and told to end"))
        for pid, what in newly:
            self.log(f"partition {pid}: {what}; a retried task resumes at window {self.done[pid]}")
        return [pid for pid, _ in newly]

    def snapshot(self, drain: bool = False) -> dict:
        """A consistent copy of the state a checkpoint keeps (parameters, accumulator, progress);
        with ``drain``, also :meth:`drain`'s counters (``"drained"``), taken at the same instant.
        :class:`Stalled` if a push being applied has not landed within ``server.timeout_s``."""
        with self._book:
            # every reserved push must land, so the copy holds exactly the windows ``done`` names
            # (Hogwild! applies outside this lock); frozen, no new push reserves meanwhile (no starvation)
            self._frozen = True
            try:
                if not self._book.wait_for(lambda: self._in_flight == 0, self.sv.timeout_s):
                    n = self._in_flight
                    raise Stalled(f"parameter server: {n} push{'es' if n > 1 else ''} still being applied after "
                                  f"{self.sv.timeout_s:g} s (server.timeout_s)")
                params = self.params.copy()
                acc = None if self.acc is None else self.acc.copy()
                return {"params": params, "acc": acc, "version": self.version, "done": list(self.done),
                        "totals": dict(self.totals), "drained": self._drain() if drain else None}
            finally:
                self._frozen = False
                self._book.notify_all()


def server_idle_s(sv) -> float:
    """How long the server keeps a worker's connection idle between requests: twice the
    ``timeout_s`` after which :class:`~rnnlm.server.worker.WorkerClient` replaces an idle connection itself."""
    return 2 * sv.timeout_s


def server_connections(partitions: int) -> int:
    """The server's cap on authenticated connections (and, apart, on those awaiting their hello):
    each worker holds two (requests, heartbeats), a retried attempt two more while its
    predecessor's are closing, and a few spare."""
    return 4 * partitions + 4


def max_push_bytes(layout, itemsize: int) -> int:
    """The largest frame a worker's push can be: the whole model (``itemsize`` bytes a value) with int32
    row ids and a float32 scale pair a row, and 64 KiB for its header."""
    return sum(itemsize * slot.size + 12 * slot.shape[0] for slot in layout) + (1 << 16)


def server_in_flight(layout, itemsize: int, partitions: int, max_frame: int) -> int:
    """The server's cap on the bytes of pushes being read or applied at once: one push of every worker
    and one more (a retried attempt's predecessor), each at most :func:`max_push_bytes` (never above
    ``max_frame``)."""
    return (partitions + 1) * min(max_frame, max_push_bytes(layout, itemsize))
