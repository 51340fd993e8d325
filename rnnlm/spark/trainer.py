"""The synchronous driver: local steps on every partition, then a ``treeAggregate`` all-reduce of
their changes (the Spark RNN report, sections 3-5).

:class:`Trainer` reads as phases: set up (the run directory, where it starts, the corpus), the loop
(a round, its evaluation and checkpoint when due), tear down (one close of the round's owner). A
round's Spark side (broadcasts, jobs, results, the partitions' carryover, ``train.overlap``'s job a round
ahead) is :class:`rnnlm.spark.allreduce.AllReduce`'s; docs/design.md says how a round runs.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..core import checkpoint
from .. import config
from . import executor
from .allreduce import AllReduce, SyncState, steps_label
from .channel import ChannelError
from .corpus import Corpus, evaluate_rdd, load_corpus, scored, total_rounds, unpersist_corpus
from ..exchange import plan
from ..exchange.aggregate import Aggregate
from .rundir import Driver, Init, TrainingError, arithmetic_notes, best_record, check_longer, resume_keys
from .session import job_errors, job_failure
from .stall import StallWatch
from .stop import Interrupted, StopRequest
from ..core.metrics import due, log_line, loss_fields
from ..core.models import build as build_model
from ..core.schedule import Schedule, early_stop, improves


@dataclass
class RunState:
    """Where the run stands, as its checkpoint's position holds it (the round's own state is
    :class:`rnnlm.spark.allreduce.SyncState`)."""

    schedule: dict = field(default_factory=dict)
    round: int = 0
    tokens: int = 0
    bytes_sent: int = 0
    bytes_broadcast: int = 0
    wall_s: float = 0.0
    eval_s: float = 0.0                                # time scoring held-out text (not in wall_s)
    best: dict | None = None                           # {"round", "valid_loss"}: what best/ holds


class Trainer(Driver):
    """The driver of one training run.

    Parameters
    ----------
    spark : SparkSession
    cfg : Config
    out, log, progress, fs
        The run's output directory and where its lines go (see :class:`rnnlm.spark.rundir.RunDir`).

    After :meth:`run`: ``metrics`` (the run's lines), ``cfg`` (resolved), ``params``, ``vocab``.
    """

    def __init__(self, *args, **kwargs):         # the Driver's arguments
        super().__init__(*args, **kwargs)
        self.cfg = self.params = self.vocab = None
        # when the last checkpoint was written (or training started), the last round ended, and its slowest task ended
        self.ck_time, self.round_end, self.last_task_end = None, None, None

    # ------------------------------------------------------------- set-up
    def _resume(self) -> tuple:
        """``(vocabulary, RunState, SyncState)`` of the checkpoint in ``--out``."""
        ck = self.dir.read_checkpoint(self.cfg_in, resume_keys(self.cfg_in))
        pos = ck.position
        at = RunState(schedule=ck.schedule, round=pos["round"], tokens=pos["tokens"], bytes_sent=pos["bytes_sent"],
                      bytes_broadcast=pos["bytes_broadcast"], wall_s=pos["wall_s"], eval_s=pos.get("eval_s", 0.0),
                      best=best_record(pos.get("best")))
        state = SyncState.resumed(ck, self.cfg_in, self.dir.ck_path)
        old = self.dir.saved_lines()
        if old is not None:
            self.dir.keep_lines([m for m in old if m["round"] <= at.round])
        return ck.vocab, at, state

    # ------------------------------------------------------------ running
    def run(self, resume: bool = False, data: Corpus | None = None, overwrite: bool = False,
            init: Init | None = None) -> dict:
        """Train to the configured length, or until ``train.patience`` ends the run; return the last metrics line.

        ``data`` reuses a corpus from :func:`load_corpus` (benchmarks sweep settings on one);
        ``overwrite`` starts again in an ``--out`` that holds a run (:meth:`rnnlm.spark.rundir.RunDir.prepare`);
        ``init`` starts a new run from a checkpoint's weights and vocabulary (``--init-from``).
        """
        # set up: the run directory, where it starts, the corpus, the resolved configuration
        self._prepare(resume, overwrite, init)
        vocab, at, state = self._resume() if resume else (init and init.checkpoint.vocab, None, None)
        if at is not None and self.cfg_in.train.rounds and at.round >= self.cfg_in.train.rounds:
            # known before any data is read
            return self.nothing_to_do(at.round, self.cfg_in.train.rounds, state.params, vocab)
        stopped = early_stop(self.cfg_in.train, at.round, at.best) if at is not None else None
        if stopped is not None:             # train.patience ended it there
            return self.nothing_to_do(at.round, None, state.params, vocab, stopped)
        owned = data is None
        group = f"rnnlm train {self.dir.out}"          # every job of the run, in Spark's UI
        self.sc.setJobGroup(group, group)
        data = data or load_corpus(self.sc, self.cfg_in, vocab, self.status)
        # idle executors answer a release at once: only a run stopped in a round releases without waiting
        sync, ended = None, True
        try:
            per = scored(self.cfg_in, data, rounds=not self.cfg_in.train.rounds)     # an epoch's tokens
            rounds = total_rounds(self.cfg_in, data, per)
            if at is not None and at.round >= rounds:
                return self.nothing_to_do(at.round, rounds, state.params, data.vocab)
            if at is not None:
                check_longer(self.cfg_in, at.round, rounds, self.metrics, at.best, self.dir.ck_path)
            cfg = self.cfg = config.resolve(self.cfg_in, len(data.vocab))
            model = build_model(cfg.model)
            at = at or RunState(schedule=Schedule(cfg.optim).state)
            if state is None:
                state = SyncState.start_from(init) if init else SyncState(params=model.init_params(cfg.train.seed))
            before = self.dir.write_info(self.sc, cfg, resume, data.devices, init, data.record())
            size = (f"vocab {len(data.vocab):,} | params {state.params.size:,} | train tokens {data.tokens:,} | "
                    f"{cfg.data.partitions} partitions x {steps_label(cfg.train)} | {rounds} rounds")
            resumed = f"resumed from round {at.round}" if resume else None
            self.dir.say_start(size, data.devices, cfg.train.device, resumed, init,
                               arithmetic_notes(data.devices, before))
            stop = StopRequest(self.log)
            try:
                watch = StallWatch(self.sc, group, cfg.train.stall_factor, cfg.train.stall_s, self.log)
                sync = AllReduce(self.sc, cfg, model, data.train, state, rounds, group, self.log,
                                 functools.partial(next_checkpoint, cfg.train, data, rounds), watch=watch)
                ended = False
                self.ck_time = time.monotonic()     # train.checkpoint_s counts training, not the corpus's read
                # the loop: a round, its evaluation when due, a checkpoint when due
                while at.round < rounds:
                    snapshot, best = self._round(cfg, model.layout, data, per.epoch, sync, at, rounds, stop)
                    if snapshot is not None or stop.requested:
                        self._checkpoint(cfg, data.vocab, sync, at, best, snapshot)
                    if stop.requested and at.round < rounds:
                        ended = True         # between rounds, checkpointed: the executors are there to answer
                        raise Interrupted(f"interrupted after round {at.round}; its checkpoint is in "
                                          f"{self.dir.ck_path} (--resume continues)", stop.signum)
                    stopped = early_stop(cfg.train, at.round, at.best) if at.round < rounds else None
                    if stopped is not None:         # an evaluation's round: checkpointed, best/ written before
                        self.log(f"stopped early after round {at.round} of {rounds}: {stopped}; best/ holds round "
                                 f"{at.best['round']}")
                        break
                ended = True
            except KeyboardInterrupt:
                # a second signal: the jobs are cancelled; checkpoint writes are atomic, so the last is whole
                raise Interrupted(f"interrupted in round {at.round + 1}; {self.dir.kept()}", stop.signum) from None
            finally:
                # tear down: a run that ended waits for the executors to answer its releases (the session may
                # stop next); the last round's broadcasts and evaluation went without waiting, answered long before
                try:
                    if sync is not None:
                        sync.close(blocking=ended)
                finally:
                    stop.release()          # the signal handlers go back, whatever the close raised
        finally:
            if owned:          # a shared session keeps nothing of this run's corpus, whatever stopped it
                unpersist_corpus(data, blocking=ended)
        self.params, self.vocab = state.params, data.vocab
        return self.metrics[-1]

    def nothing_to_do(self, at: int, rounds: int | None, params, vocab, stopped: str | None = None) -> dict:
        """A resumed run already at its length, or stopped early there: no training, the checkpoint's
        model; the last line."""
        self.cfg = config.resolve(self.cfg_in, len(vocab))
        self.params, self.vocab = params, vocab
        return self.dir.nothing_to_do(at, rounds, stopped)

    def _checkpoint_due(self, cfg, r: int, rounds: int, evaluated: bool, stop) -> bool:
        """Whether round ``r`` ends with a checkpoint: every ``train.checkpoint_every`` rounds, at the
        end, at each evaluation, once ``train.checkpoint_s`` seconds have passed since the last one
        (as ``server.checkpoint_s`` for async runs), and when asked to stop."""
        t = cfg.train
        return (due(r, t.checkpoint_every, rounds) or evaluated or stop.requested
                or bool(t.checkpoint_s and time.monotonic() - self.ck_time >= t.checkpoint_s))

    def _round(self, cfg, layout, data, per_epoch: int, sync: AllReduce, at: RunState, rounds: int, stop) -> tuple:
        """Train round ``at.round + 1``; return (the checkpoint's snapshot when one is due, else None;
        whether the round is the best)."""
        r, t0 = at.round + 1, time.perf_counter()
        sched = Schedule(cfg.optim, at.schedule)
        lr = sched.lr(at.tokens / per_epoch)
        evaluated = due(r, cfg.train.eval_every, rounds) and (data.valid is not None or data.test is not None)
        # under overlap the next round's job waits for this one before an evaluation or a checkpoint by count
        job = sync.start(r, lr, pause=evaluated or due(r, cfg.train.checkpoint_every, rounds))
        try:
            agg = sync.wait(job)
        except job_errors() as e:           # the round's job failed in Spark (its retries spent)
            self._stop(r, f"the Spark job failed: {job_failure(str(e))}")
        except ChannelError as e:           # train.results = "direct": the driver could not merge a contribution
            self._stop(r, str(e))
        arrived, t_agg = time.time(), time.perf_counter()
        # the mean change applied, unless a partition failed or a value is not finite
        errors, loss = agg.errors(), agg.stats["loss_sum"] / max(1, agg.stats["tokens"])
        if errors or not math.isfinite(loss):
            self._stop(r, errors[0] if errors else f"training loss is {loss}")
        params = sync.apply(agg)
        if not np.isfinite(params.sum(dtype=np.float64)):
            self._stop(r, "the averaged parameters are not finite")
        applied = time.perf_counter()
        # what partitions hold, collected to cut their lineage: for a checkpoint (its time is the checkpoint's,
        # as its write is) or, if due, for depth
        save = self._checkpoint_due(cfg, r, rounds, evaluated, stop)
        if not save:
            agg.wire_bytes += sync.trim(r)
        round_s = time.perf_counter() - t0
        snapshot = sync.snapshot() if save else None
        if snapshot is not None:
            agg.wire_bytes += snapshot.collected_bytes
        at.round, at.tokens = r, at.tokens + agg.stats["tokens"]
        # every executor that ran a task of the round fetched each of its broadcasts once (a task's closure
        # names them all, the carries of other partitions too); a lineage's seed, only the tasks that lacked it
        bc_bytes = job.bc_bytes * max(1, executor.executors(agg.stats)) + job.fetched
        at.bytes_sent += agg.wire_bytes
        at.bytes_broadcast += bc_bytes
        at.wall_s += round_s
        m = round_metrics(cfg, layout, at, per_epoch, agg, bc_bytes, job.rebased, job.lr, round_s)
        # where the round's time went (benchmarks/spark_sync.py --profile): the driver's phases and the slowest
        # task's; under overlap a job may wait for the one before it, so its launch counts from that one's end
        started = max(job.submitted, self.last_task_end or 0.0)
        self.last_task_end = agg.stats.get("task_end")
        m.update(round_phases(agg.stats, prepare=job.prepare_s, submitted=started, arrived=arrived,
                              apply=applied - t_agg, between=t0 - self.round_end if self.round_end else None))
        self.round_end = time.perf_counter()
        # held-out text, between rounds (its time is not the round's)
        best = False
        if evaluated:
            best = self._evaluate_round(cfg, data, params, at, sched, m, sync.watch)
        self.sc.setJobDescription(None)
        self.dir.add_line(m, rounds, log_line(m, skip=_quiet(cfg)))
        return snapshot, best

    def _evaluate_round(self, cfg, data, params, at: RunState, sched, m: dict, watch: StallWatch) -> bool:
        """Score held-out text into ``m`` (a stuck task killed and run again by ``watch``); step a plateau
        schedule; return whether this round is the best."""
        e0, best = time.perf_counter(), False
        if data.valid is not None:
            vl = self._evaluate_held_out(cfg, params, data, "valid", at.round, watch)
            m.update(loss_fields(vl, cfg.data.level, "valid"))
            sched.observe(vl)
            at.schedule = sched.state
            best = improves(at.best, vl)
            if best:
                at.best = {"round": at.round, "valid_loss": vl}
            m["best_round"] = at.best["round"]
        if data.test is not None:
            m.update(loss_fields(self._evaluate_held_out(cfg, params, data, "test", at.round, watch), cfg.data.level,
                                 "test"))
        at.eval_s += time.perf_counter() - e0
        m["eval_s"] = round(at.eval_s, 3)
        return best

    def _evaluate_held_out(self, cfg, params, data: Corpus, name: str, r: int, watch: StallWatch) -> float:
        self.dir.say_evaluating(name, data.held_out_tokens.get(name))
        self.sc.setJobDescription(f"rnnlm: evaluating {name}")
        rdd = data.valid if name == "valid" else data.test
        scores = functools.partial(evaluate_rdd, self.sc, cfg, params, rdd)
        return watch.run(scores, f"evaluating {name} after round {r}")

    def _stop(self, r: int, why: str):
        raise TrainingError(f"round {r}: {why}; stopped, {self.dir.kept()}")

    def _checkpoint(self, cfg, vocab, sync: AllReduce, at: RunState, best: bool = False, snapshot=None):
        """Write the checkpoint of round ``at.round`` from ``snapshot`` (taken now if None: a stop asked
        for after the round's line) and, with ``best``, the same files to ``best/``."""
        if snapshot is None:
            snapshot = sync.snapshot()
            at.bytes_sent += snapshot.collected_bytes       # in the position; the round's line is written
        position = {"round": at.round, "tokens": at.tokens, "bytes_sent": at.bytes_sent,
                    "bytes_broadcast": at.bytes_broadcast, "wall_s": at.wall_s, "eval_s": at.eval_s, "best": at.best}
        if snapshot.next_lr is not None:
            position["pending_lr"] = snapshot.next_lr
        ck = checkpoint.Checkpoint(
            params=sync.params, config=cfg, vocab=vocab, optim=snapshot.optim, optim_t=snapshot.optim_t,
            optim_t_local=snapshot.optim_t_local, hidden=snapshot.hidden, schedule=at.schedule, position=position)
        self.dir.write_checkpoint(ck, best)
        self.ck_time = time.monotonic()
        sync.truncate(snapshot)            # not while a round runs


def next_checkpoint(t, data: Corpus, rounds: int, r: int) -> int:
    """The first round after ``r`` that checkpoints by count: every ``t.checkpoint_every``, at each evaluation
    (every ``t.eval_every`` with held-out text), the last."""
    every = [t.checkpoint_every] + ([t.eval_every] if data.valid is not None or data.test is not None else [])
    return min([rounds] + [(r // e + 1) * e for e in every if e > 0])


def _quiet(cfg) -> tuple:
    """Prefixes of the metrics a log line leaves out: the byte counters and per-block detail (the
    metrics file has them), and fields that say nothing in this run's setting."""
    x = cfg.exchange
    skip = ["bytes", "round_", "rows_", "block_bytes.", "optim_bytes", "unique_", "rebased", "seed_groups",
            "softmax_v", "phase.", "syncs", "device", "executors"]    # syncs = round, in rounds; device: said once
    if x.embed == x.softmax == x.hidden == "dense":
        skip.append("compression")      # dense float32 blocks: 1 every round (1/3 with Adam's averaged state)
    return tuple(skip)


def round_phases(stats: dict, prepare: float, submitted: float, arrived: float, apply: float,
                 between: float | None) -> dict:
    """A round's time by phase (seconds): ``prepare`` (the broadcasts: rows or deltas, pickling,
    files), ``launch`` (job submitted to the first task running: scheduling, task shipping and
    deserialisation), the slowest task's ``view`` (broadcast fetch and rebuild), ``steps`` and
    ``encode``, ``collect`` (the last task done to the aggregate on the driver: result pickling,
    transfer, tree merges), ``apply`` (the mean change and its checks) and ``between`` (the
    previous round's metrics line to this round's start: its evaluation if one ran, the metrics
    file, the log line, a checkpoint). Task times are wall
    clocks set against the driver's, exact in local mode, as good as the clocks' agreement on a cluster."""
    out = {"prepare_s": prepare, "apply_s": apply}
    if "task_start" in stats:
        out.update(launch_s=stats["task_start"] - submitted, collect_s=arrived - stats["task_end"],
                   view_s=stats["view_s"], steps_s=stats["steps_s"], encode_s=stats["encode_s"])
    if between is not None:
        out["between_s"] = between
    return {f"phase.{k}": round(v, 4) for k, v in out.items()}


def round_metrics(cfg, layout, st: RunState, per_epoch: int, agg: Aggregate, bc_bytes: int, rebased: bool,
                  lr: float, round_s: float) -> dict:
    """The metrics line of round ``st.round`` (``st`` already moved on by it), before evaluation."""
    m = {"round": st.round, "epoch": round(st.tokens / per_epoch, 5), "tokens": st.tokens, "syncs": st.round,
         "bytes_sent": st.bytes_sent, "bytes_broadcast": st.bytes_broadcast,
         "round_bytes_sent": agg.wire_bytes, "round_bytes_broadcast": bc_bytes, "rebased": rebased,
         "wall_s": round(st.wall_s, 3), "round_s": round(round_s, 3), "compute_s": round(agg.stats["compute_s"], 3),
         "tokens_per_s": round(agg.stats["tokens"] / max(1e-9, round_s)),
         "train_loss": agg.stats["loss_sum"] / max(1, agg.stats["tokens"]), "lr": lr,
         "unique_words": int(len(agg.words)), "executors": executor.executors(agg.stats),
         "device": executor.device_field(agg.stats.get("gpu_partitions", 0), cfg.data.partitions)}
    # what travelled per parameter group (Zipf's law for the exchange: unique_words against tokens)
    m.update({k: v for k, v in sorted(agg.stats.items()) if k.startswith(("rows_", "block_bytes.", "optim_bytes"))})
    # against a dense float32 exchange of the parameters: their blocks and the optimizer state averaged beside them
    sent = sum(v for k, v in agg.stats.items() if k.startswith("block_bytes.") or k == "optim_bytes")
    m["compression"] = round(layout.size * 4 * cfg.data.partitions / max(1, sent), 3)
    m["seed_groups"] = plan.seed_groups(cfg.exchange.seed_groups, cfg.data.partitions)
    if cfg.exchange.sampled_softmax:      # mean sampled softmax sets per local step
        for k in ("softmax_v_all", "softmax_v_f"):
            m[k] = round(agg.stats.get(k, 0) / max(1, agg.stats["steps"]), 1)
    return m
