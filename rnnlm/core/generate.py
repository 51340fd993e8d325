"""Sampling text from a trained model."""
from __future__ import annotations

import math

import numpy as np

from . import backend


def generate(model, params, vocab, prime: str = "", length: int = 200,
             temperature: float = 1.0, argmax: bool = False, seed: int = 0) -> str:
    """Continue ``prime`` by ``length`` tokens.

    Parameters
    ----------
    temperature : float
        Divides the logits; below 1 sharpens, above 1 flattens.
    argmax : bool
        Always take the most likely token (``temperature`` is then ignored).
    seed : int
        Fixes the sampled sequence.

    Returns
    -------
    str
        The generated continuation (without the prime; :meth:`Vocab.join` puts them together).
        A word-level prime that does not end with a line break is continued inside its
        sentence (no ``<eos>`` is added after it).
    """
    if not (0 < temperature < math.inf) and not argmax:
        raise ValueError(f"temperature must be a number > 0 (or use argmax), not {temperature!r}")
    if length < 0:
        raise ValueError("length must be >= 0")
    xp = model.xp
    rng = np.random.default_rng(seed)
    ids = vocab.encode(prime, open_end=True) if prime else np.zeros(0, np.int32)
    if ids.size == 0:  # start from a line end / the most frequent token
        start = vocab.index.get("<eos>", vocab.index.get("\n", 0))
        ids = np.array([start], np.int32)
    state = model.zero_state(1)
    x = xp.asarray(ids.reshape(-1, 1))
    out = []
    for _ in range(length):
        with np.errstate(over="ignore", invalid="ignore"):        # checked below, in one line
            logits, state = model.next_logits(params, x, state)
        lg = backend.to_numpy(logits[0]).astype(np.float64)
        if not np.isfinite(lg).all():
            raise ValueError("the model's next-token scores are not finite (its weights overflow float32's "
                             "range on this text): nothing to sample")
        if argmax:
            nxt = int(lg.argmax())
        else:
            with np.errstate(over="ignore"):        # a temperature near 0: the others' weights underflow to 0
                pr = np.exp((lg - lg.max()) / temperature)
            pr /= pr.sum()
            nxt = int(rng.choice(pr.size, p=pr))
        out.append(nxt)
        x = xp.asarray(np.array([[nxt]], np.int32))
    return vocab.decode(out)
