"""The synchronous trainer's stall watch (rnnlm.spark.stall): a task blocked inside its training held its
round, and so the run, for ever; now it is killed and Spark runs it again, and the run's numbers stay
as they were."""
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rnnlm import config
from rnnlm.cli import make_trainer
from rnnlm.core import checkpoint
from rnnlm.spark.rundir import TrainingError
from rnnlm.spark.stall import StallWatch
from conftest import CLUSTER_RUN, HARBOUR_VALID, ROOT, blocked_at_round_3, metrics, train_cmd


def _action(sc, sleeps):
    """A job of two partitions, run when called: partition 1 sleeps ``sleeps(attempt)`` seconds first; each
    partition's (id, attempt, sum)."""
    def task(it):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        if ctx.partitionId() == 1:
            time.sleep(sleeps(ctx.attemptNumber()))
        return [(ctx.partitionId(), ctx.attemptNumber(), sum(it))]
    return lambda: sc.parallelize(range(10), 2).mapPartitions(task).collect()


def _job(sc, group: str, sleeps):
    """:func:`_action`'s job in ``group``, run from a thread of its own: the thread pool and its future."""
    from concurrent.futures import ThreadPoolExecutor
    action = _action(sc, sleeps)

    def run():
        sc.setJobGroup(group, group)
        return action()
    pool = ThreadPoolExecutor(1)
    return pool, pool.submit(run)


def test_a_stuck_task_is_killed_and_run_again(spark):
    """And the group's jobs that ended are not looked at; the retried attempt, slower than 10 times the
    finished task but within stall_s, is left alone."""
    sc, said = spark.sparkContext, []
    pool, future = _job(sc, "stall-once", lambda attempt: 0)
    future.result()
    pool.shutdown()
    pool, future = _job(sc, "stall-once", lambda attempt: 60 if attempt == 0 else 1.5)
    watch = StallWatch(sc, "stall-once", factor=10, least_s=2, log=said.append)
    start = time.monotonic()
    assert watch.wait(future, "round 3") == [(0, 0, 10), (1, 1, 35)]    # its second attempt's
    assert time.monotonic() - start < 60
    pool.shutdown()
    assert len(said) == 1 and re.fullmatch(
        r"round 3: task 1 of stage \d+ \(.*\) has run [\d.]+ s, over train.stall_factor = 10 times its stage's "
        r"slowest finished task \([\d.]+ s\) and train.stall_s = 2: stuck, killed, and Spark runs it again "
        r"\(kill 1 of at most 3\)", said[0]), said


def test_an_action_run_under_the_watch_is_in_its_group_and_its_stuck_task_run_again(spark):
    """What the driver scores held-out text with (``rnnlm evaluate``: in no job group, whatever group this
    thread's earlier jobs had)."""
    sc, said = spark.sparkContext, []
    sc.setJobGroup("some other run", "an earlier job's")
    watch = StallWatch(sc, None, factor=1, least_s=1, log=said.append)
    sc.parallelize(range(2), 2).count()             # Python workers at hand: partition 0 ends in milliseconds
    try:
        assert watch.run(_action(sc, lambda attempt: 60 if attempt == 0 else 0), "scoring t") == [
            (0, 0, 10), (1, 1, 35)]
    finally:
        sc.setJobGroup(None, None)
    assert len(said) == 1 and said[0].startswith("scoring t: task 1 of stage "), said
    # found at the first look past the limit (a poll a second), not when Spark's status store next wrote the
    # stage's task counts (at an executor's heartbeat, up to 10 s later, while nothing else happens)
    ran, slowest = map(float, re.search(r"has run ([\d.]+) s, .* finished task \(([\d.]+) s\)", said[0]).groups())
    assert ran < max(1, slowest) + 3, said
    off = StallWatch(sc, "g", factor=0, least_s=1, log=said.append)
    assert off.run(_action(sc, lambda attempt: 0), "t") == [(0, 0, 10), (1, 0, 35)] and len(said) == 1


def test_a_jobs_tasks_are_timed_from_when_it_became_the_oldest(spark):
    """Under train.overlap the next round's job runs beside this one's, its tasks waiting for this round's
    blocks: only the oldest job is watched, and a job's tasks count from when it became the oldest."""
    sc, said = spark.sparkContext, []
    pool_a, older = _job(sc, "stall-queue", lambda attempt: 2)
    time.sleep(0.2)
    pool_b, newer = _job(sc, "stall-queue", lambda attempt: 4)     # its partition 1 starts as older's 0 ends
    watch = StallWatch(sc, "stall-queue", factor=1, least_s=3, log=said.append)
    assert watch.wait(older, "r") == [(0, 0, 10), (1, 0, 35)]
    assert watch.wait(newer, "r") == [(0, 0, 10), (1, 0, 35)]      # run 4 s, 2 of them as the oldest
    pool_a.shutdown()
    pool_b.shutdown()
    assert said == []


def test_a_task_stuck_every_time_stops_the_run_in_one_line(spark):
    sc, said = spark.sparkContext, []
    pool, future = _job(sc, "stall-always", lambda attempt: 600)
    watch = StallWatch(sc, "stall-always", factor=10, least_s=1, log=said.append)
    try:
        with pytest.raises(TrainingError, match=r"^round 5: task 1 of stage \d+ .* after 3 attempts "
                                                r"killed so: stuck every time \(a run slower"):
            watch.wait(future, "round 5")
    finally:
        sc.cancelJobGroup("stall-always")
        pool.shutdown()
    assert len(said) == 3                   # kills before the run stops


def test_a_slow_task_within_the_limit_and_a_stage_with_none_finished_are_left_alone(spark):
    """Nothing to measure against (no task of the stage finished) is no stall; nor is a task slower than
    the others but within stall_factor times the slowest finished one."""
    sc, said = spark.sparkContext, []
    pool, future = _job(sc, "stall-slow", lambda attempt: 3)
    assert StallWatch(sc, "stall-slow", factor=1000, least_s=1, log=said.append).wait(future, "r") == [
        (0, 0, 10), (1, 0, 35)]
    pool.shutdown()

    def one(it):
        time.sleep(3)
        return [sum(it)]
    got = []
    thread = threading.Thread(target=lambda: (sc.setJobGroup("stall-one", "one"),
                                              got.append(sc.parallelize(range(4), 1).mapPartitions(one).collect())))
    thread.start()
    watch = StallWatch(sc, "stall-one", factor=1, least_s=0.5, log=said.append)
    while thread.is_alive():
        watch.check("r")
        time.sleep(0.2)
    assert got == [[6]] and said == []


@pytest.mark.parametrize("path, scores", [([], True), (["train.results=direct"], False),
                                          (["train.overlap=1", "train.optim_state=local"], False)],
                         ids=["treeAggregate", "direct", "lineage"])
def test_a_round_blocked_in_one_partition_is_run_again_with_the_same_numbers(spark, tmp_path, path, scores):
    """On local[2], where Spark allows a task no retry and never speculates, the run hung at round 3; now
    the blocked task is killed and run again, and the run ends with the weights of a run never blocked,
    bit for bit, on each of the three paths a round's results take. In the first run the held-out text's
    first scores block in partition 1 as well (they hung the run the same way) and are scored again: the
    same figures; so does ``rnnlm evaluate`` of its checkpoint, which prints the training log's figure."""
    held_out = [f"data.valid={HARBOUR_VALID}", "data.paragraphs=line", "data.eval_streams=2", "train.eval_every=2"]
    sets = [*CLUSTER_RUN, "train.rounds=5", "train.stall_s=1", *(held_out if scores else []), *path]
    env = blocked_at_round_3(tmp_path, scores)
    out = tmp_path / "out"
    r = subprocess.run(train_cmd(out, *sets, master="local[2]"), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=240)
    assert (tmp_path / "blocked").exists()                  # the first attempt did block
    assert (tmp_path / "blocked_scores").exists() == scores
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout + r.stderr
    assert len(re.findall(r"round 3: task 1 of stage \d+ .* stuck, killed, and Spark runs it again", said)) == 1, \
        said[-3000:]
    assert len(re.findall(r"evaluating valid after round 2: task 1 of stage \d+ .* stuck, killed", said)) == scores
    cfg = config.load(os.path.join(ROOT, "conf", "demo.toml"), sets)
    ref = make_trainer(spark, cfg, str(tmp_path / "ref"), log=lambda *_: None)
    ref.run()
    np.testing.assert_array_equal(checkpoint.load(str(out / "checkpoint")).params, ref.params)
    valid = [(m["round"], m["valid_loss"]) for m in metrics(out) if "valid_loss" in m]
    assert valid == [(m["round"], m["valid_loss"]) for m in ref.metrics if "valid_loss" in m]
    assert [r for r, _ in valid] == ([2, 4, 5] if scores else [])
    if scores:      # rnnlm evaluate watches its scoring by the checkpoint's train.stall_* keys: the same figure
        env["RNNLM_TEST_BLOCKED_SCORES"] = str(tmp_path / "blocked_evaluate")
        e = subprocess.run([sys.executable, os.path.join(ROOT, "jobs", "evaluate.py"), "--checkpoint", str(out),
                            "--data", HARBOUR_VALID, "--master", "local[2]"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=240)
        assert (tmp_path / "blocked_evaluate").exists() and e.returncode == 0, e.stderr[-3000:]
        assert len(re.findall(rf"scoring {re.escape(HARBOUR_VALID)}: task 1 of stage \d+ .* stuck, killed",
                              e.stdout + e.stderr)) == 1, (e.stdout + e.stderr)[-3000:]
        assert e.stdout.splitlines()[-2].startswith(f"{HARBOUR_VALID}: loss {valid[-1][1]:.4f} | ")
