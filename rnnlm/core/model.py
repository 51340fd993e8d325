"""The language model: embedding, stacked RNN/LSTM layers, full softmax.

Parameters and gradients are flat buffers described by ``model.layout``;
:meth:`RNNLM.loss_and_grad` runs truncated BPTT over one (T, B) chunk.
"""
from __future__ import annotations

import numpy as np

from . import backend, cells
from ..config import ModelConfig
from .layout import Layout


def _gather_columns(xp, table, idx, out):
    """``out[:, n] = table[idx[n]]``: rows of ``table`` (V, W) as columns of ``out`` (W, N).

    A strided transpose of the gathered rows is slow, so a small table is
    transposed first and gathered along its columns instead.
    """
    if table.shape[0] <= out.shape[1]:
        xp.take(xp.ascontiguousarray(table.T), idx, axis=1, out=out)    # via (W, V)
    else:
        out[...] = xp.take(table, idx, axis=0).T


class _ChunkBuffers:
    """Everything one (T, B) chunk needs, allocated once and reused."""

    def __init__(self, xp, m, T, B):
        N, H, dt = T * B, m.H, m.dtype
        e = lambda *s: xp.empty(s, dtype=dt)  # noqa: E731
        self.layers = [cells.Workspace(xp, T, B, H, m.G, dt) for _ in range(m.L)]
        self.x0 = e(m.E, N) if m.E else None           # embedded input (E, N)
        self.dx0 = e(m.E, N) if m.E else None
        self.dh = [e(H, T, B) for _ in range(m.L)]      # dL/d(layer output)
        self.dropped = [e(H, N) for _ in range(m.L)] if m.dropout else None
        self.masks = [e(H, N) for _ in range(m.L)] if m.dropout else None
        self.mask0 = e(m.E, N) if (m.dropout and m.E) else None
        self.act = [None] * m.L                          # each layer's output as fed upward
        self.logits = e(m.V, N)                          # logits, then dlogits
        self.ones_n = xp.ones(N, dtype=dt)
        self.ones_v = xp.ones(m.V, dtype=dt)
        self.cols = xp.arange(N)


class RNNLM:
    """A word- or character-level recurrent language model.

    Parameters
    ----------
    cfg : ModelConfig
        ``cfg.vocab_size`` must be set.
    xp : module, optional
        NumPy or CuPy, from :func:`rnnlm.core.backend.get_xp`.
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
        GH = self.G * self.H
        # Vocabulary-indexed matrices keep one row per token (embed, Wo); the others
        # are (out, in). With one-hot input (embed == 0) the table ``embed`` (V, GH)
        # is layer 0's input weights: one-hot @ W is a row lookup.
        entries = [("embed", (self.V, self.E or GH))]
        for layer in range(self.L):
            if layer > 0 or self.E:
                entries.append((f"Wx{layer}", (GH, self.E if layer == 0 else self.H)))
            entries += [(f"Whh{layer}", (GH, self.H)), (f"b{layer}", (GH,))]
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
                fan_in = slot.shape[1] if slot.name != "embed" else (1 if self.E else self.V)
                view[...] = rng.normal(0.0, cfg.init_scale / np.sqrt(fan_in), slot.shape)
        if self.G == 4 and cfg.forget_bias:
            for layer in range(self.L):
                b = flat[self.layout[f"b{layer}"].offset:self.layout[f"b{layer}"].end]
                b[self.H:2 * self.H] = cfg.forget_bias
        return xp.asarray(flat)

    def zero_state(self, B: int):
        """Initial hidden state (L, S, H, B): S = 2 (h, c) for the LSTM, 1 for the RNN."""
        return self.xp.zeros((self.L, self.S, self.H, B), dtype=self.dtype)

    def _bufs(self, T, B) -> _ChunkBuffers:
        key = (T, B)
        if key not in self._buffers:
            self._buffers.clear()   # one chunk shape at a time keeps memory bounded
            self._buffers[key] = _ChunkBuffers(self.xp, self, T, B)
        return self._buffers[key]

    # ---------------------------------------------------------------- forward
    def _forward(self, p, x, state, reset, rng):
        """Fill the chunk buffers up to the logits; return (buffers, new state, keep, resets)."""
        xp = self.xp
        T, B = x.shape
        N, drop = T * B, (self.dropout if rng is not None else 0.0)
        buf = self._bufs(T, B)
        idx = x.reshape(N)
        if reset is not None:
            keep = (~reset).astype(self.dtype)[:, None, :]              # (T, 1, B)
            reset_steps = set(int(t) for t in xp.nonzero(reset.any(axis=1))[0])
        else:
            keep, reset_steps = None, set()
        new_state = xp.empty_like(state)
        for layer in range(self.L):
            ws = buf.layers[layer]
            zin = ws.zin.reshape(-1, N)                                  # (GH, N)
            if layer == 0 and self.E:
                _gather_columns(xp, p["embed"], idx, buf.x0)             # (E, N)
                if drop:
                    self._dropout(rng, buf.x0, buf.mask0, drop)
                xp.matmul(p["Wx0"], buf.x0, out=zin)
            elif layer == 0:                                             # one-hot input
                _gather_columns(xp, p["embed"], idx, zin)
            else:
                xp.matmul(p[f"Wx{layer}"], buf.act[layer - 1], out=zin)
            new_state[layer] = self._forward_fn(xp, ws, p[f"Whh{layer}"], p[f"b{layer}"], state[layer],
                                                keep, reset_steps)
            act = ws.hout                                                # (H, N)
            if drop:
                buf.dropped[layer][...] = act
                act = buf.dropped[layer]
                self._dropout(rng, act, buf.masks[layer], drop)
            buf.act[layer] = act
        xp.matmul(p["Wo"], buf.act[-1], out=buf.logits)                 # (V, N)
        buf.logits += p["bo"][:, None]
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
        lg = buf.logits                                                  # (V, N)
        yv = y.reshape(-1)
        valid = yv >= 0
        yc = xp.where(valid, yv, 0)
        lg -= lg.max(axis=0)
        zy = lg[yc, buf.cols]                                            # (N,)
        xp.exp(lg, out=lg)
        s = xp.matmul(buf.ones_v, lg)                                    # (N,)
        nll = (xp.log(s) - zy) * valid
        loss = float(nll.sum(dtype=np.float64))
        count = int(valid.sum())
        if grad_scale is not None:
            w = valid.astype(self.dtype) * grad_scale
            lg *= w / s
            lg[yc, buf.cols] -= w
        return loss, count

    def loss(self, params, x, y, state, reset=None):
        """Summed NLL, token count and final state of one chunk, no gradient.

        Parameters
        ----------
        params : flat array (P,)
        x, y : int arrays (T, B)
            Inputs and next-token targets; a target < 0 is not scored.
        state : array (L, S, H, B)
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
        return buf.logits[:, (T - 1) * B:].T.copy(), new_state

    # --------------------------------------------------------------- backward
    def loss_and_grad(self, params, grads, x, y, state, reset=None, grad_scale=None, rng=None):
        """Forward and backward over one chunk (truncated BPTT).

        Writes the gradient of ``grad_scale * summed NLL`` into ``grads`` (P,),
        every slot overwritten. ``grad_scale`` defaults to 1 / tokens scored.
        ``rng`` (an ``xp`` generator) turns dropout on; None means no dropout.

        Returns
        -------
        loss_sum : float, count : int, new_state : array (L, S, H, B)
        """
        xp = self.xp
        p, g = self.layout.views(params), self.layout.views(grads)
        buf, new_state, keep, reset_steps = self._forward(p, x, state, reset, rng)
        if grad_scale is None:
            grad_scale = 1.0 / max(1, int((y >= 0).sum()))
        loss, count = self._nll(buf, y, grad_scale)
        T, B = x.shape
        N, H = T * B, self.H
        dlg = buf.logits                                                 # (V, N)
        xp.matmul(dlg, buf.act[-1].T, out=g["Wo"])                       # (V, H)
        xp.matmul(dlg, buf.ones_n, out=g["bo"])
        dtop = buf.dh[-1].reshape(H, N)
        xp.matmul(p["Wo"].T, dlg, out=dtop)                              # (H, N)
        drop = self.dropout if rng is not None else 0.0
        if drop:
            dtop *= buf.masks[-1]
        for layer in range(self.L - 1, -1, -1):
            ws = buf.layers[layer]
            self._backward_fn(xp, ws, p[f"Whh{layer}"], buf.dh[layer], g[f"Whh{layer}"],
                              keep, reset_steps)
            dz = ws.dz.reshape(-1, N)                                    # (GH, N)
            xp.matmul(dz, buf.ones_n, out=g[f"b{layer}"])
            if layer > 0:
                xp.matmul(dz, buf.act[layer - 1].T, out=g[f"Wx{layer}"])
                dprev = buf.dh[layer - 1].reshape(H, N)
                xp.matmul(p[f"Wx{layer}"].T, dz, out=dprev)              # (H, N)
                if drop:
                    dprev *= buf.masks[layer - 1]
                continue
            if self.E:
                xp.matmul(dz, buf.x0.T, out=g["Wx0"])
                xp.matmul(p["Wx0"].T, dz, out=buf.dx0)                   # (E, N)
                if drop:
                    buf.dx0 *= buf.mask0
                rows = buf.dx0
            else:
                rows = dz
            g["embed"].fill(0)
            backend.scatter_add_rows(g["embed"], x.reshape(N), rows.T)
        return loss, count, new_state
