"""The Spark side of the synchronous round, owned by one class.

:class:`AllReduce` takes the driver's parameters to the merged aggregate: it defines a round (its
broadcasts and task), submits it, waits for it, hands back what a checkpoint holds, and closes what
it made. It holds the broadcasts (:mod:`rnnlm.spark.broadcasts`), the protocol's state
(:class:`SyncState`), the results path (``treeAggregate``, the direct channel of
:mod:`rnnlm.spark.channel`, or the lineage of :mod:`rnnlm.spark.lineage`) and, under
``train.overlap``, the next round's job, defined a round ahead. The rules of the round are
:class:`rnnlm.exchange.round.SyncRound`'s; the loop around it is :class:`rnnlm.spark.trainer.Trainer`'s.
"""
from __future__ import annotations

import copy
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor, wait as wait_all
from dataclasses import dataclass, field

import numpy as np

from ..core.optim import make_optimizer
from ..exchange import plan
from ..exchange.aggregate import Aggregate, Gathered, gather
from ..exchange.round import SyncRound
from . import channel, executor
from .broadcasts import DeltaBroadcast, ParamsBroadcast
from .lineage import Lineage, held_bytes, recomputed
from .rundir import TrainingError
from .session import bind_host, broadcast_bytes, release, run_in_jvm
from .stall import StallWatch


@dataclass
class SyncState:
    """The protocol's state, carried by the driver from round to round (:class:`SyncRound` moves it)."""

    params: np.ndarray
    opt: dict | None = None                            # averaged optimizer state
    opt_local: dict = field(default_factory=dict)      # pid -> optimizer state
    states: dict = field(default_factory=dict)         # pid -> hidden state (L, S, H, B)
    velocity: np.ndarray | None = None                 # outer momentum
    held: dict = field(default_factory=dict)           # pid -> {name: array} it holds between rounds
    view: np.ndarray | None = None             # a delta broadcast's: the executors' parameters (from a checkpoint)
    next_params: np.ndarray | None = None      # train.overlap: what the next round trains from (from a checkpoint),
    next_lr: float | None = None               # and at which rate

    @classmethod
    def start_from(cls, init) -> SyncState:
        """Round 0 of a new run from ``init``'s weights (:class:`rnnlm.spark.rundir.Init`) and, with
        ``keep_optimizer``, its optimizer state (the inner optimizer's, averaged or per partition, and
        the outer momentum): nothing else of its run (position, schedule, the partitions' carryover,
        the executors' view)."""
        kept = {}
        if init.keep_optimizer:
            kept = SyncRound.from_optim(init.checkpoint.optim, init.checkpoint.optim_t, init.checkpoint.optim_t_local)
            # copies: the rounds update the velocity in place, and ``init`` may start another run (a sweep)
            kept = copy.deepcopy({k: kept[k] for k in ("opt", "opt_local", "velocity")})
        return cls(params=np.array(init.checkpoint.params), **kept)

    @classmethod
    def resumed(cls, ck, cfg, where: str) -> SyncState:
        """The state checkpoint ``ck`` (read from ``where``) holds for a run configured as ``cfg``.

        Its ``outer.view`` is a delta broadcast's view and, under overlap, what the next round trains
        from (with a delta broadcast the two are the same parameters)."""
        slots, partitions = tuple(make_optimizer(cfg.optim).slots), cfg.data.partitions
        foreign = SyncRound.foreign(ck.optim, slots, partitions)
        if foreign is not None:
            raise TrainingError(f"cannot resume: {where} holds optimizer state {foreign!r:.60} that no run of "
                                f"this configuration writes ({partitions} partitions; the optimizer's slots: "
                                f"{', '.join(slots) or 'none'})")
        kept = SyncRound.from_optim(ck.optim, ck.optim_t, ck.optim_t_local)
        stored = kept.pop("view")
        state = cls(params=ck.params, **kept)
        if cfg.exchange.broadcast != "rows":
            state.view = stored
        if overlapped(cfg.train):
            state.next_params, state.next_lr = stored, ck.position.get("pending_lr")
            if (type(state.next_lr) is not float or not math.isfinite(state.next_lr) or state.next_lr < 0
                    or stored is None or stored.shape != state.params.shape):
                raise TrainingError(f"cannot resume: {where} lacks the next round's parameters or "
                                    "learning rate that train.overlap = 1 needs")
        if ck.hidden is not None:
            if ck.hidden.ndim != 5:          # the loader also accepts one stream's (L, S, H, B)
                raise TrainingError(f"cannot resume: {where} holds one stream's hidden state (a one-machine "
                                    "run's), not one per partition")
            state.states = {pid: ck.hidden[pid] for pid in range(len(ck.hidden))}
        return state


@dataclass
class Snapshot:
    """What a checkpoint holds of the round (:meth:`AllReduce.snapshot`)."""

    optim: dict                       # ``optim.npz``'s entries (:meth:`SyncRound.to_optim`)
    optim_t: int
    optim_t_local: dict               # pid -> its own optimizer's step count
    hidden: np.ndarray | None         # the partitions' hidden states, stacked
    next_lr: float | None             # train.overlap: the next round's learning rate
    held: dict | None                 # what the partitions hold, collected from Spark
    collected_bytes: int = 0          # their bytes, moved to the driver for the checkpoint


@dataclass
class Job:
    """One round's job: what it trains from, fixed when it is defined, and once submitted its future."""

    round: int
    lr: float
    params: np.ndarray          # the driver's parameters its broadcast was made from
    task: object                # sink -> the executors' function (:func:`rnnlm.spark.executor.round_task`)
    bcs: list                   # its own broadcasts (message, carries)
    bc_bytes: int
    rebased: bool
    prepare_s: float
    submitted: float | None = None     # wall clock
    future: object = None
    out: object = None                 # its output RDD when the carryover stays in Spark
    fetched: int = 0                   # bytes the driver sent tasks that fetched a lineage's seed


class AllReduce:
    """The synchronous round's Spark side for one run.

    Parameters
    ----------
    sc : SparkContext
    cfg : Config
        Resolved; ``model`` is built from it.
    data : RDD of (pid, tokens, starts), one element per partition (the corpus's, persisted)
    state : SyncState
        Where the run starts (fresh, ``--init-from`` or a checkpoint); moved on by :meth:`apply`.
    rounds : int
        The run's length (the last round's job waits for nothing; Spark's UI names jobs by it).
    group : str, optional
        Spark's job group of the run's jobs (cancelled by :meth:`close`).
    log : callable
        Where the direct channel's warnings go.
    watch : StallWatch
        Kills a round's stuck tasks while the driver waits (one of factor 0 waits as long as the round takes).
    next_checkpoint : callable, optional
        Round r -> the first round after r that checkpoints by count (an evaluation, ``checkpoint_every``,
        the last): a lineage cut due soon before it waits for it.

    Verbs: :meth:`start` (define and submit), :meth:`wait`, :meth:`apply`, :meth:`trim`,
    :meth:`snapshot` and :meth:`truncate` (around a checkpoint), :meth:`close`.
    """

    def __init__(self, sc, cfg, model, data, state: SyncState, rounds: int, group: str | None = None, log=print,
                 next_checkpoint=None, *, watch: StallWatch):
        t = cfg.train
        self.sc, self.cfg, self.data, self.state, self.rounds, self.group = sc, cfg, data, state, rounds, group
        self.next_checkpoint, self.watch = next_checkpoint, watch
        self.overlap = overlapped(t)
        self.protocol = SyncRound(model.layout, t, cfg.data.partitions)
        self.lineage = self.broadcasts = self.channel = self.pool = None
        self.next = None                    # the next round's job, defined a round ahead (overlap)
        self.flight = []                    # submitted, not waited for
        try:
            # the partitions' carryover stays in Spark where it cannot pass through the driver
            if in_lineage(cfg):
                self.lineage = Lineage(sc, data, state.held, self._carries(), log)
            retire = self.lineage.keep if self.lineage else None
            bc = (sc, model.layout, t.rebase_every, t.rebase_fraction)
            if cfg.exchange.broadcast == "rows":
                self.broadcasts = ParamsBroadcast(*bc, retire=retire)
            else:
                self.broadcasts = DeltaBroadcast(*bc, codec=plan.parse(cfg.exchange.broadcast)[1], view=state.view,
                                                 retire=retire)
            if t.results == "direct":
                self.channel = _channel(sc, cfg, model, log)
            self.pool = ThreadPoolExecutor(2, thread_name_prefix="rnnlm-round")
        except BaseException:
            self.close()
            raise

    @property
    def params(self) -> np.ndarray:
        """The driver's parameters."""
        return self.state.params

    # ------------------------------------------------------------ a round
    def start(self, r: int, lr: float, pause: bool = False) -> Job:
        """Round ``r``'s job, submitted: the one defined a round ahead (a resumed run's from its
        checkpoint), else one defined now from the parameters at ``lr``. Under overlap round r+1's
        job is defined too, from the same parameters and ``lr`` (round r's change reaches it a round
        late), and submitted at once unless ``pause`` (an evaluation or a checkpoint by count follows
        round r), round r is the last, or the lineage is due a cut."""
        st = self.state
        if self.next is None and st.next_lr is not None:       # a resumed run's, from its checkpoint
            self.next = self._define(r, st.next_params, st.next_lr)
            st.next_params = st.next_lr = None
        elif self.next is None:
            self.next = self._define(r, st.params, lr)
        job, self.next = self.next, None
        if job.future is None:
            self._submit(job)
        if self.overlap:
            self.next = self._define(r + 1, st.params, lr)
            if not (pause or r >= self.rounds or self.lineage.cut_due(self._to_checkpoint(r))):
                self._submit(self.next)
        return job

    def wait(self, job: Job) -> Aggregate:
        """``job``'s merged aggregate (its own broadcasts released, unless the lineage reads them), the
        bytes its tasks' seed fetches moved counted: to the driver in its ``wire_bytes``, from it in
        ``job.fetched``; a task stuck meanwhile is killed and run again (:class:`StallWatch`). A wait
        interrupted (a second Ctrl-C) leaves the job running and in flight, for :meth:`close` to cancel
        before its broadcasts go."""
        ok = False
        try:
            agg = self.watch.wait(job.future, f"round {job.round}")
            ok = True
            if self.lineage is not None:
                job.fetched, received = self.lineage.take_served()
                agg.wire_bytes += received
            return agg
        finally:
            if job.future.done():
                self.flight.remove(job)
                if self.lineage is not None:
                    self.lineage.finished(job.out, ok)
                else:
                    release(job.bcs)

    def apply(self, agg: Aggregate) -> np.ndarray:
        """Move the state on by the merged ``agg`` (:meth:`SyncRound.apply`); the new parameters."""
        self.protocol.apply(self.state, agg)
        return self.state.params

    def trim(self, r: int) -> int:
        """After round ``r``, cut a lineage grown :data:`~rnnlm.spark.lineage.MAX_LINEAGE` deep (no job in
        flight) unless a checkpoint cuts it soon (:meth:`~rnnlm.spark.lineage.Lineage.cut_due`); the bytes
        collected to cut it."""
        return self.lineage.trim(self._carries(), self._to_checkpoint(r)) if self.lineage is not None else 0

    def _to_checkpoint(self, r: int) -> int | None:
        return None if self.next_checkpoint is None else self.next_checkpoint(r) - r

    # -------------------------------------------------------- checkpoints
    def snapshot(self) -> Snapshot:
        """What a checkpoint holds of the round now: the state, what the partitions hold (the last
        finished round's, even with the next running) and, under overlap, the next round's job (its
        parameters, as its broadcast's executors rebuild them, and its rate)."""
        st = self.state
        if self.lineage is not None:
            st.held = self.lineage.collect()
        # outer.view: a delta broadcast's view, and under overlap what the next round trains from (the
        # same parameters with a delta broadcast; the next job's own with rows)
        view, lr = self.broadcasts.view, None
        if self.overlap:
            view, lr = (self.next.params if view is None else view), float(self.next.lr)
        held = st.held if self.lineage is not None else None
        optim, opt_t, opt_t_local = SyncRound.to_optim(st, view, held)
        hidden = np.stack([st.states[p] for p in sorted(st.states)]) if st.states else None
        return Snapshot(optim, opt_t, opt_t_local, hidden, lr, held, held_bytes(held))

    def truncate(self, snapshot: Snapshot) -> None:
        """Restart the lineage from what a checkpoint just saved (not while a round runs)."""
        if self.lineage is not None:
            self.lineage.truncate(snapshot.held, self._carries())

    def close(self, blocking: bool = False) -> None:
        """Cancel the jobs still running (a run stopping early), wait for their threads, and
        release every broadcast, cached round and channel made (``blocking``: see
        :func:`rnnlm.spark.session.release`)."""
        if self.pool is not None:
            if self.flight:          # this run's jobs only: a shared session may run others
                stages = self._running_stages()
                if self.group is None:
                    self.sc.cancelAllJobs()
                else:
                    self.sc.cancelJobGroup(self.group)
                wait_all([job.future for job in self.flight])
                self._tasks_ended(stages)           # before wait() releases each job's broadcasts
                for job in list(self.flight):
                    try:
                        self.wait(job)
                    except Exception:       # cancelled: what it would have computed is not needed
                        pass
            self.pool.shutdown(wait=True)
            if self.next is not None and self.next.future is None:
                release(self.next.bcs, blocking=blocking)
        if self.channel is not None:
            self.channel.close()
        if self.broadcasts is not None:
            self.broadcasts.close(blocking=blocking)
        if self.lineage is not None:
            self.lineage.close(blocking=blocking)
        self.pool = self.channel = self.broadcasts = self.lineage = self.next = None

    # ------------------------------------------------------------- inside
    def _running_stages(self) -> list:
        """The stages of the run's jobs running now (the group's; with no group, those without one)."""
        tracker = self.sc.statusTracker()
        jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(self.group)]
        return [s for j in jobs if j is not None and j.status == "RUNNING" for s in j.stageIds]

    def _tasks_ended(self, stages: list, limit_s: float = 10.0) -> None:
        """Wait, at most ``limit_s``, for the tasks of the cancelled jobs' ``stages`` to end. A job
        fails as soon as it is cancelled, but each of its tasks lets go of its broadcast blocks only
        when it ends: destroying them first makes Spark log an ERROR with a stack trace per task."""
        tracker = self.sc.statusTracker()
        end = time.monotonic() + limit_s
        while time.monotonic() < end and any(getattr(tracker.getStageInfo(s), "numActiveTasks", 0)
                                             for s in stages):
            time.sleep(0.05)

    def _define(self, r: int, params, lr: float) -> Job:
        """Round ``r``'s job training from ``params`` at ``lr``: its broadcasts and task."""
        p0 = time.perf_counter()
        # what every partition reads (the base, the rows that differ from it) and what each alone carries
        base, rows, deltas, new = self.broadcasts.round(params)
        msg = self.protocol.message(self.state, self.broadcasts.token, rows)
        # under overlap the carries stay in Spark: the round before has not returned them yet
        carries = {} if self.overlap else self.protocol.carries(self.state)
        bcs = [self.sc.broadcast(msg)] + [self.sc.broadcast(c) for c in carries.values()]
        carry_bcs = dict(zip(carries, bcs[1:]))
        # sink -> the tasks' function; a partial pickles small, and rounds that replay a lineage carry one per round
        task = functools.partial(executor.round_task, self.cfg, base, bcs[0], carry_bcs, r, lr, deltas,
                                 chained=self.lineage is not None, carries_in_spark=self.overlap)
        return Job(r, lr, params, task, bcs, sum(broadcast_bytes(b) for b in bcs + new),
                   any(b is base for b in new), time.perf_counter() - p0)

    def _carries(self) -> dict | None:
        """Each partition's carry into the next round, for a lineage seeded from the driver (under
        overlap; else None: carries travel in each round's own broadcasts)."""
        return self.protocol.carries(self.state) if self.overlap else None

    def _submit(self, job: Job) -> None:
        """Start ``job`` from a thread of its own (PySpark keeps a thread's job properties apart):
        local steps on every partition, their changes merged through one of three paths."""
        description = f"rnnlm round {job.round}/{self.rounds}: {steps_label(self.cfg.train)} + treeAggregate"

        def run(thunk):
            def go():
                self.sc.setJobGroup(self.group, description)     # a thread's own job properties
                return thunk()
            return self.pool.submit(go)
        job.submitted = time.time()
        direct = None
        if self.channel is not None and self.channel.broken is None:
            direct = self.channel.sink(job.round), functools.partial(self.channel.take, job.round)
        if self.lineage is None and direct is None:
            # after a broken channel, as it merged: every leaf on the driver (a level of Spark's tree would
            # round its sum to the codec as it leaves: a transient failure would change the numbers)
            depth = 1 if self.channel is not None else self.cfg.train.tree_depth
            job.future = run(lambda: self.data.mapPartitions(job.task()).treeAggregate(
                Gathered(), gather, gather, depth=depth).settle())
        elif self.lineage is None:
            sink, take = direct

            def go():
                run_in_jvm(self.data.mapPartitions(job.task(sink)))      # nothing returns but the frames
                return take(lambda missing: recomputed(self.sc, self.data, job.task(), missing))
            job.future = run(go)
        else:
            # the carries of a lineage seeded from a checkpoint travel now, one broadcast per partition
            job.bc_bytes += sum(broadcast_bytes(b) for b in self.lineage.take_seeds())
            self.lineage.keep(job.bcs)       # the lineage reads them until the next truncation
            job.out, job.future = self.lineage.submit(job.task, run, direct)
        self.flight.append(job)


def _channel(sc, cfg, model, log) -> channel.Channel:
    """The direct result channel's driver end, listening where the executors reach the driver."""
    expect = channel.expected(cfg, model)
    host = bind_host("", sc.master, sc.getConf().get("spark.driver.host"))
    try:
        return channel.Channel(expect, host, log, channel.max_frame_bytes(expect))
    except OSError as e:
        raise TrainingError(f"train.results = 'direct': cannot listen on {host}: {e.strerror or e}") from None


def overlapped(train) -> bool:
    """``train.overlap``'s rule, read here alone: whether round r+1's job is defined from the
    parameters round r trains from, a round ahead, so that the partitions' carries stay in Spark."""
    return train.overlap > 0


def in_lineage(cfg) -> bool:
    """Whether the partitions' carryover stays in Spark's lineage (error feedback, overlap), where it
    cannot pass through the driver: each partition's result then reaches the driver on its own."""
    return bool(cfg.exchange.feedback) or overlapped(cfg.train)


def tree_aggregated(cfg) -> bool:
    """Whether a round's results reach the driver through ``treeAggregate`` (merged on executors
    first beyond 4 partitions at depth 2): not where they stay in Spark's lineage
    (:func:`in_lineage`) nor where the direct channel carries them."""
    return not in_lineage(cfg) and cfg.train.results != "direct"


def steps_label(t) -> str:
    """What a partition trains per round (``t``: the train section), for log lines."""
    return f"{t.local_steps} local steps" if t.local_steps else "one pass per round"
