"""Patwary et al.'s (2018) Zipf measurement: how many distinct words U a stretch of N tokens holds.

U grows as a power of N (U ~ c N^a, a < 1: Heaps' law, the other face of Zipf's), so a
minibatch's unique words, the rows row-sparse exchange sends, grow far slower than
the batch. :func:`unique_counts` measures U(N) on one token stream; the Spark side
(:func:`rnnlm.spark.corpus.unique_growth`) sums these over partitions.
"""
from __future__ import annotations

import numpy as np

from .vocab import tokenize


def sizes(longest: int, smallest: int = 10, per_decade: int = 4) -> np.ndarray:
    """Log-spaced stretch lengths N from ``smallest`` up to ``longest`` (int64, distinct)."""
    if longest < smallest:
        return np.zeros(0, np.int64)
    n = np.logspace(np.log10(smallest), np.log10(longest), int(per_decade * np.log10(longest / smallest)) + 1)
    return np.unique(np.round(n).astype(np.int64))


def unique_counts(tokens, ns, draws: int = 8, seed: int = 0) -> np.ndarray:
    """For each N in ``ns``: the summed count of distinct tokens over ``draws`` stretches of N
    consecutive tokens of ``tokens`` starting at seeded random offsets (0 where N exceeds
    the stream). Returns float64 sums: divide by ``draws`` for the mean.
    """
    tokens = np.asarray(tokens)
    rng = np.random.default_rng(seed)
    out = np.zeros(len(ns))
    for i, n in enumerate(ns):
        if n > len(tokens):
            continue
        for s in rng.integers(0, len(tokens) - n + 1, size=draws):
            out[i] += len(np.unique(tokens[s:s + n]))
    return out


def token_ids(paragraphs, level: str) -> np.ndarray:
    """The tokens of ``paragraphs`` (strings, :func:`rnnlm.core.vocab.tokenize`) as int64 ids in
    order of first appearance: distinct tokens, distinct ids, no vocabulary cap."""
    ids = {}
    return np.array([ids.setdefault(t, len(ids)) for p in paragraphs for t in tokenize(p, level)], np.int64)


def fit_power_law(n, u) -> tuple:
    """Least squares in log-log: ``(c, a)`` of ``u ~ c * n ** a``."""
    a, log_c = np.polyfit(np.log(np.asarray(n, float)), np.log(np.asarray(u, float)), 1)
    return float(np.exp(log_c)), float(a)
