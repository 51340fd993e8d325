"""The long-running Spark task of the asynchronous mode: one per partition.

It announces itself to the parameter server, then for each window from the
first one the server has not applied: ``train.push_every`` local steps (the same
batches, samplers and encoding as round ``window + 1`` of the synchronous
trainer), a push of the change, and training continues from the parameters in
the reply. The optimizer state, the carried hidden state and the error-feedback
residual stay in the task. A retried task starts again from the server's
parameters at its first window not applied, with a fresh optimizer state and
hidden state (what the dead attempt held is lost with it).

The task captures plain values only: the configuration as JSON, the server's
address and the run's secret.
"""
from __future__ import annotations

import time

import numpy as np

from .. import config
from ..core import backend
from ..core.local import train_steps
from ..core.model import build as build_model
from ..core.optim import make_optimizer
from ..exchange import plan
from ..exchange.paramserver import WorkerClient
from .executor import _digest, _memo, make_source, task_xp


def worker_task(cfg_json: str, address: tuple, secret: bytes, lrs: list):
    """The ``mapPartitions`` function: yields one summary per partition (pid, windows trained, error).

    ``lrs[w]`` is window w's learning rate (the schedule at the epoch every worker reaches there).
    """
    def run(it):
        cfg = config.from_json(cfg_json)
        t = cfg.train
        xp = task_xp(t.device)
        model = _memo(("model", cfg_json, backend.device_key(xp)), lambda: build_model(cfg.model, xp=xp))
        for pid, tokens, starts in it:
            client = WorkerClient(address, secret, pid, cfg.server, model.layout)
            trained, finished, error = 0, False, None
            try:
                first, windows, version, host = client.hello()
                src = _memo(("source", cfg_json, pid, _digest(tokens, starts)),
                            lambda: make_source(cfg, pid, tokens, starts))
                opt = make_optimizer(cfg.optim)
                params = xp.array(host)
                opt_state = opt.init_state(params)
                state = model.zero_state(t.batch)
                residual = None
                for w in range(first, windows):
                    if client.stopped:
                        raise RuntimeError(f"partition {pid}: superseded by a newer attempt at window {w}")
                    client.training(w)
                    t0 = time.perf_counter()
                    rnd = w + 1
                    batches = src.round_batches(rnd, t.push_every)
                    drop = backend.rng_for(xp, t.seed, rnd, pid, 0xD0) if cfg.model.dropout else None
                    sets = (plan.SoftmaxSampler(model.V, cfg.exchange, t.seed, rnd, pid, cfg.data.partitions)
                            if cfg.exchange.sampled_softmax else None)
                    res = train_steps(model, opt, params, opt_state, batches,
                                      state if src.carries_state else model.zero_state(t.batch),
                                      lr=lrs[w], clip_norm=cfg.optim.clip_norm,
                                      clip_value=cfg.optim.clip_value, grad_norm=t.grad_norm,
                                      dropout_rng=drop, softmax_sets=sets)
                    state = res.state
                    words = np.unique(np.concatenate([np.concatenate([b.x.ravel(), b.y[b.y >= 0]])
                                                      for b in batches]))
                    change = backend.to_numpy(res.params) - host
                    blocks, _, residual = plan.encode(model.layout, change, cfg.exchange, words, t.seed, rnd, pid,
                                                      cfg.data.partitions, residual)
                    reply = client.push(w, version, blocks, host, tokens=res.tokens, loss_sum=res.loss_sum,
                                        steps=res.steps, compute_s=time.perf_counter() - t0)
                    trained += 1
                    if reply is None:     # a newer attempt took over: fail, so Spark keeps that one's result
                        raise RuntimeError(f"partition {pid}: superseded by a newer attempt at window {w}")
                    _, version = reply                         # host now holds the server's parameters
                    params = xp.array(host)
                finished = True
            except FloatingPointError as e:
                error = str(e)
                client.fail(error)         # the driver stops the run now, not when the other workers finish
            finally:
                client.close(finished)
            yield pid, trained, error
    return run
