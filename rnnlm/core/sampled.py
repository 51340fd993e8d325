"""The word sets of seed 000's sampled softmax (section 4).

For one training chunk, :func:`softmax_sets` returns the two sorted id sets that
:meth:`rnnlm.core.model.RNNLM.loss_and_grad` takes as ``softmax=(v_all, v_f)``:

``v_all``  the rows whose gradient is computed (and sent): the chunk's targets,
           the ``top`` most frequent words and the exchange layer's random rows;
``v_f``    ``v_all`` plus V_gamma, ``ceil(mu * V)`` words drawn at random from the
           whole vocabulary: the softmax of the forward pass is normalised over
           ``v_f``, so these dummy words take probability but get no backward.

Ids are frequency ranks (:mod:`rnnlm.core.vocab`), so the ``top`` most frequent
words are ``arange(top)``.
"""
from __future__ import annotations

import math

import numpy as np

from . import backend


def gamma_size(mu: float, V: int) -> int:
    """``ceil(mu * V)``, read as a percentage of V (0.05 of 10000 is 500, not 501)."""
    return min(V, math.ceil(round(mu * V, 6)))


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
    v_all = np.unique(np.concatenate([t.astype(np.int64), np.arange(top, dtype=np.int64), b]))
    k = gamma_size(mu, V)
    if k >= V:
        return v_all, np.arange(V, dtype=np.int64)
    gamma = rng.choice(V, size=k, replace=False) if k else np.empty(0, np.int64)
    return v_all, np.union1d(v_all, gamma.astype(np.int64))
