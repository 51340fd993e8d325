"""A partition's carryover when it cannot pass through the driver (what it holds: error feedback's
residual, ``train.eager``'s last change; under ``train.overlap`` its carry as well), kept in Spark as
an RDD beside the corpus.

One ``(pid, tokens, starts, held, carry)`` element per partition: round r's tasks read element r-1
and emit element r, persisted on their executor. What a partition holds is a file on the
executor's disk (:mod:`rnnlm.spark.filestore`), replayed from the lineage's seed when lost; the
contributions come back through each round's accumulator (:class:`Contributions`), each
partition's once, or through the driver's channel (``train.results = "direct"``). Checkpoints and
:data:`MAX_LINEAGE` cut the lineage; the next starts from each partition's file where its executor
has it, else from the driver's copy (:mod:`rnnlm.spark.seeds`). Owned by :class:`rnnlm.spark.allreduce.AllReduce`;
docs/design.md ("Rounds whose carryover stays in Spark") says why, and what it costs.
"""
from __future__ import annotations

import threading
import uuid

from pyspark import StorageLevel
from pyspark.accumulators import AccumulatorParam

from ..exchange.aggregate import Aggregate, in_order
from . import filestore
from .channel import ChannelError
from .filestore import Stored
from .seeds import Seed, SeedServer, unreachable, unseeded
from .session import bind_host, release, run_in_jvm

MAX_LINEAGE = 48           # rounds; one cached RDD each (Spark's recursive task serialisation overflowed at 135)

_LOCK = threading.Lock()   # the driver's accumulator server thread adds while a round may be taken


class Contributions(AccumulatorParam):
    """A round's accumulator: the partitions' contributions by partition, each partition's once (a
    duplicate, from a partition computed twice, is the same numbers and is dropped), merged in
    partition order once the round has them all (so the float64 sums do not depend on the order the
    tasks finished in); closed once the round has read it, so that what arrives later changes nothing.

    The driver keeps them here (``leaves``), never in the accumulator's value: PySpark assigns what
    :meth:`addInPlace` returns to that value after the call, outside any lock, so a value holding them
    was put back by an update racing :meth:`take`, and PySpark keeps every accumulator for the life of
    the context."""

    def __init__(self):
        self.closed, self.leaves = False, {}

    def __getstate__(self):         # to the executors: none of the round's blocks
        return {"closed": self.closed, "leaves": {}}

    def zero(self, value):
        return {}

    def addInPlace(self, a: dict, b) -> dict:
        if not isinstance(b, dict):         # on the executor: a task's contribution, sent as {pid: it}
            a.setdefault(next(iter(b.local)), b)
            return a
        with _LOCK:                         # on the driver: a task's update, kept until the round is read
            if not self.closed:
                for pid, leaf in b.items():
                    self.leaves.setdefault(pid, leaf)
        return {}

    @staticmethod
    def take(acc) -> dict:
        """pid -> contribution; the accumulator closed, and left holding none of them."""
        param = acc.accum_param
        with _LOCK:
            param.closed = True
            leaves, param.leaves = param.leaves, {}
        return leaves


def _is_contribution(x) -> bool:
    return isinstance(x, Aggregate)


def recomputed(sc, rdd, task, missing: set) -> list:
    """The contributions of the ``missing`` partitions of ``rdd`` (partition i holds pid i), ``task``
    run again on them alone through Spark (a round whose contribution never arrived)."""
    def leaves(it):
        return filter(_is_contribution, task(it))
    return [a for a in sc.runJob(rdd, leaves, sorted(missing)) if set(a.local) <= missing]


def _replayed(item, ref: Stored, seed, base: int, chain: tuple):
    """What ``ref`` names the partition held, recomputed: the partition's rounds since the lineage's seed
    (``chain``: their task factories, called with no sink) run again in this process, the same
    numbers (each round is a pure function of its broadcasts and its input element)."""
    pid, tokens, starts = item
    element = seed((pid, tokens, starts))
    for make_task in chain[:ref.seq - base]:
        out = list(make_task(None)(iter([element])))
        errors = [e for x in out if _is_contribution(x) for e in x.errors()]
        if errors:      # a round that cannot be redone here (no usable device): never stale arrays
            raise RuntimeError(f"recomputing what a partition held: {errors[0]}")
        element = out[-1]
    return element[3]


def _resolved(pid: int, tokens, starts, held, seed, base: int, chain: tuple):
    """What a partition holds: ``held`` itself, or the arrays its :class:`Stored` names, read back from
    this host's files or replayed."""
    if not isinstance(held, Stored):
        return held
    found = filestore.load(held, pid)
    return found if found is not None else _replayed((pid, tokens, starts), held, seed, base, chain)


def _resolve(it, seed, base: int, chain: tuple):
    """Elements with what they hold resolved (:func:`_resolved`)."""
    for pid, tokens, starts, held, carry in it:
        yield pid, tokens, starts, _resolved(pid, tokens, starts, held, seed, base, chain), carry


def _through_files(task, run: str, seq: int, seed, base: int, chain: tuple):
    """Round ``seq``'s ``task`` with what partitions hold kept in files: read before, written after."""
    def go(it):
        for x in task(_resolve(it, seed, base, chain)):
            if not _is_contribution(x) and x[3]:
                pid, tokens, starts, held, carry = x
                x = pid, tokens, starts, filestore.save(run, seq, pid, held), carry
            yield x
    return go


def _held(seed, base: int, chain: tuple):
    def go(it):
        for pid, tokens, starts, ref, _ in it:
            held = _resolved(pid, tokens, starts, ref, seed, base, chain)
            if held:
                yield pid, (held, ref if isinstance(ref, Stored) else None)
    return go


class Collected(dict):
    """pid -> what it holds ({name: array}), as :meth:`Lineage.collect` read it, and ``files``: pid ->
    the file (:class:`Stored`) each partition's was read from on its executor, which a lineage
    started from these (:meth:`Lineage.truncate`) reads before asking the driver."""

    def __init__(self, pairs: list):
        super().__init__((pid, held) for pid, (held, _) in pairs)
        self.files = {pid: ref for pid, (_, ref) in pairs if ref is not None}


class Lineage:
    """Owns the RDD of the partitions' carryover, its lineage, the broadcasts that lineage reads and
    each round's accumulator.

    Parameters
    ----------
    sc : SparkContext
    data : RDD of (pid, tokens, starts), one element per partition (persisted)
    held : dict of int -> dict of str -> array, optional
        What each partition holds, from a checkpoint (None: nothing yet).
    carries : dict of int -> Carry, optional
        Each partition's carry into the next round (``train.overlap``; None: carries
        travel through the driver).
    log : callable
        Where the seed server's refusals go.
    """

    def __init__(self, sc, data, held: dict | None = None, carries: dict | None = None, log=print):
        self.sc, self.data, self.log = sc, data, log
        self.partitions = data.getNumPartitions()
        self._kept, self._outs = [], []     # broadcasts the lineage reads; outputs defined and still cached
        self._seeds = []                    # per-partition broadcasts the next round measures
        self._server, self._closed = None, (0, 0)  # the seed's server; the bytes of those closed before it
        self._taken = (0, 0)                # the bytes served that rounds have counted (take_served)
        self._fetch = None                  # whether executors fetch seeds from the driver (probed when first due)
        self._unreached = 0                 # probes that found an executor unable to reach the driver
        self.in_flight = 0                  # jobs submitted and not finished
        self.key = uuid.uuid4().hex         # names the files of what this run's partitions hold (filestore)
        self.seq = 0                        # rounds defined, over every lineage
        self._host = bind_host("", sc.master, sc.getConf().get("spark.driver.host"))
        self._seed(held or {}, carries or {})

    def _seed(self, held: dict, carries: dict):
        """Start a lineage from ``held`` (each partition's file first, where :class:`Collected` names
        one, else the driver's copy; where the executors cannot reach the driver, a broadcast per
        partition) and ``carries`` (a broadcast each)."""
        bcs = {pid: self.sc.broadcast(carries[pid]) for pid in sorted(carries)}
        shares = {}
        self._close_server()
        if held and self._fetches():
            self._server = SeedServer(held, self._host, self.log)
            self._from = self._server.seed(getattr(held, "files", {}), bcs)
        elif held:                          # the executors cannot reach the driver: every share to every one
            shares = {pid: self.sc.broadcast(held[pid]) for pid in sorted(held)}
            self._from = Seed.broadcast(held, shares, bcs)
        else:
            self._from = unseeded(bcs)
        self._seeds = [*bcs.values(), *shares.values()]
        self._kept += self._seeds
        self.rdd = self.done = self.data.map(self._from, preservesPartitioning=True)
        self._base, self._chain = self.seq, ()     # the lineage's rounds, replayable

    def _fetches(self) -> bool:
        """Whether the executors reach the driver's seed server: probed the first time it is due, until one
        probe finds they do (kept for the run) or two find one that does not (a firewall: kept too); a
        probe that failed, or found one unreachable once, sends that cut's shares as broadcasts."""
        if self._fetch is None:
            try:
                why = unreachable(self.data, self._host, self.log)
            except Exception as e:          # the probe's job failed (an executor lost): broadcast, probe again later
                self.log(f"warning: probing whether the executors reach the driver failed ({type(e).__name__}); "
                         "what partitions hold goes back to them as broadcasts this time")
                return False
            if why is None:
                self._fetch = True
            else:
                self._unreached += 1
                self._fetch = False if self._unreached >= 2 else None
                self.log(f"warning: the executors cannot reach the driver on a port of its own ({why}); what "
                         "partitions hold goes back to them as a broadcast per partition, which every executor "
                         f"fetches whole, {'after each lineage cut' if self._fetch is False else 'this time'}")
                return False
        return self._fetch

    def _close_server(self):
        if self._server is not None:
            self._closed = self._served()
            self._server.close()
            self._server = None

    def _served(self) -> tuple:
        """(bytes to the executors, bytes from them) every seed server of the run has moved."""
        now = self._server.bytes if self._server is not None else (0, 0)
        return tuple(a + b for a, b in zip(self._closed, now))

    @property
    def depth(self) -> int:
        """Rounds in the current lineage."""
        return len(self._chain)

    def take_seeds(self) -> list:
        """The per-partition broadcasts the lineage was last seeded with (carries; what partitions hold
        where the executors cannot reach the driver), once: the next round counts their bytes."""
        seeds, self._seeds = self._seeds, []
        return seeds

    def take_served(self) -> tuple:
        """(bytes to the executors, bytes from them) that seeds fetched from the driver moved since the
        last call (counted by the round that takes them)."""
        total = self._served()
        out, self._taken = tuple(a - b for a, b in zip(total, self._taken)), total
        return out

    def keep(self, broadcasts) -> None:
        """Broadcasts a round's tasks read: alive until the lineage is next truncated."""
        self._kept += list(broadcasts)

    def submit(self, make_task, run, direct=None):
        """Define one round's output, persisted, and start its job through ``run`` (a callable
        taking a thunk, returning a future of the round's merged :class:`Aggregate`).
        ``make_task(sink)`` is the round's task adding its contribution to ``sink``, the round's
        accumulator (with None: yielding it); every later round of the lineage carries ``make_task``
        to replay this one, so it should pickle small (a :func:`functools.partial`). ``direct``:
        ``(sink, take)`` of the direct result channel (:class:`rnnlm.spark.channel.Channel`) in place
        of the accumulator. The next round can be defined on the output at once. Returns
        ``(output, future)``."""
        acc = self.sc.accumulator({}, Contributions()) if direct is None else None
        src = self.rdd
        self.seq += 1
        key, seq, seed, base, chain = self.key, self.seq, self._from, self._base, self._chain

        def task(sink):
            return _through_files(make_task(sink), key, seq, seed, base, chain)
        out = src.mapPartitions(task(acc if direct is None else direct[0])).persist(StorageLevel.MEMORY_AND_DISK)
        self._outs.append(out)
        self._chain += (make_task,)
        self.rdd = out
        self.in_flight += 1
        partitions = self.partitions

        def recompute(missing: set) -> list:
            # the contributions alone: the files what partitions hold lie in are the cached output's (saved
            # again, a file's new identity would make the next round replay the partition's whole lineage)
            return recomputed(self.sc, src, lambda it: make_task(None)(_resolve(it, seed, base, chain)), missing)

        def go():
            try:
                run_in_jvm(out)        # the round runs and caches its output; no Python reads it
            finally:                   # failed or cancelled too: the partitions that finished added theirs
                leaves = Contributions.take(acc) if direct is None else None
            if direct is not None:
                return direct[1](recompute)
            missing = set(range(partitions)) - set(leaves)
            if missing:                # computed inside another job: recomputed here, the same numbers
                for a in recompute(missing):
                    leaves.setdefault(next(iter(a.local)), a)
                lost = sorted(set(range(partitions)) - set(leaves))
                if lost:                # a mean over fewer partitions is no round's
                    raise ChannelError(f"no contribution from partitions {lost}")
            return in_order(leaves.values())
        return out, run(go)

    def finished(self, out, ok: bool) -> None:
        """Round ``out`` ended (``ok``: its aggregate arrived): the outputs before it are no longer
        read by any job (the next round's reads ``out``) and are released."""
        self.in_flight -= 1
        if not ok:
            return
        self.done = out
        i = self._outs.index(out)
        release(rdds=self._outs[:i])
        del self._outs[:i]

    def collect(self) -> Collected:
        """pid -> what it holds ({name: array}) after the last finished round, one partition at a time
        (for a checkpoint), and the files each was read from."""
        read = _held(self._from, self._base, self._chain)
        return Collected(list(self.done.mapPartitions(read).toLocalIterator()))

    def truncate(self, held: dict, carries: dict | None = None) -> bool:
        """Restart the lineage from ``held`` (what :meth:`collect` returned and a checkpoint holds: its
        partitions read their files first) and ``carries``; only when no job is in flight (returns
        whether it did)."""
        if self.in_flight:
            return False
        old, outs = self._kept, self._outs
        self._kept, self._outs = [], []
        try:
            self._seed(held, carries or {})
        finally:                # a seed that cannot be made (no file descriptor left) stops the run: not these too
            release(old, outs)
        return True

    def cut_due(self, to_checkpoint: int | None = None) -> bool:
        """Whether the lineage, :data:`MAX_LINEAGE` rounds deep, is to be cut now: not when a checkpoint,
        which cuts it anyway, comes ``to_checkpoint`` rounds later at a depth at most half as much again
        (a cut costs what partitions hold, to the driver and back)."""
        if self.depth < MAX_LINEAGE:
            return False
        return to_checkpoint is None or self.depth + to_checkpoint > MAX_LINEAGE + MAX_LINEAGE // 2

    def trim(self, carries: dict | None = None, to_checkpoint: int | None = None) -> int:
        """Truncate the lineage when :meth:`cut_due` and no job is in flight; return the bytes collected."""
        if not self.cut_due(to_checkpoint) or self.in_flight:
            return 0
        held = self.collect()
        self.truncate(held, carries)
        return held_bytes(held)

    def close(self, blocking: bool) -> None:
        """Release every output and broadcast held (``blocking``: see :func:`rnnlm.spark.session.release`)
        and remove the files of what partitions hold."""
        release(self._kept, self._outs, blocking)
        self._kept, self._outs = [], []
        self._close_server()
        try:        # on the executors that hold the corpus partitions, where the rounds ran
            self.data.foreachPartition(filestore.remover(self.key))
        except Exception:       # a stopped context: its directories go with it
            pass


def held_bytes(held: dict | None) -> int:
    """The bytes of what :meth:`Lineage.collect` moved to the driver (the arrays' own, as a round's
    contributions are counted)."""
    return sum(a.nbytes for arrays in (held or {}).values() for a in arrays.values())
