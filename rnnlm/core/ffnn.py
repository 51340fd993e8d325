"""Bengio et al.'s feed-forward neural network language model (as Tai and Xu 2014 train it).

Each position reads the K words ending at it: their embeddings, concatenated,
feed one tanh layer and a full softmax. :class:`FFNNLM` is a drop-in
replacement for :class:`rnnlm.core.model.RNNLM`: the same flat parameter
buffer, chunked ``loss``/``loss_and_grad`` and a carried "state", which here is
the last K - 1 token ids of each stream, so a stream cut into chunks scores
exactly as one long chunk.
"""
from __future__ import annotations

import numpy as np

from . import backend, output
from ..config import ModelConfig
from .layout import Layout

NO_SAMPLED = "the sampled softmax is not supported by model.cell = 'ffnn'"


class _ChunkBuffers:
    """Everything one (T, B) chunk needs, allocated once and reused."""

    def __init__(self, xp, m, T, B):
        N, K, dt = T * B, m.K, m.dtype
        e = lambda *s: xp.empty(s, dtype=dt)  # noqa: E731
        self.ids = xp.empty((K - 1 + T, B), dtype=xp.int64)   # carried words, then x; id + 1, 0 = none
        self.word = xp.empty((K, N), dtype=xp.int64)           # context word j of position n, id + 1
        self.rows = xp.empty((K, N), dtype=xp.int64)           # its embedding row (0 where missing)
        self.present = e(K, N)                                 # 1 where the word exists, else 0
        self.cut = xp.empty((T, B), dtype=bool)                # a reset lies between the word and n
        self.ctx = e(K * m.E, N)                               # concatenated embeddings
        self.dctx = e(K * m.E, N)
        self.h = e(m.H, N)                                     # tanh layer, then 1 - h^2
        self.dh = e(m.H, N)
        self.ones_n = xp.ones(N, dtype=dt)
        self.out = m.out.buffers(N)                            # logits, then dlogits


class FFNNLM:
    """A feed-forward n-gram neural language model (Bengio et al., 2003), without direct connections.

    Parameters
    ----------
    cfg : ModelConfig
        ``cfg.vocab_size`` and ``cfg.embed`` must be set; ``cfg.context`` is K,
        the words each prediction reads (the current one and K - 1 before it).
    xp : module, optional
        NumPy or CuPy, from :func:`rnnlm.core.backend.get_xp`.
    dtype : str, optional
        Overrides ``cfg.dtype`` (``"float64"`` for gradient checks).

    Notes
    -----
    The state (1, 1, K - 1, B) holds each stream's previous K - 1 token ids plus
    one, oldest first, as floats (exact up to 2**24); 0 is "no word" (a stream's
    start), which contributes a zero vector and receives no gradient.
    """

    def __init__(self, cfg: ModelConfig, xp=np, dtype: str | None = None):
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (from the vocabulary)")
        if cfg.embed <= 0 or cfg.context < 1:
            raise ValueError("model.cell = 'ffnn' needs model.embed > 0 and model.context >= 1")
        self.cfg, self.xp = cfg, xp
        self.dtype = np.dtype(dtype or cfg.dtype)
        self.V, self.E, self.H, self.K = cfg.vocab_size, cfg.embed, cfg.hidden, cfg.context
        self.L, self.S = 1, 1                            # the state's leading axes, as RNNLM's (L, S, H, B)
        self.out = output.Softmax(cfg, self.V, self.H, xp, self.dtype)
        self.layout = Layout([("embed", (self.V, self.E)), ("W1", (self.H, self.K * self.E)),
                              ("b1", (self.H,)), *self.out.entries])
        self._buffers: dict = {}

    def init_params(self, seed: int):
        """Seeded initial parameters as a flat buffer (P,), drawn as the RNN's are
        (:mod:`rnnlm.core.output`): embeddings with fan_in 1, W1 with K * E, zero biases."""
        cfg, rng = self.cfg, output.init_rng(seed)
        flat = np.zeros(self.layout.size, dtype=self.dtype)
        p = self.layout.views(flat)
        p["embed"][...] = output.draw(rng, cfg, p["embed"].shape, 1)
        p["W1"][...] = output.draw(rng, cfg, p["W1"].shape, self.K * self.E)
        self.out.init(p, rng)
        return self.xp.asarray(flat)

    def zero_state(self, B: int):
        """Initial state (1, 1, K - 1, B): no previous words."""
        return self.xp.zeros((self.L, self.S, self.K - 1, B), dtype=self.dtype)

    def _bufs(self, T, B) -> _ChunkBuffers:
        return output.reuse(self._buffers, (T, B), lambda: _ChunkBuffers(self.xp, self, T, B))

    # ---------------------------------------------------------------- forward
    def _context(self, buf, x, state, reset):
        """Fill ``buf.word``/``rows``/``present``; return the new state."""
        xp, K = self.xp, self.K
        T, B = x.shape
        ids, word = buf.ids, buf.word.reshape(K, T, B)
        ids[:K - 1] = state[0, 0]
        ids[K - 1:] = x
        ids[K - 1:] += 1
        buf.cut.fill(False)
        for j in range(K - 1, -1, -1):                   # word j lies d = K - 1 - j steps back
            word[j] = ids[j:j + T]
            d = K - 1 - j
            if reset is not None and d:
                # a reset at any step in (t - d, t] cuts position t off from the word at t - d
                if d <= T:
                    buf.cut[d - 1:] |= reset[:T - d + 1]
                word[j] *= ~buf.cut
        xp.greater(buf.word, 0, out=buf.present)
        xp.subtract(buf.word, 1, out=buf.rows)
        xp.maximum(buf.rows, 0, out=buf.rows)            # any row: it is zeroed by present
        new_state = xp.empty_like(state)
        new_state[0, 0] = word[1:, T - 1]                # (K - 1, B)
        return new_state

    def _forward(self, p, x, state, reset):
        """Fill the chunk buffers up to the logits; return (buffers, new state)."""
        xp, E = self.xp, self.E
        T, B = x.shape
        buf = self._bufs(T, B)
        new_state = self._context(buf, x, state, None if reset is None else xp.asarray(reset))
        for j in range(self.K):
            cj = buf.ctx[j * E:(j + 1) * E]                               # (E, N)
            backend.gather_columns(xp, p["embed"], buf.rows[j], cj)
            cj *= buf.present[j]
        backend.matmul(p["W1"], buf.ctx, out=buf.h)                       # (H, N)
        buf.h += p["b1"][:, None]
        xp.tanh(buf.h, out=buf.h)
        self.out.forward(p, buf.out, buf.h)                               # (V, N)
        return buf, new_state

    def loss(self, params, x, y, state, reset=None):
        """Summed NLL, token count and final state of one chunk, no gradient.

        Parameters
        ----------
        params : flat array (P,)
        x, y : int arrays (T, B)
            Inputs and next-token targets; a target < 0 is not scored.
        state : array (1, 1, K - 1, B)
        reset : bool array (T, B), optional
            True where a stream starts afresh: words before that step are missing (NumPy or ``xp``).

        Returns
        -------
        loss_sum : float, count : int, new_state : array (1, 1, K - 1, B)
        """
        buf, new_state = self._forward(self.layout.views(params), x, state, reset)
        loss, count = self.out.loss(buf.out, y)
        return loss, count, new_state

    def next_logits(self, params, x, state):
        """Logits (B, V) after the last step of ``x`` (T, B), and the new state."""
        buf, new_state = self._forward(self.layout.views(params), x, state, None)
        return self.out.last(buf.out, *x.shape), new_state

    def sampled_layout(self, softmax, y):
        """The recurrent model's entry to the sampled softmax
        (:meth:`rnnlm.core.model.RNNLM.sampled_layout`): refused here."""
        raise ValueError(NO_SAMPLED)

    # --------------------------------------------------------------- backward
    def loss_and_grad(self, params, grads, x, y, state, reset=None, grad_scale=None, rng=None,
                      softmax=None):
        """Forward and backward over one chunk.

        Writes the gradient of ``grad_scale * summed NLL`` into ``grads`` (P,),
        every slot overwritten. ``grad_scale`` defaults to 1 / tokens scored.
        ``rng`` is accepted for RNNLM's signature and ignored: there is no dropout.

        Returns
        -------
        loss_sum, count : 0-d arrays on the device (NumPy scalars on the host), new_state : array (1, 1, K - 1, B)

        Raises
        ------
        ValueError
            ``softmax`` is not None: the sampled softmax is not implemented here.
        """
        if softmax is not None:
            raise ValueError(NO_SAMPLED)
        xp, K, E = self.xp, self.K, self.E
        p, g = self.layout.views(params), self.layout.views(grads)
        T, B = x.shape
        N = T * B
        buf, new_state = self._forward(p, x, state, reset)
        loss, count = self.out.loss_grad(buf.out, y, grad_scale)
        h, dh = buf.h, buf.dh                                             # (H, N), (H, N)
        self.out.backward(p, g, buf.out, h, dh)
        xp.multiply(h, h, out=h)                                          # h is spent: tanh' = 1 - h^2
        xp.subtract(1, h, out=h)
        dh *= h
        backend.matmul(dh, buf.ones_n, out=g["b1"])
        backend.matmul(dh, buf.ctx.T, out=g["W1"])                        # (H, KE)
        backend.matmul(p["W1"].T, dh, out=buf.dctx)                       # (KE, N)
        dctx = buf.dctx.reshape(K, E, N)
        dctx *= buf.present[:, None, :]                  # missing words add zero (to row 0)
        g["embed"].fill(0)
        backend.scatter_add_rows(g["embed"], buf.rows.reshape(K * N),
                                 dctx.transpose(0, 2, 1).reshape(K * N, E))   # (KN, E)
        return loss, count, new_state

    def loss_and_sparse_grad(self, params, grads, x, y, state, reset=None, grad_scale=None, rng=None,
                             softmax=None):
        """:meth:`loss_and_grad` and ``()``: every slot's gradient is in ``grads`` (the
        :meth:`rnnlm.core.model.RNNLM.loss_and_sparse_grad` interface)."""
        return (*self.loss_and_grad(params, grads, x, y, state, reset, grad_scale, rng, softmax), ())
