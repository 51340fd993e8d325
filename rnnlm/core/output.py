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
            self.ypos = xp.empty(self.cols.size, dtype=xp.int64)
            self.log_pi = xp.empty(V, dtype=dtype)
            self.log_pi_rows = xp.empty(V, dtype=dtype)


# On a GPU the sampled sets are padded to multiples of this many rows, so that a step's shapes repeat
# and it can be replayed from a CUDA graph (rnnlm.core.graphs); NumPy runs them unpadded.
ROW_BUCKET = 128
PAD = 1.0e4       # a padded row's log_pi: its logit drops by 1e4 and its exp is exactly 0


class Layout(NamedTuple):
    """One chunk's sampled softmax as the output layer reads it (NumPy, on the host;
    :meth:`Softmax.layout`): ``rows[:n_f]`` are v_all, padding up to ``n_all``, V_gamma (v_f
    minus v_all, sorted), padding up to ``n_f``. A padded row is a word outside v_f whose
    ``log_pi`` is :data:`PAD`: its probability, its logit's gradient and its row's gradient are
    exactly zero, so the padded step computes the unpadded one (summed in another order)."""
    rows: np.ndarray            # (n_f,) int64
    n_all: int
    n_f: int
    ypos: np.ndarray            # (N,) int64: each target's row (0 where unscored)
    log_pi: np.ndarray | None   # (n_f,) subtracted from every logit but the target's, or None
    log_pi_rows: np.ndarray | None   # (n_all,) the rows' reweighting (Sets.log_pi_rows), or None
    through_gamma: bool


class Rows(NamedTuple):
    """A :class:`Layout` on the device: ``buf.rows[:n_f]`` and views of the chunk buffers
    (:meth:`Softmax.load`), which a CUDA graph reads from one step to the next."""
    n_all: int
    n_f: int
    ypos: object                # (N,)
    log_pi: object              # (n_f,) or None
    log_pi_rows: object         # (n_all,) or None
    through_gamma: bool


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
    def layout(self, softmax, y, bucket: int = 1) -> Layout:
        """Check ``softmax`` (a :class:`rnnlm.core.sampled.Sets` or a plain ``(v_all, v_f)``)
        against the targets ``y`` (T, B) on the host and lay it out (:class:`Layout`), each
        block padded to a multiple of ``bucket`` rows as far as the vocabulary allows.

        Raises
        ------
        ValueError
            A scored target is not in v_all, the sets are not sorted unique ids with v_all a
            subset of v_f, or ``log_pi`` / ``log_pi_rows`` does not match v_f / v_all.
        """
        V = self.V
        sets = sampled.Sets(*softmax)
        v_all = np.asarray(backend.to_numpy(sets.v_all), dtype=np.int64).reshape(-1)
        v_f = np.asarray(backend.to_numpy(sets.v_f), dtype=np.int64).reshape(-1)
        na, nf = v_all.size, v_f.size
        if not 0 < na <= nf <= V:
            raise ValueError(f"softmax sets: need 0 < |v_all| <= |v_f| <= V={V} (got {na} and {nf})")
        loc = np.minimum(np.searchsorted(v_f, v_all), nf - 1)           # (n_all,) v_all in v_f
        if not ((v_f[loc] == v_all).all() and (v_all[1:] > v_all[:-1]).all()
                and (v_f[1:] > v_f[:-1]).all() and v_f[0] >= 0 and v_f[-1] < V):
            raise ValueError(f"softmax sets: v_all and v_f must be sorted unique ids in [0, {V}) "
                             "with v_all a subset of v_f")
        yv = np.asarray(backend.to_numpy(y)).reshape(-1)
        valid = yv >= 0
        ypos = np.minimum(np.searchsorted(v_all, np.where(valid, yv, 0)), na - 1)   # (N,)
        if not ((v_all[ypos] == yv) | ~valid).all():
            missing = np.setdiff1d(yv[valid], v_all)
            raise ValueError(f"sampled softmax: every scored target must be in v_all; "
                             f"{missing.size} target id(s) are not, e.g. {missing[:5].tolist()}")
        gamma = np.ones(nf, dtype=bool)
        gamma[loc] = False
        n_all = min(-(-na // bucket) * bucket, V - (nf - na))            # room left for V_gamma
        n_f = min(-(-(n_all + nf - na) // bucket) * bucket, V)
        pads = np.empty(0, np.int64)
        if n_f > nf:
            outside = np.ones(V, dtype=bool)
            outside[v_f] = False
            pads = np.flatnonzero(outside)[:n_f - nf]                    # words outside v_f, distinct
        rows = np.concatenate([v_all, pads[:n_all - na], v_f[gamma], pads[n_all - na:]])
        log_pi = lp_rows = None
        if sets.log_pi is not None:
            lp = np.asarray(backend.to_numpy(sets.log_pi), dtype=self.dtype)
            if lp.shape != (nf,):
                raise ValueError(f"softmax log_pi: need one value per word of v_f ({nf}), got {lp.shape}")
            log_pi = lp[np.concatenate([loc, np.flatnonzero(gamma)])]
            if sets.log_pi_rows is not None:
                lp_rows = np.asarray(backend.to_numpy(sets.log_pi_rows), dtype=self.dtype)
                if lp_rows.shape != (na,):
                    raise ValueError(f"softmax log_pi_rows: need one value per word of v_all ({na}), "
                                     f"got {lp_rows.shape}")
        if n_f > nf:                                                     # the pads' PAD, the rest as they were
            lp = np.zeros(nf, self.dtype) if log_pi is None else log_pi
            pad = np.full(n_f - nf, PAD, self.dtype)
            log_pi = np.concatenate([lp[:na], pad[:n_all - na], lp[na:], pad[n_all - na:]])
            if lp_rows is not None:
                lp_rows = np.concatenate([lp_rows, pad[:n_all - na]])
        return Layout(rows, n_all, n_f, ypos, log_pi, lp_rows, bool(sets.through_gamma))

    def load(self, buf: Buffers, lay: Layout) -> Rows:
        """Copy ``lay`` into the chunk's buffers (ordered on the device after the steps before it)."""
        xp = self.xp
        buf.sampled(xp, self.V, self.H, self.dtype)
        na, nf = lay.n_all, lay.n_f
        buf.rows[:nf] = xp.asarray(lay.rows)
        buf.ypos[...] = xp.asarray(lay.ypos)
        log_pi = lp_rows = None
        if lay.log_pi is not None:
            log_pi = buf.log_pi[:nf]
            log_pi[...] = xp.asarray(lay.log_pi)
        if lay.log_pi_rows is not None:
            lp_rows = buf.log_pi_rows[:na]
            lp_rows[...] = xp.asarray(lay.log_pi_rows)
        return Rows(na, nf, buf.ypos, log_pi, lp_rows, lay.through_gamma)

    def backward(self, p: dict, g: dict, buf: Buffers, h, dh, rows: Rows | None = None,
                 sparse: bool = False) -> tuple:
        """From the dlogits :meth:`loss_grad` left: ``Wo``/``bo``'s gradient into ``g`` (every
        entry written) and the top layer's, dL/dh (H, N), into ``dh``.

        With ``rows`` (the rules: :meth:`rnnlm.core.model.RNNLM.loss_and_grad`) ``Wo``/``bo``'s
        gradient is zero outside v_all, and dL/dh sums over v_f's rows with
        ``rows.through_gamma``, else over v_all's. With ``rows`` and ``sparse`` that gradient is
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
        na, ypos, log_pi = rows.n_all, rows.ypos, rows.log_pi
        n_top = rows.n_f if rows.through_gamma else na                   # dL/dh: v_f's or v_all's
        backend.matmul(buf.Wf[:n_top].T, buf.logits[:n_top], out=dh)    # (H, N)
        dlg, Wa, ba = buf.logits[:na], buf.Wf[:na], buf.bf[:na]          # (n_all, N), (n_all, H)
        if rows.log_pi_rows is not None:
            # a row moves only in steps where it is in v_all (probability pi_all), but its
            # push-down was weighted for v_f (1 / pi_f): reweight it to 1 / pi_all, so that in
            # expectation each row is pushed down as under the full softmax; a target's
            # own entry (in v_all for sure) stays
            ey = dlg[ypos, buf.cols]                                     # (N,) a copy
            dlg *= xp.exp(log_pi[:na] - rows.log_pi_rows)[:, None]
            dlg[ypos, buf.cols] = ey
        backend.matmul(dlg, h.T, out=Wa)                                 # the weights are spent
        backend.matmul(dlg, buf.ones_n, out=ba)
        idx = buf.rows[:na]                                              # v_all (and pads): distinct
        if sparse:
            return ("Wo", (idx, Wa)), ("bo", (idx, ba))
        g["Wo"].fill(0)
        g["Wo"][idx] = Wa
        g["bo"].fill(0)
        g["bo"][idx] = ba
        return ()
