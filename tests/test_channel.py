"""The direct result channel: contributions as checked frames (rnnlm.exchange.frames), merged in
partition order on the driver (rnnlm.spark.channel), over the real wire."""
import time

import numpy as np
import pytest

from rnnlm.exchange.aggregate import Aggregate
from rnnlm.exchange.blocks import Block
from rnnlm.exchange.frames import Expected, Malformed, contribution_from_wire, contribution_to_wire
from rnnlm.exchange.round import Carry
from rnnlm.server import wire
from rnnlm.spark.channel import Channel, ChannelError, Inbox, Sink

SHAPES = {"params.E": (8, 3), "params.b": (5,), "opt.m": (29,)}
EXPECT = Expected(SHAPES, partitions=3, vocab=8, state=(1, 2, 4, 2), opt=("m",), size=29)


def leaf(pid: int, seed: int = 0, weight: float = 100.0, codec: str = "onebit") -> Aggregate:
    rng = np.random.default_rng(seed + pid)
    blocks = {"params.E": Block(rng.normal(size=(3, 3)).astype(np.float32), (8, 3), np.array([1, 4, 6], np.int32),
                                codec),
              "params.b": Block(rng.normal(size=5).astype(np.float32), (5,), None, "fp16"),
              "opt.m": Block(rng.normal(size=29).astype(np.float32), (29,))}
    carry = Carry(state=rng.normal(size=(1, 2, 4, 2)).astype(np.float32),
                  opt={"t": 7, "m": rng.normal(size=29).astype(np.float32)})
    return Aggregate.contribution(weight, blocks, {pid: carry}, words=[5, 1, 1, 7], tokens=int(weight),
                                  loss_sum=2.5 * weight, steps=4, compute_s=0.5, **{"block_bytes.embed": 120})


@pytest.mark.parametrize("codec", ["f32", "fp16", "bf16", "int8", "onebit"])
def test_a_contribution_crosses_the_wire_format_unchanged(codec):
    a = leaf(1, codec=codec)
    pid, b = contribution_from_wire(*contribution_to_wire(1, a), EXPECT)
    assert pid == 1 and b.weight == a.weight and b.stats == a.stats
    assert np.array_equal(b.words, [1, 5, 7])
    for name, block in a.dense.items():
        got = b.dense[name]
        assert (got.codec, got.shape) == (block.codec, block.shape)
        assert np.array_equal(got.decode(), block.decode())
        assert (got.ids is None) == (block.ids is None) and (got.ids is None or np.array_equal(got.ids, block.ids))
    assert np.array_equal(b.local[1].state, a.local[1].state)
    assert b.local[1].opt["t"] == 7 and np.array_equal(b.local[1].opt["m"], a.local[1].opt["m"])
    failed = Aggregate.contribution(0.0, {}, {2: Carry(error="loss is nan")})
    pid, f = contribution_from_wire(*contribution_to_wire(2, failed), EXPECT)
    assert (pid, f.errors(), f.dense) == (2, ["partition 2: loss is nan"], {})


def _field(key, value):
    def change(fields, arrays):
        fields[key] = value
    return change


def _array(key, value):
    def change(fields, arrays):
        arrays[key] = value
    return change


def _error_alone(*kept):
    """An error frame: no blocks, and of the arrays only ``words`` and those named in ``kept``."""
    def change(fields, arrays):
        fields.update(error="failed", blocks={})
        for k in set(arrays) - {"words", *kept}:
            del arrays[k]
    return change


ALONE = "partition 0: an error is a string of 1 to 2000 characters, sent alone"


@pytest.mark.parametrize("change,line", [
    (_field("pid", 3), "pid 3 is not a partition of this run (0..2)"),
    (_field("pid", True), "pid True is not a partition of this run (0..2)"),
    (_field("weight", float("inf")), "partition 0: weight must be a finite number in [0, 2**53]"),
    (_field("stats", {"tokens": 1, "steps": 1, "x": float("nan")}),
     "partition 0: stat 'x' must be a finite number named [A-Za-z0-9_.]"),
    (_field("stats", {"tokens": -1, "steps": 1}), "partition 0: stat tokens must be a non-negative integer"),
    (_field("stats", [["tokens", 1], ["steps", 1]]), "partition 0: stats must be an object of at most 256 numbers"),
    (_field("stats", {"tokens": 1, "steps": 1, "x": 2.0 ** 53 + 2}),
     "partition 0: stat 'x' must be a finite number named [A-Za-z0-9_.]"),        # past float64's exact integers
    (_field("stats", {"tokens": 1, "steps": 1, **{f"s{i}": 0 for i in range(255)}}),
     "partition 0: stats must be an object of at most 256 numbers"),
    (_array("carry.opt.m", np.full(29, np.nan, np.float32)), "partition 0: optimizer slot m holds non-finite values"),
    (_field("stats", {"tokens": 1, "steps": 1, "a b": 1}),
     "partition 0: stat 'a b' must be a finite number named [A-Za-z0-9_.]"),
    (lambda f, a: f["blocks"].pop("opt.m"), "partition 0: blocks must be exactly ['opt.m', 'params.E', 'params.b']..."),
    (_array("params.E.ids", np.array([4, 1, 6], np.int32)), "params.E: row ids must be sorted unique int32 in [0, 8)"),
    (_array("params.E.ids", np.array([1, 4, 8], np.int32)), "params.E: row ids must be sorted unique int32 in [0, 8)"),
    (_array("params.E.ids", np.array([-1, 4, 6], np.int32)),      # -1 would index the last row, never sent
     "params.E: row ids must be sorted unique int32 in [0, 8)"),
    (_array("carry.state", np.full((1, 2, 4, 2), np.nan, np.float32)),
     "partition 0: the hidden state holds non-finite values"),
    (_array("opt.m.data", np.full((29, 1), np.nan, np.float32)), "partition 0: opt.m holds non-finite values"),
    (_field("t", -5), "partition 0: its optimizer state must name ['m'] and a step count"),
    (_array("params.E.data", np.zeros((3, 2), np.uint8)), "params.E: onebit data must be a uint8[3, 1] array"),
    (_array("params.E.scale", np.full((3, 2), np.nan, np.float32)), "params.E: onebit scale must hold finite values"),
    (_array("opt.m.data", np.zeros((29, 1), np.float64)), "opt.m: f32 data must be a float32[29, 1] array"),
    (lambda f, a: f["blocks"]["params.b"].update(scale=1e50),          # decoded to zeros, silently
     "params.b: the fp16 scale must be a power of two in [2^-113, 2^127]"),
    (lambda f, a: f["blocks"]["params.b"].update(scale=2.0 ** -120),    # decoded to infinities
     "params.b: the fp16 scale must be a power of two in [2^-113, 2^127]"),
    (lambda f, a: f["blocks"]["params.b"].update(scale=3.0),
     "params.b: the fp16 scale must be a power of two in [2^-113, 2^127]"),
    (lambda f, a: f["blocks"]["opt.m"].update(scale=2.0), "opt.m: the f32 scale must be 1"),
    (_array("words", np.array([3, 9], np.int32)), "partition 0: words must be sorted unique int32 in [0, 8)"),
    (_array("words", np.array([3, 3], np.int32)), "partition 0: words must be sorted unique int32 in [0, 8)"),
    (_array("carry.state", np.zeros((1, 2, 4, 3), np.float32)),
     "partition 0: the hidden state must be a float32[1, 2, 4, 2] array"),
    (_field("state", False), "partition 0: state must be true in this run"),
    (lambda f, a: (f.update(state=False), a.pop("carry.state")), "partition 0: state must be true in this run"),
    (lambda f, a: (f.update(opt=None, t=None), a.pop("carry.opt.m")),
     "partition 0: its optimizer state must name ['m'] and a step count"),
    (_field("opt", ["m", "v"]), "partition 0: its optimizer state must name ['m'] and a step count"),
    (_array("carry.opt.m", np.zeros(28, np.float32)), "partition 0: optimizer slot m must be a float32[29] array"),
    (_array("extra", np.zeros(1, np.float32)), "partition 0: unknown arrays ['extra']"),
    (_field("error", "x" * 3000), ALONE),
    (_field("error", "failed"), ALONE),                                  # with its blocks
    (_error_alone("params.E.data"), ALONE),                              # no blocks named, one's array sent
    (_error_alone("carry.state"), ALONE),                                # a carry with it
    (lambda f, a: (f.update(error="", blocks={}), [a.pop(k) for k in list(a) if k != "words"]),
     ALONE),                                  # an empty error would pass for a healthy partition
])
def test_a_malformed_contribution_is_refused_with_its_reason(change, line):
    fields, arrays = contribution_to_wire(0, leaf(0))
    change(fields, arrays)
    with pytest.raises(Malformed) as e:
        contribution_from_wire(fields, arrays, EXPECT)
    assert str(e.value) == line


def test_an_error_sent_alone_is_taken_as_the_partitions_failure():
    fields, arrays = contribution_to_wire(0, leaf(0))
    _error_alone()(fields, arrays)
    pid, got = contribution_from_wire(fields, arrays, EXPECT)
    assert (pid, got.errors(), got.dense, got.weight) == (0, ["partition 0: failed"], {}, 0.0)


def _values_leaf(pid: int, v: float) -> Aggregate:
    return Aggregate.contribution(1.0, {"params.b": Block(np.full(5, v, np.float32), (5,))}, {pid: Carry()},
                                  tokens=1, steps=1)


def test_the_inbox_merges_in_partition_order_whatever_the_arrival_order():
    # float64 sums are not associative: (2^53 - 2^53) + 1 = 1, but (2^53 + 1) - 2^53 = 0
    values = {0: 2.0 ** 53, 1: -(2.0 ** 53), 2: 1.0}
    means = []
    for order in ([0, 1, 2], [2, 0, 1], [0, 2, 1], [1, 2, 0]):
        box = Inbox(3)
        for pid in order:
            assert box.put(pid, _values_leaf(pid, values[pid]))
            box.drain()
        assert box.missing == set()
        means.append(box.agg.mean("params.b"))
    for m in means:
        assert np.array_equal(m, np.full(5, np.float32(1 / 3)))
    box = Inbox(3)
    assert box.put(1, _values_leaf(1, 1.0)) and box.missing == {0, 2}
    assert not box.put(1, _values_leaf(1, 5.0))        # a second copy of a partition is dropped
    assert box.put(0, _values_leaf(0, 1.0)) and not box.put(0, _values_leaf(0, 5.0))
    assert box.missing == {2}


def test_a_closed_inbox_takes_nothing():
    box = Inbox(3)
    assert box.put(1, leaf(1)) and not box.put(1, leaf(1, seed=9))
    box.close()
    assert not box.put(0, leaf(0)) and box.missing == {0, 2}


def test_the_accumulator_merges_in_partition_order_whatever_the_arrival_order():
    """Rounds whose carryover stays in Spark without the channel: the accumulator keeps each partition's
    contribution and the round merges them in partition order."""
    from pyspark.accumulators import Accumulator
    from rnnlm.exchange.aggregate import in_order
    from rnnlm.spark.lineage import Contributions
    values = {0: 2.0 ** 53, 1: -(2.0 ** 53), 2: 1.0}
    for aid, order in enumerate(([0, 1, 2], [2, 0, 1], [0, 2, 1]), 20_001):
        param = Contributions()
        acc = Accumulator(aid, {}, param)
        for pid in order:       # one task's value on its executor, then added on the driver
            acc += param.addInPlace(param.zero(None), _values_leaf(pid, values[pid]))
        acc += {0: _values_leaf(0, 7.0)}                                # a partition computed twice
        leaves = Contributions.take(acc)
        assert sorted(leaves) == [0, 1, 2]
        assert np.array_equal(in_order(leaves.values()).mean("params.b"), np.full(5, np.float32(1 / 3)))


@pytest.fixture
def channel():
    """A real channel on loopback, and the lines it logged."""
    lines = []
    ch = Channel(EXPECT, "127.0.0.1", lines.append, max_frame=1 << 20)
    yield ch, lines
    ch.close()


def test_the_channel_takes_each_partition_once_and_refuses_what_does_not_belong(channel):
    ch, lines = channel
    sink = ch.sink(5)
    assert sink.add(leaf(2)) and sink.add(leaf(0))
    assert not sink.add(leaf(0, seed=9))                  # a retried task's copy: dropped
    host, port = ch.server.address
    conn = wire.connect(host, port, ch._secret, 1 << 20)
    fields, arrays = contribution_to_wire(1, leaf(1))
    conn.send("contribution", dict(fields, round=5, weight=-1.0), arrays)
    assert conn.recv()[:2] == ("refused", {"reason": "partition 1: weight must be a finite number in [0, 2**53]"})
    conn.close()
    stranger = Sink(host, port, wire.new_secret(), 5, 1 << 20)
    assert not stranger.add(leaf(1))                      # another secret: refused at the handshake
    assert not Sink(host, port, ch._secret, 4, 1 << 20).add(leaf(1))     # no such round open
    huge = Aggregate.contribution(1.0, leaf(1).dense, {1: Carry()}, words=np.arange(400_000))
    assert not Sink(host, port, ch._secret, 5, 4 << 20).add(huge)        # over the channel's frame cap: closed
    assert sink.add(leaf(1))
    agg = ch.take(5, recompute=lambda missing: pytest.fail("nothing is missing"))
    payload = sum(a.nbytes for p in range(3) for a in contribution_to_wire(p, leaf(p))[1].values())
    assert payload < agg.wire_bytes < ch.server.bytes_received           # not the refused frames' bytes
    want = leaf(0).merge(leaf(1)).merge(leaf(2))
    assert np.array_equal(agg.mean("params.E"), want.mean("params.E"))
    assert sorted(agg.local) == [0, 1, 2] and agg.stats["tokens"] == 300 and agg.weight == 300.0
    for _ in range(200):                                  # the server counts it once its thread has closed
        if len(ch.server.refused) == 2:
            break
        time.sleep(0.01)
    assert ch.server.refused == {"handshake": 1, "size": 1}
    assert ch.taken == 3
    assert any("weight must be a finite number" in line for line in lines)
    assert not sink.add(leaf(1))                          # the round has closed: late
    assert ch.broken is None


def test_a_round_counts_every_byte_its_contributions_brought_to_the_driver(channel):
    """Not the payload alone: each task's hello, each frame's header, sizes and MAC too, as the
    server's socket counted them."""
    ch, _ = channel
    sink = ch.sink(3)
    assert all(sink.add(leaf(p)) for p in (1, 0, 2))
    agg = ch.take(3, recompute=lambda missing: pytest.fail("nothing is missing"))
    assert agg.wire_bytes == ch.server.bytes_received


def test_a_round_missing_a_partition_recomputes_it_and_gives_the_channel_up(channel):
    ch, lines = channel
    sink = ch.sink(1)
    assert sink.add(leaf(0)) and sink.add(leaf(2))
    asked = []

    def recompute(missing):
        asked.append(missing)
        return [leaf(0, seed=9), leaf(1)]           # a recomputation may hold partitions already in
    agg = ch.take(1, recompute)
    assert asked == [{1}]
    want = leaf(0).merge(leaf(1)).merge(leaf(2))
    assert np.array_equal(agg.mean("params.E"), want.mean("params.E"))
    assert ch.broken == "partitions [1] of round 1 did not arrive"
    assert [x for x in lines if "direct result channel" in x] == [
        "warning: the direct result channel failed (partitions [1] of round 1 did not arrive); recomputed "
        "through Spark, and the rounds submitted from now on send their results through Spark"]


def test_a_partition_no_run_carries_state_for_is_refused_with_a_carry():
    fields, arrays = contribution_to_wire(0, leaf(0))
    fields["opt"], fields["t"] = None, None
    del arrays["carry.opt.m"]
    stateless = Expected(SHAPES, partitions=3, vocab=8, state=None, opt=None, size=29)
    with pytest.raises(Malformed, match="state must be false in this run"):
        contribution_from_wire(fields, arrays, stateless)
    fields["state"] = False
    del arrays["carry.state"]
    pid, b = contribution_from_wire(fields, arrays, stateless)
    assert b.local[0].state is None and b.local[0].opt is None
    for names, t in ([], 3), (None, 3), ([], None):                  # either half of one is refused
        fields["opt"], fields["t"] = names, t
        with pytest.raises(Malformed, match="this run's partitions carry no optimizer state"):
            contribution_from_wire(fields, arrays, stateless)


def test_the_edges_of_a_well_formed_contribution_are_accepted():
    """A partition that scored nothing (weight, tokens, steps and its step count 0), 256 statistics,
    one at 2**53, and an error of one character all pass the checks."""
    fields, arrays = contribution_to_wire(0, leaf(0))
    fields.update(weight=0.0, t=0, stats={"tokens": 0, "steps": 0, "big": 2 ** 53,
                                          **{f"s{i}": 0 for i in range(253)}})
    pid, got = contribution_from_wire(fields, arrays, EXPECT)
    assert (got.weight, got.local[0].opt["t"], len(got.stats), got.stats["big"]) == (0.0, 0, 256, 2 ** 53)
    fields, arrays = contribution_to_wire(0, leaf(0))
    _error_alone()(fields, arrays)
    fields["error"] = "x"
    assert contribution_from_wire(fields, arrays, EXPECT)[1].errors() == ["partition 0: x"]


def test_a_merge_that_fails_fails_the_round_instead_of_dropping_the_partition(monkeypatch, channel):
    real = Aggregate.merge

    def merge(self, other):            # as when the driver runs out of memory merging partition 1
        if 1 in other.local:
            raise MemoryError("no room for the float64 sums")
        return real(self, other)
    monkeypatch.setattr(Aggregate, "merge", merge)
    ch, _ = channel
    sink = ch.sink(1)
    assert sink.add(leaf(0)) and sink.add(leaf(1)) and sink.add(leaf(2))
    with pytest.raises(ChannelError, match="^merging the contributions failed: MemoryError: no room"):
        ch.take(1, recompute=lambda missing: pytest.fail(f"{missing} counted missing, not failed"))
