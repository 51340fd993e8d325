"""The language model: embedding, stacked RNN/LSTM layers, full softmax.

Parameters and gradients are flat buffers described by ``model.layout``;
:meth:`RNNLM.loss_and_grad` runs truncated BPTT over one (T, B) chunk.
"""
from __future__ import annotations

import numpy as np

from . import backend, cells
from .config import ModelConfig
from .layout import Layout


class _ChunkBuffers:
    """Everything one (T, B) chunk needs, allocated once and reused."""

    def __init__(self, xp, m, T, B):
        N, H, dt = T * B, m.H, m.dtype
        e = lambda *s: xp.empty(s, dtype=dt)  # noqa: E731
        self.layers = [cells.Workspace(xp, T, B, H, m.G, dt) for _ in range(m.L)]
        self.x0 = e(N, m.E) if m.E else None           # embedded input
        self.dx0 = e(N, m.E) if m.E else None
        self.dh = [e(T, B, H) for _ in range(m.L)]      # dL/d(layer output)
        self.dropped = [e(N, H) for _ in range(m.L)] if m.dropout else None
        self.act = [None] * m.L                          # each layer's output as fed upward
        self.masks = [e(N, H) for _ in range(m.L)] if m.dropout else None
        self.mask0 = e(N, m.E) if (m.dropout and m.E) else None
        self.logits = e(N, m.V)                          # logits, then dlogits
        self.ones_n = xp.ones(N, dtype=dt)
        self.ones_v = xp.ones(m.V, dtype=dt)
        self.rows = xp.arange(N)


class RNNLM:
    """A word- or character-level recurrent language model.

    Parameters
    ----------
    cfg : ModelConfig
        ``cfg.vocab_size`` must be set.
    xp : module, optional
        NumPy or CuPy, from :func:`rnnlm.backend.get_xp`.
    dtype : str, optional
        Overrides ``cfg.dtype`` (``"float64"`` for gradient checks).
    """

    def __init__(self, cfg: ModelConfig, xp=np, dtype: str | None = None):
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (from the vocabulary)")
        self.cfg, self.xp = cfg, xp
        self.dtype = np.dtype(dtype or cfg.dtype)
        self.V, self.E, self.H, self.L = cfg.vocab_size, cfg.embed, cfg.hidden, cfg.layers
        self.G = 4 if cfg.cell == "lstm" else 1
        self.S = 2 if cfg.cell == "lstm" else 1          # state tensors per layer
        self.dropout = cfg.dropout
        entries = [("embed", (self.V, self.E))] if self.E else []
        for layer in range(self.L):
            fan_in = (self.E or self.V) if layer == 0 else self.H
            entries += [(f"Wx{layer}", (fan_in, self.G * self.H)),
                        (f"Whh{layer}", (self.H, self.G * self.H)),
                        (f"b{layer}", (self.G * self.H,))]
        entries += [("Wo", (self.V, self.H)), ("bo", (self.V,))]
        self.layout = Layout(entries)
        self._buffers: dict = {}
        self._forward_fn = cells.lstm_forward if self.G == 4 else cells.rnn_forward
        self._backward_fn = cells.lstm_backward if self.G == 4 else cells.rnn_backward

    # ------------------------------------------------------------------ setup
    def init_params(self, seed: int):
        """Seeded initial parameters as a flat buffer (P,)."""
        xp, cfg = self.xp, self.cfg
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x1417]))
        flat = np.zeros(self.layout.size, dtype=self.dtype)
        for slot in self.layout:
            view = flat[slot.offset:slot.end].reshape(slot.shape)
            if slot.name.startswith("b"):
                continue                                 # biases start at zero
            if cfg.init == "uniform":
                view[...] = rng.uniform(-cfg.init_scale, cfg.init_scale, slot.shape)
            else:
                fan_in = 1 if slot.name == "embed" else (slot.shape[1] if slot.name == "Wo" else slot.shape[0])
                view[...] = rng.normal(0.0, cfg.init_scale / np.sqrt(fan_in), slot.shape)
        if self.G == 4 and cfg.forget_bias:
            for layer in range(self.L):
                b = flat[self.layout[f"b{layer}"].offset:self.layout[f"b{layer}"].end]
                b[self.H:2 * self.H] = cfg.forget_bias
        return xp.asarray(flat)

    def zero_state(self, B: int):
        """Initial hidden state (L, S, B, H): S = 2 (h, c) for the LSTM, 1 for the RNN."""
        return self.xp.zeros((self.L, self.S, B, self.H), dtype=self.dtype)

    def _bufs(self, T, B) -> _ChunkBuffers:
        key = (T, B)
        if key not in self._buffers:
            self._buffers.clear()   # one chunk shape at a time keeps memory bounded
            self._buffers[key] = _ChunkBuffers(self.xp, self, T, B)
        return self._buffers[key]

    # ---------------------------------------------------------------- forward
    def _forward(self, p, x, state, reset, rng):
        """Fill the chunk buffers up to the logits; return (buffers, new state)."""
        xp = self.xp
        T, B = x.shape
        N, H, drop = T * B, self.H, (self.dropout if rng is not None else 0.0)
        buf = self._bufs(T, B)
        idx = x.reshape(N)
        if reset is not None:
            keep = (~reset).astype(self.dtype)[:, :, None]            # (T, B, 1)
            reset_steps = set(int(t) for t in xp.nonzero(reset.any(axis=1))[0])
        else:
            keep, reset_steps = None, set()
        new_state = xp.empty_like(state)
        for layer in range(self.L):
            ws = buf.layers[layer]
            z = ws.z.reshape(N, self.G * H)                              # (N, GH)
            Wx = p[f"Wx{layer}"]
            if layer == 0 and self.E:
                xp.take(p["embed"], idx, axis=0, out=buf.x0)            # (N, E)
                if drop:
                    self._dropout(rng, buf.x0, buf.mask0, drop)
                xp.matmul(buf.x0, Wx, out=z)
            elif layer == 0:
                xp.take(Wx, idx, axis=0, out=z)                          # one-hot input
            else:
                xp.matmul(buf.act[layer - 1], Wx, out=z)
            z += p[f"b{layer}"]
            out = self._forward_fn(xp, ws, p[f"Whh{layer}"], *state[layer], keep, reset_steps)
            for s, arr in enumerate(out):
                new_state[layer, s] = arr
            act = ws.hout.reshape(N, H)                                  # (N, H)
            if drop:
                buf.dropped[layer][...] = act
                act = buf.dropped[layer]
                self._dropout(rng, act, buf.masks[layer], drop)
            buf.act[layer] = act
        xp.matmul(buf.act[-1], p["Wo"].T, out=buf.logits)           # (N, V)
        buf.logits += p["bo"]
        return buf, new_state, keep, reset_steps

    def _dropout(self, rng, a, mask, rate):
        # inverted dropout: kept units are scaled by 1 / (1 - rate)
        u = rng.random(mask.shape, dtype=self.dtype)
        self.xp.greater_equal(u, rate, out=mask)
        mask *= 1.0 / (1.0 - rate)
        a *= mask

    def _nll(self, buf, y, grad_scale):
        """Log-softmax cross-entropy in place over ``buf.logits``.

        Returns the summed NLL (float) and the number of scored tokens; with
        ``grad_scale`` set, leaves ``grad_scale * dNLL/dlogits`` in ``buf.logits``.
        """
        xp = self.xp
        lg = buf.logits                                                  # (N, V)
        yv = y.reshape(-1)
        valid = yv >= 0
        yc = xp.where(valid, yv, 0)
        lg -= lg.max(axis=1, keepdims=True)
        zy = lg[buf.rows, yc]                                            # (N,)
        xp.exp(lg, out=lg)
        s = xp.matmul(lg, buf.ones_v)                                    # (N,)
        nll = (xp.log(s) - zy) * valid
        loss = float(nll.sum(dtype=np.float64))
        count = int(valid.sum())
        if grad_scale is not None:
            w = valid.astype(self.dtype) * grad_scale
            lg *= (w / s)[:, None]
            lg[buf.rows, yc] -= w
        return loss, count

    def loss(self, params, x, y, state, reset=None):
        """Summed NLL, token count and final state of one chunk, no gradient.

        Parameters
        ----------
        params : flat array (P,)
        x, y : int arrays (T, B)
            Inputs and next-token targets; a target < 0 is not scored.
        state : array (L, S, B, H)
        reset : bool array (T, B), optional
            True where a stream starts afresh (its incoming state is zeroed).
        """
        p = self.layout.views(params)
        buf, new_state, _, _ = self._forward(p, x, state, reset, None)
        loss, count = self._nll(buf, y, None)
        return loss, count, new_state

    def next_logits(self, params, x, state):
        """Logits (B, V) after the last step of ``x`` (T, B), and the new state."""
        p = self.layout.views(params)
        buf, new_state, _, _ = self._forward(p, x, state, None, None)
        T, B = x.shape
        return buf.logits[(T - 1) * B:].copy(), new_state

    # --------------------------------------------------------------- backward
    def loss_and_grad(self, params, grads, x, y, state, reset=None, grad_scale=None, rng=None):
        """Forward and backward over one chunk (truncated BPTT).

        Writes the gradient of ``grad_scale * summed NLL`` into ``grads`` (P,),
        every slot overwritten. ``grad_scale`` defaults to 1 / tokens scored.
        ``rng`` (an ``xp`` generator) turns dropout on; None means no dropout.

        Returns
        -------
        loss_sum : float, count : int, new_state : array (L, S, B, H)
        """
        xp = self.xp
        p, g = self.layout.views(params), self.layout.views(grads)
        buf, new_state, keep, reset_steps = self._forward(p, x, state, reset, rng)
        if grad_scale is None:
            grad_scale = 1.0 / max(1, int((y >= 0).sum()))
        loss, count = self._nll(buf, y, grad_scale)
        T, B = x.shape
        N, H, GH = T * B, self.H, self.G * self.H
        dlg = buf.logits                                                 # (N, V)
        xp.matmul(dlg.T, buf.act[-1], out=g["Wo"])                    # (V, H)
        xp.matmul(buf.ones_n, dlg, out=g["bo"])
        dtop = buf.dh[-1].reshape(N, H)
        xp.matmul(dlg, p["Wo"], out=dtop)                                # (N, H)
        drop = self.dropout if rng is not None else 0.0
        if drop:
            dtop *= buf.masks[-1]
        for layer in range(self.L - 1, -1, -1):
            ws = buf.layers[layer]
            self._backward_fn(xp, ws, p[f"Whh{layer}"], buf.dh[layer], g[f"Whh{layer}"],
                              keep, reset_steps)
            dz = ws.dz.reshape(N, GH)                                    # (N, GH)
            xp.matmul(buf.ones_n, dz, out=g[f"b{layer}"])
            gWx = g[f"Wx{layer}"]
            if layer > 0:
                xp.matmul(buf.act[layer - 1].T, dz, out=gWx)
                dprev = buf.dh[layer - 1].reshape(N, H)
                xp.matmul(dz, p[f"Wx{layer}"].T, out=dprev)
                if drop:
                    dprev *= buf.masks[layer - 1]
            elif self.E:
                xp.matmul(buf.x0.T, dz, out=gWx)
                xp.matmul(dz, p["Wx0"].T, out=buf.dx0)                   # (N, E)
                if drop:
                    buf.dx0 *= buf.mask0
                g["embed"].fill(0)
                backend.scatter_add_rows(g["embed"], x.reshape(N), buf.dx0)
            else:
                gWx.fill(0)
                backend.scatter_add_rows(gWx, x.reshape(N), dz)
        return loss, count, new_state
