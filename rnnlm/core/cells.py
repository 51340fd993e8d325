"""Recurrent cell kernels: tanh RNN and LSTM over a (T, B) chunk, feature-major.

The per-step recurrent product is ``Whh (GH, H) @ h (H, B)`` (OpenBLAS is ~40%
faster this way round than ``h @ W`` at small B). Per-step buffers are
step-major (T, F, B) so every op in the loop touches contiguous memory; the
chunk-wide products use feature-major (F, T, B) = (F, N) matrices, and the two
are converted by one transposing copy per chunk, not by strided writes in the
loop (those cost ~4x more and evict the weights between steps).

The caller computes the input projection ``zin = Wx @ x`` (GH, T, B) for all
steps in one product, or fills ``z`` (T, GH, B) itself and passes ``step_major``.
The kernels add the bias inside the loop, where the step's (GH, B) block is hot
in cache. The chunk-wide layout changes go through :func:`backend.swap01`, which
NumPy does as a copy of B-wide rows rather than of single numbers. The backward
pass propagates ``dh`` per step with ``Whh`` transposed once per chunk
(:func:`backend.transpose_into`) and forms ``dWhh`` as one (GH, N) @ (N, H) product.

Stream resets: ``keep`` is (T, 1, B) with 0 where a stream restarts at step t:
its incoming state is zeroed and no gradient flows back across the boundary.
LSTM gate order is (i, f, o, g): the sigmoid gates are one contiguous block,
and ``sigmoid(a) = (1 + tanh(a / 2)) / 2`` lets one ``tanh`` call cover all four
gates (NumPy's tanh is about twice as fast as the exp and division it replaces).
"""
from __future__ import annotations

import numpy as np

from . import backend, fused
from .backend import swap01, transpose_into, transpose_panels


class Workspace:
    """Buffers of one recurrent layer for a (T, B) chunk.

    ``fused``: each step's elementwise work as one kernel (:mod:`rnnlm.core.fused`), bit-identical
    to the unfused path; by default on CuPy in float32 (the kernels' type).
    """

    def __init__(self, xp, T, B, H, G, dtype, fused: bool | None = None):
        self.T, self.B, self.H, self.G = T, B, H, G
        self.fused = (xp is not np and np.dtype(dtype) == np.float32) if fused is None else fused
        e = lambda *s: xp.empty(s, dtype=dtype)  # noqa: E731
        self.zin = e(G * H, T, B)     # input projection of every step (caller fills, unless step-major)
        self.z = e(T, G * H, B)       # per step: projection, then gate activations
        self.hs = e(T + 1, H, B)      # [0] incoming state, [t + 1] output of step t
        self.hcat = e(H, T + 1, B)    # the same, feature-major
        self.tmp_g = e(G * H, B)
        self.WhhT = e(H, G * H)       # the recurrent weights transposed, for the backward pass
        self.panels = transpose_panels(xp, G * H, H, dtype)
        self.bias = e(G * H, B)       # the bias broadcast over the batch, for in-loop adds
        self.dhs = e(T, H, B)         # gradient from above, step-major
        self.dzs = e(T, G * H, B)     # gate pre-activation gradients per step
        self.dz = e(G * H, T, B)      # the same, feature-major
        self.dh = e(H, B)
        self.dh_next = e(H, B)
        self.hmask = e(H, B)          # masked incoming state at a mid-chunk reset
        if G == 4:
            self.c = e(T + 1, H, B)   # [0] incoming cell, [t + 1] cell after step t
            self.tc = e(T, H, B)      # tanh(c)
            self.cmask = e(H, B)
            self.tmp = e(H, B)
            self.tmp3 = e(3 * H, B)
            self.dc_next = e(H, B)

    @property
    def hout(self):
        """Outputs of all steps as (H, N) (a view: rows have stride (T + 1) B)."""
        return self.hcat[:, 1:, :].reshape(self.H, self.T * self.B)


def _incoming(xp, ws, t, keep, reset_steps):
    """The state entering step t: a view, or a masked copy at a mid-chunk reset."""
    h = ws.hs[t]
    if t in reset_steps and t > 0:
        xp.multiply(h, keep[t], out=ws.hmask)
        return ws.hmask, True
    return h, False


def _start(xp, ws, b, state, keep, reset_steps, step_major):
    if not step_major:
        swap01(ws.z, ws.zin)                                         # (T, GH, B)
    xp.copyto(ws.bias, b[:, None])                                   # (GH, B)
    ws.hs[0] = state[0]
    if 0 in reset_steps:
        ws.hs[0] *= keep[0]
    if ws.G == 4:
        ws.c[0] = state[1]
        if 0 in reset_steps:
            ws.c[0] *= keep[0]


def _step_input(ws, z):
    """``z += Whh hp + bias``, ``Whh hp`` in ``ws.tmp_g``: the step's pre-activations (GH, B)."""
    z += ws.tmp_g
    z += ws.bias


def _finish_forward(xp, ws):
    swap01(ws.hcat, ws.hs)                                           # (H, T + 1, B)


def _start_backward(xp, ws, dhout):
    swap01(ws.dhs, dhout)                                            # (T, H, B)


def _dwhh(xp, ws, dWhh, keep, reset_steps):
    # dWhh = sum_t dz_t hprev_t^T over the chunk, then undo the unmasked part at resets
    N, H = ws.T * ws.B, ws.H
    swap01(ws.dz, ws.dzs)                                            # (GH, T, B)
    hprev = ws.hcat[:, :ws.T, :].reshape(H, N)                      # (H, N) view
    backend.matmul(ws.dz.reshape(-1, N), hprev.T, out=dWhh)         # (GH, H)
    for t in reset_steps:
        if t > 0:
            dropped = ws.hs[t] * (1.0 - keep[t])                     # (H, B)
            dWhh -= backend.matmul(ws.dzs[t], dropped.T)


def rnn_forward(xp, ws, Whh, b, state, keep, reset_steps, step_major=False):
    """``h_t = tanh(zin_t + b + Whh h_{t-1})``; returns the final state (1, H, B)."""
    _start(xp, ws, b, state, keep, reset_steps, step_major)
    for t in range(ws.T):
        hp, _ = _incoming(xp, ws, t, keep, reset_steps)
        z = ws.z[t]                                                  # (H, B)
        backend.matmul(Whh, hp, out=ws.tmp_g)
        if ws.fused:
            fused.rnn_forward_step(z, ws.tmp_g, ws.bias, ws.hs[t + 1])
            continue
        _step_input(ws, z)
        xp.tanh(z, out=ws.hs[t + 1])
    _finish_forward(xp, ws)
    return ws.hs[None, ws.T].copy()


def rnn_backward(xp, ws, Whh, dhout, dWhh, keep, reset_steps):
    """Backward of :func:`rnn_forward` given ``dhout`` (H, T, B).

    Leaves ``dz`` (H, T, B) in ``ws.dz`` and writes ``dWhh``.
    """
    WhhT = ws.WhhT                                                   # (H, GH)
    transpose_into(WhhT, Whh, ws.panels)
    _start_backward(xp, ws, dhout)
    dh, dh_next = ws.dh, ws.dh_next
    dh_next.fill(0)
    for t in range(ws.T - 1, -1, -1):
        h, dzt = ws.hs[t + 1], ws.dzs[t]
        if ws.fused:
            fused.rnn_backward_step(ws.dhs[t], dh_next, h, dzt)
        else:
            xp.add(ws.dhs[t], dh_next, out=dh)
            xp.multiply(h, h, out=dzt)                               # dz = (1 - h^2) dh
            xp.subtract(1.0, dzt, out=dzt)
            dzt *= dh
        if t == 0:
            break                       # truncated BPTT: nothing flows into the incoming state
        backend.matmul(WhhT, dzt, out=dh_next)
        if t in reset_steps:
            dh_next *= keep[t]
    _dwhh(xp, ws, dWhh, keep, reset_steps)


def lstm_forward(xp, ws, Whh, b, state, keep, reset_steps, step_major=False):
    """LSTM over the chunk; returns the final state (2, H, B): (h, c)."""
    H = ws.H
    _start(xp, ws, b, state, keep, reset_steps, step_major)
    for t in range(ws.T):
        hp, masked = _incoming(xp, ws, t, keep, reset_steps)
        cp = ws.c[t]
        if masked:
            xp.multiply(cp, keep[t], out=ws.cmask)
            cp = ws.cmask
        z = ws.z[t]                                                  # (4H, B)
        backend.matmul(Whh, hp, out=ws.tmp_g)
        if ws.fused:
            fused.lstm_forward_step(z, ws.tmp_g, ws.bias, cp, ws.c[t + 1], ws.tc[t], ws.hs[t + 1])
            continue
        _step_input(ws, z)
        s = z[:3 * H]
        s *= 0.5                                                     # sigmoid through tanh
        xp.tanh(z, out=z)
        s *= 0.5
        s += 0.5
        i, f, o, g = z[:H], z[H:2 * H], z[2 * H:3 * H], z[3 * H:]
        ct = ws.c[t + 1]
        xp.multiply(f, cp, out=ct)
        xp.multiply(i, g, out=ws.tmp)
        ct += ws.tmp
        xp.tanh(ct, out=ws.tc[t])
        xp.multiply(o, ws.tc[t], out=ws.hs[t + 1])
    _finish_forward(xp, ws)
    out = xp.empty((2, H, ws.B), dtype=ws.c.dtype)
    out[0] = ws.hs[ws.T]
    out[1] = ws.c[ws.T]
    return out


def _lstm_step_backward(xp, ws, t, cp):
    """Step t's pre-activation gradients into ``ws.dzs[t]`` (4H, B) from ``ws.dhs[t] + ws.dh_next``,
    and ``ws.dc_next`` from dL/dc_t to dL/dc_{t-1} (before any reset mask); ``cp`` the incoming cell."""
    H = ws.H
    dh, dc, tmp, tmp3 = ws.dh, ws.dc_next, ws.tmp, ws.tmp3
    xp.add(ws.dhs[t], ws.dh_next, out=dh)
    z, dzt = ws.z[t], ws.dzs[t]
    i, f, o, g = z[:H], z[H:2 * H], z[2 * H:3 * H], z[3 * H:]
    di, df, do, dg = dzt[:H], dzt[H:2 * H], dzt[2 * H:3 * H], dzt[3 * H:]
    tc = ws.tc[t]
    xp.multiply(dh, tc, out=do)
    xp.multiply(ws.hs[t + 1], tc, out=tmp)                           # dc += dh o (1 - tanh(c)^2),
    xp.subtract(o, tmp, out=tmp)                                     # o (1 - tc^2) = o - h tc
    tmp *= dh
    dc += tmp
    xp.multiply(dc, g, out=di)
    xp.multiply(dc, i, out=dg)
    xp.multiply(dc, cp, out=df)
    dc *= f                                                          # dc for step t - 1
    s = z[:3 * H]                                                    # sigmoid' = s (1 - s)
    xp.subtract(1.0, s, out=tmp3)
    tmp3 *= s
    dzt[:3 * H] *= tmp3
    xp.multiply(g, g, out=tmp)                                       # tanh' = 1 - g^2
    xp.subtract(1.0, tmp, out=tmp)
    dg *= tmp


def lstm_backward(xp, ws, Whh, dhout, dWhh, keep, reset_steps):
    """Backward of :func:`lstm_forward` given ``dhout`` (H, T, B).

    Leaves the pre-activation gradients (4H, T, B) in ``ws.dz``, writes ``dWhh``.
    """
    WhhT = ws.WhhT                                                   # (H, 4H)
    transpose_into(WhhT, Whh, ws.panels)
    _start_backward(xp, ws, dhout)
    dh_next, dc = ws.dh_next, ws.dc_next
    dh_next.fill(0)
    dc.fill(0)
    for t in range(ws.T - 1, -1, -1):
        cp = ws.c[t]
        if t in reset_steps and t > 0:
            xp.multiply(cp, keep[t], out=ws.cmask)
            cp = ws.cmask
        if ws.fused:
            fused.lstm_backward_step(ws.dhs[t], dh_next, ws.z[t], ws.tc[t], ws.hs[t + 1], cp, dc, ws.dzs[t])
        else:
            _lstm_step_backward(xp, ws, t, cp)
        if t == 0:
            break                       # truncated BPTT: nothing flows into the incoming state
        backend.matmul(WhhT, ws.dzs[t], out=dh_next)
        if t in reset_steps:
            dh_next *= keep[t]
            dc *= keep[t]
    _dwhh(xp, ws, dWhh, keep, reset_steps)
