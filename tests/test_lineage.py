"""The lineage of what partitions hold between rounds (:class:`rnnlm.spark.lineage.Lineage`), with a toy
round in place of training: each round adds one to a partition's counter, held in a file on its
executor and replayed from the lineage's seed where the file is gone."""
import functools
import os
import sys

import numpy as np
import pytest
from pyspark import cloudpickle
from pyspark.accumulators import Accumulator

from rnnlm.exchange.aggregate import Aggregate
from rnnlm.exchange.round import Carry
from rnnlm.spark import filestore, lineage
from rnnlm.spark.channel import ChannelError
from rnnlm.spark.lineage import Contributions, Lineage

cloudpickle.register_pickle_by_value(sys.modules[__name__])      # the toy round travels to the workers


def count_round(step, sink):
    """A round's task: a partition's counter ``n`` plus ``step``; its contribution weighs the new count."""
    def run(it):
        for pid, tokens, starts, held, carry in it:
            n = (held or {}).get("n", np.zeros(1)) + step
            agg = Aggregate.contribution(float(n[0]), {"n": n.reshape(1, 1).astype(np.float32)}, {pid: Carry()})
            if sink is None:
                yield agg
            else:
                sink.add(agg)
            yield pid, tokens, starts, {"n": n}, carry
    return run


@pytest.fixture
def lin(spark):
    sc = spark.sparkContext
    data = sc.parallelize([(0, np.arange(3), np.array([0])), (1, np.arange(4), np.array([0]))], 2).cache()
    lin = Lineage(sc, data, held={0: {"n": np.array([10.0])}, 1: {"n": np.array([20.0])}})
    yield lin
    lin.close(blocking=True)
    data.unpersist()


def submit(lin, step):
    """One round, run at once; returns (its output, its merged aggregate)."""
    return lin.submit(functools.partial(count_round, step), lambda go: go())


def counts(held: dict) -> dict:
    return {pid: float(h["n"][0]) for pid, h in held.items()}


def test_rounds_chain_from_the_seed_each_partitions_once(lin):
    out1, agg1 = submit(lin, 1)
    assert agg1.weight == 11 + 21 and sorted(agg1.local) == [0, 1]
    assert (lin.seq, lin.depth, lin.in_flight) == (1, 1, 1)
    out2, agg2 = submit(lin, 2)
    assert agg2.weight == 13 + 23 and (lin.seq, lin.depth, lin.in_flight) == (2, 2, 2)
    lin.finished(out1, True)
    lin.finished(out2, True)
    assert lin.in_flight == 0
    assert counts(lin.collect()) == {0: 13.0, 1: 23.0}


def test_a_failed_round_leaves_the_last_finished_one_as_what_partitions_hold(lin):
    out1, _ = submit(lin, 1)
    lin.finished(out1, True)
    out2, _ = submit(lin, 5)
    lin.finished(out2, False)
    assert lin.in_flight == 0 and counts(lin.collect()) == {0: 11.0, 1: 21.0}


def test_what_a_partition_held_is_replayed_from_the_seed_when_its_files_are_gone(lin):
    for step in (1, 2, 3):
        out, _ = submit(lin, step)
        lin.finished(out, True)
    lin.data.foreachPartition(filestore.remover(lin.key))           # every executor's files
    assert counts(lin.collect()) == {0: 16.0, 1: 26.0}
    out, agg = submit(lin, 1)                                      # a round reads the replayed counts too
    assert agg.weight == 17 + 27


def test_a_cut_whose_seed_cannot_be_made_still_releases_the_old_lineage(lin, monkeypatch):
    """A new SeedServer that cannot start (no file descriptor left) raised out of truncate after the old
    lineage's broadcasts and cached rounds had been taken from it, so nothing released them."""
    released = []
    monkeypatch.setattr(lineage, "release", lambda *a, **k: released.append(a))
    kept = [lin.sc.broadcast(1)]
    lin.keep(kept)
    out, _ = submit(lin, 1)
    lin.finished(out, True)
    held = lin.collect()

    def no_fd(*args, **kwargs):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(lineage, "SeedServer", no_fd)
    with pytest.raises(OSError, match="Too many open files"):
        lin.truncate(held)
    assert any(a and kept[0] in a[0] for a in released), released


def test_a_lineage_is_truncated_only_with_no_round_in_flight_and_keeps_counting_rounds(lin, monkeypatch):
    released = []
    monkeypatch.setattr(lineage, "release", lambda *a, **k: released.append((a, k)))
    kept = [lin.sc.broadcast(1)]
    lin.keep(kept)
    out1, _ = submit(lin, 1)
    assert not lin.truncate({0: {"n": np.array([0.0])}}) and lin.depth == 1 and released == []
    lin.finished(out1, True)
    held = lin.collect()
    assert lin.truncate(held) and lin.depth == 0 and lin.seq == 1
    assert released[:-1] == [((), {"rdds": []})]                    # finished: no output before round 1's
    (old, outs), k = released[-1]                                   # the kept one (no carries); round 1's output
    assert old == kept and outs == [out1] and k == {}
    out2, agg = submit(lin, 1)
    assert lin.seq == 2 and lin.depth == 1 and agg.weight == 12 + 22


def test_where_executors_cannot_reach_the_driver_a_lineage_starts_from_broadcasts(spark, monkeypatch):
    """The probe (tests/test_seeds.py) found the driver's port closed to the executors: each partition's
    share goes to them as a broadcast, counted by the next round, the same numbers, and a warning says so.
    Once could be a passing refusal: the next cut probes again, and a second verdict is kept for the run."""
    probes = []
    monkeypatch.setattr(lineage, "unreachable",
                        lambda data, host, log: probes.append(host) or f"{host}:1: ConnectionRefusedError")
    sc, said = spark.sparkContext, []
    data = sc.parallelize([(0, np.arange(3), np.array([0])), (1, np.arange(4), np.array([0]))], 2).cache()
    lin = Lineage(sc, data, held={0: {"n": np.array([10.0])}, 1: {"n": np.array([20.0])}}, log=said.append)
    try:
        assert len(said) == 1 and "cannot reach the driver" in said[0] and "ConnectionRefusedError" in said[0]
        assert said[0].endswith("fetches whole, this time")
        assert [b.value for b in lin.take_seeds()] == [{"n": np.array([10.0])}, {"n": np.array([20.0])}]
        out, agg = submit(lin, 1)
        lin.finished(out, True)
        assert agg.weight == 11 + 21 and lin.take_served() == (0, 0)
        assert lin.truncate(lin.collect()) and len(lin.take_seeds()) == 2 and len(probes) == 2    # probed again
        assert len(said) == 2 and said[1].endswith("fetches whole, after each lineage cut")
        out, agg = submit(lin, 2)
        assert agg.weight == 13 + 23
        lin.finished(out, True)
        assert lin.truncate(lin.collect()) and len(lin.take_seeds()) == 2 and len(probes) == 2    # kept
        out, agg = submit(lin, 3)
        lin.finished(out, True)
    finally:
        lin.close(blocking=True)
        data.unpersist()


def test_a_probe_that_fails_sends_broadcasts_that_once_and_probes_again_at_the_next_cut(spark, monkeypatch):
    answers = iter([RuntimeError("an executor lost during the probe"), None])

    def unreachable(data, host, log):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer
    monkeypatch.setattr(lineage, "unreachable", unreachable)
    sc, said = spark.sparkContext, []
    data = sc.parallelize([(0, np.arange(3), np.array([0])), (1, np.arange(4), np.array([0]))], 2).cache()
    lin = Lineage(sc, data, held={0: {"n": np.array([10.0])}, 1: {"n": np.array([20.0])}}, log=said.append)
    try:
        assert len(lin.take_seeds()) == 2 and len(said) == 1 and "probing" in said[0]
        out, agg = submit(lin, 1)
        lin.finished(out, True)
        assert lin.truncate(lin.collect()) and lin.take_seeds() == [] and len(said) == 1    # probed: reachable
        out, agg = submit(lin, 2)
        lin.finished(out, True)
        assert agg.weight == 13 + 23 and lin.take_served() == (0, 0)
    finally:
        lin.close(blocking=True)
        data.unpersist()


def test_a_cut_lineage_starts_from_the_partitions_files_and_fetches_only_what_is_gone(lin):
    """Seeded from a checkpoint, every partition fetches its own share from the driver (no executor
    has a file); after a cut, each reads the file it was collected from, and only a partition whose
    file is gone fetches, the same numbers."""
    out, agg = submit(lin, 1)
    lin.finished(out, True)
    to_executors, from_executors = lin.take_served()
    assert agg.weight == 11 + 21 and to_executors > 2 * 8 and from_executors > 0
    assert lin.take_served() == (0, 0)                              # taken once
    held = lin.collect()
    assert sorted(held.files) == [0, 1] and all(f.seq == 1 for f in held.files.values())
    assert lin.truncate(held)
    out, agg = submit(lin, 2)
    lin.finished(out, True)
    assert agg.weight == 13 + 23 and lin.take_served() == (0, 0)    # both files read: nothing fetched
    held = lin.collect()
    assert lin.truncate(held)
    local_dirs = lin.sc.parallelize([0], 1).map(lambda _: os.environ["SPARK_LOCAL_DIRS"]).first()
    os.unlink(os.path.join(filestore.root(lin.key, local_dirs), f"1.{held.files[1].seq}.n.npy"))  # partition 1's alone
    out, agg = submit(lin, 3)
    lin.finished(out, True)
    one, _ = lin.take_served()
    assert agg.weight == 16 + 26 and 8 < one < to_executors         # partition 1's share alone


def test_a_lineage_is_trimmed_at_its_depth_bound(lin, monkeypatch):
    monkeypatch.setattr(lineage, "MAX_LINEAGE", 2)
    out, _ = submit(lin, 1)
    lin.finished(out, True)
    assert lin.trim() == 0 and lin.depth == 1
    out, _ = submit(lin, 1)
    assert lin.trim() == 0 and lin.depth == 2                       # a round in flight
    lin.finished(out, True)
    assert lin.trim() == 2 * 8 and lin.depth == 0                   # two partitions' float64 counters
    assert counts(lin.collect()) == {0: 12.0, 1: 22.0}


def test_what_partitions_hold_lies_in_their_executors_files(lin):
    out, _ = submit(lin, 1)
    held = sorted((pid, h) for pid, _, _, h, _ in out.collect())
    assert [(pid, type(h)) for pid, h in held] == [(0, filestore.Stored), (1, filestore.Stored)]
    assert [(h.seq, h.names) for _, h in held] == [(1, ("n",)), (1, ("n",))]


def test_a_replay_after_a_failed_round_stops_at_the_last_finished_one(lin):
    """Round 3 failed: what partitions hold is round 2's, replayed from the seed the truncation after
    round 1 left, through round 2 alone."""
    out, _ = submit(lin, 1)
    lin.finished(out, True)
    assert lin.truncate(lin.collect())
    out, _ = submit(lin, 2)
    lin.finished(out, True)
    out, _ = submit(lin, 5)
    lin.finished(out, False)
    lin.data.foreachPartition(filestore.remover(lin.key))
    assert counts(lin.collect()) == {0: 13.0, 1: 23.0}


class FileSink:
    """A direct result channel's stand-in: each contribution's partition and weight in a file of its own."""

    def __init__(self, where):
        self.where = str(where)

    def add(self, agg):
        (pid,) = agg.local
        with open(f"{self.where}/{pid}", "w") as f:
            f.write(repr(agg.weight))


def test_a_round_through_a_direct_channel_and_a_partition_recomputed(lin, tmp_path):
    """With ``direct``, the contributions go to its sink, and its ``take`` gets a way to recompute the
    partitions whose contribution never came: their task run again, the same numbers."""
    got = {}

    def take(recompute):
        for name in sorted(os.listdir(tmp_path)):
            got[int(name)] = float(open(tmp_path / name).read())
        (again,) = recompute({1})
        got["again"] = (sorted(again.local), again.weight)
        return "merged"
    out, merged = lin.submit(functools.partial(count_round, 3), lambda go: go(), direct=(FileSink(tmp_path), take))
    assert merged == "merged" and got == {0: 13.0, 1: 23.0, "again": ([1], 23.0)}
    # the recompute left the files of the round's cached output as they were: read back, not replayed (it saved
    # them again, and the next round replayed the partition's whole lineage: the same numbers, rounds later)
    assert sorted(out.mapPartitions(_from_files).collect()) == [(0, True), (1, True)]


def _from_files(it):
    for pid, _, _, held, _ in it:
        yield pid, filestore.load(held, pid) is not None


def leaf(pid, w, size=1):
    return Aggregate.contribution(w, {"n": np.ones((size, 1), np.float32)}, {pid: Carry()})


def test_a_round_taken_is_closed_to_contributions_that_arrive_later():
    """What arrives after the round was read (a partition computed twice) changes nothing, and the
    accumulator keeps none of the round's blocks."""
    param = Contributions()
    sent = param.addInPlace(param.zero(None), leaf(0, 1.0))                # a task's, on its executor
    assert list(sent) == [0]
    acc = Accumulator(10_001, {}, param)
    acc += sent                                                            # its update, on the driver
    acc += {0: leaf(0, 9.0)}                                               # a duplicate: the first kept
    taken = Contributions.take(acc)
    assert sorted(taken) == [0] and taken[0].weight == 1.0 and acc.value == {}
    acc += {1: leaf(1, 2.0)}                                               # late: dropped
    assert acc.value == {} and Contributions.take(acc) == {}


def test_an_update_racing_the_take_puts_no_block_back():
    """PySpark assigns what addInPlace returns to the accumulator's value after the call: an update that had
    added its partition to the value (the round's own dict) as the round was taken put that dict back after
    take() emptied it, a round's model-sized blocks held for the life of the context."""
    import threading
    param = Contributions()
    acc = Accumulator(10_002, {}, param)
    acc += {0: leaf(0, 1.0, 1000)}
    returned, go, add = threading.Event(), threading.Event(), param.addInPlace

    def add_then_pause(a, b):          # the accumulator server's thread, paused between the call and the assignment
        out = add(a, b)
        returned.set()
        go.wait(5)
        return out
    param.addInPlace = add_then_pause
    late = threading.Thread(target=acc.add, args=({1: leaf(1, 1.0, 1000)},))
    late.start()
    assert returned.wait(5)
    taken = Contributions.take(acc)
    go.set()
    late.join()
    assert sorted(taken) == [0, 1]
    assert not acc.value and Contributions.take(acc) == {}


def fail_on(pid_failing, step, sink):
    """A round's task that fails on one partition, after the others have added their contributions."""
    inner = count_round(step, sink)

    def run(it):
        rows = list(it)
        if rows and rows[0][0] == pid_failing:
            import time
            time.sleep(2.0)                  # the other partitions finish (and add theirs) first
            raise RuntimeError("a task that fails")
        yield from inner(iter(rows))
    return run


def test_a_failed_round_leaves_no_contribution_in_the_accumulator_pyspark_keeps(lin):
    """PySpark keeps every accumulator for the life of the context: a round whose job failed or was
    cancelled never took the contributions the partitions that finished had added, model-sized blocks
    left in the session; and a late update racing the take put back what it had just emptied."""
    from pyspark.accumulators import _accumulatorRegistry
    before = set(_accumulatorRegistry)
    with pytest.raises(Exception, match="a task that fails"):
        lin.submit(functools.partial(fail_on, 1, 1), lambda go: go())
    made = [a for k, a in _accumulatorRegistry.items() if k not in before and isinstance(a.accum_param, Contributions)]
    assert len(made) == 1 and made[0].value == {}
    late = Contributions()
    late.closed = True
    one = leaf(0, 1.0)
    assert late.addInPlace({}, {0: one}) == {} and late.leaves == {}
    assert Contributions().addInPlace({}, one) == {0: one}


def drop_contribution(pid_dropped, step, sink):
    """A round's task in which partition ``pid_dropped`` trains but sends no contribution, in the round or
    recomputed."""
    def run(it):
        rows = list(it)
        dropped = bool(rows) and rows[0][0] == pid_dropped
        for x in count_round(step, None if dropped else sink)(iter(rows)):
            if not (dropped and isinstance(x, Aggregate)):
                yield x
    return run


def test_a_round_missing_a_contribution_even_recomputed_stops_rather_than_averaging_fewer(lin):
    """The accumulator's round recomputes the partitions whose contribution never came; where one still does
    not come, the round stops naming it (as the direct channel's does), where it averaged the others alone."""
    with pytest.raises(ChannelError, match=r"^no contribution from partitions \[1\]$"):
        lin.submit(functools.partial(drop_contribution, 1, 1), lambda go: go())
