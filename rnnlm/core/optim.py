"""Optimizers that update a flat parameter buffer in place.

An optimizer object holds only hyper-parameters; its state is a plain dict of
flat arrays plus a step count, so it can be averaged, shipped to executors and
saved in a checkpoint like the parameters themselves.
"""
from __future__ import annotations

import math

from . import backend
from .layout import dense_ranges
from ..config import OptimConfig


def clip_factor(grads, clip_norm: float = 0.0, clip_value: float = 0.0, tables=()) -> tuple:
    """Element-clip ``grads`` in place; return (global L2 norm, global-norm clip factor).

    Both stay on the gradient's device (0-d float64 arrays; the factor is 1.0 without
    ``clip_norm``), so a step needs no host sync; on NumPy they are float64 scalars. The
    factor (<= 1; NaN with a non-finite norm) is not applied here: :meth:`Optimizer.step`
    folds it into its own pass over the gradient. ``tables``: a row-sparse gradient
    (:class:`rnnlm.core.layout.RowGrad`s; their slots of ``grads`` are not read), its squares
    summed after the rest's.
    """
    xp = backend.xp_of(grads)
    parts = [grads[r] for r in dense_ranges(grads.size, tables)] + [t.values for t in tables] if tables else [grads]
    if clip_value:
        for a in parts:
            xp.clip(a, -clip_value, clip_value, out=a)
    sq = backend.sumsq(parts[0])
    for a in parts[1:]:
        sq = sq + backend.sumsq(a.reshape(-1))
    norm = xp.sqrt(sq)
    factor = clip_norm / xp.maximum(norm, clip_norm) if clip_norm else 1.0     # exactly 1.0 up to clip_norm
    return norm, factor


def clip_grads(grads, clip_norm: float = 0.0, clip_value: float = 0.0):
    """Clip ``grads`` (P,) in place; return the global L2 norm before clipping.

    Element clipping (``clip_value``) is applied first, then global-norm clipping.
    """
    norm, factor = clip_factor(grads, clip_norm, clip_value)
    if not _is_one(factor):
        grads *= _scalar(factor, grads.dtype)
    return norm


def _is_one(v) -> bool:
    """``v == 1`` for a host number (NumPy's scalars are); a device value is never taken as one (no sync)."""
    return isinstance(v, (int, float)) and v == 1.0


def _scalar(v, dtype):
    """``v`` (a number or a 0-d array) as a 0-d array of ``dtype``: rounded once, as NumPy rounds a Python
    float it multiplies an array of ``dtype`` by (a float64 0-d array would make the product float64)."""
    return backend.xp_of(v).asarray(v, dtype=dtype)


class Optimizer:
    """Base class: ``step`` applies one update to ``params`` from ``grads``."""

    slots: tuple = ()
    scales_grads = False   # True when the update is linear in lr * g (the scale folds into lr)
    row_sparse = False     # True: step() also takes a row-sparse gradient, an update equal to the dense one
    same_every_step = True  # the update's arithmetic does not depend on the step count (a CUDA graph can replay it)

    def __init__(self, cfg: OptimConfig):
        self.cfg = cfg
        self._scratch = None

    def init_state(self, params) -> dict:
        """Fresh state: zero accumulators shaped like ``params`` and ``t = 0``."""
        xp = backend.xp_of(params)
        state = {name: xp.zeros_like(params) for name in self.slots}
        state["t"] = 0
        return state

    def step(self, params, grads, state: dict, lr: float, grad_scale=1.0, tables=()) -> None:
        """Update ``params`` in place from ``grad_scale * grads``.

        ``grad_scale``: a number, or a 0-d array on the device (:func:`clip_factor`'s).
        ``grads`` is used as scratch and left undefined. ``tables`` (where :attr:`row_sparse`): the
        gradient of some slots as :class:`rnnlm.core.layout.RowGrad`s, zero outside their rows
        (their slots of ``grads`` are not read); only those rows of the slots are written.
        """
        if tables and not self.row_sparse:
            raise ValueError(f"{type(self).__name__} takes no row-sparse gradient: its update moves every row")
        state["t"] += 1
        if self.scales_grads:
            host = isinstance(grad_scale, (int, float))       # a Python float multiplies as float32 does
            lr = float(lr * grad_scale) if host else _scalar(lr * grad_scale, params.dtype)
        elif not _is_one(grad_scale):
            grads *= _scalar(grad_scale, grads.dtype)
        if tables:
            self._update_rows(params, grads, tables, lr)
        else:
            self._update(params, grads, state, lr, backend.xp_of(params))

    def scratch(self, like):
        # one reusable buffer shaped like the parameters, never part of the state
        if self._scratch is None or self._scratch.shape != like.shape or self._scratch.dtype != like.dtype:
            self._scratch = backend.xp_of(like).empty_like(like)
        return self._scratch

    def _update(self, params, grads, state, lr, xp):
        raise NotImplementedError

    def _update_rows(self, params, grads, tables, lr):
        raise NotImplementedError


class SGD(Optimizer):
    """``p -= lr * g``; with a row-sparse gradient only the rows it names move (the others' update is
    ``p - 0``: the same parameters to the bit)."""

    scales_grads = True
    row_sparse = True

    def _update(self, params, grads, state, lr, xp):
        grads *= lr
        params -= grads

    def _update_rows(self, params, grads, tables, lr):
        for r in dense_ranges(params.size, tables):
            self._update(params[r], grads[r], None, lr, None)
        for t in tables:
            step = t.values
            step *= lr
            t.slot.view(params)[t.rows] -= step                               # distinct rows: no update lost


class Momentum(Optimizer):
    """Heavy-ball momentum ``v = mu v + g``; Nesterov uses ``g + mu v``."""

    slots = ("velocity",)

    def _update(self, params, grads, state, lr, xp):
        v = state["velocity"]
        v *= self.cfg.momentum
        v += grads
        tmp = self.scratch(params)
        if self.cfg.nesterov:
            xp.multiply(v, self.cfg.momentum, out=tmp)
            tmp += grads
        else:
            tmp[...] = v
        tmp *= lr
        params -= tmp


class AdaGrad(Optimizer):
    """``G += g^2;  p -= lr g / (sqrt(G) + eps)`` (the Spark RNN report; Tai and Xu 2014)."""

    slots = ("sum_sq",)

    def _update(self, params, grads, state, lr, xp):
        acc, denom = state["sum_sq"], self.scratch(params)
        xp.multiply(grads, grads, out=denom)
        acc += denom
        xp.sqrt(acc, out=denom)
        denom += self.cfg.eps
        grads *= lr
        grads /= denom
        params -= grads


class Adam(Optimizer):
    """Adam with bias correction."""

    slots = ("m", "v")
    same_every_step = False    # bias correction: a function of t

    def _update(self, params, grads, state, lr, xp):
        b1, b2, t = self.cfg.beta1, self.cfg.beta2, state["t"]
        m, v = state["m"], state["v"]
        denom = self.scratch(params)
        m *= b1
        grads *= 1.0 - b1
        m += grads
        v *= b2
        xp.multiply(grads, grads, out=denom)
        denom *= (1.0 - b2) / (1.0 - b1) ** 2       # (1 - b2) g^2, g was scaled by 1 - b1
        v += denom
        # lr * m_hat / (sqrt(v_hat) + eps), rearranged so only m and v are touched
        step = lr * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
        xp.sqrt(v, out=denom)
        denom += self.cfg.eps * math.sqrt(1.0 - b2 ** t)
        xp.divide(m, denom, out=grads)
        grads *= step
        params -= grads


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adagrad": AdaGrad, "adam": Adam}


def make_optimizer(cfg: OptimConfig) -> Optimizer:
    return OPTIMIZERS[cfg.name](cfg)
