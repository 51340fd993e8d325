"""The dry run's arithmetic (rnnlm.spark.dryrun) without Spark: what it reads from the probe's metrics
lines, and an async run's estimate from the words each partition reads (its end-to-end test, against a
real run's bytes, is in test_jobs)."""
import numpy as np
import pytest

from rnnlm import config
from rnnlm.core.models import build as build_model
from rnnlm.spark.dryrun import estimate, measured, merge_levels, round_words_task
from rnnlm.spark.executor import make_source


def test_the_probe_reads_round_1s_bytes_and_later_rounds_medians():
    """A round's broadcast bytes count a copy per executor that read it; the link's model takes one copy."""
    lines = [{"round_bytes_sent": 1000, "round_bytes_broadcast": 15000, "executors": 3, "block_bytes.embed": 300,
              "block_bytes.softmax": 400, "compute_s": 9.0, "round_s": 20.0},
             {"round_bytes_sent": 990, "round_bytes_broadcast": 1400, "executors": 2, "compute_s": 1.0, "round_s": 1.5},
             {"round_bytes_sent": 980, "round_bytes_broadcast": 800, "executors": 1, "compute_s": 2.0, "round_s": 2.2},
             {"round_bytes_sent": 970, "round_bytes_broadcast": 2700, "executors": 3, "compute_s": 3.0, "round_s": 2.5}]
    got = measured(lines, partitions=3, params=1000)
    assert got == {"sent": 1000, "broadcast": 800, "blocks": 700, "first_broadcast": 5000, "dense": 12000,
                   "model": 4000, "compute_s": 2.0, "overhead_s": pytest.approx(0.2)}    # 0.5, 0.2, and 0 (not -0.5)


def test_under_overlap_the_broadcast_is_not_round_2s_which_carries_no_change():
    """Round 2's job is defined from round 1's parameters under train.overlap (its broadcast holds
    the round message alone, as a probe of AllReduce measured: 104 bytes against 20,784)."""
    lines = [{"round_bytes_sent": 900, "round_bytes_broadcast": b, "executors": 1, "compute_s": 1.0, "round_s": 1.0}
             for b in (20784, 104, 20784, 20784)]
    assert measured(lines, partitions=2, params=5138)["broadcast"] == 20784


def test_the_link_note_counts_executor_merges_only_where_treeaggregate_carries_the_results():
    def levels(*sets):
        return merge_levels(config.load(None, ["data.partitions=8", "train.tree_depth=2", *sets]))
    assert levels() == 1 and levels("train.tree_depth=1") == 0
    assert levels("data.partitions=4") == 0
    # error feedback and overlap keep results in Spark's lineage, the direct channel sends them as frames:
    # every partition's result reaches the driver itself
    assert levels("exchange.feedback=true", "exchange.embed=rows") == 0
    assert levels("train.overlap=1") == 0 and levels("train.results=direct") == 0


def _async_cfg(*sets):
    cfg = config.load(None, ["model.hidden=8", "model.vocab_size=50", "train.mode=async", "data.partitions=2",
                             "optim.name=adagrad", *sets])
    return cfg, build_model(cfg.model).layout


def test_an_async_estimate_sends_every_weight_dense_and_only_the_rows_read_as_rows():
    cfg, layout = _async_cfg()
    words = [(0, np.array([1, 2, 3]), np.array([1, 2, 3, 4])), (1, np.array([5]), np.array([5, 6]))]
    dense = estimate(layout, cfg, words)
    assert dense == {"sent": 2 * layout.size * 4, "dense": 2 * layout.size * 4, "model": layout.size * 4}
    cfg, layout = _async_cfg("exchange.embed=rows")
    E = layout["embed"].shape[1]
    rest = (layout.size - 50 * E) * 4                       # every other weight, dense float32
    for n in (0, 1, 3, 50):
        got = estimate(layout, cfg, [(0, np.arange(n), np.arange(50))])["sent"]
        assert got == rest + n * (4 * E + 4), n            # the input rows read: E float32 and an int32 id each
    both = estimate(layout, cfg, words)["sent"]            # input words, not every word: 3 rows, then 1
    assert both == 2 * rest + 4 * (4 * E + 4)


def test_an_async_estimate_reads_round_1s_input_words_and_targets():
    """Per partition: the words round 1's batches read as input, and those with its targets (padding,
    -1, is no word; word 0 is)."""
    cfg, _ = _async_cfg("train.push_every=2", "train.bptt=3", "train.batch=2", "data.strategy=streams")
    cfg = config.replace(cfg, "train", local_steps=2)
    tokens = (1 + np.arange(60) % 49).astype(np.int32)
    tokens[6] = 0                                              # stream 0's last target in round 1, and no input
    (pid, x, both), = round_words_task(cfg)(iter([(4, tokens, np.array([0]))]))
    batches = make_source(cfg, 4, tokens, np.array([0])).round_batches(1, 2)
    inputs = {int(t) for b in batches for t in b.x.ravel()}
    targets = {int(t) for b in batches for t in b.y.ravel() if t >= 0}
    assert pid == 4 and x.tolist() == sorted(inputs) and both.tolist() == sorted(inputs | targets)
    assert 0 in targets and 0 not in inputs
    first = make_source(cfg, 4, tokens, np.array([0])).round_batches(0, 2)
    assert {int(t) for b in first for t in b.x.ravel()} != inputs                  # round 1, not round 0
