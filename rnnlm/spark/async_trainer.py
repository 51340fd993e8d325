"""Asynchronous training (``train.mode = "async"``): a parameter server on the driver.

The driver serves :class:`rnnlm.server.paramserver.ParameterServer` behind an authenticated
:class:`rnnlm.server.wire.FrameServer` where the executors reach it (``server.host``, else
:func:`bind_host`'s choice), runs one Spark job of one long-running task per partition
(:func:`rnnlm.spark.async_task.worker_task`), and meanwhile writes a metrics line per
``data.partitions`` pushes, evaluates held-out text locally and checkpoints the server's state.
docs/async.md says what this guarantees and what a driver failure loses.
"""
from __future__ import annotations

import math
import time

from .. import config
from ..core import checkpoint
from ..core.local import held_out_nll
from ..core.metrics import log_line, loss_fields, number
from ..core.models import build as build_model
from ..core.schedule import Schedule, improves
from ..server import wire
from ..server.paramserver import (ParameterServer, Stalled, max_push_bytes, server_connections, server_idle_s,
                                  server_in_flight)
from .async_task import worker_task
from .rundir import Driver, Init, RunDir, TrainingError, async_finished, best_record, resume_keys
from .session import bind_host, job_failure
from .stop import Interrupted, StopRequest
from .corpus import load_corpus, scored, total_rounds, unpersist_corpus
from .executor import device_field


class AsyncTrainer(Driver):
    """The driver of one asynchronous run (the same constructor and outputs as
    :class:`rnnlm.spark.trainer.Trainer`; after :meth:`run`, ``server`` and its ``frames`` as well)."""

    def run(self, resume: bool = False, data=None, overwrite: bool = False, init: Init | None = None) -> dict:
        # set up: the run directory, where it starts (nothing to do is known before any data is read when
        # train.rounds gives the length), the corpus
        self._prepare(resume, overwrite, init)
        ck = self._load_checkpoint() if resume else None
        t = self.cfg_in.train
        if ck is not None and t.rounds and async_finished(ck.position, t.rounds):
            self.cfg = config.resolve(self.cfg_in, len(ck.vocab))
            self.params, self.vocab = ck.params, ck.vocab
            return self.dir.nothing_to_do(ck.position["round"], t.rounds)
        probe_cfg = config.replace(self.cfg_in, "train", local_steps=t.push_every)
        owned = data is None
        data = data or load_corpus(self.sc, probe_cfg, ck.vocab if ck else init and init.checkpoint.vocab, self.status)
        ended = True          # until the job starts, no task of this run holds an executor
        try:
            cfg = self.cfg = config.resolve(self.cfg_in, len(data.vocab))
            model = build_model(cfg.model)
            self.layout, P = model.layout, cfg.data.partitions
            per = scored(probe_cfg, data)          # a window's tokens and an epoch's
            windows = total_rounds(probe_cfg, data, per)
            if ck is not None and async_finished(ck.position, windows):
                self.params, self.vocab = ck.params, data.vocab
                return self.dir.nothing_to_do(ck.position["round"], windows)
            self.dir.write_info(self.sc, cfg, resume, data.devices, init, data.record())
            server = self._server(cfg, model, windows, ck, init)
            params = server.params
            held_out = {name: _collect(rdd) for name, rdd in (("valid", data.valid), ("test", data.test))
                        if rdd is not None}
            secret = wire.new_secret()
            frames = self._listen(cfg, server, params, secret)
            try:
                self.dir.say_start(
                    f"vocab {len(data.vocab):,} | params {params.size:,} | train tokens {data.tokens:,} | "
                    f"{P} workers x {windows} windows of {t.push_every} steps | server {frames.address[0]}:"
                    f"{frames.address[1]} ({'locked' if cfg.server.lock else 'lock-free'}, {cfg.server.update}, "
                    f"staleness {cfg.server.staleness})", data.devices, cfg.train.device,
                    None if ck is None else f"resumed from round {ck.position['round']} (version "
                    f"{ck.position['version']})", init)
                # the loop: the job's windows, metrics lines, evaluations and checkpoints
                lrs = window_lrs(cfg, per.round, per.epoch, windows)
                run = _Run(self.dir, cfg, data, per.epoch, server, frames, model, held_out, lrs,
                           ck.position if ck else {})
                task = worker_task(cfg, frames.address, secret, lrs)
                stop = StopRequest(self.log)
                job, ended = _Job(self.sc, data.train, task), False
                try:
                    run.loop(job, stop)
                    ended = True
                except Interrupted:             # stopped by request, checkpointed: the executors are there to answer
                    ended = True
                    raise
                except KeyboardInterrupt:
                    job.cancel()
                    raise Interrupted(f"interrupted; {self.dir.kept()}", stop.signum) from None
                except Stalled as e:            # a checkpoint that cannot be consistent: stop rather than wait
                    raise TrainingError(f"{e}; stopped, {self.dir.kept()}") from None
                finally:
                    stop.release()
                    job.cancel()
            finally:
                frames.close()
                server.flush_log()
        finally:
            # tear down: a run that ended waits for the executors' answers (the session may stop next)
            if owned:
                unpersist_corpus(data, blocking=ended)
        self.params, self.vocab, self.server, self.frames = server.params, data.vocab, server, frames
        return self.metrics[-1]

    def _server(self, cfg, model, windows: int, ck, init: Init | None) -> ParameterServer:
        """The parameter server, from the checkpoint ``ck`` being resumed, ``init``'s weights, or the seed's."""
        state = None
        if ck is not None:
            pos = ck.position
            state = {"version": pos["version"], "done": pos["done"], "totals": pos["totals"]}
            if "server.acc" in ck.optim:
                state["acc"] = ck.optim["server.acc"]
        elif init and init.keep_optimizer and "server.acc" in init.checkpoint.optim:
            state = {"acc": init.checkpoint.optim["server.acc"]}        # a new run: version 0, no window done
        params = ck.params if ck else init.checkpoint.params if init else model.init_params(cfg.train.seed)
        return ParameterServer(model.layout, params, cfg.server, windows, cfg.data.partitions, state, log=self.log)

    def _listen(self, cfg, server: ParameterServer, params, secret: bytes) -> wire.FrameServer:
        """The server's authenticated listener, where the executors reach it."""
        sv, P = cfg.server, cfg.data.partitions
        host = bind_host(sv.host, self.sc.master, self.sc.getConf().get("spark.driver.host"))
        max_frame = int(sv.max_frame_mb * (1 << 20))
        push = max_push_bytes(self.layout, params.itemsize)
        if push > max_frame:
            raise config.ConfigError(f"server.max_frame_mb = {sv.max_frame_mb:g} is smaller than a push can be "
                                     f"({push / (1 << 20):.2f} MiB: the model's {params.nbytes / (1 << 20):.2f} "
                                     "MiB with its rows' ids and scales): it would be refused")
        if P > self.sc.defaultParallelism:
            self.log(f"warning: {P} workers but {self.sc.defaultParallelism} task slots: the tasks that do not "
                     "fit wait for a slot, then train all their windows")
        try:
            return wire.FrameServer(server.handle, secret, host, sv.port, max_frame, timeout=sv.timeout_s,
                                    log=self.log, max_connections=server_connections(P), idle=server_idle_s(sv),
                                    max_in_flight=server_in_flight(self.layout, params.itemsize, P,
                                                                   max_frame)).start()
        except OSError as e:
            raise TrainingError(f"the parameter server cannot listen on {host}:{sv.port}: "
                                f"{e.strerror or e} (set server.host / server.port)") from None

    def _load_checkpoint(self):
        ck = self.dir.read_checkpoint(self.cfg_in, resume_keys(self.cfg_in))
        lines = [m for m in self.dir.saved_lines(("round", "syncs")) or [] if m["syncs"] <= ck.position["version"]]
        line = ck.position.get("line")
        if line and (not lines or lines[-1]["syncs"] < line["syncs"]):
            lines.append(line)        # the driver died between the checkpoint and its line (the loader checked it)
        elif lines and not all(number(lines[-1].get(k)) is not None and lines[-1][k] >= 0
                               for k in checkpoint.LINE_AMOUNTS):       # the next line subtracts them
            raise TrainingError(f"{self.dir.metrics_path}: the line of round {lines[-1]['round']}, which a resume "
                                f"goes on from, lacks {', '.join(checkpoint.LINE_AMOUNTS)} (numbers >= 0): mend "
                                "it, or start again with --overwrite")
        self.dir.keep_lines(lines)
        return ck


class _Job:
    """The training job, run from a thread so the driver can log, evaluate and checkpoint meanwhile."""

    def __init__(self, sc, rdd, task):
        from pyspark import InheritableThread
        self.sc, self.group = sc, f"rnnlm-async-{id(self)}"
        self.result, self.error = None, None
        self.thread = InheritableThread(target=self._run, args=(rdd, task), daemon=True)
        self.thread.start()

    def _run(self, rdd, task):
        self.sc.setJobGroup(self.group, "rnnlm async training: one long task per partition", True)
        try:
            self.result = rdd.mapPartitions(task).collect()
        except Exception as e:           # py4j carries the executor's traceback: keep its cause
            self.error = job_failure(str(e)) or type(e).__name__
        finally:
            self.sc.setJobGroup(None, None)

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def cancel(self):
        if self.running:
            self.sc.cancelJobGroup(self.group)
            self.thread.join(timeout=60)


class _Run:
    """The driver's loop over one async run: metrics lines, evaluations, checkpoints."""

    def __init__(self, rundir: RunDir, cfg, data, per_epoch: int, server, frames, model, held_out, lrs: list,
                 position):
        self.dir, self.cfg, self.data, self.server, self.frames = rundir, cfg, data, server, frames
        self.per_epoch = per_epoch      # the tokens of a pass over every partition
        self.model, self.held_out, self.lrs, self.windows = model, held_out, lrs, len(lrs)
        self.tokens = position.get("tokens", 0)
        self.eval_s = position.get("eval_s", 0.0)      # the driver's time scoring held-out text (inside wall_s)
        self.wall = position.get("wall_s", 0.0)
        self.sent0, self.bcast0 = position.get("bytes_sent", 0), position.get("bytes_broadcast", 0)
        self.last_eval = position.get("round", 0) // max(1, cfg.train.eval_every) if cfg.train.eval_every else 0
        self.eval_pending = False       # an evaluation put off to the next line, which is a checkpoint's
        # best/ may be ahead of the checkpoint (the driver died between the two writes), holding a round this
        # run's rounds, which differ, need not match: it stays best until one beats it
        self.best = best_record(position.get("best"))
        if position:
            saved = rundir.best_saved()
            if saved is not None and improves(self.best, saved["valid_loss"]):
                self.best = saved
        self.held_out_tokens = {name: sum(len(x) for x in streams) for name, streams in held_out.items()}
        self.ck_time, self.ck_version = time.monotonic(), server.version
        self.scored = (None, {})        # the version last evaluated and its fields (the last line repeats them)

    def loop(self, job: _Job, stop: StopRequest):
        P, sv = self.cfg.data.partitions, self.cfg.server
        t0 = time.perf_counter()
        while True:
            n = self.server.wait(P, timeout=min(1.0, sv.heartbeat_s))
            self.server.check_workers()
            done = not job.running
            if self.server.failures:        # before a line: its checkpoint would hold a push half applied
                job.cancel()
                self._stop_on_failure()
            if n >= P and not done:
                self._line(t0, checkpoint=self._checkpoint_due())
            if job.error:
                told = sorted(self.server.told_stuck)      # and no attempt of their task has said hello since
                ended = (f" (partition {told[0]}'s worker, found stuck, was ended, and spark.task.maxFailures allows "
                         "its task no retry)" if told else "")
                raise TrainingError(f"async training job failed{ended}: {job.error}; {self.dir.kept()}")
            errors = [f"partition {pid}: {err}" for pid, _, err in (job.result or []) if err]
            if errors:
                raise TrainingError(f"{errors[0]}; stopped, {self.dir.kept()}")
            if done:                # every window trained: a stop asked for now gets the run's last line
                break
            if stop.requested:
                job.cancel()
                kept = self._line(t0, checkpoint=True)["syncs"]   # cancelled tasks' pushes may land after it
                raise Interrupted(f"interrupted at version {kept}; its checkpoint is in "
                                  f"{self.dir.ck_path} (--resume continues)", stop.signum)
            if self._checkpoint_due():             # by time, between lines
                self._line(t0, checkpoint=True)
        lost = self._line(t0, final=True, checkpoint=True)["windows_lost"]
        if lost:
            raise TrainingError(f"the job ended with {lost} windows never applied (see {self.dir.metrics_path})")

    def _stop_on_failure(self) -> None:
        """TrainingError for the server's first failure (a push that failed to apply, a worker's error)."""
        if self.server.failures:
            raise TrainingError(f"{self.server.failures[0]}; stopped, {self.dir.kept()}")

    def _checkpoint_due(self) -> bool:
        sv = self.server.sv
        return ((sv.checkpoint_s and time.monotonic() - self.ck_time >= sv.checkpoint_s)
                or (sv.checkpoint_pushes and self.server.version - self.ck_version >= sv.checkpoint_pushes))

    def _line(self, t0, final: bool = False, checkpoint: bool = False) -> dict:
        """Write a metrics line (evaluating when due); with ``checkpoint``, first a checkpoint of
        the server taken at the same instant as the line's counters, so the checkpoint holds
        exactly the pushes of the lines up to this one (``--resume`` keeps those lines).

        A line that evaluates is a checkpoint's (``best/`` is one): whether it evaluates is known
        from the version its snapshot drains; a line whose round passed an evaluation while it was
        being taken without a snapshot leaves the evaluation to the next line, which takes one."""
        srv, P = self.server, self.cfg.data.partitions
        every = self.cfg.train.eval_every

        def eval_due(rnd):
            return final or self.eval_pending or bool(every and rnd // every > self.last_eval)
        checkpoint = checkpoint or (bool(self.held_out) and eval_due(math.ceil(srv.version / P)))
        snap = srv.snapshot(drain=True) if checkpoint else None
        taken = time.monotonic()        # the checkpoint's instant: the next one by time is due checkpoint_s after it
        self._stop_on_failure()         # a push that failed while the snapshot waited for it: not checkpointed
        s = snap["drained"] if snap else srv.drain()
        version = s["syncs"]
        self.tokens += s.get("tokens", 0)
        rnd = math.ceil(version / P)
        first = {"wall_s": self.wall, "bytes_sent": self.sent0, "bytes_broadcast": self.bcast0}
        prev = self.dir.metrics[-1] if self.dir.metrics else first
        sent, bcast = self.sent0 + self.frames.bytes_received, self.bcast0 + self.frames.bytes_sent
        m = {"round": rnd, "epoch": round(self.tokens / self.per_epoch, 5), "tokens": self.tokens,
             "syncs": version, "pushes": s.get("pushes", 0), "pulls": s.get("pulls", 0),
             "staleness": s["staleness"], "bytes_sent": sent, "bytes_broadcast": bcast,
             "round_bytes_sent": sent - prev["bytes_sent"], "round_bytes_broadcast": bcast - prev["bytes_broadcast"],
             "wall_s": None, "tokens_per_s": None,       # once the line's own evaluation is done (below)
             **_train_loss(s), "lr": self.lrs[min(max(1, rnd), self.windows) - 1],   # round r's at lrs[r - 1]
             "device": device_field(sum(d["ran"] != "cpu" for d in self.data.devices.values()), P)}
        m.update(sorted((snap["totals"] if snap else srv.totals).items()))     # the checkpoint's, when it has one
        if self.frames.refused:
            m["refused_wire"] = dict(self.frames.refused)
        if final:       # windows no attempt applied: none, unless a partition's every attempt failed
            m["windows_lost"] = sum(max(0, self.windows - d) for d in snap["done"])     # a last line checkpoints
        best = False
        if eval_due(rnd) and snap is None and self.held_out:
            self.eval_pending = True
        elif eval_due(rnd) and snap and self.scored[0] == snap["version"]:    # no push since: the same parameters
            self.last_eval, self.eval_pending = rnd // every if every else 0, False
            m.update(self.scored[1], eval_s=round(self.eval_s, 3))
        elif eval_due(rnd):
            self.last_eval, self.eval_pending = rnd // every if every else 0, False
            e0, scored = time.perf_counter(), {}
            for name, streams in self.held_out.items():
                self.dir.say_evaluating(name, self.held_out_tokens[name])
                loss = _evaluate(self.model, snap["params"], streams)
                scored.update(loss_fields(loss, self.cfg.data.level, name))
                if name == "valid":
                    best = improves(self.best, loss)
                    if best:
                        self.best = {"round": rnd, "valid_loss": loss}
                    scored["best_round"] = self.best["round"]
            self.eval_s += time.perf_counter() - e0
            self.scored = (snap["version"], scored)
            m.update(scored, eval_s=round(self.eval_s, 3))
        wall = self.wall + time.perf_counter() - t0     # with this line's evaluation, which eval_s counts
        m["wall_s"] = round(wall, 3)
        m["tokens_per_s"] = round(s.get("tokens", 0) / max(1e-9, wall - prev["wall_s"]))     # as a round's, whole
        if snap:
            position = {"round": rnd, "tokens": self.tokens, "eval_s": self.eval_s, "wall_s": wall,
                        "bytes_sent": sent, "bytes_broadcast": bcast, "best": self.best, "line": m}
            self.dir.write_checkpoint(_server_checkpoint(self.cfg, self.data.vocab, snap, position), best)
            self.ck_time, self.ck_version = taken, snap["version"]
        quiet = ("bytes", "round_", "staleness", "refused_", "attempts_", "device")
        self.dir.add_line(m, self.windows, log_line(m, skip=quiet))
        return m


def _server_checkpoint(cfg, vocab, snap: dict, position: dict) -> checkpoint.Checkpoint:
    """The checkpoint of a server snapshot at the line ``position`` describes."""
    optim = {} if snap["acc"] is None else {"server.acc": snap["acc"]}
    pos = dict(position, version=snap["version"], done=snap["done"], totals=snap["totals"])
    return checkpoint.Checkpoint(params=snap["params"], config=cfg, vocab=vocab, optim=optim, position=pos)


def _train_loss(drained: dict) -> dict:
    """``train_loss`` of the pushes a line counts; a line without any (the last one, often) has
    none: a 0.0 there read as a perfect model in the log and on plots."""
    tokens = drained.get("tokens", 0)
    return {"train_loss": drained.get("loss_sum", 0.0) / tokens} if tokens else {}


def _collect(rdd) -> list:
    """The held-out streams' tokens, on the driver (the training job holds every executor core)."""
    return [tokens for _, tokens, _ in rdd.collect()]


def _evaluate(model, params, streams) -> float:
    total, count = held_out_nll(model, params, streams)
    return total / max(1, count)


def window_lrs(cfg, per_window: float, per_epoch: float, windows: int) -> list:
    """The learning rate of each window (its epoch: the ``per_window`` tokens of each window every worker
    trained, over an epoch's ``per_epoch``; multiplied before the division, so that a window starting a
    whole epoch is not read a bit short of it, at the previous epoch's rate)."""
    sched = Schedule(cfg.optim)
    return [sched.lr(w * per_window / per_epoch) for w in range(windows)]
