"""The long-running Spark task of the asynchronous mode: one per partition.

Per window from the first one the server has not applied: ``train.push_every`` local steps (as
round ``window + 1`` of the synchronous trainer), a push of the change, and training on from the
parameters in the reply; optimizer state, hidden state and residual stay in the task, and a retry
starts afresh from the server's (docs/async.md, "Worker failure"). An attempt a newer one supersedes
stands by until the partition is finished or the newer one is gone. The task captures plain values
only: the configuration (resolved on the driver), the server's address and the run's secret.
"""
from __future__ import annotations

import functools
import os
import sys
import time

from .. import config
from ..core import backend
from ..core.models import build as build_model
from ..core.optim import make_optimizer
from ..server.worker import WorkerClient
from .executor import make_source, task_xp, train_and_encode
from . import memo
from .memo import digest


def worker_task(cfg: config.Config, address: tuple, secret: bytes, lrs: list):
    """The ``mapPartitions`` function: yields one summary per partition (pid, windows trained, error).

    ``lrs[w]`` is window w's learning rate (the schedule at the epoch every worker reaches there). An attempt
    superseded by a newer one (a speculative copy, a retry beside a zombie) stands by rather than failing, and
    trains on if the newer one goes (:meth:`~rnnlm.server.worker.WorkerClient.standby`).
    """
    def run(it):
        t = cfg.train
        try:
            xp = task_xp(t.device)
        except RuntimeError as e:           # no device here: a retry would meet the same, so an answer, not a failure
            for pid, _, _ in it:
                yield pid, 0, str(e)
            return
        model = memo.MEMO.get(("model", cfg.model, backend.device_key(xp)), lambda: build_model(cfg.model, xp=xp))
        for pid, tokens, starts in it:
            client = WorkerClient(address, secret, pid, cfg.server, model.layout,
                                  on_stuck=functools.partial(end_stuck, pid))
            trained, error = 0, None
            try:
                src = memo.MEMO.get(("source", cfg, pid, digest(tokens, starts)),
                                    lambda: make_source(cfg, pid, tokens, starts))
                while True:
                    trained += _train_windows(cfg, model, src, client, lrs, xp)
                    if not client.superseded or not client.standby():
                        break
            except FloatingPointError as e:
                error = str(e)
                client.fail(error)         # the driver stops the run now, not when the other workers finish
            finally:
                client.close()
            yield pid, trained, error
    return run


def end_stuck(pid: int, reason: str) -> None:
    """The parameter server found this attempt stuck (its heartbeats arrive, its windows do not): its training
    thread may be blocked anywhere (a read that never returns, a device that hangs), where no exception reaches
    it, so the Python worker ends at once. Spark counts a failed attempt and retries the task, which resumes
    at the first window not applied (``spark.task.maxFailures``; a local master's default of 1 fails the job,
    and the run stops with its checkpoint kept)."""
    sys.stderr.write(f"rnnlm: partition {pid}: the parameter server found this task stuck ({reason}); "
                     "ending its Python worker so that Spark retries the task\n")
    sys.stderr.flush()
    os._exit(STUCK_EXIT)


STUCK_EXIT = 75         # EX_TEMPFAIL: another attempt may succeed


def _train_windows(cfg, model, src, client: WorkerClient, lrs: list, xp) -> int:
    """One attempt's tenure: hello, then the windows from the first the server has not applied, each pushed, until
    the last or until a push answers that a newer attempt took over (``client.superseded``); the windows applied.
    Optimizer state, hidden state and residual start afresh from the server's parameters."""
    t = cfg.train
    first, windows, version, host = client.hello()
    opt = make_optimizer(cfg.optim)
    params = xp.array(host)
    opt_state = opt.init_state(params)
    state = model.zero_state(t.batch)
    residual = None
    for w in range(first, windows):
        client.training(w)
        t0 = time.perf_counter()
        res, blocks, _, residual, _, _ = train_and_encode(
            cfg, model, src, opt, params, opt_state, state, host, w + 1, client.pid, lrs[w], t.push_every,
            residual, by_tokens=False)
        state = res.state if src.carries_state else model.zero_state(t.batch)
        version = client.push(w, version, blocks, host, tokens=res.tokens, loss_sum=res.loss_sum,
                              steps=res.steps, compute_s=time.perf_counter() - t0)
        if version is None:                        # this push was refused: not applied
            return w - first
        params = xp.array(host)                    # host now holds the server's parameters
    return windows - first
