"""A round's job on Spark: defined once, submitted (a round ahead under ``train.overlap``),
waited for, or cancelled when the run stops early.

A :class:`Job` holds everything a round's tasks read, fixed when it is defined, so when it
runs changes nothing in its numbers. :class:`Jobs` submits each from a thread of its own
(PySpark keeps a thread's job properties apart), so a second round can run while the driver
waits for the first.
"""
from __future__ import annotations

import functools
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..exchange.aggregate import Aggregate, merge
from .session import release


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
    out: object = None                 # its output RDD when carries stay in Spark


class Jobs:
    """Submits rounds' jobs over ``data`` (the corpus RDD), through ``residuals``
    (:class:`rnnlm.spark.residuals.Residuals`, or None: ``treeAggregate`` of depth ``tree_depth``),
    and keeps those still running. With ``channel`` (:class:`rnnlm.spark.channel.Channel`) the
    contributions travel through it instead, until it fails once. Jobs are in Spark's job ``group``."""

    def __init__(self, sc, data, residuals, tree_depth: int, channel=None, group: str | None = None):
        self.sc, self.data, self.residuals, self.tree_depth = sc, data, residuals, tree_depth
        self.channel, self.group = channel, group
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="rnnlm-round")
        self.flight = []            # submitted, not waited for

    def submit(self, job: Job, description: str) -> None:
        """Start ``job``: local steps on every partition, their changes merged."""
        def run(thunk):
            def go():
                self.sc.setJobGroup(self.group, description)     # a thread's own job properties
                return thunk()
            return self.pool.submit(go)
        job.submitted = time.time()
        direct = None
        if self.channel is not None and self.channel.broken is None:
            direct = self.channel.sink(job.round), functools.partial(self.channel.take, job.round)
        if self.residuals is None and direct is None:
            job.future = run(lambda: self.data.mapPartitions(job.task()).treeAggregate(
                Aggregate(), merge, merge, depth=self.tree_depth))
        elif self.residuals is None:
            sink, take = direct

            def go():
                self.data.mapPartitions(job.task(sink))._jrdd.count()      # the JVM runs the tasks; nothing returns
                # partition i holds pid i: only the missing ones run again
                return take(lambda missing: self.sc.runJob(self.data, job.task(), sorted(missing)))
            job.future = run(go)
        else:
            # residuals and carries re-seeded from a checkpoint travel now, one broadcast per partition
            job.bc_bytes += sum(broadcast_bytes(b) for b in self.residuals.pending_broadcast)
            self.residuals.pending_broadcast = []
            self.residuals.keep(job.bcs)       # the lineage reads them until the next truncation
            job.out, job.future = self.residuals.submit(job.task, run, direct)
        self.flight.append(job)

    def wait(self, job: Job) -> Aggregate:
        """``job``'s aggregate (its own broadcasts released, unless the residuals' lineage reads them)."""
        ok = False
        try:
            agg, ok = job.future.result(), True
            return agg
        finally:
            self.flight.remove(job)
            if self.residuals is not None:
                self.residuals.finished(job.out, ok)
            else:
                release(job.bcs)

    def close(self, pending: Job | None = None, blocking: bool = False) -> None:
        """Cancel the jobs still running (a run stopping early, by error or signal), wait for their
        threads, and release ``pending``, a job defined and never submitted (``blocking``: see
        :func:`rnnlm.spark.session.release`)."""
        if self.flight:          # this run's jobs only: a shared session may run others
            if self.group is None:
                self.sc.cancelAllJobs()
            else:
                self.sc.cancelJobGroup(self.group)
        for job in list(self.flight):
            try:
                self.wait(job)
            except Exception:       # cancelled: what it would have computed is not needed
                pass
        self.pool.shutdown(wait=True)
        if pending is not None and pending.future is None:
            release(pending.bcs, blocking=blocking)


def broadcast_bytes(bc) -> int:
    """What a broadcast moves: PySpark writes the pickled value to a file the executors read."""
    path = getattr(bc, "_path", None)
    if path and os.path.exists(path):
        return os.path.getsize(path)
    return len(pickle.dumps(bc.value, protocol=pickle.HIGHEST_PROTOCOL))
