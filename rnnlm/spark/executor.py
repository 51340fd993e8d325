"""What runs inside Spark tasks. Functions here capture plain values and
broadcast handles only (never the SparkContext or a driver object), so every
task is a pure function of (broadcasts, round, partition data): a retried task
reproduces its result exactly.

Tasks receive the run's configuration resolved and validated once, on the driver
(:func:`rnnlm.config.resolve`), as a frozen dataclass.

A task that cannot train (a non-finite loss, no usable GPU) reports the error in
its result instead of raising: Spark would retry a raising task, and the retry
would fail the same way.
"""
from __future__ import annotations

import hashlib
import os
import socket
import time

import numpy as np

from ..core import backend, sampled
from .. import config
from ..exchange import plan
from ..exchange.round import Carry, SyncRound, view
from ..core.local import held_out_nll, train_steps
from ..core.models import build as build_model
from ..core.optim import make_optimizer
from ..core.strategies import Source, TooShort
from . import memo
from .memo import digest


EXECUTOR_STAT = "executor."      # + this executor's key: the partitions it ran in the round (summed when merged)


def executor_key() -> str:
    """This executor's name among a round's statistics: its host and block manager directories (Spark
    gives each executor its own; in local mode the driver's), hashed to 12 hex digits."""
    where = f"{socket.gethostname()}|{os.environ.get('SPARK_LOCAL_DIRS', '')}"
    return hashlib.sha1(where.encode()).hexdigest()[:12]


def executors(stats: dict) -> int:
    """The executors that ran a round's tasks, from its merged statistics."""
    return sum(k.startswith(EXECUTOR_STAT) for k in stats)


def assigned_gpus() -> list:
    """The GPU addresses Spark assigned this task (``spark.task.resource.gpu.amount``), [] if none."""
    from pyspark import TaskContext
    ctx = TaskContext.get()
    gpus = ctx.resources().get("gpu") if ctx is not None else None
    return list(gpus.addresses) if gpus is not None else []


def task_xp(device: str):
    """The array module for this task: NumPy, or CuPy on the GPU Spark assigned it (its first address).

    ``auto`` runs on the CPU where CuPy or a CUDA device is missing, whatever Spark assigned; ``gpu``
    then raises RuntimeError.
    """
    xp = backend.get_xp(device)
    if xp is not np:
        gpus = assigned_gpus()
        if gpus:
            backend.use_gpu(gpu_index(gpus[0]))
    return xp


def gpu_index(address: str) -> int:
    """The CUDA device index of a GPU address Spark assigned (RuntimeError, the task's one-line answer,
    where the discovery script gave something else: a retry would meet the same)."""
    try:
        index = int(address)
    except ValueError:
        index = -1
    if index < 0:
        raise RuntimeError(f"Spark assigned the GPU address {address!r}, not a CUDA device index: the discovery "
                           "script (spark.*.resource.gpu.discoveryScript) must print indices, as nvidia-smi's")
    return index


def device_label(xp) -> str:
    """Where a task computes: ``cpu``, or ``gpu N`` (the CUDA device index)."""
    key = backend.device_key(xp)
    return "cpu" if key == "numpy" else "gpu " + key.split(":")[1]


def device_field(gpu_partitions: int, partitions: int) -> str:
    """A metrics line's ``device``: ``cpu``, ``gpu``, or ``gpu+cpu`` when only some partitions had one."""
    return "cpu" if gpu_partitions == 0 else "gpu" if gpu_partitions >= partitions else "gpu+cpu"


def make_source(cfg: config.Config, pid: int, tokens, starts) -> Source:
    d, t = cfg.data, cfg.train
    return Source(d.strategy, tokens, starts, t.batch, t.bptt, stride=d.window_stride,
                  fraction=d.sample_fraction, seed=t.seed, partition=pid)


def probe_task(cfg: config.Config):
    """Per partition: (pid, tokens, expected tokens per round, tokens per epoch, error message or None,
    device, the digest of its tokens and paragraph starts), the device a dict: ``ran`` (:func:`device_label`,
    None on error), ``assigned`` (Spark's GPU addresses), ``arithmetic`` (what else fixes its numbers:
    :func:`rnnlm.core.backend.arithmetic`)."""
    def run(it):
        device = {"ran": None, "assigned": assigned_gpus()}
        try:
            xp = task_xp(cfg.train.device)
            device["ran"], device["arithmetic"] = device_label(xp), backend.arithmetic(xp)
            device_error = None
        except RuntimeError as e:
            device_error = str(e)
        for pid, tokens, starts in it:
            if device_error:
                yield pid, len(tokens), 0.0, 0, device_error, device, None
                continue
            try:
                src = make_source(cfg, pid, tokens, starts)
                yield (pid, len(tokens), src.round_tokens(cfg.train.local_steps), src.epoch_tokens(), None, device,
                       digest(tokens, starts))
            except TooShort as e:
                yield pid, len(tokens), 0.0, 0, str(e), device, None
    return run


def round_task(cfg: config.Config, bc_base, bc, bc_carry: dict, rnd: int, lr: float, deltas=(), sink=None, *,
               chained: bool, carries_in_spark: bool):
    """One round on one partition from the broadcast state (:mod:`rnnlm.exchange.round`).

    ``bc_base`` is the parameters' base (kept by executors across rounds) and ``bc`` the
    round's :class:`~rnnlm.exchange.round.RoundMessage`; ``deltas`` are the broadcasts of
    :class:`rnnlm.spark.broadcasts.DeltaBroadcast`, added to the base in order (an executor
    caches its sum, the view, per base); ``bc_carry`` maps a partition to a broadcast of its
    :class:`~rnnlm.exchange.round.Carry`, so an executor fetches only its own partitions' share.

    With ``chained`` (the partitions' carryover stays in Spark, as
    :class:`rnnlm.spark.allreduce.AllReduce` decides) the task reads
    :class:`rnnlm.spark.lineage.Lineage`' elements ``(pid, tokens, starts, held, carry)`` and
    yields the next round's; its contribution goes to the accumulator ``sink`` (with None it is
    yielded before the element). ``held`` maps :attr:`rnnlm.exchange.round.StateKeys.HELD`
    names to what the partition holds between rounds: error feedback's residual
    (``"feedback"``) and with ``train.eager`` its last change (``"eager"``). The carry is read
    from the element and the next one emitted into it with ``carries_in_spark`` (under
    ``train.overlap``), else it comes from ``bc_carry`` and the element's is None. Without
    ``chained`` the task reads ``(pid, tokens, starts)`` and yields its contribution.

    ``train.eager`` (Kale et al. 2025, "Eager Updates for Overlapped Communication and
    Computation in DiLoCo"): under overlap a round trains from parameters that lack the round
    before's mean change; the partition starts from them plus its own share of that mean, its
    own last change over the partition count. Its contribution is its change from that start,
    so each change still counts once.
    """
    def run(it):
        started = time.time()       # wall clock: the driver sets it against the job's submission
        t = cfg.train
        items = (x if chained else (*x, None, None) for x in it)

        def emit(contribution, pid, tokens, starts, held, carry):
            if sink is not None:
                sink.add(contribution)
            else:
                yield contribution
            if chained:
                yield pid, tokens, starts, held, carry
        try:
            xp = task_xp(t.device)
        except RuntimeError as e:
            for pid, tokens, starts, held, carry in items:
                yield from emit(SyncRound.failed(pid, str(e)), pid, tokens, starts, held, carry)
            return
        msg = bc.value
        model = memo.MEMO.get(("model", cfg.model, backend.device_key(xp)), lambda: build_model(cfg.model, xp=xp))
        protocol = SyncRound(model.layout, t, cfg.data.partitions)
        v0 = time.perf_counter()
        host = view(model.layout, bc_base, msg, deltas, memo.MEMO)      # the parameters the driver sent
        view_s = time.perf_counter() - v0
        for pid, tokens, starts, held, spark_carry in items:
            t0 = time.perf_counter()
            held = held or {}
            opt = make_optimizer(cfg.optim)
            start = host + held["eager"] / cfg.data.partitions if t.eager and "eager" in held else host    # (P,)
            params = xp.array(start)
            carry = spark_carry if spark_carry is not None else bc_carry[pid].value if pid in bc_carry else Carry()
            opt_state = protocol.start(msg, carry, opt, params, xp.array)
            src = memo.MEMO.get(("source", cfg, pid, digest(tokens, starts)),
                                lambda: make_source(cfg, pid, tokens, starts))
            state = carry.state if src.carries_state else None
            state = model.zero_state(t.batch) if state is None else xp.asarray(state)
            try:
                res, blocks, block_stats, left, words, change = train_and_encode(
                    cfg, model, src, opt, params, opt_state, state, start, rnd, pid, lr, t.local_steps,
                    held.get("feedback"), by_tokens=True)
            except FloatingPointError as e:
                yield from emit(protocol.failed(pid, str(e)), pid, tokens, starts, held, spark_carry)
                continue
            block_stats.update({"task_start": started, "task_end": time.time(), "view_s": view_s,
                                "gpu_partitions": int(xp is not np), EXECUTOR_STAT + executor_key(): 1})
            agg = protocol.contribution(pid, res, blocks, block_stats, src.carries_state, words,
                                        time.perf_counter() - t0, backend.to_numpy)
            keep = {"feedback": left, "eager": change if t.eager else None}
            yield from emit(agg, pid, tokens, starts, {k: v for k, v in keep.items() if v is not None},
                            agg.local[pid] if carries_in_spark else None)
    return run


def train_and_encode(cfg, model, src, opt, params, opt_state, state, host, rnd: int, pid: int, lr: float,
                     steps: int, residual, *, by_tokens: bool):
    """Round ``rnd``'s ``steps`` local steps of partition ``pid`` from ``params`` (on the device; ``host``
    is the same on the host), and its change encoded as :func:`rnnlm.exchange.plan.encode` sends it.
    ``by_tokens``: the change weighs its scored tokens where it is applied (the synchronous round's mean;
    the server applies any push), so a round that scored none keeps its residual whole.

    The synchronous round and the asynchronous window share it: the same batches, dropout masks,
    sampled softmax sets and encoding for the same ``(seed, rnd, pid)``.

    Returns
    -------
    result : LocalResult, blocks : dict, stats : dict, residual : array or None, words : int array,
    change : array (P,), the parameters' change from ``host``

    Raises
    ------
    FloatingPointError
        From :func:`rnnlm.core.local.train_steps`.
    """
    t, xp = cfg.train, model.xp
    batches = src.round_batches(rnd, steps)
    drop = backend.rng_for(xp, t.seed, rnd, pid, 0xD0) if cfg.model.dropout else None
    sets = (plan.SoftmaxSampler(model.V, cfg.exchange, t.seed, rnd, pid, cfg.data.partitions,
                                # a partition's, once per executor process (the key holds its source)
                                presence=memo.MEMO.get(("presence", src, t.bptt, model.V),
                                                       lambda: sampled.presence(src.tokens, t.bptt, model.V)))
            if cfg.exchange.sampled_softmax else None)
    t0 = time.perf_counter()
    res = train_steps(model, opt, params, opt_state, batches, state, lr=lr, clip_norm=cfg.optim.clip_norm,
                      clip_value=cfg.optim.clip_value, grad_norm=t.grad_norm, dropout_rng=drop, softmax_sets=sets)
    t1 = time.perf_counter()
    words = np.unique(np.concatenate([np.concatenate([b.x.ravel(), b.y[b.y >= 0]]) for b in batches]))
    change = backend.to_numpy(res.params) - host        # what this partition did
    blocks, stats, left = plan.encode(model.layout, change, cfg.exchange, words, t.seed, rnd, pid,
                                      cfg.data.partitions, residual,
                                      scored=res.tokens > 0 or not by_tokens)
    stats.update(steps_s=t1 - t0, encode_s=time.perf_counter() - t1)
    if sets is not None:
        stats.update(softmax_v_all=sets.sizes[0], softmax_v_f=sets.sizes[1])
    return res, blocks, stats, left, words, change


def eval_task(cfg: config.Config, bc):
    """Summed NLL and token count of each partition read as one stream."""
    def run(it):
        xp = task_xp(cfg.train.device)
        model = build_model(cfg.model, xp=xp)
        params = xp.asarray(bc.value)
        for _, tokens, _ in it:
            yield held_out_nll(model, params, [tokens])
    return run
