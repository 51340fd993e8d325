"""A synchronous run's stuck task, found and run again.

A task blocked inside its training or its scoring (a read that never returns, a device that hangs) held
its round or evaluation for ever: the driver waits for every partition, Spark starts no other attempt
while one runs, and a local master never speculates. While the driver waits on a round
(:meth:`StallWatch.wait`) or on held-out text's scores (:meth:`StallWatch.run`), :class:`StallWatch`
looks at the run's oldest running job: a task that has run ``train.stall_factor`` times as long as the
slowest task its stage has finished, and at least ``train.stall_s``, is killed through Spark's
``killTaskAttempt``, which runs it again and does not count it as a failure. These tasks are pure (a
retry computes the same numbers), so the run's numbers stay as they were. A stage with no task finished
has nothing to measure against and is not watched (one partition, or every task stuck alike). A task
killed :data:`MOST_KILLS` times in one stage stops the run in one line.

Spark's status tracker names a job's stages and tells how many tasks a stage has running and finished,
not which, and those counts lag (they are written at the status store's next flush): the tasks come from
its status store (``SparkContext.statusStore``, private to Spark, through py4j).
"""
from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all

from .rundir import TrainingError
from .session import scala_context

MOST_KILLS = 3      # attempts of one task killed as stuck before the run stops
POLL_S = 1.0        # how often, at least, a round's running tasks are looked at while the driver waits
# a thread's own properties of its jobs (SparkContext's keys): their group, their name in Spark's UI
GROUP, JOB_PROPERTIES = "spark.jobGroup.id", ("spark.job.description", "spark.job.interruptOnCancel")


class StallWatch:
    """The stuck tasks of the job group ``group`` (None: the jobs in no group) on ``sc``, killed; ``log``
    hears each kill. A ``factor`` of 0 watches nothing (``train.stall_factor = 0``)."""

    def __init__(self, sc, group: str | None, factor: float, least_s: float, log=print):
        self.sc, self.group, self.factor, self.least_s, self.log = sc, group, factor, least_s, log
        self.kills = collections.Counter()      # (stage, task index) -> its attempts killed
        self.killed = set()                     # task ids told to end (an attempt takes a moment to)
        self.job_id, self.since_ms = None, 0.0  # the job watched, and since when (ms since the epoch)

    def wait(self, future, what: str):
        """``future``'s result, the running tasks looked at every :data:`POLL_S` (or a twentieth of
        ``least_s``, if longer) until it has one (``what``: the round, for the messages)."""
        while self.factor and not wait_all([future], timeout=max(POLL_S, self.least_s / 20)).done:
            self.check(what)
        return future.result()

    def run(self, action, what: str):
        """``action()``, a blocking Spark action, run from a thread of its own in the watched group, with this
        thread's job description (PySpark keeps a thread's job properties apart), while :meth:`wait` looks at
        its tasks; in this thread where nothing is watched. A wait interrupted (a second Ctrl-C) leaves the
        job running, for the group's cancellation to end."""
        if not self.factor:
            return action()
        properties = {GROUP: self.group, **{k: self.sc.getLocalProperty(k) for k in JOB_PROPERTIES}}

        def go():
            for k, v in properties.items():
                self.sc.setLocalProperty(k, v)
            return action()
        pool = ThreadPoolExecutor(1, thread_name_prefix="rnnlm-watched")
        try:
            return self.wait(pool.submit(go), what)
        finally:
            pool.shutdown(wait=False)

    def check(self, what: str) -> None:
        """Kill every task of the group's oldest running job found stuck; TrainingError for one found stuck
        the :data:`MOST_KILLS` + 1st time. Only the oldest job is watched, its tasks timed from when it
        became the oldest: under ``train.overlap`` the next round's task of a partition waits for the
        block this round's computes, and would otherwise look stuck alongside it."""
        tracker = self.sc.statusTracker()
        jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(self.group)]
        jobs = [j for j in jobs if j is not None and j.status == "RUNNING"]
        if not jobs:
            return
        job = min(jobs, key=lambda j: j.jobId)
        if job.jobId != self.job_id:
            self.job_id, self.since_ms = job.jobId, time.time() * 1000
        if time.time() * 1000 - self.since_ms <= 1000 * self.least_s:
            return                  # no task of it can have run longer yet: a round's tasks are not listed
        for stage_id in job.stageIds:
            # not by the stage's task counts, which wait for the status store's next flush (an event: up to an
            # executor heartbeat, 10 s, while nothing else happens); its tasks' own records are written at once
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                self._stage(stage, what)

    def _stage(self, stage, what: str) -> None:
        tasks = scala_context(self.sc).statusStore().taskList(stage.stageId, stage.currentAttemptId, 1 << 30)
        now_ms, slowest_ms, running = time.time() * 1000, 0, []
        for i in range(tasks.size()):
            t = tasks.apply(i)
            status = t.status()
            if status == "SUCCESS" and t.duration().isDefined():
                slowest_ms = max(slowest_ms, t.duration().get())
            elif status == "RUNNING" and t.taskId() not in self.killed:
                running.append((t.taskId(), t.index(), now_ms - max(self.since_ms, t.launchTime().getTime())))
        limit_ms = max(1000 * self.least_s, self.factor * slowest_ms)
        for task_id, index, ran_ms in running:
            if not slowest_ms or ran_ms <= limit_ms:
                continue
            key = (stage.stageId, index)
            said = (f"{what}: task {index} of stage {stage.stageId} ({stage.name}) has run {ran_ms / 1000:.1f} s, "
                    f"over train.stall_factor = {self.factor:g} times its stage's slowest finished task "
                    f"({slowest_ms / 1000:.2f} s) and train.stall_s = {self.least_s:g}")
            if self.kills[key] >= MOST_KILLS:
                raise TrainingError(f"{said}, after {MOST_KILLS} attempts killed so: stuck every time (a run "
                                    "slower than that throughout sets a larger train.stall_factor or 0)")
            self.kills[key] += 1
            self.killed.add(task_id)
            self.log(f"{said}: stuck, killed, and Spark runs it again (kill {self.kills[key]} of at most "
                     f"{MOST_KILLS})")
            scala_context(self.sc).killTaskAttempt(task_id, True, f"rnnlm: stuck ({what})")
