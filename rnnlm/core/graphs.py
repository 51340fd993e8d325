"""A training step as a CUDA graph: captured once per chunk shape and reset pattern, then replayed.

On CuPy a step is ~1,000 kernel launches and GEMMs at ~25 us of Python each: the GPU idles while
the host dispatches. A graph launches them all at once. What it needs (docs/design.md):

- every GEMM through :mod:`rnnlm.core.gemm` (CuPy's own cuBLAS calls refuse capture);
- no host sync in the step (the loss, norm and count stay on the device; the clip factor is
  computed there), no host-to-device copy (the batch and the reset mask go into the graph's own
  input buffers before each launch), no random draws (cuRAND refuses capture: a step's dropout
  masks are drawn before its launch, as an eager step draws them), and the same arithmetic every
  step (a scale that depends on the step count, as Adam's bias correction, or on the batch, as the
  token norm, would be frozen: those run eagerly), and shapes that repeat (a sampled softmax's
  sets are padded to multiples of ``output.ROW_BUCKET`` rows, laid out on the host and copied into
  the graph's buffers before its launch, as the dropout masks are drawn there);
- memory that outlives the graph: what the step allocates while captured comes from a pool of the
  graph's own, and the graph holds the model's chunk buffers and the optimizer's scratch.

A key's first step runs eagerly (it compiles the kernels and allocates the buffers); its second is
captured and every later one replayed. Eager and replayed steps run the same kernels with the same
arguments, so they agree to the bit (``tests/test_gpu_step.py``).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

from . import backend

MAX_GRAPHS = 8          # per model, least recently used dropped first


def capturable(model) -> bool:
    """Whether the model's chunks can be captured at all (the recurrent model on CuPy with nvmath-python):
    what an evaluation needs."""
    return backend.graphs_available(model.xp) and hasattr(model, "resets")


def usable(model, optimizer, *, grad_norm: str) -> bool:
    """Whether this call's steps can be replayed from a graph (else they run eagerly)."""
    return capturable(model) and optimizer.same_every_step and grad_norm == "batch"


def _capture(xp, body):
    """Run ``body()`` once under capture on a stream of its own (ordered after the current one); return
    the graph and the memory pool everything ``body`` allocated came from, which must live as long as it."""
    pool = xp.cuda.MemoryPool()
    stream = xp.cuda.Stream(non_blocking=True)
    stream.wait_event(xp.cuda.get_current_stream().record())
    with xp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            body()
        finally:
            graph = stream.end_capture()
    return graph, pool


class StepGraph:
    """One captured step: its input buffers, its outputs, the memory it runs in.

    ``fn(x, y, resets, state)`` runs the step on the graph's input buffers and returns
    ``(loss, norm, count, new_state)``; it is called once, under capture. ``buffers``: the model's
    chunk buffers the step runs in (a step with dropout reads its masks there: draw them into
    these before :meth:`replay`); ``hold``: anything else the graph reads, kept alive with it.
    """

    def __init__(self, xp, fn, x, y, resets, state, buffers, hold=None):
        self.xp, self.buffers, self.hold = xp, buffers, hold
        self.x, self.y = xp.empty(x.shape, x.dtype), xp.empty(y.shape, y.dtype)
        self.keep = None if resets is None else xp.empty_like(resets.keep)
        self.resets = None if resets is None else type(resets)(self.keep, resets.steps)
        self.state = xp.empty_like(state)

        def body():
            loss, norm, count, self.new_state = fn(self.x, self.y, self.resets, self.state)
            self.watch = xp.stack([loss, norm, count])                       # (3,) float64
        self.graph, self.pool = _capture(xp, body)

    def replay(self, x, y, resets, state) -> tuple:
        """Run the step on this batch: returns (its watch (3,): loss, norm, count; the new state), copies."""
        self.x[...] = self.xp.asarray(x)
        self.y[...] = self.xp.asarray(y)
        if resets is not None:
            self.keep[...] = resets.keep
        self.state[...] = state
        self.graph.launch(self.xp.cuda.get_current_stream())
        return self.watch.copy(), self.new_state.copy()


class EvalGraph:
    """One captured evaluation chunk: the forward pass and the loss of a (T, B) chunk, its sum and
    count added into ``acc`` (2,) float64 on the device, which the caller zeroes and reads once.

    ``fn(x, y, state)`` returns ``(loss, count, new_state)`` with the loss and count on the device.
    """

    def __init__(self, xp, fn, x, y, state, acc, buffers):
        self.xp, self.buffers, self.acc = xp, buffers, acc
        self.x, self.y = xp.empty(x.shape, x.dtype), xp.empty(y.shape, y.dtype)
        self.state = xp.empty_like(state)

        def body():
            loss, count, self.new_state = fn(self.x, self.y, self.state)
            xp.add(acc, xp.stack([loss, count]), out=acc)                  # acc += (loss, count)
        self.graph, self.pool = _capture(xp, body)

    def replay(self, x, y, state):
        """Add this chunk's loss and count into ``acc``; return the new state (the graph's buffer:
        valid until the next replay, which may take it as its ``state``)."""
        self.x[...] = self.xp.asarray(x)
        self.y[...] = self.xp.asarray(y)
        self.state[...] = state
        self.graph.launch(self.xp.cuda.get_current_stream())
        return self.new_state


class StepGraphs:
    """The graphs of one model's training steps, by everything a graph freezes."""

    _of = weakref.WeakKeyDictionary()

    def __init__(self):
        self.graphs: OrderedDict = OrderedDict()
        self.seen: set = set()

    @classmethod
    def of(cls, model) -> "StepGraphs":
        if model not in cls._of:
            cls._of[model] = cls()
        return cls._of[model]

    def get(self, key, make):
        """The graph for ``key``; None on the key's first step (run it eagerly), ``make()`` on its second."""
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        if key not in self.seen:
            if len(self.seen) > 1000:      # keys of buffers long gone (a trainer's rounds allocate anew)
                self.seen.clear()
            self.seen.add(key)
            return None
        g = self.graphs[key] = make()
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return g


def step_key(optimizer, params, grads, opt_state, x, y, resets, state, **frozen) -> tuple:
    """What a captured step depends on besides its inputs' values: shapes, reset steps, buffer
    addresses, the optimizer and its hyper-parameters, and ``frozen`` (lr, the scale, the clips)."""
    slots = tuple((k, v.data.ptr) for k, v in sorted(opt_state.items()) if k != "t")
    return (id(optimizer), optimizer.cfg, x.shape, str(x.dtype), str(y.dtype), state.shape,
            None if resets is None else resets.steps, params.data.ptr, params.size, grads.data.ptr, slots,
            tuple(sorted(frozen.items())))
