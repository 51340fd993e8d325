"""What each partition sends of its change: per parameter group, all rows or some, in a codec.

Groups (the ``[exchange]`` configuration section): ``embed``, ``softmax`` (``Wo`` and ``bo``),
``hidden`` (every other slot), each ``dense`` or ``rows`` with an optional codec; what is not sent
is dropped, or with ``exchange.feedback`` kept as the partition's **residual**. docs/exchange.md
("What travels", "Error feedback", "Merging in the tree") says how rows are chosen (Xiao et al.
2017), how a residual catches up, and how seed groups draw random rows (Patwary et al. 2018).
"""
from __future__ import annotations

import math

import numpy as np

from ..core import sampled
from .blocks import Block

PARAMS = "params."          # a block of a parameter slot's change is named PARAMS + the slot's name
GROUP_OF = {"embed": "embed", "Wo": "softmax", "bo": "softmax"}   # every other slot: hidden
_KEY = 0xEC
_SOFTMAX_SALT = 1 << 20        # Wo and bo draw the same V_beta (hidden slots salt with their index)
_GAMMA_KEY = 0x5A


def group_of(slot: str) -> str:
    return GROUP_OF.get(slot, "hidden")


def parse(spec: str) -> tuple:
    """``"rows+fp16"`` -> (True, "fp16"); ``"dense"`` -> (False, "f32")."""
    kind, _, codec = spec.partition("+")
    return kind == "rows", codec or "f32"


def seed_groups(how: str, partitions: int) -> int:
    """How many distinct random-row seeds ``partitions`` partitions use."""
    return {"one": 1, "partition": partitions, "log2": max(1, math.ceil(math.log2(partitions))),
            "pow064": math.ceil(partitions ** 0.64)}[how]


def _random_rows(n: int, fraction: float, seed: int, rnd: int, group: int, salt: int) -> np.ndarray:
    if fraction <= 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, rnd, group, salt, _KEY]))
    return rng.choice(n, size=math.ceil(fraction * n), replace=False)


def _frequent(V: int, ex) -> int:
    """|V_alpha|: the ``exchange.frequent`` most frequent words are ids ``0 .. n - 1``."""
    return min(V, math.ceil(ex.frequent * V))


def _beta(V: int, ex, seed: int, rnd: int, seed_group: int) -> np.ndarray:
    """V_beta: the softmax rows a seed group draws this round (the same for ``Wo`` and ``bo``)."""
    return _random_rows(V, ex.random, seed, rnd, seed_group, _SOFTMAX_SALT)


def select_rows(group: str, slot_index: int, change, ex, words, seed: int, rnd: int, seed_group: int):
    """The sorted row ids of one slot's ``change`` (R, ...) a partition sends."""
    R = change.shape[0]
    if group == "embed":
        return np.flatnonzero(np.any(change.reshape(R, -1) != 0, axis=1)).astype(np.int32)
    if group == "softmax":
        top = np.arange(_frequent(R, ex))
        return np.union1d(np.union1d(words, top), _beta(R, ex, seed, rnd, seed_group)).astype(np.int32)
    return np.unique(_random_rows(R, ex.random, seed, rnd, seed_group, slot_index)).astype(np.int32)


class SoftmaxSampler:
    """The sampled softmax for one partition's round: ``(step, targets) -> Sets``.

    v_all = the step's targets U V_alpha U V_beta, a subset of the rows the
    ``softmax`` group sends this round (its V_base is every word of the round);
    v_f adds V_gamma, ``ceil(exchange.mu * V)`` words drawn from
    ``(seed, round, seed group, step)``, so partitions of one shared-seed group
    normalise over the same dummy words. ``exchange.sampled_variant`` picks the variant
    (:mod:`rnnlm.core.sampled`); ``corrected`` needs ``presence``, each word's chance of being
    among a stream's T targets (:func:`rnnlm.core.sampled.presence`), for its inclusion probabilities.
    For :func:`rnnlm.core.local.train_steps`; ``sizes`` sums |v_all| and |v_f| over the
    steps drawn (for the metrics).
    """

    def __init__(self, V: int, ex, seed: int, rnd: int, pid: int, partitions: int, presence=None):
        if ex.sampled_variant == "corrected" and presence is None:
            raise ValueError("the corrected sampled softmax needs the words' presence (sampled.presence)")
        self.V, self.mu, self.seed, self.rnd = V, ex.mu, seed, rnd
        self.corrected, self.presence = ex.sampled_variant == "corrected", presence
        self.group = pid % seed_groups(ex.seed_groups, partitions)
        self.top, self.beta = _frequent(V, ex), _beta(V, ex, seed, rnd, self.group)
        self.sizes = [0, 0]

    def __call__(self, step: int, targets):
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.rnd, self.group, step, _GAMMA_KEY]))
        if self.corrected:
            sets = sampled.corrected_sets(targets, self.V, self.top, self.beta, self.mu, rng, self.presence)
        else:
            sets = sampled.Sets(*sampled.softmax_sets(targets, self.V, self.top, self.beta, self.mu, rng))
        self.sizes[0] += sets.v_all.size
        self.sizes[1] += sets.v_f.size
        return sets


def encode(layout, change, ex, words, seed: int, rnd: int, pid: int, partitions: int,
           residual=None, scored: bool = True) -> tuple:
    """One partition's change (P,) as blocks named ``PARAMS + slot``, and per-group statistics.

    Parameters
    ----------
    residual : array (P,) or None
        With ``ex.feedback``: what earlier rounds did not send (None: nothing yet).
    scored : bool
        Whether the partition scored a token this round. Its blocks weigh its tokens in the mean, so
        one that scored none sends nothing that counts: with ``ex.feedback`` it keeps its change and
        residual whole.

    Returns
    -------
    blocks : dict of str -> Block
    stats : dict of str -> int
        ``rows_sent.<group>``, ``rows_total.<group>`` and ``block_bytes.<group>``.
    residual : array (P,) of the change's dtype, or None
        With ``ex.feedback``, what this round did not send (change + residual - sent).
    """
    g = pid % seed_groups(ex.seed_groups, partitions)
    blocks, stats = {}, {}
    if ex.feedback:
        total = change.copy() if residual is None else change + residual      # (P,), the model's dtype
        left = total.copy()
    for i, slot in enumerate(layout):
        group = group_of(slot.name)
        rows, codec = parse(getattr(ex, group))
        view = change[slot.offset:slot.end].reshape(slot.shape)
        send = total[slot.offset:slot.end].reshape(slot.shape) if ex.feedback else view
        ids = select_rows(group, i, view, ex, words, seed, rnd, g) if rows else None
        b = Block(send if ids is None else send[ids], slot.shape, ids, codec)
        if ex.feedback:
            kept = left[slot.offset:slot.end].reshape(slot.shape[0], -1)                # (R, C)
            kept[slice(None) if ids is None else ids] -= b.decode()
        blocks[PARAMS + slot.name] = b
        for k, v in (("rows_sent", b.rows), ("rows_total", slot.shape[0]), ("block_bytes", b.nbytes)):
            stats[f"{k}.{group}"] = stats.get(f"{k}.{group}", 0) + int(v)
    return blocks, stats, ((left if scored else total) if ex.feedback else None)


def mean_change(layout, agg, dtype) -> np.ndarray:
    """The token-weighted mean change (P,) from an aggregate of :func:`encode`'d blocks."""
    out = np.empty(layout.size, dtype)
    for slot in layout:
        out[slot.offset:slot.end] = agg.mean(PARAMS + slot.name, dtype).reshape(-1)
    return out
