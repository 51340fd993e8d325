"""The language model: embedding, stacked RNN/LSTM layers, full softmax.

Parameters and gradients are flat buffers described by ``model.layout``;
:meth:`RNNLM.loss_and_grad` runs truncated BPTT over one (T, B) chunk, with the
full softmax or (in training only) a sampled softmax over a subset of the
vocabulary (:mod:`rnnlm.core.sampled` builds the subsets and describes the variants;
:mod:`rnnlm.core.output` is the output layer).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import backend, cells, output
from ..config import ModelConfig
from .layout import Layout, RowGrad


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


DRAWN = "dropout masks drawn"    # loss_and_grad's rng: dropout with the masks already in the chunk buffers


class Resets(NamedTuple):
    """Where streams restart in a (T, B) chunk: ``keep`` (T, 1, B) on the device, 0 where a stream
    restarts, and ``steps``, the steps with a restart (known on the host)."""
    keep: object
    steps: frozenset


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
        self.bias = [e(m.G * H) for _ in range(m.L)] if m.two_biases else None   # b + bh, per layer
        self.dropped = [e(H, N) for _ in range(m.L)] if m.dropout else None
        self.masks = [e(H, N) for _ in range(m.L)] if m.dropout else None
        self.mask0 = e(m.E, N) if (m.dropout and m.E) else None
        self.act = [None] * m.L                          # each layer's output as fed upward
        self.ones_n = xp.ones(N, dtype=dt)
        self.out = m.out.buffers(N)


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
        self.two_biases = cfg.biases == "two"
        self.out = output.Softmax(cfg, self.V, self.H, xp, self.dtype)
        GH = self.G * self.H
        # Vocabulary-indexed matrices keep one row per token (embed, Wo); the others
        # are (out, in). With one-hot input (embed == 0) the table ``embed`` (V, GH)
        # is layer 0's input weights: one-hot @ W is a row lookup. With biases = "two"
        # each layer has a recurrent bias bh beside b, as Torch's LSTM has (b_ih, b_hh):
        # the cells see their sum, and both get its gradient.
        entries = [("embed", (self.V, self.E or GH))]
        for layer in range(self.L):
            if layer > 0 or self.E:
                entries.append((f"Wx{layer}", (GH, self.E if layer == 0 else self.H)))
            entries += [(f"Whh{layer}", (GH, self.H)), (f"b{layer}", (GH,))]
            entries += [(f"bh{layer}", (GH,))] if self.two_biases else []
        entries += self.out.entries
        self.layout = Layout(entries)
        self._buffers: dict = {}
        self._forward_fn = cells.lstm_forward if self.G == 4 else cells.rnn_forward
        self._backward_fn = cells.lstm_backward if self.G == 4 else cells.rnn_backward

    # ------------------------------------------------------------------ setup
    def init_params(self, seed: int):
        """Seeded initial parameters as a flat buffer (P,)."""
        cfg, rng = self.cfg, output.init_rng(seed)
        flat = np.zeros(self.layout.size, dtype=self.dtype)
        p = self.layout.views(flat)
        # in layout order, one stream; biases start at zero, or with biases = "two" are drawn
        # as the weights are (Zaremba et al.'s Torch code draws every parameter, as PyTorch does)
        p["embed"][...] = output.draw(rng, cfg, p["embed"].shape, 1 if self.E else self.V)
        for layer in range(self.L):
            for name in (f"Wx{layer}", f"Whh{layer}"):
                if name in p:
                    p[name][...] = output.draw(rng, cfg, p[name].shape, p[name].shape[1])
            for name in (f"b{layer}", f"bh{layer}") if self.two_biases else ():
                p[name][...] = output.draw(rng, cfg, p[name].shape, self.H)
        self.out.init(p, rng)
        if self.two_biases:
            p["bo"][...] = output.draw(rng, cfg, p["bo"].shape, self.H)
        if self.G == 4 and cfg.forget_bias:
            for layer in range(self.L):
                p[f"b{layer}"][self.H:2 * self.H] = cfg.forget_bias
        return self.xp.asarray(flat)

    def zero_state(self, B: int):
        """Initial hidden state (L, S, H, B): S = 2 (h, c) for the LSTM, 1 for the RNN."""
        return self.xp.zeros((self.L, self.S, self.H, B), dtype=self.dtype)

    def chunk_buffers(self, T, B) -> _ChunkBuffers:
        """The buffers of (T, B) chunks, allocated on first use (a new shape replaces them)."""
        return output.reuse(self._buffers, (T, B), lambda: _ChunkBuffers(self.xp, self, T, B))

    def sampled_layout(self, softmax, y) -> output.Layout:
        """A sampled softmax's sets (see :meth:`loss_and_grad`) for the targets ``y`` (T, B),
        checked and laid out on the host (:meth:`rnnlm.core.output.Softmax.layout`): on a GPU
        padded to multiples of ``output.ROW_BUCKET`` rows, so that a step's shapes repeat."""
        return self.out.layout(softmax, y, 1 if self.xp is np else output.ROW_BUCKET)

    def sampled_rows(self, lay: output.Layout, T: int, B: int, buffers=None) -> output.Rows:
        """``lay`` copied into the (T, B) chunk buffers (or ``buffers``: a CUDA graph's), for
        :meth:`loss_and_grad`."""
        return self.out.load((self.chunk_buffers(T, B) if buffers is None else buffers).out, lay)

    # ---------------------------------------------------------------- forward
    def resets(self, reset) -> Resets | None:
        """``reset`` (T, B) bool, on the host (None: no stream restarts) as the device mask and the steps."""
        if reset is None:
            return None
        rh = backend.to_numpy(reset).astype(bool, copy=False)   # the steps with a reset, on the host: no sync
        # (as bool: ~ of an integer 0/1 mask is -1/-2, which would negate or double the incoming state)
        return Resets(self.xp.asarray((~rh).astype(self.dtype))[:, None, :],
                      frozenset(np.nonzero(rh.any(axis=1))[0].tolist()))

    def _forward(self, p, x, state, reset, rng, rows=None):
        """Fill the chunk buffers up to the logits; return (buffers, new state, keep, resets).

        ``rows`` (:meth:`rnnlm.core.output.Softmax.select`): logits only for the sampled
        softmax's rows; None: all V rows.
        """
        xp = self.xp
        T, B = x.shape
        N, drop = T * B, (self.dropout if rng is not None else 0.0)
        buf = self.chunk_buffers(T, B)
        idx = x.reshape(N)
        if reset is not None and not isinstance(reset, Resets):
            reset = self.resets(reset)
        keep, reset_steps = reset if reset is not None else (None, frozenset())   # (T, 1, B)
        new_state = xp.empty_like(state)
        for layer in range(self.L):
            ws = buf.layers[layer]
            zin = ws.zin.reshape(-1, N)                                  # (GH, N)
            step_major = False
            if layer == 0 and self.E:
                backend.gather_columns(xp, p["embed"], idx, buf.x0)      # (E, N)
                if drop:
                    buf.x0 *= buf.mask0
                backend.matmul(p["Wx0"], buf.x0, out=zin)
            elif layer == 0 and buf.onehot is not None:                  # one-hot input
                _onehot_steps(xp, p["embed"], x, buf.onehot, ws.z)       # (T, GH, B)
                step_major = True
            elif layer == 0:
                backend.gather_columns(xp, p["embed"], idx, zin)
            else:
                backend.matmul(p[f"Wx{layer}"], buf.act[layer - 1], out=zin)
            bias = p[f"b{layer}"]
            if self.two_biases:
                bias = xp.add(bias, p[f"bh{layer}"], out=buf.bias[layer])          # (GH,)
            new_state[layer] = self._forward_fn(xp, ws, p[f"Whh{layer}"], bias, state[layer],
                                                keep, reset_steps, step_major)
            act = ws.hout                                                # (H, N)
            if drop:
                buf.dropped[layer][...] = act
                act = buf.dropped[layer]
                act *= buf.masks[layer]
            buf.act[layer] = act
        self.out.forward(p, buf.out, buf.act[-1], rows)
        return buf, new_state, keep, reset_steps

    def draw_dropout(self, rng, buf: _ChunkBuffers) -> None:
        """Draw a chunk's dropout masks from ``rng`` into ``buf``, in the order the forward pass
        applies them (the input's, then each layer's output's). Inverted dropout: a kept unit is
        scaled by 1 / (1 - rate). A CUDA graph replays a step over masks drawn here (cuRAND cannot
        be captured), and an eager step draws the same numbers in the same order."""
        rate = self.dropout
        for mask in ([buf.mask0] if self.E else []) + buf.masks:
            u = rng.random(mask.shape, dtype=self.dtype)
            self.xp.greater_equal(u, rate, out=mask)
            mask *= 1.0 / (1.0 - rate)

    def loss(self, params, x, y, state, reset=None, read=True):
        """Summed NLL, token count and final state of one chunk, no gradient (``read=False``: the
        sum and the count stay on the device, as 0-d float64 arrays).

        Parameters
        ----------
        params : flat array (P,)
        x, y : int arrays (T, B)
            Inputs and next-token targets; a target < 0 is not scored.
        state : array (L, S, H, B)
        reset : bool array (T, B), optional
            True where a stream starts afresh (its incoming state is zeroed); NumPy or ``xp``
            (a host array spares the device a sync).
        """
        p = self.layout.views(params)
        buf, new_state, _, _ = self._forward(p, x, state, reset, None)
        loss, count = self.out.loss(buf.out, y, read=read)
        return loss, count, new_state

    def next_logits(self, params, x, state):
        """Logits (B, V) after the last step of ``x`` (T, B), and the new state."""
        p = self.layout.views(params)
        buf, new_state, _, _ = self._forward(p, x, state, None, None)
        return self.out.last(buf.out, *x.shape), new_state

    # --------------------------------------------------------------- backward
    def loss_and_grad(self, params, grads, x, y, state, reset=None, grad_scale=None, rng=None,
                      softmax=None):
        """Forward and backward over one chunk (truncated BPTT).

        Writes the gradient of ``grad_scale * summed NLL`` into ``grads`` (P,),
        every slot overwritten. ``grad_scale`` defaults to 1 / tokens scored.
        ``rng`` (an ``xp`` generator) turns dropout on; None means no dropout; :data:`DRAWN` means
        dropout over the masks :meth:`draw_dropout` left in the chunk's buffers.

        ``softmax`` None is the full softmax. Otherwise a :class:`rnnlm.core.sampled.Sets`
        (or a plain ``(v_all, v_f)``: two sorted unique int arrays of vocabulary ids, NumPy
        or ``xp``, v_all a subset of v_f), or the :class:`rnnlm.core.output.Rows` that
        :meth:`sampled_rows` made of one for this ``y``, is a sampled softmax:

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
        loss_sum, count : 0-d arrays on the device (NumPy scalars on the host): a step reads nothing back
        new_state : array (L, S, H, B)

        Raises
        ------
        ValueError
            A scored target is not in v_all, or the sets are not sorted unique ids
            with v_all a subset of v_f.
        """
        return self._loss_and_grad(params, grads, x, y, state, reset, grad_scale, rng, softmax, False)[:3]

    def loss_and_sparse_grad(self, params, grads, x, y, state, reset=None, grad_scale=None, rng=None,
                             softmax=None):
        """As :meth:`loss_and_grad`, with a fourth value: ``tables``, a tuple of
        :class:`rnnlm.core.layout.RowGrad`, the gradient of the slots that is zero but on a few rows,
        which ``grads`` then leaves undefined. On NumPy with a vocabulary too large for a one-hot
        scatter (:func:`rnnlm.core.backend.row_sums`): the embedding's (the chunk's input words) and,
        with a sampled softmax, ``Wo``'s and ``bo``'s (v_all's rows). Elsewhere ``()``: every slot is
        in ``grads``."""
        return self._loss_and_grad(params, grads, x, y, state, reset, grad_scale, rng, softmax, True)

    def _loss_and_grad(self, params, grads, x, y, state, reset, grad_scale, rng, softmax, sparse):
        xp = self.xp
        sparse = sparse and backend.row_sums(xp, self.V)
        p, g = self.layout.views(params), self.layout.views(grads)
        T, B = x.shape
        N, H = T * B, self.H
        if rng is not None and rng is not DRAWN and self.dropout:
            self.draw_dropout(rng, self.chunk_buffers(T, B))
        rows = softmax
        if softmax is not None and not isinstance(softmax, output.Rows):
            rows = self.sampled_rows(self.sampled_layout(softmax, y), T, B)
        buf, new_state, keep, reset_steps = self._forward(p, x, state, reset, rng, rows)
        loss, count = self.out.loss_grad(buf.out, y, grad_scale, rows)
        dtop = buf.dh[-1].reshape(H, N)
        tables = [RowGrad(self.layout[name], *got)
                  for name, got in self.out.backward(p, g, buf.out, buf.act[-1], dtop, rows, sparse)]
        drop = self.dropout if rng is not None else 0.0
        if drop:
            dtop *= buf.masks[-1]
        for layer in range(self.L - 1, -1, -1):
            ws = buf.layers[layer]
            self._backward_fn(xp, ws, p[f"Whh{layer}"], buf.dh[layer], g[f"Whh{layer}"],
                              keep, reset_steps)
            dz = ws.dz.reshape(-1, N)                                    # (GH, N)
            backend.matmul(dz, buf.ones_n, out=g[f"b{layer}"])
            if self.two_biases:
                g[f"bh{layer}"][...] = g[f"b{layer}"]
            if layer > 0:
                backend.matmul(dz, buf.act[layer - 1].T, out=g[f"Wx{layer}"])
                dprev = buf.dh[layer - 1].reshape(H, N)
                backend.matmul(p[f"Wx{layer}"].T, dz, out=dprev)         # (H, N)
                if drop:
                    dprev *= buf.masks[layer - 1]
                continue
            if self.E:
                backend.matmul(dz, buf.x0.T, out=g["Wx0"])
                backend.matmul(p["Wx0"].T, dz, out=buf.dx0)              # (E, N)
                if drop:
                    buf.dx0 *= buf.mask0
                dinput = buf.dx0
            else:
                dinput = dz
            if sparse:
                tables.insert(0, RowGrad(self.layout["embed"], *backend.sum_rows(x.reshape(N), dinput.T)))
            else:
                g["embed"].fill(0)
                backend.scatter_add_rows(g["embed"], x.reshape(N), dinput.T)
        return loss, count, new_state, tuple(tables)
