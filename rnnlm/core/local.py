"""The local training loop the Spark executors run: no Spark, no I/O.

:func:`train_steps` runs a number of optimizer steps over batches (from
:mod:`rnnlm.core.strategies`), carrying hidden state, and returns the new
parameters, optimizer state and carried state with the tokens processed and the
summed loss.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np


from . import backend, graphs
from .metrics import EVAL_BPTT
from .model import DRAWN
from .optim import clip_factor
from .strategies import StreamBlock


@dataclass
class LocalResult:
    params: object
    opt_state: dict
    state: object
    tokens: int
    loss_sum: float
    steps: int


def _checked_not_warned(fn):
    """``fn`` under NumPy's errstate ignoring overflow, invalid values and division by zero: a diverging
    step's non-finite loss, norm or parameters are what :func:`train_steps` checks and raises as one
    FloatingPointError (NumPy's warnings of them reached the user's terminal as two more lines)."""
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return fn(*args, **kwargs)
    return checked


@_checked_not_warned
def train_steps(model, optimizer, params, opt_state, batches, state, *, lr: float,
                clip_norm: float = 0.0, clip_value: float = 0.0, grad_norm: str = "batch",
                dropout_rng=None, grads=None, softmax_sets=None, cuda_graphs: bool = True) -> LocalResult:
    """Run one optimizer step per batch, carrying hidden state between them.

    Parameters
    ----------
    model : RNNLM or FFNNLM (:func:`rnnlm.core.models.build`)
    optimizer : Optimizer
    params : flat array (P,), updated in place
    opt_state : dict, updated in place
    batches : iterable of Batch
        The steps to run, in order; its length is the step count.
    state : array (L, S, H, B)
        Hidden state carried into the first batch.
    grad_norm : {"batch", "token"}
        Gradient of the summed NLL divided by B (sum over time, mean over streams,
        as Zaremba et al.) or by the tokens scored.
    dropout_rng : xp generator, optional
        Enables dropout when given.
    softmax_sets : callable, optional
        ``(step_index, y) -> (v_all, v_f)`` or a :class:`rnnlm.core.sampled.Sets`, with ``y``
        the batch's targets as a NumPy array: each step then trains with the sampled softmax
        over those sets (see
        :meth:`RNNLM.loss_and_grad`, :func:`rnnlm.core.sampled.softmax_sets`). None
        is the full softmax.
    cuda_graphs : bool
        On CuPy with nvmath-python, replay steps from CUDA graphs where the step allows
        (:mod:`rnnlm.core.graphs`; bit-identical to running them eagerly). False: always eagerly.

    Raises
    ------
    FloatingPointError
        When a loss or the gradient's norm was NaN or infinite, naming the first such step, or
        when the parameters are no longer finite after the last step (an update that
        overflowed). It is raised at the end of the call, which reads the device once: the
        parameters then hold every step's update and are not to be used (no caller sends them).
    """
    xp = model.xp
    if not getattr(model, "dropout", 0.0):
        dropout_rng = None          # nothing to draw (a graph of such a model has no mask buffers to draw into)
    grads = xp.empty_like(params) if grads is None else grads
    graphed = cuda_graphs and graphs.usable(model, optimizer, grad_norm=grad_norm)
    steps = 0
    watch = []                  # per step, on the device: its loss, its gradient's norm, the tokens scored

    def step(x, y, reset, state, scale, softmax=None, rng=dropout_rng):
        if optimizer.row_sparse:            # the tables' rows alone, where the model gives them (NumPy)
            loss, count, state, tables = model.loss_and_sparse_grad(params, grads, x, y, state, reset,
                                                                    grad_scale=scale, rng=rng, softmax=softmax)
        else:
            tables = ()
            loss, count, state = model.loss_and_grad(params, grads, x, y, state, reset, grad_scale=scale,
                                                     rng=rng, softmax=softmax)
        norm, factor = clip_factor(grads, clip_norm, clip_value, tables)
        optimizer.step(params, grads, opt_state, lr, grad_scale=factor, tables=tables)
        return loss, norm, count, state

    for b in batches:
        # (the token norm counts the targets first: on the host, where the trainer's batches are)
        scale = 1.0 / b.x.shape[1] if grad_norm == "batch" else 1.0 / max(1, int((b.y >= 0).sum()))
        reset, lay = b.reset, None
        if softmax_sets is not None:                    # the step's sets, checked and laid out on the host
            yh = backend.to_numpy(b.y)
            lay = model.sampled_layout(softmax_sets(steps, yh), yh)
        if graphed:
            reset = model.resets(b.reset)
            graph = _graph(model, optimizer, params, grads, opt_state, b, reset, state, step, scale, lay,
                           lr=lr, clip_norm=clip_norm, clip_value=clip_value, dropout=dropout_rng is not None)
            if graph is not None:                       # into the buffers the graph reads:
                if dropout_rng is not None:
                    model.draw_dropout(dropout_rng, graph.buffers)     # the dropout masks
                if lay is not None:
                    model.sampled_rows(lay, *b.x.shape, graph.buffers)  # the sampled rows
                seen, state = graph.replay(b.x, b.y, reset, state)
                opt_state["t"] += 1
                watch.append(seen)
                steps += 1
                continue
        softmax = None if lay is None else model.sampled_rows(lay, *b.x.shape)
        loss, norm, count, state = step(xp.asarray(b.x), xp.asarray(b.y), reset, state, scale, softmax)
        watch.append(xp.stack([loss, norm, count]))                     # float64, all three
        steps += 1
    if not steps:
        return LocalResult(params, opt_state, state, 0, 0.0, 0)
    # the call's one read from the device; the parameters' sum of squares (one BLAS dot on NumPy: the cheapest
    # pass over them) catches an update that overflowed, confirmed below element by element
    seen = backend.to_numpy(xp.concatenate([*watch, backend.sumsq(params)[None]]))
    loss_sum, tokens = 0.0, int(seen[2:-1:3].sum())
    for k in range(steps):
        loss, norm = float(seen[3 * k]), float(seen[3 * k + 1])
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at local step {k}")
        if not math.isfinite(norm):
            # clipping cannot catch it (NaN > clip_norm is False): the update would poison every weight
            raise FloatingPointError(f"gradient norm became {norm} at local step {k}")
        loss_sum += loss
    if not math.isfinite(float(seen[-1])) and not bool(xp.isfinite(params).all()):
        raise FloatingPointError(f"parameters are no longer finite after local step {steps - 1}")
    return LocalResult(params, opt_state, state, tokens, loss_sum, steps)


def _graph(model, optimizer, params, grads, opt_state, b, resets, state, step, scale, lay, **frozen):
    """The step's CUDA graph (:mod:`rnnlm.core.graphs`), or None where it runs eagerly this time.
    ``lay``: the step's sampled softmax (an ``output.Layout``: its sizes are frozen), or None."""
    xp = model.xp
    sizes = None if lay is None else (lay.n_all, lay.n_f, lay.through_gamma, lay.log_pi is not None,
                                      lay.log_pi_rows is not None)
    key = graphs.step_key(optimizer, params, grads, opt_state, b.x, b.y, resets, state, scale=scale,
                          sampled=sizes, **frozen)

    def make():
        T, B = b.x.shape
        rng = DRAWN if frozen["dropout"] else None
        buffers = model.chunk_buffers(T, B)
        rows = None if lay is None else model.sampled_rows(lay, T, B, buffers)   # views the graph reads

        def fn(x, y, r, s):
            return step(x, y, r, s, scale, softmax=rows, rng=rng)
        t = opt_state["t"]
        try:
            return graphs.StepGraph(xp, fn, b.x, b.y, resets, state, buffers, hold=optimizer.scratch(params))
        finally:
            opt_state["t"] = t                  # the capture ran the step's Python once, and nothing on the device
    return graphs.StepGraphs.of(model).get(key, make)


def evaluate(model, params, tokens, B: int, T: int, cuda_graphs: bool = True) -> tuple:
    """Summed NLL and token count of ``tokens`` read as B streams with carried state.

    On CuPy the full chunks' sums stay on the device, added in chunk order in float64 (as the host
    adds them), and are read once; from the second chunk on each is replayed from a CUDA graph
    (``cuda_graphs=False``: every chunk eagerly, each read as it ends; the same numbers).
    """
    xp = model.xp
    block = StreamBlock(tokens, B, T)
    state = model.zero_state(B)
    total, count = 0.0, 0
    if cuda_graphs and block.steps_per_pass and graphs.capturable(model):
        acc = xp.zeros(2, dtype=xp.float64)
        graph = None
        for k in range(block.steps_per_pass):
            b = block.batch(k)
            if k == 0:                                   # eagerly: compiles the kernels, allocates the buffers
                loss, c, state = model.loss(params, xp.asarray(b.x), xp.asarray(b.y), state, read=False)
                acc += xp.stack([loss, c])
                continue
            if graph is None:
                graph = graphs.EvalGraph(xp, lambda x, y, s: model.loss(params, x, y, s, read=False),
                                         b.x, b.y, state, acc, model.chunk_buffers(T, B))
            state = graph.replay(b.x, b.y, state)
        state = state.copy()
        seen = backend.to_numpy(acc)
        total, count = float(seen[0]), int(seen[1])
    else:
        for k in range(block.steps_per_pass):
            b = block.batch(k)
            loss, c, state = model.loss(params, xp.asarray(b.x), xp.asarray(b.y), state)
            total += loss
            count += c
    a = block.steps_per_pass * T                    # the tail shorter than T
    if a + 1 < len(block.streams):
        x, y = block.streams[a:-1], block.streams[a + 1:]
        loss, c, state = model.loss(params, xp.asarray(x), xp.asarray(y), state)
        total += loss
        count += c
    return total, count


def held_out_nll(model, params, streams) -> tuple:
    """Summed NLL and token count of held-out streams, each read as one stream from a zero state
    in chunks of ``EVAL_BPTT`` (streams shorter than 2 tokens score nothing)."""
    total, count = 0.0, 0
    for tokens in streams:
        if len(tokens) >= 2:
            s, c = evaluate(model, params, tokens, 1, min(EVAL_BPTT, len(tokens) - 1))
            total, count = total + s, count + c
    return total, count
