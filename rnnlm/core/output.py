"""The softmax output layer both language models end in, and the seeded initialisation they share.

The recurrent model (:class:`rnnlm.core.model.RNNLM`) and the feed-forward one
(:class:`rnnlm.core.ffnn.FFNNLM`) differ below their top hidden layer h (H, N) and share
everything above it: ``logits = Wo @ h + bo`` over the vocabulary (or, in training, over a
sampled subset of it: :mod:`rnnlm.core.sampled`), the log-softmax cross-entropy and its
gradient. ``Wo`` (V, H) and ``bo`` (V,) come last in both layouts.

Initialisation: one generator per seed (:func:`init_rng`) draws every weight matrix in layout
order (:func:`draw`), the output layer's last; biases start at zero. Checkpoints hold the
values, not the seed, so only a new run depends on this order.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import backend, sampled


def init_rng(seed: int):
    """The generator a model's initial parameters are drawn from (NumPy, whatever the device)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), 0x1417]))


def draw(rng, cfg, shape, fan_in: int):
    """A weight matrix's initial values (float64): uniform in +-``init_scale`` or, with
    ``cfg.init = "normal"``, normal with standard deviation ``init_scale / sqrt(fan_in)``."""
    if cfg.init == "uniform":
        return rng.uniform(-cfg.init_scale, cfg.init_scale, shape)
    return rng.normal(0.0, cfg.init_scale / np.sqrt(fan_in), shape)


def reuse(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` on first use. A new key drops the old entry: one chunk
    shape's buffers at a time keeps memory bounded (the logits alone are V x N)."""
    if key not in cache:
        cache.clear()
        cache[key] = make()
    return cache[key]


class Buffers:
    """The output layer's buffers for chunks of N positions, allocated once and reused."""

    def __init__(self, xp, V: int, N: int, dtype):
        self.logits = xp.empty((V, N), dtype=dtype)   # logits, then dlogits
        self.ones_n = xp.ones(N, dtype=dtype)
        self.ones_v = xp.ones(V, dtype=dtype)
        self.cols = xp.arange(N)
        self.rows = None                               # sampled softmax, allocated on first use

    def sampled(self, xp, V: int, H: int, dtype):
        """Allocate (once) the sampled softmax's buffers, full size; a chunk uses ``[:n]``."""
        if self.rows is None:
            self.rows = xp.empty(V, dtype=xp.int64)    # output rows: v_all, then v_f minus v_all
            self.Wf = xp.empty((V, H), dtype=dtype)    # gathered Wo rows, then their gradient
            self.bf = xp.empty(V, dtype=dtype)         # gathered bo rows, then their gradient


class Rows(NamedTuple):
    """One chunk's sampled softmax, laid out by :meth:`Softmax.select`: ``buf.rows[:n_f]`` holds
    v_all followed by v_f minus v_all (V_gamma), so v_all's rows are the slice ``[:n_all]``."""
    sets: sampled.Sets
    n_all: int
    n_f: int
    ypos: object      # (N,) each target's row in that layout
    log_pi: object    # (n_f,) ``sets.log_pi`` in that layout, or None


class Softmax:
    """The output layer of a model with vocabulary ``V`` and top hidden width ``H``.

    Parameters
    ----------
    cfg : ModelConfig
        Its ``init`` and ``init_scale``.
    xp : module
        NumPy or CuPy.
    dtype : numpy dtype
        The parameters' and buffers' dtype.
    """

    def __init__(self, cfg, V: int, H: int, xp, dtype):
        self.cfg, self.V, self.H, self.xp, self.dtype = cfg, V, H, xp, dtype
        self.entries = [("Wo", (V, H)), ("bo", (V,))]  # the model's layout ends with them

    def init(self, p: dict, rng) -> None:
        """Draw ``Wo`` into the views ``p`` of a zeroed buffer (``bo`` stays zero), after the
        model has drawn the slots before it from the same ``rng``."""
        p["Wo"][...] = draw(rng, self.cfg, p["Wo"].shape, self.H)

    def buffers(self, N: int) -> Buffers:
        return Buffers(self.xp, self.V, N, self.dtype)

    # ---------------------------------------------------------------- forward
    def forward(self, p: dict, buf: Buffers, h, rows: Rows | None = None) -> None:
        """Logits of the top layer ``h`` (H, N) into ``buf.logits`` (V, N); with ``rows`` only
        those of ``buf.rows[:n_f]``, into ``buf.logits[:n_f]``."""
        xp = self.xp
        if rows is None:
            backend.matmul(p["Wo"], h, out=buf.logits)                  # (V, N)
            buf.logits += p["bo"][:, None]
            return
        n_out = rows.n_f
        idx, Wf, bf = buf.rows[:n_out], buf.Wf[:n_out], buf.bf[:n_out]
        xp.take(p["Wo"], idx, axis=0, out=Wf)                            # (n_f, H)
        xp.take(p["bo"], idx, out=bf)                                    # (n_f,)
        lg = buf.logits[:n_out]                                          # (n_f, N)
        backend.matmul(Wf, h, out=lg)
        lg += bf[:, None]

    def last(self, buf: Buffers, T: int, B: int):
        """The logits (B, V) of the last step of a (T, B) chunk, a copy."""
        return buf.logits[:, (T - 1) * B:].T.copy()

    def loss(self, buf: Buffers, y, rows: Rows | None = None, read: bool = True) -> tuple:
        """Summed NLL of the targets ``y`` (T, B) (< 0: not scored) and the number scored,
        computed in place over ``buf.logits``: a float and an int (read from the device), or with
        ``read=False`` two 0-d float64 arrays left on it."""
        loss, count = self._nll(buf, y, None, rows)
        return (float(loss), int(count)) if read else (loss, count)

    def loss_grad(self, buf: Buffers, y, grad_scale=None, rows: Rows | None = None) -> tuple:
        """As :meth:`loss`, leaving ``grad_scale * dNLL/dlogits`` in ``buf.logits``;
        ``grad_scale`` defaults to 1 / tokens scored. The sum and the count stay on the device
        (0-d float64 arrays; NumPy's scalars on the host): a training step reads nothing back."""
        if grad_scale is None:
            grad_scale = 1.0 / max(1, int((y >= 0).sum()))
        return self._nll(buf, y, grad_scale, rows)

    def _nll(self, buf, y, grad_scale, rows):
        """Log-softmax cross-entropy in place over ``buf.logits``.

        With ``rows`` (sampled softmax) only ``buf.logits[:n_f]`` is normalised and
        ``rows.ypos`` (N,) gives each target's row in it; ``rows.log_pi`` (n_f,), if set, is
        subtracted from every logit but the target's (a constant shift: the gradient
        with respect to the logits keeps its form).
        """
        xp = self.xp
        yv = y.reshape(-1)
        valid = yv >= 0
        log_pi = None
        if rows is None:
            lg, ones = buf.logits, buf.ones_v                            # (V, N), (V,)
            yc = xp.where(valid, yv, 0)
        else:
            n_out, log_pi = rows.n_f, rows.log_pi
            lg, ones, yc = buf.logits[:n_out], buf.ones_v[:n_out], rows.ypos   # (n_f, N), (n_f,)
        if log_pi is not None:
            raw = lg[yc, buf.cols]                                       # (N,) a copy
            lg -= log_pi[:, None]
            lg[yc, buf.cols] = raw                                       # ...but its own target's
        lg -= lg.max(axis=0)
        zy = lg[yc, buf.cols]                                            # (N,)
        xp.exp(lg, out=lg)
        s = backend.matmul(ones, lg)                                     # (N,)
        nll = (xp.log(s) - zy) * valid
        loss = nll.sum(dtype=np.float64)                                 # 0-d, on the device
        count = valid.sum(dtype=np.float64)                              # float64: stacks with the loss
        if grad_scale is not None:
            w = valid.astype(self.dtype) * grad_scale
            lg *= w / s
            lg[yc, buf.cols] -= w
        return loss, count

    # --------------------------------------------------------------- backward
    def select(self, buf: Buffers, softmax, y) -> Rows:
        """Check ``softmax`` (a :class:`rnnlm.core.sampled.Sets` or a plain ``(v_all, v_f)``)
        against the targets ``y`` and lay out ``buf.rows`` (see :class:`Rows`).

        Raises
        ------
        ValueError
            A scored target is not in v_all, the sets are not sorted unique ids with v_all a
            subset of v_f, or ``log_pi`` does not match v_f.
        """
        xp, V = self.xp, self.V
        softmax = sampled.Sets(*softmax)
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
        buf.sampled(xp, V, self.H, self.dtype)
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
        return Rows(softmax, na, nf, ypos, log_pi)

    def backward(self, p: dict, g: dict, buf: Buffers, h, dh, rows: Rows | None = None,
                 sparse: bool = False) -> tuple:
        """From the dlogits :meth:`loss_grad` left: ``Wo``/``bo``'s gradient into ``g`` (every
        entry written) and the top layer's, dL/dh (H, N), into ``dh``.

        With ``rows`` (the rules: :meth:`rnnlm.core.model.RNNLM.loss_and_grad`) ``Wo``/``bo``'s
        gradient is zero outside v_all, and dL/dh sums over v_f's rows with
        ``sets.through_gamma``, else over v_all's. With ``rows`` and ``sparse`` that gradient is
        returned as ``(("Wo", (v_all, (n_all, H))), ("bo", (v_all, (n_all,))))`` (views of ``buf``)
        and ``g``'s are not written; otherwise the return is ``()``.
        """
        xp = self.xp
        if rows is None:
            dlg = buf.logits                                             # (V, N)
            backend.matmul(dlg, h.T, out=g["Wo"])                        # (V, H)
            backend.matmul(dlg, buf.ones_n, out=g["bo"])
            backend.matmul(p["Wo"].T, dlg, out=dh)                       # (H, N)
            return ()
        sets, na, ypos, log_pi = rows.sets, rows.n_all, rows.ypos, rows.log_pi
        n_top = rows.n_f if sets.through_gamma else na                   # dL/dh: v_f's or v_all's
        backend.matmul(buf.Wf[:n_top].T, buf.logits[:n_top], out=dh)    # (H, N)
        dlg, Wa, ba = buf.logits[:na], buf.Wf[:na], buf.bf[:na]          # (n_all, N), (n_all, H)
        if sets.log_pi_rows is not None and log_pi is not None:
            # a row moves only in steps where it is in v_all (probability pi_all), but its
            # push-down was weighted for v_f (1 / pi_f): reweight it to 1 / pi_all, so that in
            # expectation each row is pushed down as under the full softmax; a target's
            # own entry (in v_all for sure) stays
            lpr = xp.asarray(sets.log_pi_rows, dtype=self.dtype)
            if lpr.shape != (na,):
                raise ValueError(f"softmax log_pi_rows: need one value per word of v_all ({na}), got {lpr.shape}")
            ey = dlg[ypos, buf.cols]                                     # (N,) a copy
            dlg *= xp.exp(log_pi[:na] - lpr)[:, None]
            dlg[ypos, buf.cols] = ey
        backend.matmul(dlg, h.T, out=Wa)                                 # the weights are spent
        backend.matmul(dlg, buf.ones_n, out=ba)
        idx = buf.rows[:na]                                              # v_all: sorted, distinct
        if sparse:
            return ("Wo", (idx, Wa)), ("bo", (idx, ba))
        g["Wo"].fill(0)
        g["Wo"][idx] = Wa
        g["bo"].fill(0)
        g["bo"][idx] = ba
        return ()
