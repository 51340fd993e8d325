"""Distributed training on Spark: local steps on every partition, then a
``treeAggregate`` all-reduce of the weights (the Spark RNN report, sections 3-5).

Per round the driver broadcasts the flat parameters (with optimizer state and
carried hidden states where they travel), every partition runs
``train.local_steps`` optimizer steps, and the token-weighted average comes back
through ``treeAggregate``. Tasks are stateless: whatever a partition carries to
the next round returns inside the aggregate and goes out with the next broadcast
(or stays in Spark, :mod:`rnnlm.spark.residuals`).

``train.overlap = 1`` hides the round's synchronisation behind the next round's
computation (as Streaming DiLoCo, Douillard et al. 2025, overlaps its outer
synchronisation with inner steps): round r+1's job is submitted before round r's
result has arrived, so it starts from the parameters with every mean change up to
round r-1 applied, and round r's change reaches the partitions a round late (each
change is still applied exactly once). Which round waits for the one before
(evaluations, checkpoints due by count, the last round, lineage cuts) changes
when work runs, never the numbers: a job's parameters and learning rate are fixed
when it is defined, one round ahead.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..core import checkpoint
from .. import config
from . import channel, executor
from .corpus import Corpus, evaluate_rdd, load_corpus, total_rounds, unpersist_corpus
from ..exchange import plan
from ..exchange.aggregate import Aggregate
from .broadcasts import DeltaBroadcast, ParamsBroadcast
from ..exchange.round import SyncRound
from .residuals import MAX_LINEAGE, Residuals
from .allreduce import Job, Jobs, broadcast_bytes
from .rundir import Driver, Init, TrainingError, best_record, check_longer, improves, resume_keys
from .session import bind_host
from .stop import Interrupted, StopRequest
from ..core.metrics import due, log_line, loss_fields
from ..core.models import build as build_model
from ..core.schedule import Schedule


@dataclass
class RunState:
    """Everything the driver carries from round to round (and checkpoints)."""

    params: np.ndarray
    opt: dict | None = None                            # averaged optimizer state
    opt_local: dict = field(default_factory=dict)      # pid -> optimizer state
    states: dict = field(default_factory=dict)         # pid -> hidden state (L, S, H, B)
    velocity: np.ndarray | None = None                 # outer momentum
    held: dict = field(default_factory=dict)           # pid -> {name: array} it holds between rounds (residuals)
    view: np.ndarray | None = None                     # the executors' parameters (exchange.broadcast = delta)
    #                                                    or, with train.overlap, those the next round trains from
    pending_lr: float | None = None                    # train.overlap: the next round's learning rate
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

    # ------------------------------------------------------------- set-up
    def _fresh(self, cfg):
        model = build_model(cfg.model)
        params = model.init_params(cfg.train.seed)
        return RunState(params=params, schedule=Schedule(cfg.optim).state)

    def _start_from(self, cfg, init: Init) -> RunState:
        """Round 0 of a new run from ``init``'s weights and, with ``keep_optimizer``, its optimizer
        state (the inner optimizer's, averaged or per partition, and the outer momentum): nothing
        else of its run (position, schedule, hidden states, residuals, the executors' view)."""
        st = RunState(params=np.array(init.checkpoint.params), schedule=Schedule(cfg.optim).state)
        if init.keep_optimizer:
            kept = SyncRound.from_optim(init.checkpoint.optim, init.checkpoint.optim_t)
            st.opt, st.opt_local, st.velocity = kept["opt"], kept["opt_local"], kept["velocity"]
        return st

    def _resume(self):
        ck = self.dir.read_checkpoint(self.cfg_in, resume_keys(self.cfg_in))
        pos = ck.position
        st = RunState(params=ck.params, schedule=ck.schedule, round=pos["round"], tokens=pos["tokens"],
                      bytes_sent=pos["bytes_sent"], bytes_broadcast=pos["bytes_broadcast"], wall_s=pos["wall_s"],
                      eval_s=pos.get("eval_s", 0.0), best=best_record(pos.get("best")))
        for k, v in SyncRound.from_optim(ck.optim, ck.optim_t).items():
            setattr(st, k, v)
        if self.cfg_in.train.overlap:
            st.pending_lr = pos.get("pending_lr")
            if (type(st.pending_lr) is not float or not math.isfinite(st.pending_lr) or st.pending_lr < 0
                    or st.view is None or st.view.shape != st.params.shape):
                raise TrainingError(f"cannot resume: {self.dir.ck_path} lacks the next round's parameters or "
                                    "learning rate that train.overlap = 1 needs")
        if ck.hidden is not None:
            if ck.hidden.ndim != 5:          # the loader also accepts one stream's (L, S, H, B)
                raise TrainingError(f"cannot resume: {self.dir.ck_path} holds one stream's hidden state (a one-machine "
                                    "run's), not one per partition")
            st.states = {pid: ck.hidden[pid] for pid in range(len(ck.hidden))}
        old = self.dir.saved_lines()
        if old is not None:
            self.dir.keep_lines([m for m in old if m["round"] <= st.round])
        return ck.vocab, st

    # ------------------------------------------------------------ running
    def run(self, resume: bool = False, data: Corpus | None = None, overwrite: bool = False,
            init: Init | None = None) -> dict:
        """Train to the configured length; return the last metrics line.

        ``data`` reuses a corpus from :func:`load_corpus` (benchmarks sweep settings on one);
        ``overwrite`` starts again in an ``--out`` that holds a run (:meth:`rnnlm.spark.rundir.RunDir.prepare`);
        ``init`` starts a new run from a checkpoint's weights and vocabulary (``--init-from``).
        """
        self._prepare(resume, overwrite, init)
        vocab, st = self._resume() if resume else (init and init.checkpoint.vocab, None)
        if st is not None and self.cfg_in.train.rounds and st.round >= self.cfg_in.train.rounds:
            # known before any data is read
            return self.nothing_to_do(st.round, self.cfg_in.train.rounds, st.params, vocab)
        owned = data is None
        group = f"rnnlm train {self.dir.out}"          # every job of the run, in Spark's UI
        self.sc.setJobGroup(group, group)
        data = data or load_corpus(self.sc, self.cfg_in, vocab, self.status)
        rounds = total_rounds(self.cfg_in, data)
        if st is not None and st.round >= rounds:
            if owned:
                unpersist_corpus(data, blocking=True)
            return self.nothing_to_do(st.round, rounds, st.params, data.vocab)
        if st is not None:
            try:
                check_longer(self.cfg_in, st.round, rounds, self.metrics, st.best, self.dir.ck_path)
            except TrainingError:
                if owned:
                    unpersist_corpus(data, blocking=True)
                raise
        cfg = self.cfg = config.resolve(self.cfg_in, len(data.vocab))
        model = build_model(cfg.model)
        self.layout = model.layout
        self.protocol = SyncRound(self.layout, cfg.train, cfg.data.partitions)
        st = st or (self._start_from(cfg, init) if init else self._fresh(cfg))
        self.dir.write_info(self.sc, cfg, resume, data.devices, init)
        self.residuals = None
        if executor.chained(cfg):
            self.residuals = Residuals(self.sc, data.train, st.held, self._carries(cfg, st))
        bc_args = (self.sc, self.layout, cfg.train.rebase_every, cfg.train.rebase_fraction)
        retire = self.residuals.keep if self.residuals else None
        if cfg.exchange.broadcast == "rows":
            self.params_bc = ParamsBroadcast(*bc_args, retire=retire)
        else:
            self.params_bc = DeltaBroadcast(*bc_args, codec=plan.parse(cfg.exchange.broadcast)[1], view=st.view,
                                            retire=retire)
        self.log(f"vocab {len(data.vocab)} | params {st.params.size:,} | train tokens {data.tokens:,} | "
                 f"{cfg.data.partitions} partitions x {steps_label(cfg.train)} | {rounds} rounds")
        if executor.devices_line(data.devices, cfg.train.device):
            self.log(executor.devices_line(data.devices, cfg.train.device))
        if resume:
            self.log(f"resumed from round {st.round}")
        elif init:
            self.log(init.line())
        stop = StopRequest(self.log)
        self.ck_time, self.round_end, self.last_task_end = time.monotonic(), None, None
        self.next = None                  # the next round's job, defined a round ahead (train.overlap)
        self.jobs, self.channel = None, None
        ended = False
        try:
            self.channel = self._channel(cfg, model) if cfg.train.results == "direct" else None
            self.jobs = Jobs(self.sc, data.train, self.residuals, cfg.train.tree_depth, self.channel, group)
            while st.round < rounds:
                save, best = self._round(cfg, data, st, rounds, stop)
                if save or stop.requested:
                    self._checkpoint(cfg, data.vocab, st, best)
                if stop.requested and st.round < rounds:
                    ended = True         # between rounds, checkpointed: the executors are there to answer
                    raise Interrupted(f"interrupted after round {st.round}; its checkpoint is in {self.dir.ck_path} "
                                      "(--resume continues)", stop.signum)
            ended = True
        except KeyboardInterrupt:
            # a second signal: the jobs are cancelled; checkpoint writes are atomic, so the last is whole
            raise Interrupted(f"interrupted in round {st.round + 1}; {self.dir.kept()}", stop.signum) from None
        finally:
            # a run that ended waits for the executors to answer its releases (the session may stop next);
            # the last round's broadcasts and evaluation went without waiting, answered long before in practice
            if self.jobs is not None:
                self.jobs.close(pending=self.next, blocking=ended)
            if self.channel is not None:
                self.channel.close()
            stop.release()
            self.params_bc.close(blocking=ended)
            if self.residuals is not None:
                self.residuals.close(blocking=ended)
            if owned:
                unpersist_corpus(data, blocking=ended)
        self.params, self.vocab = st.params, data.vocab
        return self.metrics[-1]

    def nothing_to_do(self, at: int, rounds: int, params, vocab) -> dict:
        """A resumed run already at its length: no training, the checkpoint's model; the last line."""
        self.cfg = config.resolve(self.cfg_in, len(vocab))
        self.params, self.vocab = params, vocab
        return self.dir.nothing_to_do(at, rounds)

    def _checkpoint_due(self, cfg, r: int, rounds: int, evaluated: bool, stop) -> bool:
        """Whether round ``r`` ends with a checkpoint: every ``train.checkpoint_every`` rounds, at the
        end, at each evaluation, once ``train.checkpoint_s`` seconds have passed since the last one
        (as ``server.checkpoint_s`` for async runs), and when asked to stop."""
        t = cfg.train
        return (due(r, t.checkpoint_every, rounds) or evaluated or stop.requested
                or bool(t.checkpoint_s and time.monotonic() - self.ck_time >= t.checkpoint_s))

    def _round(self, cfg, data, st: RunState, rounds: int, stop) -> tuple:
        """Train round ``st.round + 1``; return (whether a checkpoint follows, whether it is the best)."""
        r, t0 = st.round + 1, time.perf_counter()
        sched = Schedule(cfg.optim, st.schedule)
        lr = sched.lr(st.tokens / data.tokens)
        # this round's job, defined a round ahead under overlap (a resumed run's from its checkpoint)
        if self.next is None:
            resumed = cfg.train.overlap and st.pending_lr is not None
            self.next = self._define(cfg, st, r, st.view if resumed else st.params, st.pending_lr if resumed else lr)
        job, self.next = self.next, None
        if job.future is None:
            self.jobs.submit(job, _description(cfg, job.round, rounds))
        if cfg.train.overlap:
            # the next round's job from the parameters before this round's change, submitted before waiting
            self.next = self._define(cfg, st, r + 1, st.params, lr)
            if not self._drains(cfg, data, r, rounds):
                self.jobs.submit(self.next, _description(cfg, r + 1, rounds))
        agg = self.jobs.wait(job)
        arrived, t_agg = time.time(), time.perf_counter()
        # the mean change applied, unless a partition failed or a value is not finite
        errors, loss = agg.errors(), agg.stats["loss_sum"] / max(1, agg.stats["tokens"])
        if errors or not math.isfinite(loss):
            self._stop(r, errors[0] if errors else f"training loss is {loss}")
        self.protocol.apply(st, agg)
        if not np.isfinite(st.params.sum(dtype=np.float64)):
            self._stop(r, "the averaged parameters are not finite")
        applied = time.perf_counter()
        evaluated = due(r, cfg.train.eval_every, rounds) and (data.valid is not None or data.test is not None)
        save = self._checkpoint_due(cfg, r, rounds, evaluated, stop)
        if self.residuals is not None and not save:
            agg.wire_bytes += self.residuals.trim(self._carries(cfg, st))   # collected to cut their lineage
        st.round, st.tokens = r, st.tokens + agg.stats["tokens"]
        st.bytes_sent += agg.wire_bytes
        st.bytes_broadcast += job.bc_bytes
        st.wall_s += time.perf_counter() - t0
        m = round_metrics(cfg, self.layout, st, data.tokens, agg, job.bc_bytes, job.rebased, job.lr,
                          time.perf_counter() - t0)
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
            best = self._evaluate_round(cfg, data, st, sched, m)
        self.sc.setJobDescription(None)
        self.dir.add_line(m, rounds, log_line(m, skip=_quiet(cfg)))
        return save, best

    def _define(self, cfg, st: RunState, r: int, params, lr: float) -> Job:
        """Round ``r``'s job training from ``params`` at ``lr``: its broadcasts and task."""
        p0 = time.perf_counter()
        # what every partition reads (the base, the rows that differ from it) and what each alone carries
        base, rows, deltas, new = self.params_bc.round(params)
        msg, carries = self.protocol.messages(st, self.params_bc.token, rows)
        if cfg.train.overlap:
            carries = {}                # they stay in Spark: the round before has not returned them yet
        bcs = [self.sc.broadcast(msg)] + [self.sc.broadcast(c) for c in carries.values()]
        carry_bcs = dict(zip(carries, bcs[1:]))
        # sink -> the tasks' function; a partial pickles small, and rounds that replay a lineage carry one per round
        task = functools.partial(executor.round_task, cfg, base, bcs[0], carry_bcs, r, lr, deltas)
        return Job(r, lr, params, task, bcs, sum(broadcast_bytes(b) for b in bcs + new),
                   any(b is base for b in new), time.perf_counter() - p0)

    def _channel(self, cfg, model) -> channel.Channel:
        """The direct result channel's driver end, listening where the executors reach the driver."""
        expect = channel.expected(cfg, model)
        host = bind_host("", self.sc.master, self.sc.getConf().get("spark.driver.host"))
        try:
            return channel.Channel(expect, host, self.log, channel.max_frame_bytes(expect))
        except OSError as e:
            raise TrainingError(f"train.results = 'direct': cannot listen on {host}: {e.strerror or e}") from None

    def _drains(self, cfg, data, r: int, rounds: int) -> bool:
        """Whether round r+1's job waits for round r (overlap): after the last round, before an
        evaluation or a checkpoint due by count, and before a lineage cut."""
        t = cfg.train
        return (r >= rounds or due(r, t.checkpoint_every, rounds)
                or (due(r, t.eval_every, rounds) and (data.valid is not None or data.test is not None))
                or self.residuals.depth >= MAX_LINEAGE)

    def _carries(self, cfg, st: RunState) -> dict | None:
        """What each partition carries into the next round, for a lineage seeded from the driver."""
        return self.protocol.messages(st, "", {})[1] if cfg.train.overlap else None

    def _evaluate_round(self, cfg, data, st: RunState, sched, m: dict) -> bool:
        """Score held-out text into ``m``; step a plateau schedule; return whether this round is the best."""
        e0, best = time.perf_counter(), False
        if data.valid is not None:
            vl = self._evaluate_held_out(cfg, st.params, data, "valid")
            m.update(loss_fields(vl, cfg.data.level, "valid"))
            sched.observe(vl)
            st.schedule = sched.state
            best = improves(st.best, vl)
            if best:
                st.best = {"round": st.round, "valid_loss": vl}
            m["best_round"] = st.best["round"]
        if data.test is not None:
            m.update(loss_fields(self._evaluate_held_out(cfg, st.params, data, "test"), cfg.data.level, "test"))
        st.eval_s += time.perf_counter() - e0
        m["eval_s"] = round(st.eval_s, 3)
        return best

    def _evaluate_held_out(self, cfg, params, data: Corpus, name: str) -> float:
        self.dir.say_evaluating(name, data.held_out_tokens.get(name))
        self.sc.setJobDescription(f"rnnlm: evaluating {name}")
        return self.evaluate(cfg, params, data.valid if name == "valid" else data.test)

    def _stop(self, r: int, why: str):
        raise TrainingError(f"round {r}: {why}; stopped, {self.dir.kept()}")

    def evaluate(self, cfg, params, rdd) -> float:
        return evaluate_rdd(self.sc, cfg, params, rdd)

    def _checkpoint(self, cfg, vocab, st: RunState, best: bool = False):
        """Write the checkpoint of round ``st.round`` (and, with ``best``, the same files to ``best/``)."""
        if self.residuals is not None:
            st.held = self.residuals.collect()       # the last finished round's, even with the next running
        position = {"round": st.round, "tokens": st.tokens, "bytes_sent": st.bytes_sent,
                    "bytes_broadcast": st.bytes_broadcast, "wall_s": st.wall_s, "eval_s": st.eval_s, "best": st.best}
        view = self.params_bc.view
        if cfg.train.overlap:
            # the next round's job, defined already: what it trains from (its broadcast's parameters) and its rate
            view = self.params_bc.view if isinstance(self.params_bc, DeltaBroadcast) else self.next.params
            position["pending_lr"] = float(self.next.lr)
        optim, opt_t = SyncRound.to_optim(st, view, st.held if self.residuals else None)
        hidden = np.stack([st.states[p] for p in sorted(st.states)]) if st.states else None
        ck = checkpoint.Checkpoint(
            params=st.params, config=cfg, vocab=vocab, optim=optim, optim_t=opt_t, hidden=hidden,
            schedule=st.schedule, position=position)
        self.dir.write_checkpoint(ck, best)
        self.ck_time = time.monotonic()
        if self.residuals is not None:
            self.residuals.truncate(st.held, self._carries(cfg, st))    # not while a round runs


def _quiet(cfg) -> tuple:
    """Prefixes of the metrics a log line leaves out: the byte counters and per-block detail (the
    metrics file has them), and fields that say nothing in this run's setting."""
    x = cfg.exchange
    skip = ["bytes", "round_", "rows_", "block_bytes.", "unique_", "rebased", "seed_groups", "softmax_v",
            "phase.", "syncs", "device"]          # syncs = round, in rounds; device: said once at the start
    if x.embed == x.softmax == x.hidden == "dense":
        skip.append("compression")      # dense float32 blocks: 1 every round
    return tuple(skip)


def _description(cfg, r: int, rounds: int) -> str:
    """Spark UI's name of round ``r``'s job."""
    return f"rnnlm round {r}/{rounds}: {steps_label(cfg.train)} + treeAggregate"


def steps_label(t) -> str:
    """What a partition trains per round (``t``: the train section), for log lines."""
    return f"{t.local_steps} local steps" if t.local_steps else "one pass per round"


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


def round_metrics(cfg, layout, st: RunState, corpus_tokens: int, agg: Aggregate, bc_bytes: int, rebased: bool,
                  lr: float, round_s: float) -> dict:
    """The metrics line of round ``st.round`` (``st`` already moved on by it), before evaluation."""
    m = {"round": st.round, "epoch": round(st.tokens / corpus_tokens, 5), "tokens": st.tokens, "syncs": st.round,
         "bytes_sent": st.bytes_sent, "bytes_broadcast": st.bytes_broadcast,
         "round_bytes_sent": agg.wire_bytes, "round_bytes_broadcast": bc_bytes, "rebased": rebased,
         "wall_s": round(st.wall_s, 3), "round_s": round(round_s, 3), "compute_s": round(agg.stats["compute_s"], 3),
         "tokens_per_s": round(agg.stats["tokens"] / max(1e-9, round_s)),
         "train_loss": agg.stats["loss_sum"] / max(1, agg.stats["tokens"]), "lr": lr,
         "unique_words": int(len(agg.words)),
         "device": executor.device_field(agg.stats.get("gpu_partitions", 0), cfg.data.partitions)}
    # what travelled per parameter group (Zipf's law for the exchange: unique_words against tokens)
    m.update({k: v for k, v in sorted(agg.stats.items()) if k.startswith(("rows_", "block_bytes."))})
    sent = sum(v for k, v in agg.stats.items() if k.startswith("block_bytes."))
    m["compression"] = round(layout.size * 4 * cfg.data.partitions / max(1, sent), 3)
    m["seed_groups"] = plan.seed_groups(cfg.exchange.seed_groups, cfg.data.partitions)
    if cfg.exchange.sampled_softmax:      # mean sampled softmax sets per local step
        for k in ("softmax_v_all", "softmax_v_f"):
            m[k] = round(agg.stats.get(k, 0) / max(1, agg.stats["steps"]), 1)
    return m
