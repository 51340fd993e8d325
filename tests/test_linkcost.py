"""The link model behind ``train.py --dry-run --bandwidth`` (rnnlm.spark.linkcost), by hand: the dry
run's own test (test_jobs) checks it against a real run's bytes, the shaped-link test (test_netcluster)
the rates against tc."""
import pytest

from rnnlm.spark.linkcost import LinkError, broadcast_copies, parse_latency, parse_rate, predict, tree_levels


@pytest.mark.parametrize("text,bits", [
    ("100mbit", 1e8), ("1gbit", 1e9), ("10Gbit/s", 1e10), ("2.5gbps", 2e10), (" 64kbit ", 64e3),
    ("1tbit", 1e12), ("800", 800.0), (".5mbit", 5e5), ("3mbps", 2.4e7), ("0.5", 0.5), ("125kbps/s", 1e6),
])
def test_rates_in_decimal_units_as_tc_reads_them(text, bits):
    assert parse_rate(text) == pytest.approx(bits, rel=1e-12)


@pytest.mark.parametrize("text,msg", [
    ("fast", "expected a number and a unit"), ("1xbit", "expected a number"), ("-1mbit", "expected a number"),
    ("0gbit", "must be > 0"), ("0.0", "must be > 0"), ("", "expected a number"),
    ("3MB", "expected a number"), ("1gb", "expected a number"),          # bits or bytes? tc reads neither
])
def test_a_rate_that_cannot_be_read_is_one_line(text, msg):
    with pytest.raises(LinkError, match=f"^bandwidth {text!r}: {msg}"):
        parse_rate(text)


def test_latencies():
    assert [parse_latency(t) for t in ("100us", "1ms", "0.5MS", "2s", "0s", " 7 ms ")] == \
        pytest.approx([1e-4, 1e-3, 5e-4, 2.0, 0.0, 7e-3], rel=1e-12)
    for bad in ("1", "soon", "1h", "-1ms"):
        with pytest.raises(LinkError, match=f"^latency {bad!r}: expected a number and a unit"):
            parse_latency(bad)


def test_broadcast_copies_are_half_the_executors_and_one():
    assert [broadcast_copies(p) for p in (1, 2, 4, 9)] == [1.0, 1.5, 2.5, 5.0]


def test_a_round_on_a_100_mbit_link():
    # 12 Mbyte/s of payload (96% of 12.5): 6 MB of results in 0.5 s; 2.4 MB broadcast to 3 partitions
    # leaves the driver twice (4.8 MB, 0.4 s); 4 round trips of 2 x 1 ms
    out = predict(6e6, 2.4e6, 3, 1e8, latency_s=1e-3, overhead_s=0.3, compute_s=2.0)
    want = {"down_s": 0.5, "up_s": 0.4, "latency_s": 0.008, "wire_s": 0.908, "overhead_s": 0.3,
            "sync_s": 0.15 + 0.908, "round_s": 2.0 + 1.058, "sync_fraction": 1.058 / 3.058}
    assert out.keys() == want.keys()
    for k, v in want.items():
        assert out[k] == pytest.approx(v, rel=1e-12), k


def test_on_a_fast_link_the_overhead_is_what_a_round_pays():
    out = predict(6e6, 2.4e6, 3, 1e11, overhead_s=0.3)        # wire 0.0009 s: under half the overhead
    assert out["sync_s"] == 0.3 and "round_s" not in out and "sync_fraction" not in out
    assert out["latency_s"] == pytest.approx(0.0, abs=1e-15)


def test_without_a_measured_overhead_a_round_pays_the_wire():
    out = predict(1.2e6, 0.0, 2, 1e8)                          # 0.1 s of results, nothing broadcast
    assert out["sync_s"] == pytest.approx(0.1, rel=1e-12) and out["overhead_s"] == 0.0


def test_tree_levels_are_pysparks():
    """treeAggregate's loop (scale = ceil(P^(1/depth)), at least 2; a level while n > scale + n / scale): up to
    4 partitions at depth 2 every result reaches the driver; from 5 executors merge first."""
    assert [tree_levels(p, 2) for p in (1, 2, 3, 4, 5, 6, 9, 16, 100)] == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert [tree_levels(p, 1) for p in (2, 64)] == [0, 0] and tree_levels(64, 3) == 2 and tree_levels(8, 3) == 1
