"""The word sets of the sampled softmax and their inclusion probabilities.

The method is section 4 of Xiao et al., "Fast Parallel Training of Neural Language Models"
(IJCAI 2017); what is wrong with its literal form and the correction: docs/exchange.md, "Sampled softmax".

For one training chunk, :func:`softmax_sets` returns the two sorted id sets that
:meth:`rnnlm.core.model.RNNLM.loss_and_grad` takes as ``softmax=(v_all, v_f)``:

``v_all``  the rows whose gradient is computed (and sent): the chunk's targets,
           the ``top`` most frequent words and the exchange layer's random rows;
``v_f``    ``v_all`` plus V_gamma, ``ceil(mu * V)`` words drawn at random from the
           whole vocabulary: the softmax of the forward pass is normalised over ``v_f``.

Two variants read these sets (:class:`Sets`):

``literal``    as the paper describes it: the dummy words V_gamma take probability
               mass in the forward pass and get no backward at all. The update is then
               the gradient of no loss, and a word outside the frequent set is pushed
               down only in steps where it happens to be drawn; on PTB it trains a far
               worse model than the full softmax (docs/exchange.md, "Sampled softmax").
``corrected``  the same sets and the same ``Wo``/``bo`` rows updated (v_all only, so the
               exchange sends what it sends for ``literal``), with three changes: the
               hidden state's gradient covers every word of ``v_f`` (the paper's "also
               apply this method to dE/dx_j"); every non-target logit is lowered by
               ``log pi_i``, pi_i its word's probability of being in the step's ``v_f``
               (:func:`log_inclusion`; the importance correction of Bengio & Senecal 2008
               and Jean et al. 2015), so the sampled normaliser estimates the full one and
               every parameter below the output layer gets the gradient of that loss; and
               a row of v_all, which moves only in steps where it is in v_all, has its
               push-down weighted by the probability of *that* (``Sets.log_pi_rows``), so
               that in expectation each row is pushed down as the full softmax pushes it.

Ids are frequency ranks (:mod:`rnnlm.core.vocab`), so the ``top`` most frequent
words are ``arange(top)``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import backend

VARIANTS = ("corrected", "literal")


# softmax_sets marks its ids in a (V,) array of flags where V is at most this many times their
# number, and sorts them (np.unique) where V is larger: at PTB's sizes (V 10k, ~1,100 ids) the flags
# take 11 us and the sorts 97 (docs/design.md, "The sampled softmax in a graph")
BITMAP_RATIO = 32


class Sets(NamedTuple):
    """One step's sampled softmax for :meth:`rnnlm.core.model.RNNLM.loss_and_grad`.

    ``v_all`` and ``v_f``: sorted unique ids, ``v_all`` a subset of ``v_f`` (NumPy or ``xp``).
    ``log_pi``: None, or (n_f,) the log-probability of each word of ``v_f`` (same order) being
    in the step's set, subtracted from its logit wherever it is not the target.
    ``through_gamma``: the hidden state's gradient covers every word of ``v_f`` (True) or
    only ``v_all`` (False, the paper's dummy words without backward).
    ``log_pi_rows``: None, or (n_all,) the log-probability of each word of ``v_all`` being in
    it; the rows' gradient then weighs a non-target entry by 1 / that, not 1 / pi.
    """
    v_all: object
    v_f: object
    log_pi: object = None
    through_gamma: bool = False
    log_pi_rows: object = None


def gamma_size(mu: float, V: int) -> int:
    """``ceil(mu * V)``, read as a percentage of V (0.05 of 10000 is 500, not 501)."""
    return min(V, math.ceil(round(mu * V, 6)))


def presence(tokens, T: int, V: int) -> np.ndarray:
    """(V,) float64: the fraction of ``tokens``' consecutive length-``T`` windows that hold each
    word at least once (a word never seen: half a window).

    The chance that a word is among one stream's T targets of a step, measured rather than
    taken as ``1 - (1 - f)^T`` from the unigram frequency f, which assumes words independent
    (on PTB at T = 20 the two differ by about 2%: the words' burstiness within 20 tokens is small).
    """
    t = np.asarray(backend.to_numpy(tokens)).reshape(-1)
    n = max(1, t.size // T)
    w = t[:n * T].reshape(n, -1).astype(np.int64)                       # (windows, T)
    pairs = np.unique((w + (np.arange(n, dtype=np.int64) * V)[:, None])[w >= 0])
    return np.maximum(np.bincount(pairs % V, minlength=V)[:V], 0.5) / n


def log_inclusion(ids, presence, streams: int, top: int, n_beta: int, n_gamma: int, V: int) -> np.ndarray:
    """log pi_i (len(ids),) float64: the probability that word ``i`` is in a step's set ``v_f``.

    The ``top`` most frequent words are always in it (pi = 1). Any other word is in it as a
    target of one of the step's ``streams`` streams (each holding it with probability
    ``presence[i]``, :func:`presence`), as one of the ``n_beta`` random rows or as one of the
    ``n_gamma`` dummy words (each drawn uniformly from V without replacement):
    ``pi_i = 1 - (1 - presence_i)^streams (1 - n_beta / V) (1 - n_gamma / V)``.
    """
    ids = np.asarray(backend.to_numpy(ids), dtype=np.int64)
    f = np.asarray(presence, dtype=np.float64)[ids]
    with np.errstate(divide="ignore"):                              # log(0) = -inf: surely in the set
        # no stream scores a target (a chunk of lane padding): no term, not 0 x log(0) = NaN for a word in every window
        as_target = streams * np.log1p(-np.minimum(f, 1.0)) if streams else np.zeros_like(f)
        log_out = as_target + np.log1p(-min(1.0, n_beta / V)) + np.log1p(-min(1.0, n_gamma / V))  # log P(not in it)
        out = np.log1p(-np.exp(log_out))
    out[ids < top] = 0.0
    return out


def softmax_sets(targets, V: int, top: int, beta, mu: float, rng: np.random.Generator):
    """The sets ``(v_all, v_f)`` of one chunk's sampled softmax.

    Parameters
    ----------
    targets : int array, any shape
        The chunk's next-token targets (NumPy or ``xp``); ids < 0 are not scored
        and ignored.
    V : int
        Vocabulary size.
    top : int
        How many of the most frequent words (ids ``0 .. top - 1``) join ``v_all``.
    beta : int array
        Random rows the caller adds to ``v_all`` (the rows the exchange layer sends
        this round); may be empty.
    mu : float
        Fraction of the vocabulary drawn (without replacement, by ``rng``) as the
        dummy words V_gamma; ``1.0`` makes ``v_f`` the whole vocabulary.
    rng : numpy.random.Generator

    Returns
    -------
    v_all, v_f : int64 ndarray
        Sorted unique ids, ``v_all`` a subset of ``v_f``.

    Raises
    ------
    ValueError
        An id (target or ``beta``) outside ``[0, V)``, or ``top``/``mu`` out of range.
    """
    if not 0 <= top <= V:
        raise ValueError(f"top must be in [0, V={V}], got {top}")
    if not 0.0 <= mu <= 1.0:
        raise ValueError(f"mu is a fraction of the vocabulary in [0, 1], got {mu}")
    t = backend.to_numpy(targets).reshape(-1)
    t = t[t >= 0]
    b = np.asarray(backend.to_numpy(beta), dtype=np.int64).reshape(-1)
    for name, ids in (("target", t), ("beta", b)):
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            raise ValueError(f"{name} ids must be in [0, {V})")
    top = _top(top, t.size, b.size)
    k = gamma_size(mu, V)
    gamma = rng.choice(V, size=k, replace=False).astype(np.int64) if 0 < k < V else np.empty(0, np.int64)
    if V > BITMAP_RATIO * (t.size + top + b.size + gamma.size):        # sorting the ids is cheaper
        v_all = np.unique(np.concatenate([t.astype(np.int64), np.arange(top, dtype=np.int64), b]))
        v_f = np.union1d(v_all, gamma)
    else:                                                              # (V,) flags: no sort
        flags = np.zeros(V, dtype=bool)
        flags[t], flags[:top], flags[b] = True, True, True
        v_all = np.flatnonzero(flags).astype(np.int64, copy=False)
        flags[gamma] = True
        v_f = np.flatnonzero(flags).astype(np.int64, copy=False)
    return v_all, (np.arange(V, dtype=np.int64) if k >= V else v_f)


def _top(top: int, targets: int, beta: int) -> int:
    """``top``, or 1 for a chunk with nothing else in v_all (no scored target, as in a chunk of lane
    padding, and no random row): its one row is the most frequent word's, surely in the set."""
    return top if top or targets or beta else 1


def corrected_sets(targets, V: int, top: int, beta, mu: float, rng: np.random.Generator, presence) -> Sets:
    """:func:`softmax_sets` for ``targets`` (T, B) with the corrected variant's ``log_pi`` and
    ``log_pi_rows`` (``presence``: :func:`presence` with windows of T).

    ``log_pi``: each word of v_f is in the step's set as a target of one of the B streams, a
    random row or a dummy word (:func:`log_inclusion`). ``log_pi_rows``: each word of v_all is
    in it as a target or a random row (the dummy words' rows never move).
    """
    v_all, v_f = softmax_sets(targets, V, top, beta, mu, rng)
    t = backend.to_numpy(targets)
    streams = int((t.reshape(t.shape[0], -1) >= 0).any(axis=0).sum())
    n_beta = np.unique(np.asarray(backend.to_numpy(beta)).reshape(-1)).size
    top = _top(top, streams, n_beta)
    return Sets(v_all, v_f, log_inclusion(v_f, presence, streams, top, n_beta, gamma_size(mu, V), V), True,
                log_inclusion(v_all, presence, streams, top, n_beta, 0, V))
