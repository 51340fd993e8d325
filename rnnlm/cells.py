"""Recurrent cell kernels: tanh RNN and LSTM over a (T, B) chunk.

Each kernel works on a preallocated :class:`Workspace` (no allocation per step
except BLAS temporaries), takes the input projection ``z = x @ Wx + b`` for all
T steps at once (one big matrix product done by the caller), and runs only the
recurrent product per step. The backward pass propagates ``dh`` per step and
forms ``dWhh`` as one (H, N) @ (N, GH) product after the loop.

Stream resets: ``keep`` is (T, B, 1) with 0 where a stream restarts at step t,
so its incoming state is zero there and no gradient flows back across it.
Gate order of the LSTM is (i, f, o, g): the three sigmoid gates are contiguous.
"""
from __future__ import annotations


class Workspace:
    """Buffers of one recurrent layer for a (T, B) chunk."""

    def __init__(self, xp, T, B, H, G, dtype):
        self.T, self.B, self.H, self.G = T, B, H, G
        e = lambda *s: xp.empty(s, dtype=dtype)  # noqa: E731
        self.z = e(T, B, G * H)       # gate pre-activations, then activations
        self.hprev = e(T, B, H)       # state entering step t (after resets)
        self.hout = e(T, B, H)        # state leaving step t
        self.dz = e(T, B, G * H)
        self.tmp_g = e(B, G * H)
        self.dh_next = e(B, H)
        if G == 4:
            self.cprev = e(T, B, H)
            self.c = e(T, B, H)
            self.tc = e(T, B, H)      # tanh(c)
            self.tmp_h = e(B, H)
            self.tmp_h2 = e(B, H)
            self.tmp_3h = e(B, 3 * H)
            self.dc_next = e(B, H)


def _sigmoid_(xp, a):
    # a <- 1 / (1 + exp(-a)), in place
    xp.negative(a, out=a)
    xp.exp(a, out=a)
    a += 1.0
    xp.reciprocal(a, out=a)


def rnn_forward(xp, ws, Whh, h0, keep, reset_steps):
    """Forward of ``h_t = tanh(z_t + h_{t-1} @ Whh)``; ``ws.z`` holds ``x @ Wx + b``."""
    T = ws.T
    h = h0
    for t in range(T):
        hp = ws.hprev[t]
        if t in reset_steps:
            xp.multiply(h, keep[t], out=hp)
        else:
            hp[...] = h
        z = ws.z[t]                                   # (B, H)
        xp.matmul(hp, Whh, out=ws.tmp_g)
        z += ws.tmp_g
        xp.tanh(z, out=z)
        ws.hout[t] = z
        h = ws.hout[t]
    return (ws.hout[T - 1].copy(),)


def rnn_backward(xp, ws, Whh, dhout, dWhh, keep, reset_steps):
    """Backward of :func:`rnn_forward`; ``dhout`` (T, B, H) is consumed.

    Leaves ``dz`` (T, B, H) in ``ws.dz`` and writes ``dWhh``.
    """
    dh_next = ws.dh_next
    dh_next.fill(0)
    for t in range(ws.T - 1, -1, -1):
        dh = dhout[t]
        dh += dh_next
        dz = ws.dz[t]
        h = ws.hout[t]
        xp.multiply(h, h, out=dz)                     # dz = (1 - h^2) * dh
        xp.subtract(1.0, dz, out=dz)
        dz *= dh
        xp.matmul(dz, Whh.T, out=dh_next)
        if t in reset_steps:
            dh_next *= keep[t]
    N = ws.T * ws.B
    xp.matmul(ws.hprev.reshape(N, ws.H).T, ws.dz.reshape(N, ws.H), out=dWhh)


def lstm_forward(xp, ws, Whh, h0, c0, keep, reset_steps):
    """LSTM forward over the chunk; ``ws.z`` holds ``x @ Wx + b`` (T, B, 4H)."""
    T, H = ws.T, ws.H
    h, c = h0, c0
    for t in range(T):
        hp, cp = ws.hprev[t], ws.cprev[t]
        if t in reset_steps:
            xp.multiply(h, keep[t], out=hp)
            xp.multiply(c, keep[t], out=cp)
        else:
            hp[...] = h
            cp[...] = c
        z = ws.z[t]                                   # (B, 4H)
        xp.matmul(hp, Whh, out=ws.tmp_g)
        z += ws.tmp_g
        sig = z[:, :3 * H]
        _sigmoid_(xp, sig)
        g = z[:, 3 * H:]
        xp.tanh(g, out=g)
        i, f, o = z[:, :H], z[:, H:2 * H], z[:, 2 * H:3 * H]
        ct = ws.c[t]
        xp.multiply(f, cp, out=ct)
        xp.multiply(i, g, out=ws.tmp_h)
        ct += ws.tmp_h
        tc = ws.tc[t]
        xp.tanh(ct, out=tc)
        ht = ws.hout[t]
        xp.multiply(o, tc, out=ht)
        h, c = ht, ct
    return ws.hout[T - 1].copy(), ws.c[T - 1].copy()


def lstm_backward(xp, ws, Whh, dhout, dWhh, keep, reset_steps):
    """Backward of :func:`lstm_forward`; ``dhout`` (T, B, H) is consumed.

    Leaves the pre-activation gradients (T, B, 4H) in ``ws.dz``, writes ``dWhh``.
    """
    H = ws.H
    dh_next, dc_next = ws.dh_next, ws.dc_next
    dh_next.fill(0)
    dc_next.fill(0)
    tmp, tmp2, tmp3 = ws.tmp_h, ws.tmp_h2, ws.tmp_3h
    for t in range(ws.T - 1, -1, -1):
        dh = dhout[t]
        dh += dh_next
        z, dz = ws.z[t], ws.dz[t]
        i, f, o, g = z[:, :H], z[:, H:2 * H], z[:, 2 * H:3 * H], z[:, 3 * H:]
        di, df, do, dg = dz[:, :H], dz[:, H:2 * H], dz[:, 2 * H:3 * H], dz[:, 3 * H:]
        tc = ws.tc[t]
        xp.multiply(dh, tc, out=do)
        # dc = dc_next + dh * o * (1 - tanh(c)^2)
        xp.multiply(tc, tc, out=tmp)
        xp.subtract(1.0, tmp, out=tmp)
        tmp *= o
        tmp *= dh
        dc = dc_next
        dc += tmp
        xp.multiply(dc, g, out=di)
        xp.multiply(dc, i, out=dg)
        xp.multiply(dc, ws.cprev[t], out=df)
        dc *= f                                       # becomes dc_next for t - 1
        # through the nonlinearities: sigmoid' = s (1 - s), tanh' = 1 - g^2
        s = z[:, :3 * H]
        xp.subtract(1.0, s, out=tmp3)
        tmp3 *= s
        dz[:, :3 * H] *= tmp3
        xp.multiply(g, g, out=tmp2)
        xp.subtract(1.0, tmp2, out=tmp2)
        dg *= tmp2
        xp.matmul(dz, Whh.T, out=dh_next)
        if t in reset_steps:
            dh_next *= keep[t]
            dc_next *= keep[t]
    N = ws.T * ws.B
    xp.matmul(ws.hprev.reshape(N, H).T, ws.dz.reshape(N, 4 * H), out=dWhh)
