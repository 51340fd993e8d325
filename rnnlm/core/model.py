"""The language model: embedding, stacked RNN/LSTM layers, full softmax.

Parameters and gradients are flat buffers described by ``model.layout``;
:meth:`RNNLM.loss_and_grad` runs truncated BPTT over one (T, B) chunk, with the
full softmax or (in training only) a sampled softmax over a subset of the
vocabulary (:mod:`rnnlm.core.sampled` builds the subsets and describes the variants).
"""
from __future__ import annotations

import numpy as np

from . import backend, cells, sampled
from ..config import ModelConfig
from .layout import Layout


def _onehot_steps(xp, table, x, onehot, out):
    """``out[t] = table[x[t]].T``: rows of ``table`` (V, W) as step-major columns (T, W, B).

    One batched product with one-hot columns: exact (one nonzero term per sum). Its cost
    grows with V and it runs on every BLAS thread, so it pays only for a character-sized
    vocabulary with two threads or more: at V = 65, W = 2048, T = 64, B = 32 on 2 threads,
    2.4 ms against 5.9 ms for a gather plus a change of layout; on 1 thread at B = 16
    (a Spark task) 2.7 against 2.1 ms, ~0.4% of that step.
    """
    T, B = x.shape
    onehot.fill(0)
    onehot[xp.arange(T)[:, None], x, xp.arange(B)[None, :]] = 1        # (T, V, B)
    xp.matmul(table.T, onehot, out=out)                                  # (T, W, B)


class _ChunkBuffers:
    """Everything one (T, B) chunk needs, allocated once and reused."""

    def __init__(self, xp, m, T, B):
        N, H, dt = T * B, m.H, m.dtype
        e = lambda *s: xp.empty(s, dtype=dt)  # noqa: E731
        self.layers = [cells.Workspace(xp, T, B, H, m.G, dt) for _ in range(m.L)]
        self.x0 = e(m.E, N) if m.E else None           # embedded input (E, N)
        small = not m.E and backend.onehot_input_product(xp, m.V)
        self.onehot = e(T, m.V, B) if small else None  # one-hot input, step-major
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
        self.rows = None                                 # sampled softmax, allocated on first use

    def sampled(self, xp, m):
        """Allocate (once) the sampled softmax's buffers, full size; a chunk uses ``[:n]``."""
        if self.rows is None:
            self.rows = xp.empty(m.V, dtype=xp.int64)    # output rows: v_all, then v_f minus v_all
            self.Wf = xp.empty((m.V, m.H), dtype=m.dtype)  # gathered Wo rows, then their gradient
            self.bf = xp.empty(m.V, dtype=m.dtype)       # gathered bo rows, then their gradient


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
    def _forward(self, p, x, state, reset, rng, n_out=None):
        """Fill the chunk buffers up to the logits; return (buffers, new state, keep, resets).

        ``n_out`` set: logits only for the vocabulary rows ``buf.rows[:n_out]``, into
        ``buf.logits[:n_out]`` (the sampled softmax); None: all V rows.
        """
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
            step_major = False
            if layer == 0 and self.E:
                backend.gather_columns(xp, p["embed"], idx, buf.x0)      # (E, N)
                if drop:
                    self._dropout(rng, buf.x0, buf.mask0, drop)
                xp.matmul(p["Wx0"], buf.x0, out=zin)
            elif layer == 0 and buf.onehot is not None:                  # one-hot input
                _onehot_steps(xp, p["embed"], x, buf.onehot, ws.z)       # (T, GH, B)
                step_major = True
            elif layer == 0:
                backend.gather_columns(xp, p["embed"], idx, zin)
            else:
                xp.matmul(p[f"Wx{layer}"], buf.act[layer - 1], out=zin)
            new_state[layer] = self._forward_fn(xp, ws, p[f"Whh{layer}"], p[f"b{layer}"], state[layer],
                                                keep, reset_steps, step_major)
            act = ws.hout                                                # (H, N)
            if drop:
                buf.dropped[layer][...] = act
                act = buf.dropped[layer]
                self._dropout(rng, act, buf.masks[layer], drop)
            buf.act[layer] = act
        if n_out is None:
            xp.matmul(p["Wo"], buf.act[-1], out=buf.logits)             # (V, N)
            buf.logits += p["bo"][:, None]
            return buf, new_state, keep, reset_steps
        rows, Wf, bf = buf.rows[:n_out], buf.Wf[:n_out], buf.bf[:n_out]
        xp.take(p["Wo"], rows, axis=0, out=Wf)                           # (n_f, H)
        xp.take(p["bo"], rows, out=bf)                                   # (n_f,)
        lg = buf.logits[:n_out]                                          # (n_f, N)
        xp.matmul(Wf, buf.act[-1], out=lg)
        lg += bf[:, None]
        return buf, new_state, keep, reset_steps

    def _dropout(self, rng, a, mask, rate):
        # inverted dropout: kept units are scaled by 1 / (1 - rate)
        u = rng.random(mask.shape, dtype=self.dtype)
        self.xp.greater_equal(u, rate, out=mask)
        mask *= 1.0 / (1.0 - rate)
        a *= mask

    def _nll(self, buf, y, grad_scale, n_out=None, ypos=None, log_pi=None):
        """Log-softmax cross-entropy in place over ``buf.logits``.

        Returns the summed NLL (float) and the number of scored tokens; with
        ``grad_scale`` set, leaves ``grad_scale * dNLL/dlogits`` in ``buf.logits``.
        With ``n_out`` (sampled softmax) only ``buf.logits[:n_out]`` is normalised and
        ``ypos`` (N,) gives each target's row in it; ``log_pi`` (n_out,), if set, is
        subtracted from every logit but the target's (a constant shift: the gradient
        with respect to the logits keeps its form).
        """
        xp = self.xp
        yv = y.reshape(-1)
        valid = yv >= 0
        if n_out is None:
            lg, ones = buf.logits, buf.ones_v                            # (V, N), (V,)
            yc = xp.where(valid, yv, 0)
        else:
            lg, ones, yc = buf.logits[:n_out], buf.ones_v[:n_out], ypos  # (n_f, N), (n_f,)
        if log_pi is not None:
            raw = lg[yc, buf.cols]                                       # (N,) a copy
            lg -= log_pi[:, None]
            lg[yc, buf.cols] = raw                                       # ...but its own target's
        lg -= lg.max(axis=0)
        zy = lg[yc, buf.cols]                                            # (N,)
        xp.exp(lg, out=lg)
        s = xp.matmul(ones, lg)                                          # (N,)
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
    def _softmax_rows(self, buf, softmax, y):
        """Check ``softmax = (v_all, v_f)`` against ``y`` and lay out ``buf.rows``.

        ``buf.rows[:n_f]`` becomes v_all followed by v_f minus v_all (V_gamma), so
        the backward pass reads the v_all rows as the contiguous slice ``[:n_all]``.
        Returns n_all, n_f, each target's row in that layout (N,) and ``softmax.log_pi``
        in that layout, (n_f,) (None without a correction).
        """
        xp, V = self.xp, self.V
        v_all = xp.asarray(softmax.v_all).reshape(-1)
        v_f = xp.asarray(softmax.v_f).reshape(-1)
        na, nf = int(v_all.size), int(v_f.size)
        if not 0 < na <= nf <= V:
            raise ValueError(f"softmax sets: need 0 < |v_all| <= |v_f| <= V={V} (got {na} and {nf})")
        yv = y.reshape(-1)
        valid = yv >= 0
        loc = xp.minimum(xp.searchsorted(v_f, v_all), nf - 1)           # (n_all,) v_all in v_f
        ypos = xp.minimum(xp.searchsorted(v_all, xp.where(valid, yv, 0)), na - 1)   # (N,)
        # one device-to-host transfer for every check
        sets_ok = ((v_f[loc] == v_all).all() & (v_all[1:] > v_all[:-1]).all()
                   & (v_f[1:] > v_f[:-1]).all() & (v_f[0] >= 0) & (v_f[-1] < V))
        targets_ok = ((v_all[ypos] == yv) | ~valid).all()
        ok = backend.to_numpy(xp.stack([sets_ok, targets_ok]))
        if not ok[0]:
            raise ValueError(f"softmax sets: v_all and v_f must be sorted unique ids in [0, {V}) "
                             "with v_all a subset of v_f")
        if not ok[1]:
            yh, ah = backend.to_numpy(yv), backend.to_numpy(v_all)
            missing = np.setdiff1d(yh[yh >= 0], ah)
            raise ValueError(f"sampled softmax: every scored target must be in v_all; "
                             f"{missing.size} target id(s) are not, e.g. {missing[:5].tolist()}")
        buf.sampled(xp, self)
        buf.rows[:na] = v_all
        lp = log_pi = None
        if softmax.log_pi is not None:
            lp = xp.asarray(softmax.log_pi, dtype=self.dtype)
            if lp.shape != (nf,):
                raise ValueError(f"softmax log_pi: need one value per word of v_f ({nf}), got {lp.shape}")
            log_pi = lp[loc]
        if nf > na:
            gamma = xp.ones(nf, dtype=bool)
            gamma[loc] = False
            buf.rows[na:nf] = v_f[gamma]                                 # V_gamma, sorted
            if lp is not None:
                log_pi = xp.concatenate([log_pi, lp[gamma]])
        return na, nf, ypos, log_pi

    def loss_and_grad(self, params, grads, x, y, state, reset=None, grad_scale=None, rng=None,
                      softmax=None):
        """Forward and backward over one chunk (truncated BPTT).

        Writes the gradient of ``grad_scale * summed NLL`` into ``grads`` (P,),
        every slot overwritten. ``grad_scale`` defaults to 1 / tokens scored.
        ``rng`` (an ``xp`` generator) turns dropout on; None means no dropout.

        ``softmax`` None is the full softmax. Otherwise a :class:`rnnlm.core.sampled.Sets`
        (or a plain ``(v_all, v_f)``: two sorted unique int arrays of vocabulary ids, NumPy
        or ``xp``, v_all a subset of v_f) is a sampled softmax:

        * forward: logits only for the rows v_f of ``Wo``/``bo``, normalised over v_f;
          with ``log_pi`` every non-target logit is first lowered by its word's log
          inclusion probability, so the loss is
          ``-log(exp(s_y) / (exp(s_y) + sum_{i in v_f, i != y} exp(s_i - log pi_i)))``;
        * ``Wo``/``bo``'s gradient is zero outside v_all and, on v_all, the exact gradient
          of that sampled loss (so only rows the exchange sends move);
        * the gradient into the top layer: with ``through_gamma`` the exact one,
          ``sum_{i in v_f} dlogit_i * Wo[i]``, and every hidden parameter's gradient is the
          gradient of the sampled loss; without it ``sum_{i in v_all}``: the dummy words
          V_gamma = v_f minus v_all take probability mass in the forward pass but get
          no backward (the paper's literal variant, the gradient of no loss).

        The output layer then costs GEMMs of n_f rows forward and n_all rows (plus n_f
        for the top layer's gradient with ``through_gamma``) backward instead of V.
        Every scored target (y >= 0) must be in v_all.

        Returns
        -------
        loss_sum : float, count : int, new_state : array (L, S, H, B)

        Raises
        ------
        ValueError
            A scored target is not in v_all, or the sets are not sorted unique ids
            with v_all a subset of v_f.
        """
        xp = self.xp
        p, g = self.layout.views(params), self.layout.views(grads)
        T, B = x.shape
        N, H = T * B, self.H
        na = nf = ypos = log_pi = None
        if softmax is not None:
            softmax = sampled.Sets(*softmax)
            na, nf, ypos, log_pi = self._softmax_rows(self._bufs(T, B), softmax, y)
        buf, new_state, keep, reset_steps = self._forward(p, x, state, reset, rng, nf)
        if grad_scale is None:
            grad_scale = 1.0 / max(1, int((y >= 0).sum()))
        loss, count = self._nll(buf, y, grad_scale, nf, ypos, log_pi)
        dtop = buf.dh[-1].reshape(H, N)
        if softmax is None:
            dlg = buf.logits                                             # (V, N)
            xp.matmul(dlg, buf.act[-1].T, out=g["Wo"])                   # (V, H)
            xp.matmul(dlg, buf.ones_n, out=g["bo"])
            xp.matmul(p["Wo"].T, dlg, out=dtop)                          # (H, N)
        else:                                    # Wo/bo: v_all's rows only
            n_top = nf if softmax.through_gamma else na                  # dL/dh: v_f's or v_all's
            xp.matmul(buf.Wf[:n_top].T, buf.logits[:n_top], out=dtop)   # (H, N)
            dlg, Wa, ba = buf.logits[:na], buf.Wf[:na], buf.bf[:na]      # (n_all, N), (n_all, H)
            if softmax.log_pi_rows is not None and log_pi is not None:
                # a row moves only in steps where it is in v_all (probability pi_all), but its
                # push-down was weighted for v_f (1 / pi_f): reweight it to 1 / pi_all, so that in
                # expectation each row is pushed down as under the full softmax; a target's
                # own entry (in v_all for sure) stays
                lpr = xp.asarray(softmax.log_pi_rows, dtype=self.dtype)
                if lpr.shape != (na,):
                    raise ValueError(f"softmax log_pi_rows: need one value per word of v_all ({na}), got {lpr.shape}")
                ey = dlg[ypos, buf.cols]                                 # (N,) a copy
                dlg *= xp.exp(log_pi[:na] - lpr)[:, None]
                dlg[ypos, buf.cols] = ey
            xp.matmul(dlg, buf.act[-1].T, out=Wa)                        # the weights are spent
            xp.matmul(dlg, buf.ones_n, out=ba)
            rows = buf.rows[:na]
            g["Wo"].fill(0)
            g["Wo"][rows] = Wa
            g["bo"].fill(0)
            g["bo"][rows] = ba
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


def build(cfg: ModelConfig, xp=np, dtype: str | None = None):
    """The model ``cfg.cell`` names: :class:`RNNLM` or the feed-forward :class:`rnnlm.core.ffnn.FFNNLM`."""
    if cfg.cell == "ffnn":
        from .ffnn import FFNNLM
        return FFNNLM(cfg, xp=xp, dtype=dtype)
    return RNNLM(cfg, xp=xp, dtype=dtype)
