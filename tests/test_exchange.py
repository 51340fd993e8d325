"""The exchange layer: codecs, row blocks and their merge, row selection, and sparse training on Spark."""
import os
import pickle
import types

import numpy as np
import pytest

from rnnlm import config
from rnnlm.exchange import plan
from rnnlm.exchange.aggregate import Aggregate, Gathered, gather
from rnnlm.exchange.blocks import Block, Sum
from rnnlm.spark.trainer import Trainer

from conftest import ROOT, TINY, metrics


def merge(a, b):
    """Fold ``b`` into ``a`` at once, as a tree node does when its value leaves it."""
    return a.merge(b)


@pytest.mark.parametrize("top", [1e-35, 1e-8, 3e-3, 1.0, 1.9999, 65535.0, 7e4, 1e9])   # 1e-35: its scale 2^131 was inf
def test_fp16_scaling_round_trips_within_its_bound_and_never_overflows(top):
    rng = np.random.default_rng(1)
    v = (rng.standard_normal((50, 7)) * top / 4).astype(np.float32)
    v[3, 2] = top
    b = Block(v, v.shape, codec="fp16")
    assert b.data.dtype == np.float16 and b.data.nbytes == v.nbytes // 2
    got = pickle.loads(pickle.dumps(b)).decode()
    assert np.isfinite(got).all()
    assert (np.abs(got - v) <= np.abs(v) * 2.0 ** -11 + top * 2.0 ** -24).all()
    # what an unscaled cast does at the extremes: overflow, or lose the small values
    if top > 65504 or top < 1e-7:
        with np.errstate(over="ignore"):
            plain = v.astype(np.float16).astype(np.float32)
        assert not np.isfinite(plain).all() or (np.abs(plain - v) > np.abs(v) * 2.0 ** -11 + top * 2.0 ** -24).any()


def test_int8_keeps_each_row_within_its_largest_value_over_254():
    rng = np.random.default_rng(3)
    v = (rng.standard_normal((40, 9)) * np.logspace(-30, 30, 40)[:, None]).astype(np.float32)
    v[5] = 0.0
    b = pickle.loads(pickle.dumps(Block(v, v.shape, codec="int8")))
    got = b.decode()
    top = np.abs(v).max(axis=1, keepdims=True)
    assert b.data.dtype == np.int8 and b.nbytes == v.size + 40 * 4
    assert np.isfinite(got).all() and (got[5] == 0).all()
    assert (np.abs(got - v) <= top / 254 * (1 + 1e-6)).all()
    assert (np.abs(got - v) > top / 1000).any()          # it does round: not float32 in disguise
    vec = Block(v[:, 0].copy(), (40,), codec="int8")     # a vector is one group: one scale
    assert vec.scale.shape == (1, 1) and vec.decode().shape == (40, 1)
    tiny = np.float32([[190, -50, 3]]) * np.float32(2.0 ** -149)       # subnormal: top / 127 rounds down
    assert np.sign(Block(tiny, tiny.shape, codec="int8").decode()).tolist() == [[1, -1, 1]]    # 128 wrapped to -128
    tinier = np.float32([[5, -3, 0]]) * np.float32(2.0 ** -149)      # top / 127 is 0 in float32: inf, NaN
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        assert Block(tinier, tinier.shape, codec="int8").decode().tolist() == tinier.tolist()


def test_bf16_rounds_to_nearest_even_and_keeps_what_is_not_finite():
    v = np.array([[1.0, -3.14159, 1e-30, 3e38]], np.float32)
    b = Block(v, v.shape, codec="bf16")
    got = b.decode()
    assert b.data.dtype == np.uint16 and (np.abs(got - v) <= np.abs(v) * 2.0 ** -8).all()
    assert got[0, 0] == 1.0 and np.isfinite(got).all()
    ulp = 2.0 ** -7                                       # bfloat16's spacing in [1, 2): 7 stored bits
    near = np.array([[1 + 0.75 * ulp, 1 + 0.5 * ulp, 1 + 1.5 * ulp, -(1 + 0.75 * ulp)]], np.float32)
    assert Block(near, near.shape, codec="bf16").decode().tolist() == [[1 + ulp, 1, 1 + 2 * ulp, -(1 + ulp)]]
    edge = np.array([[3.4028235e38, -3.4028235e38, np.inf, -np.inf, np.nan]], np.float32)
    got = Block(edge, edge.shape, codec="bf16").decode()[0]
    assert got[:2].tolist() == [3.3895313892515355e38, -3.3895313892515355e38]    # the largest, not infinity
    assert got[2:4].tolist() == [np.inf, -np.inf] and np.isnan(got[4])
    # no bias: a cut to the upper half shrank every value, by 0.28% on average
    x = np.random.default_rng(0).standard_normal((100_000, 1)).astype(np.float32)
    rel = (Block(x, x.shape, codec="bf16").decode() - x) / x
    assert abs(rel.mean()) < 1e-4 and np.abs(rel).max() <= 2.0 ** -8


def test_int8_says_a_group_holding_nan_or_infinity_is_not_finite():
    w = np.array([[1, np.nan, 2], [1, 2, 3], [np.inf, 0, 0], [-np.inf, 5, 1]], np.float32)
    with np.errstate(all="raise"):
        got = Block(w, w.shape, codec="int8").decode()
    assert np.isnan(got[[0, 2, 3]]).all()
    np.testing.assert_allclose(got[1], [1, 2, 3], rtol=0, atol=3 / 254)                # half a step of 3 / 127


def rows_leaf(pid, weight, ids, rng, shape=(20, 3)):
    vals = rng.standard_normal((len(ids), shape[1])).astype(np.float32)
    full = np.zeros(shape, np.float32)
    full[ids] = vals
    return (Aggregate.contribution(weight, {"w": Block(vals, shape, np.array(ids, np.int32))}, {pid: {}}),
            Aggregate.contribution(weight, {"w": full}, {pid: {}}))


def hop(a):
    return pickle.loads(pickle.dumps(a))


def test_row_blocks_merge_as_a_union_in_any_order_and_equal_the_dense_mean():
    rng = np.random.default_rng(0)
    ids = [[1, 4, 7], [4, 5], [0, 19], [7, 8, 9, 4]]
    leaves = [rows_leaf(i, w, r, rng) for i, (w, r) in enumerate(zip((3, 5, 7, 11), ids))]
    dense = merge(merge(leaves[0][1], leaves[1][1]), merge(leaves[2][1], leaves[3][1])).mean("w")
    union = sorted(set(sum(ids, [])))
    # Spark's tree: nodes {0, 2} and {1, 3} (index modulo the level's width) merge in whatever
    # order their inputs arrive, each node's sum crosses to the driver, which merges in node order
    node = lambda p, a, b, first: merge(hop(p[a]), hop(p[b])) if first else merge(hop(p[b]), hop(p[a]))  # noqa: E731
    results = []
    for first in (True, False):
        for zero_first in (True, False):
            p = [s for s, _ in leaves]
            left, right = hop(node(p, 0, 2, first)), hop(node(p, 1, 3, not first))
            a = merge(merge(Aggregate(), left), right) if zero_first else merge(left, right)
            assert a.dense["w"].ids.tolist() == union                   # no level grows past the union
            results.append(a.mean("w"))
    assert all(np.array_equal(r, results[0]) for r in results)          # arrival order does not matter
    assert np.allclose(results[0], dense, rtol=1e-6, atol=1e-7)         # f32 hops: float32 rounding only
    flat = merge(merge(merge(merge(Aggregate(), hop(leaves[2][0])), hop(leaves[0][0])), hop(leaves[3][0])),
                 hop(leaves[1][0]))
    assert np.array_equal(flat.mean("w"), dense)                        # no hop between merges: exact
    half = merge(hop(leaves[0][0]), hop(leaves[1][0]))
    assert hop(half).dense["w"].ids.tolist() == [1, 4, 5, 7]


def test_a_tree_node_merges_its_inputs_in_partition_order_whatever_order_they_arrive():
    """From 5 partitions at depth 2 Spark's tree has a reduceByKey level: a node gets 3 or more values,
    fetched in any order. Folded as they came, float64 sums of three are not associative: 2^53, -2^53 and 1
    make 1 or 0, and so did a round's mean and its loss. Gathered, they fold in partition order as
    the node's value leaves it, and at the driver."""
    values = {0: 1.0, 1: 2.0 ** 53, 2: -(2.0 ** 53), 3: 0.5, 4: 0.25}    # in partition order 1 is lost: 0
    leaf = lambda pid: Aggregate.contribution(1.0, {"b": np.full(3, values[pid], np.float64)}, {pid: {}},  # noqa: E731
                                              loss_sum=values[pid])
    results = set()
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        node = Gathered()
        for pid in order:                                    # fetched from the leaves' tasks as they finished
            node = gather(node, hop(gather(Gathered(), leaf(pid))))
        driver = gather(gather(Gathered(), hop(Gathered([leaf(3), leaf(4)]))), hop(node))    # nodes' values collected
        agg = driver.settle()
        assert sorted(agg.local) == [0, 1, 2, 3, 4]
        results.add((agg.mean("b", np.float64).tobytes(), agg.stats["loss_sum"]))
    assert len(results) == 1
    [(mean, loss)] = results
    assert np.frombuffer(mean, np.float64).tolist() == [0.75 * (1 / 5)] * 3 and loss == 0.75   # (1 + 2^53) - 2^53 + .75


def test_a_merge_keeps_the_first_start_the_union_of_words_and_errors_in_partition_order():
    def leaf(pid, start, words, error=None):
        local = {pid: types.SimpleNamespace(error=error)}
        return Aggregate.contribution(1.0, {"b": np.zeros(2)}, local, words=words, task_start=start, compute_s=start)
    a = merge(leaf(2, 12.0, [5, 7], "loss nan"), leaf(1, 10.0, [1, 5], "out of memory"))
    a = merge(a, leaf(0, 11.0, [2]))
    assert a.stats["task_start"] == 10.0 and a.stats["compute_s"] == 12.0     # the first start, the slowest phase
    assert a.words.tolist() == [1, 2, 5, 7]
    assert a.errors() == ["partition 1: out of memory", "partition 2: loss nan"]


def test_the_zero_value_shipped_in_every_tasks_closure_is_not_counted_as_result_bytes():
    """treeAggregate pickles its zero value into each task's closure (driver to executor): that pickle's size,
    ~200 bytes, was baked into the zero and counted once per partition in bytes_sent."""
    import pickle

    def leaf():
        return Aggregate.contribution(1.0, {"b": np.arange(3, dtype=np.float32)}, {0: {}}, loss_sum=1.0)
    shipped = pickle.loads(pickle.dumps(Gathered()))                  # the zero as a task receives it
    result = pickle.loads(pickle.dumps(gather(shipped, leaf())))      # the task's value, as it leaves the task
    alone = pickle.loads(pickle.dumps(Gathered([leaf()])))
    assert result.settle().wire_bytes == alone.settle().wire_bytes > 0


@pytest.mark.parametrize("codec,width", [("f32", 4), ("fp16", 2), ("bf16", 2), ("int8", 2), ("onebit", 2)])
def test_a_merged_level_travels_at_the_sent_precision(codec, width):
    rng = np.random.default_rng(5)
    shape = (400, 64)
    leaves = [Aggregate.contribution(w, {"w": Block(rng.standard_normal(shape).astype(np.float32), shape,
                                                    codec=codec)}) for w in (700, 300)]
    exact = merge(hop(leaves[0]), hop(leaves[1]))
    want = exact.mean("w")
    sent = hop(merge(hop(leaves[0]), hop(leaves[1])))
    values = shape[0] * shape[1]
    assert hop(exact).wire_bytes - exact.wire_bytes < values * width + 4096      # not float64 (8 bytes a value)
    assert hop(exact).wire_bytes - exact.wire_bytes > values * width
    got = sent.mean("w")
    bound = {"f32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7, "int8": 2.0 ** -10, "onebit": 2.0 ** -10}[codec]
    assert np.all(np.abs(got - want) <= np.abs(want) * bound + np.abs(want).max() * 2.0 ** -23)
    assert np.isfinite(got).all()
    f64 = Aggregate.contribution(1, {"w": rng.standard_normal(shape)})          # a float64 model stays float64
    both = merge(hop(f64), hop(f64))
    assert np.array_equal(hop(both).mean("w", np.float64), both.mean("w", np.float64))


def test_onebit_sends_signs_and_two_means_per_row():
    v = np.array([[1.0, 3.0, -2.0, 0.0, -4.0], [-1.0, -1.0, -1.0, -1.0, -1.0]], np.float32)
    b = hop(Block(v, v.shape, codec="onebit"))
    assert np.array_equal(b.decode(), np.float32([[4 / 3, 4 / 3, -3, 4 / 3, -3], [-1] * 5]))
    assert b.nbytes == 2 * 1 + 2 * 2 * 4                                   # 5 sign bits per row in one byte
    vec = np.array([[0.5], [1.5], [-2.0]], np.float32)                      # a vector: one group, not one per value
    assert Block(vec, (3,), codec="onebit").decode().ravel().tolist() == [1.0, 1.0, -2.0]
    big = np.random.default_rng(0).standard_normal((100, 200)).astype(np.float32)
    assert Block(big, big.shape, codec="onebit").nbytes * 24 < big.nbytes      # 1 + 64/200 bits a value


def test_error_feedback_transmits_the_whole_change_with_a_bounded_residual():
    from rnnlm.core.layout import Layout
    layout = Layout([("embed", (30, 8)), ("Wx0", (16, 8)), ("b0", (16,)), ("Wo", (30, 8)), ("bo", (30,))])
    ex = Ex(embed="rows+onebit", softmax="rows+onebit", hidden="dense+onebit", random=0.2, feedback=True)
    rng = np.random.default_rng(3)
    change = rng.standard_normal(layout.size).astype(np.float32) * 1e-2        # the same change every round
    residual, sent, norms = None, np.zeros(layout.size, np.float64), []
    for rnd in range(1, 201):
        blocks, _, residual = plan.encode(layout, change, ex, np.array([1, 2]), 5, rnd, 0, 2, residual)
        for slot in layout:
            b = blocks[f"params.{slot.name}"]
            view = sent[slot.offset:slot.end].reshape(slot.shape[0], -1)
            view[slice(None) if b.ids is None else b.ids] += b.decode()
        assert np.allclose(sent + residual, change.astype(np.float64) * rnd, atol=1e-4)   # nothing is lost
        norms.append(np.abs(residual).max())
    assert max(norms[100:]) <= 1.5 * max(norms[:100])                         # bounded, not growing
    assert np.abs(sent / 200 - change).max() < 0.15 * np.abs(change).max()     # the whole change arrives
    without, _, none = plan.encode(layout, change, Ex(embed="rows+bf16", random=0.2), np.array([1]), 5, 1, 0, 2)
    assert none is None
    # a float64 model: its f32 blocks and residual float64 from the first round (float32 there: refused on
    # the direct channel, and the rounding lost from the residual)
    f64 = change.astype(np.float64) + 1e-12
    ex64 = Ex(embed="rows", softmax="rows", hidden="dense", random=0.2, feedback=True)
    blocks, _, residual = plan.encode(layout, f64, ex64, np.array([1, 2]), 5, 1, 0, 2)
    assert residual.dtype == np.float64 and all(b.data.dtype == np.float64 for b in blocks.values())
    sent = np.zeros(layout.size)
    for slot in layout:
        b = blocks[f"params.{slot.name}"]
        sent[slot.offset:slot.end].reshape(slot.shape[0], -1)[slice(None) if b.ids is None else b.ids] = b.decode()
    assert np.array_equal(sent + residual, f64)                                # exactly


def test_a_sum_of_rows_folds_into_a_dense_sum():
    s = Sum((4, 2), None, np.ones((4, 2)))
    s.add(Sum((4, 2), np.array([1, 3], np.int32), np.full((2, 2), 2.0)))
    assert s.values.tolist() == [[1, 1], [3, 3], [1, 1], [3, 3]]


def test_a_sum_of_rows_merges_rows_it_holds_and_rows_it_does_not():
    """The other's rows a subset of these, a superset, the same, overlapping, disjoint: each the dense sum."""
    rng = np.random.default_rng(2)
    shape = (10, 3)
    for mine, theirs in [([1, 4, 7], [4]), ([1, 4, 7], [1, 7]), ([4], [1, 4, 7]), ([2, 3], [2, 3]),
                         ([1, 4], [4, 5]), ([0], [9])]:
        a, b = rng.standard_normal((len(mine), 3)), rng.standard_normal((len(theirs), 3))
        want = np.zeros(shape)
        want[mine] += a
        want[theirs] += b
        s = Sum(shape, np.array(mine, np.int32), a.copy()).add(Sum(shape, np.array(theirs, np.int32), b))
        assert s.ids.tolist() == sorted(set(mine) | set(theirs)), (mine, theirs)
        np.testing.assert_array_equal(s.dense(1.0, np.float64), want)


EDGES = np.array([[0, 0, 0, 0], [-1, -2, -3, -4], [1, 2, 3, 4], [0.5, -0.5, 0, 0.25]], np.float32)
EDGES_ONEBIT = np.array([[0] * 4, [-2.5] * 4, [2.5] * 4, [0.25, -0.5, 0.25, 0.25]], np.float32)


@pytest.mark.parametrize("codec", ["f32", "fp16", "bf16", "int8", "onebit"])
def test_blocks_of_no_rows_zero_rows_and_one_signed_rows_pass_the_receivers_checks(codec):
    """What a sender encodes, a receiver takes (no NaN scale for a zero row or a row of one sign, a zero-row
    block in the shapes the receiver checks), decodes without a floating-point warning, and counts in full."""
    from rnnlm.exchange.frames import block_from_wire, block_to_wire
    cases = [("rows", EDGES, (6, 4), [0, 2, 3, 5]), ("no rows", EDGES[:0], (6, 4), []),
             ("all zero", np.zeros((6, 4), np.float32), (6, 4), None),
             ("zero vector", np.zeros(6, np.float32), (6,), None), ("empty vector", np.zeros(0, np.float32), (6,), [])]
    for name, values, shape, ids in cases:
        with np.errstate(all="raise"):
            b = Block(values, shape, None if ids is None else np.array(ids, np.int32), codec)
            meta, arrays = block_to_wire("w", b)
            got = block_from_wire("w", shape, meta, arrays).decode()
        assert b.nbytes == sum(a.nbytes for a in arrays.values()), name          # what travels, all of it
        want = values.reshape(len(values), *(shape[1:] or (1,)))
        want = EDGES_ONEBIT if codec == "onebit" and name == "rows" else want
        if codec == "int8":
            top = np.abs(want).max(axis=1, keepdims=True) if want.size else 0
            assert np.all(np.abs(got - want) <= top / 254), name
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    with np.errstate(all="raise"):                                               # non-finite: scale 1, no error
        assert Block(np.float32([[np.inf, 1]]), (1, 2), codec="fp16").scale == 1.0


@pytest.mark.parametrize("codec", ["f32", "int8", "onebit"])
def test_a_round_that_left_the_embedding_alone_sends_no_embedding_rows(codec):
    """A partition whose embedding did not move (nothing trained this round) sends a row block of no rows;
    it failed to build one (a reshape to (0, -1)), which failed the task and every retry of it."""
    from rnnlm.core.layout import Layout
    layout = Layout([("embed", (30, 8)), ("Wx0", (16, 8)), ("b0", (16,)), ("Wo", (30, 8)), ("bo", (30,))])
    change = np.zeros(layout.size, np.float32)
    layout.views(change)["Wx0"][...] = 1.0
    name = "rows" if codec == "f32" else f"rows+{codec}"
    blocks, _, _ = plan.encode(layout, change, Ex(embed=name), np.array([1, 2]), 5, 1, 0, 2)
    assert blocks["params.embed"].rows == 0 and blocks["params.embed"].decode().shape == (0, 8)
    agg = merge(Aggregate.contribution(1, blocks), hop(Aggregate.contribution(1, blocks)))
    assert not agg.mean("params.embed").any() and agg.mean("params.Wx0").all()


class Ex:
    def __init__(self, **kw):
        self.__dict__.update(dict(config.ExchangeConfig().__dict__, **kw))


def test_softmax_rows_are_words_frequent_and_seeded_random_shared_within_a_seed_group():
    change = np.zeros((1000, 4), np.float32)
    words = np.array([5, 500, 999])
    ex = Ex(frequent=0.01, random=0.02)
    rows = plan.select_rows("softmax", 7, change, ex, words, seed=3, rnd=2, seed_group=0)
    assert set(words) | set(range(10)) <= set(rows.tolist()) and len(rows) <= 3 + 10 + 20
    again = plan.select_rows("softmax", 7, change, ex, words, seed=3, rnd=2, seed_group=0)
    other_group = plan.select_rows("softmax", 7, change, ex, words, seed=3, rnd=2, seed_group=1)
    other_round = plan.select_rows("softmax", 7, change, ex, words, seed=3, rnd=3, seed_group=0)
    assert np.array_equal(rows, again) and not np.array_equal(rows, other_group)
    assert not np.array_equal(rows, other_round)
    assert [plan.seed_groups(h, 8) for h in ("one", "partition", "log2", "pow064")] == [1, 8, 3, 4]
    assert [plan.seed_groups(h, 1) for h in ("one", "partition", "log2", "pow064")] == [1, 1, 1, 1]
    change[[2, 9]] = 1.0
    change[4, 1] = -1.0                                   # a row changed in one column is a changed row
    assert plan.select_rows("embed", 0, change, ex, words, 3, 2, 0).tolist() == [2, 4, 9]   # exactly what changed
    # shares that are no whole number of rows round up: 1% of 1,001 words is 11, 25% of 10 rows 3, 5% 1
    top = plan.select_rows("softmax", 7, np.zeros((1001, 4)), Ex(frequent=0.01, random=0.0), words[:0], 3, 2, 0)
    assert top.tolist() == list(range(11))
    for fraction, n in ((0.25, 3), (0.05, 1)):
        drawn = plan.select_rows("hidden", 1, np.zeros((10, 4)), Ex(random=fraction), words, 3, 2, 0)
        assert len(drawn) == n, fraction


def test_encode_shares_random_rows_within_a_seed_group_and_counts_each_group_in_full():
    """Six partitions in ceil(log2 6) = 3 seed groups: 0 and 3 draw the same random hidden rows, 1 and 4 too,
    exactly ceil(random * R) distinct rows each; the statistics add up every slot of a group."""
    from rnnlm.core.layout import Layout
    layout = Layout([("embed", (30, 8)), ("Wx0", (40, 8)), ("b0", (40,)), ("Wo", (30, 8)), ("bo", (30,))])
    ex = Ex(embed="rows", softmax="rows+int8", hidden="rows+fp16", random=0.5, frequent=0.0, seed_groups="log2")
    change = np.random.default_rng(0).standard_normal(layout.size).astype(np.float32)
    sent = {pid: plan.encode(layout, change, ex, np.array([1, 2]), 5, 1, pid, 6) for pid in range(6)}
    ids = {pid: sent[pid][0]["params.Wx0"].ids.tolist() for pid in range(6)}
    assert ids[0] == ids[3] and ids[1] == ids[4] and len({str(ids[p]) for p in range(3)}) == 3
    assert all(len(set(ids[p])) == len(ids[p]) == 20 for p in range(6))             # ceil(0.5 * 40), distinct
    blocks, stats, _ = sent[0]
    for group, slots in (("embed", ["embed"]), ("softmax", ["Wo", "bo"]), ("hidden", ["Wx0", "b0"])):
        got = [blocks[plan.PARAMS + s] for s in slots]
        assert stats[f"rows_sent.{group}"] == sum(b.rows for b in got)
        assert stats[f"rows_total.{group}"] == sum(b.shape[0] for b in got)
        assert stats[f"block_bytes.{group}"] == sum(b.nbytes for b in got) > 0
    softmax = blocks["params.Wo"].ids.tolist()
    assert softmax == blocks["params.bo"].ids.tolist() and {1, 2} <= set(softmax) and len(softmax) >= 15
    merged = merge(Aggregate.contribution(3, blocks), Aggregate.contribution(1, blocks))
    mean = plan.mean_change(layout, merged, np.float32)
    for slot in layout:
        b = blocks[plan.PARAMS + slot.name]
        want = np.zeros((slot.shape[0], b.decode().shape[1]), np.float32)
        want[slice(None) if b.ids is None else b.ids] = b.decode()
        np.testing.assert_allclose(mean[slot.offset:slot.end], want.ravel(), rtol=1e-6, err_msg=slot.name)


def train(spark, tmp_path, name, *sets):
    cfg = config.load(os.path.join(ROOT, "conf/demo.toml"), [
        f"data.train={ROOT}/rnnlm/data/harbour.txt", "data.valid=", "data.level=word", "model.embed=16",
        *TINY, "train.rounds=6",
        "train.eval_every=0", "optim.name=sgd", "optim.lr=0.5", "train.optim_state=reset", *sets])
    tr = Trainer(spark, cfg, str(tmp_path / name), log=lambda s: None)
    tr.run()
    return tr, metrics(tmp_path / name)


def test_rows_on_the_input_embedding_alone_equal_dense_exchange(spark, tmp_path):
    dense, md = train(spark, tmp_path, "dense")
    rows, mr = train(spark, tmp_path, "rows", "exchange.embed=rows")
    assert np.abs(dense.params - rows.params).max() < 1e-6        # exact up to float32 rounding
    assert [x["train_loss"] for x in md] == pytest.approx([x["train_loss"] for x in mr], rel=1e-5)
    assert mr[-1]["bytes_sent"] < md[-1]["bytes_sent"]
    last = mr[-1]
    assert 0 < last["rows_sent.embed"] < last["rows_total.embed"] and last["rows_sent.softmax"] == last[
        "rows_total.softmax"]
    assert last["unique_words"] <= last["rows_sent.embed"]                # SGD: the rows read are the rows changed


def test_sparse_and_compressed_exchange_learns_with_fewer_bytes(spark, tmp_path):
    _, md = train(spark, tmp_path, "dense")
    _, ms = train(spark, tmp_path, "sparse", "exchange.embed=rows+fp16", "exchange.softmax=rows+fp16",
                  "exchange.hidden=dense+bf16", "exchange.frequent=0.05", "exchange.random=0.05")
    assert ms[-1]["train_loss"] < ms[0]["train_loss"] - 0.1                # it learns...
    assert abs(ms[-1]["train_loss"] - md[-1]["train_loss"]) < 0.02           # ...about as dense exchange does
    assert ms[-1]["bytes_sent"] < 0.6 * md[-1]["bytes_sent"]
    assert ms[-1]["compression"] > 1.8 and md[-1]["compression"] == pytest.approx(1.0, rel=0.01)


def test_changed_rows_rebuild_the_parameters_bit_for_bit():
    from rnnlm.core.layout import Layout
    from rnnlm.exchange import rebase
    layout = Layout([("embed", (50, 4)), ("W", (6, 3)), ("b", (6,))])
    rng = np.random.default_rng(2)
    base = rng.standard_normal(layout.size).astype(np.float32)
    params = base.copy()
    params[4 * 7:4 * 8] += 1e-7                       # one embedding row, a change below float32's spacing at 1
    params[200:218] *= 1.5                            # all of W
    rows = rebase.changed_rows(layout, params, base)
    assert rows["embed"][0].tolist() == [7] and rows["W"][0] is None and "b" not in rows
    assert np.array_equal(rebase.rebuild(layout, base, rows), params)
    assert rebase.size(rows) == 4 + 1 + 18                      # values and ids: embed row 7 (and its id), all of W
    # a slot goes whole once more than half its rows changed (ids would cost more), not at half
    for changed, whole in ((3, False), (4, True)):
        p = base.copy()
        p[200:200 + 3 * changed] += 1.0                             # the first rows of W (6, 3)
        d = p - base
        assert (rebase.changed_rows(layout, p, base)["W"][0] is None) == whole
        assert (rebase.delta_blocks(layout, d, "f32")["W"].ids is None) == whole


def test_the_broadcast_shrinks_to_the_rows_that_changed(spark, tmp_path):
    _, md = train(spark, tmp_path, "dense")
    _, mr = train(spark, tmp_path, "rows", "exchange.embed=rows", "exchange.softmax=rows", "exchange.frequent=0.05")
    assert all(x["rebased"] for x in md)                          # dense: every row changes, every round re-bases
    assert not mr[1]["rebased"] and mr[1]["round_bytes_broadcast"] < 0.45 * md[1]["round_bytes_broadcast"]
    assert mr[-1]["bytes_broadcast"] < 0.75 * md[-1]["bytes_broadcast"]     # a ~500-word vocabulary: re-bases often


class _FakeBroadcast:
    def __init__(self, value):
        self.value = pickle.loads(pickle.dumps(value))        # what an executor unpickles
        self.destroyed = False

    def destroy(self, blocking=False):
        self.destroyed = True


class _FakeSC:
    def broadcast(self, value):
        return _FakeBroadcast(value)


@pytest.mark.parametrize("codec", ["f32", "fp16", "int8", "onebit"])
def test_delta_broadcast_executors_rebuild_the_view_and_the_view_catches_up(codec):
    from rnnlm.core.layout import Layout
    from rnnlm.exchange import rebase
    from rnnlm.spark.broadcasts import DeltaBroadcast
    layout = Layout([("embed", (50, 4)), ("W", (6, 3)), ("b", (6,))])
    rng = np.random.default_rng(2)
    params = rng.standard_normal(layout.size).astype(np.float32)
    db = DeltaBroadcast(_FakeSC(), layout, every=0, fraction=0.5, codec=codec)
    first = db.round(params)
    assert first[2] == [] and first[3] == [first[0]] and np.array_equal(db.view, params)
    bases, lags = [first[0]], []
    for r in range(40):
        if r < 20:                                    # moving, then still: the view must catch up
            params = params.copy()
            params[4 * (r % 50):4 * (r % 50) + 4] += 0.01 * rng.standard_normal(4).astype(np.float32)
            params[200:218] += 0.001 * rng.standard_normal(18).astype(np.float32)
        bc_base, rows, deltas, new = db.round(params)
        if bc_base is not bases[-1]:
            assert bases[-1].destroyed and new[0] is bc_base   # a new base: the old one and its deltas go
            bases.append(bc_base)
        view = rebase.rebuild(layout, bc_base.value, rows)     # what an executor rebuilds
        for d in deltas:
            rebase.apply_delta(layout, view, d.value)
        assert np.array_equal(view, db.view)                   # bit for bit
        lags.append(np.abs(params - db.view).max())
    # each delta block is a tenth of the model's float32 bytes or less: it re-bases by size
    assert len(bases) > 2
    if codec == "onebit":
        assert max(lags[:20]) < 0.02 and lags[-1] < 0.1 * max(lags[:20])   # the codec's error is sent later
    elif codec == "fp16":
        assert max(lags) < 1e-5 and lags[-1] == 0.0
    elif codec == "int8":
        assert max(lags) < 1e-4 and lags[-1] < 1e-6
    else:
        assert max(lags) == 0.0


def test_the_base_is_renewed_when_a_rounds_rows_reach_the_fraction_or_every_rounds():
    """One slot of 10 rows of 4 (40 values), fraction 0.5: k changed rows send 4k values and k ids, so 4 rows
    (20) renew the base and 3 (15) do not; with ``every = N`` a base serves N rounds (it served N + 1, and
    ``every = 1`` re-based every other round). A new base is a new token, and the old one is retired."""
    from rnnlm.core.layout import Layout
    from rnnlm.spark.broadcasts import ParamsBroadcast
    layout = Layout([("W", (10, 4))])
    base = np.zeros(40, np.float32)

    def moved(rows):
        p = base.copy()
        p[:4 * rows] = 1.0
        return p

    retired = []
    pb = ParamsBroadcast(_FakeSC(), layout, every=0, fraction=0.5, retire=retired.extend)
    bc, rows, deltas, new = pb.round(base)
    assert new == [bc] and rows == {} and deltas == [] and pb.token.endswith(":1")
    for _ in range(5):                                          # only by size: 3 rows never renew it
        again, rows, _, new = pb.round(moved(3))
        assert again is bc and new == [] and rows["W"][0].tolist() == [0, 1, 2]
    renewed, rows, _, new = pb.round(moved(4))
    assert renewed is not bc and new == [renewed] and rows == {} and retired == [bc] and pb.token.endswith(":2")
    assert np.array_equal(renewed.value, moved(4))
    for every, want in ((3, "RrrRrrRr"), (1, "RRRRRRRR")):
        pb = ParamsBroadcast(_FakeSC(), layout, every=every, fraction=0.5, retire=retired.extend)
        assert "".join("R" if pb.round(moved(1))[3] else "r" for _ in range(8)) == want
    assert ParamsBroadcast(_FakeSC(), layout, 0, 0.5).token != ParamsBroadcast(_FakeSC(), layout, 0, 0.5).token


def test_a_delta_broadcast_renews_its_base_once_its_deltas_bytes_reach_the_fraction():
    """f32 deltas of 2 rows of 4 cost 32 bytes and 8 of ids; fraction 0.5 of 160 bytes renews the base once
    80 bytes have been sent since it: after two such deltas, at the third round's start."""
    from rnnlm.core.layout import Layout
    from rnnlm.spark.broadcasts import DeltaBroadcast
    layout = Layout([("W", (10, 4))])
    params = np.zeros(40, np.float32)
    db = DeltaBroadcast(_FakeSC(), layout, every=0, fraction=0.5, codec="f32", retire=lambda old: None)
    first, _, deltas, new = db.round(params)
    assert new == [first] and deltas == []                       # nothing moved: no delta
    kinds = []
    for r in range(6):
        params = params.copy()
        params[8 * (r % 5):8 * (r % 5) + 8] += 1.0               # two rows
        bc, _, deltas, new = db.round(params)
        kinds.append(("base" if bc in new else "") + f"+{len(deltas)}")
        assert np.array_equal(db.view, params) and new[-1] is deltas[-1]
    assert kinds == ["+1", "+2", "base+1", "+2", "base+1", "+2"]
    db = DeltaBroadcast(_FakeSC(), layout, every=2, fraction=10.0, codec="f32", retire=lambda old: None)
    db.round(params)
    kinds = []
    for r in range(6):                                           # by age alone: a base serves two rounds
        params = params + 1.0
        bc, _, deltas, new = db.round(params)
        kinds.append(("base" if bc in new else "") + f"+{len(deltas)}")
    assert kinds == ["+1", "base+1", "+2", "base+1", "+2", "base+1"]


def test_a_delta_broadcast_in_fp16_trains_like_the_exact_one_for_a_fraction_of_the_bytes(spark, tmp_path):
    rows = ("exchange.embed=rows", "exchange.softmax=rows", "exchange.frequent=0.05")
    _, mr = train(spark, tmp_path, "rows", *rows)
    _, md = train(spark, tmp_path, "delta", *rows, "exchange.broadcast=delta+fp16", "exchange.hidden=dense+fp16",
                  "train.rebase_fraction=2")
    # rows re-base every other round (half this small model changes); deltas pile up on the first base
    assert [x["rebased"] for x in md] == [True] + [False] * 5 and sum(x["rebased"] for x in mr) == 3
    assert md[-1]["bytes_broadcast"] < 0.7 * mr[-1]["bytes_broadcast"]
    _, m32 = train(spark, tmp_path, "delta32", *rows, "exchange.broadcast=delta", "exchange.hidden=dense+fp16",
                   "train.rebase_fraction=2")
    later = [sum(x["round_bytes_broadcast"] for x in m[1:]) for m in (md, m32)]
    assert later[0] < 0.85 * later[1]                                      # the deltas travel in fp16
    assert abs(md[-1]["train_loss"] - mr[-1]["train_loss"]) < 0.02


def test_softmax_sampler_shares_words_within_a_seed_group_and_stays_inside_the_rows_sent():
    ex = Ex(frequent=0.01, random=0.02, mu=0.05, seed_groups="log2", sampled_variant="literal")   # 2 groups
    targets = np.array([[5, 500], [999, -1]])
    a, b, c = (plan.SoftmaxSampler(1000, ex, seed=3, rnd=2, pid=p, partitions=4) for p in (0, 2, 1))
    v_all, v_f = a(0, targets)[:2]
    assert [x.tolist() for x in b(0, targets)[:2]] == [v_all.tolist(), v_f.tolist()]    # pids 0, 2: group 0
    step1 = a(1, targets)[1]
    assert c(0, targets)[1].tolist() != v_f.tolist() and step1.tolist() != v_f.tolist()
    assert 50 <= len(v_f) <= 50 + len(v_all) and a.sizes == [2 * len(v_all), len(v_f) + len(step1)]
    sent = plan.select_rows("softmax", 7, np.zeros((1000, 4)), ex, np.array([5, 500, 999]), 3, 2, 0)
    assert set(v_all.tolist()) <= set(sent.tolist()) and {5, 500, 999} | set(range(10)) <= set(v_all.tolist())
    bias = plan.select_rows("softmax", 8, np.zeros(1000), ex, np.array([5, 500, 999]), 3, 2, 0)
    assert bias.tolist() == sent.tolist()                                     # Wo and bo send the same rows
