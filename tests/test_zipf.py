"""Patwary et al.'s (2018) U against N (rnnlm.core.zipf, rnnlm.spark.corpus.unique_growth)."""
import numpy as np
import pytest

from rnnlm.core import zipf


def test_unique_counts_of_a_periodic_stream():
    tokens = np.arange(1000) % 10             # any stretch of N holds min(N, 10) distinct tokens
    ns = np.array([1, 5, 10, 50, 999, 1000, 1001, 2000])     # 1000: the whole stream, one stretch
    got = zipf.unique_counts(tokens, ns, draws=4) / 4
    assert got.tolist() == [1, 5, 10, 10, 10, 10, 0, 0]


def test_unique_counts_are_seeded_draws():
    tokens = np.random.default_rng(0).zipf(1.5, 5000)
    ns = zipf.sizes(4000)
    assert ns[0] == 10 and ns[-1] == 4000 and np.all(np.diff(ns) > 0)
    a, b = zipf.unique_counts(tokens, ns, seed=3), zipf.unique_counts(tokens, ns, seed=3)
    assert np.array_equal(a, b) and not np.array_equal(a, zipf.unique_counts(tokens, ns, seed=4))
    assert np.array_equal(zipf.unique_counts(tokens, ns), zipf.unique_counts(tokens, ns, draws=8, seed=0))
    assert np.all(np.diff(a) >= -8)           # U grows with N (up to draw noise)


def test_sizes_are_four_per_decade_by_default():
    # 10 ** (1 + k / 4), rounded: 17.8, 31.6, 56.2, 177.8, 316.2, 562.3
    assert zipf.sizes(1000).tolist() == [10, 18, 32, 56, 100, 178, 316, 562, 1000]
    assert zipf.sizes(100, smallest=1, per_decade=2).tolist() == [1, 3, 10, 32, 100]
    assert zipf.sizes(10).tolist() == [10] and len(zipf.sizes(9)) == 0


def test_fit_power_law_recovers_the_exponent():
    n = np.array([10, 100, 1000, 10000])
    c, a = zipf.fit_power_law(n, 3.0 * n ** 0.64)
    assert c == pytest.approx(3.0) and a == pytest.approx(0.64)


def test_unique_growth_on_spark_averages_the_partitions(spark, tmp_path):
    from rnnlm.spark.corpus import unique_growth
    f = tmp_path / "c.txt"
    f.write_text("a b c d\n" * 400)            # tokens a b c d <eos>: period 5
    n, u = unique_growth(spark.sparkContext, str(f), "word", "line", partitions=2, longest=1000, draws=3)
    assert n[0] == 10 and n[-1] == 1000
    assert u.tolist() == [5.0] * len(n)
    g = tmp_path / "g.txt"                      # partitions of different vocabularies: the mean of both
    g.write_text("aaa bbb\n" * 300 + "c d e f\n" * 300)       # 3 and 5 types, split at the halfway byte
    n, u = unique_growth(spark.sparkContext, str(g), "word", "line", partitions=2, longest=100, draws=8)
    assert u[0] == pytest.approx((3 + 5) / 2, abs=0.3)
