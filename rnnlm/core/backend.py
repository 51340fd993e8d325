"""Array backend: the one place that chooses NumPy or CuPy.

Every numerical module asks this module for ``xp``; nothing else imports CuPy.

Shape glossary (used in ``# (...)`` comments throughout the package)::

    T  time steps of one truncated-BPTT chunk
    B  parallel streams (batch rows)
    N  T * B, all positions of a chunk
    E  embedding width (the one-hot input width V when ``embed == 0``)
    H  hidden width
    G  gates per cell: 4 for the LSTM (i, f, o, g), 1 for the tanh RNN
    L  stacked layers
    V  vocabulary size
    P  total number of parameters (the flat buffer)
"""
from __future__ import annotations

import numpy as np

from . import gemm, numerics

try:  # CuPy is optional: the gpu extra installs it.
    import cupy as _cupy
except Exception:  # ImportError, or a CUDA runtime that fails to load
    _cupy = None


def gpu_available() -> bool:
    """Return True when CuPy imports and sees at least one CUDA device."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get_xp(device: str = "cpu"):
    """Return the array module for ``device``.

    Parameters
    ----------
    device : {"cpu", "gpu", "auto"}
        ``"auto"`` picks the GPU when one is usable, else NumPy.
    """
    if device == "cpu":
        return np
    if device == "auto":
        return _cupy if gpu_available() else np
    if device == "gpu":
        if not gpu_available():
            raise RuntimeError("device='gpu' but CuPy or a CUDA device is not available")
        return _cupy
    raise ValueError(f"unknown device {device!r}: expected cpu, gpu or auto")


def matmul(a, b, out=None):
    """``a @ b`` into ``out`` for 2-d (or matrix-vector) operands: ``numpy.matmul`` on NumPy; on
    CuPy, cuBLAS through :mod:`rnnlm.core.gemm` where nvmath-python is installed (a CUDA graph
    can capture it), else ``cupy.matmul``."""
    xp = xp_of(a)
    if xp is np or not gemm.available():
        return xp.matmul(a, b, out=out)
    return gemm.matmul(xp, a, b, out)


_sumsq_kernel = None      # CuPy's reduction kernel, compiled on first use


def sumsq(a):
    """``sum(a * a)`` of a flat array as a 0-d float64 array on its device: BLAS ``dot`` on NumPy, again over
    ``a`` scaled by its largest magnitude where finite float32 squares overflow (a gradient of 1e20 is
    clipped, as on CuPy, not read as an infinite norm; inf or NaN stays so); on CuPy one reduction kernel
    that accumulates in float64 (cuBLAS's ``dot`` cannot be captured)."""
    xp = xp_of(a)
    if xp is np:
        with np.errstate(over="ignore", invalid="ignore"):
            d = np.dot(a, a).astype(np.float64)
            if not np.isfinite(d) and a.size:
                top = np.float64(np.abs(a).max())
                if np.isfinite(top):                                 # no inf or NaN: the squares overflowed
                    scaled = a / a.dtype.type(top)                      # |values| <= 1
                    d = np.dot(scaled, scaled).astype(np.float64) * top * top
        return d
    global _sumsq_kernel
    if _sumsq_kernel is None:
        _sumsq_kernel = xp.ReductionKernel("T x", "float64 y", "(double)x * (double)x", "a + b", "y = a", "0",
                                           "rnnlm_sumsq")
    return _sumsq_kernel(a)


def graphs_available(xp) -> bool:
    """Whether a training step on ``xp`` can be captured as a CUDA graph (CuPy with nvmath-python)."""
    return xp is not np and gemm.available()


def use_gpu(index: int) -> None:
    """Make CUDA device ``index`` current (what Spark's TaskContext assigned)."""
    if _cupy is None:
        raise RuntimeError("CuPy is not installed")
    _cupy.cuda.Device(int(index)).use()


def arithmetic(xp) -> str:
    """What fixes a step's bits on ``xp`` beside the seed and the configuration: on NumPy the BLAS with its
    kernels and threads and NumPy's SIMD code (:func:`numerics.describe`, ``openblas 0.3.31 Haswell x1,
    numpy 2.4.6 X86_V4``); on CuPy the GPU's model and the CUDA and CuPy versions (cuBLAS is bitwise
    reproducible for one GPU model and toolkit)."""
    if xp is np:
        return numerics.describe()
    try:
        props = _cupy.cuda.runtime.getDeviceProperties(_cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return f"{name} cuda {_cupy.cuda.runtime.runtimeGetVersion()} cupy {_cupy.__version__}"
    except Exception:                    # a label: never worth a task's failure
        return f"cuda cupy {getattr(_cupy, '__version__', '?')}"


def xp_of(a):
    """The array module that owns ``a``."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy
    return np


def to_numpy(a) -> np.ndarray:
    """Copy ``a`` to host memory (no copy for NumPy arrays)."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy.asnumpy(a)
    return np.asarray(a)


def rng_for(xp, seed: int, *keys: int):
    """A generator of ``xp`` seeded by ``(seed, *keys)``.

    One seed and a tuple of integer keys (round, partition, purpose...) name an
    independent, reproducible stream, so a retried task draws the same numbers.
    """
    entropy = [int(seed)] + [int(k) for k in keys]
    if xp is np:
        return np.random.default_rng(np.random.SeedSequence(entropy))
    ss = np.random.SeedSequence(entropy)
    return xp.random.default_rng(int(ss.generate_state(1, np.uint64)[0] >> np.uint64(1)))


ONE_HOT_MAX_V = 1024   # up to this many rows a one-hot product beats scattering rows (the embedding gradient)
ONE_HOT_INPUT_MAX_V = 80   # up to this many, NumPy builds one-hot input as a product (model._onehot_steps)


def onehot_input_product(xp, V: int) -> bool:
    """Whether one-hot input over ``V`` symbols is built as a product rather than gathered:
    on NumPy for a small vocabulary only (the product's cost grows with V; CuPy gathers)."""
    return xp is np and V <= ONE_HOT_INPUT_MAX_V


def gather_columns(xp, table, idx, out):
    """``out[:, n] = table[idx[n]]``: rows of ``table`` (V, W) as columns of ``out`` (W, N).

    A strided transpose of the gathered rows is slow, so a small table is
    transposed first and gathered along its columns instead.
    """
    if table.shape[0] <= out.shape[1]:
        xp.take(xp.ascontiguousarray(table.T), idx, axis=1, out=out)    # via (W, V)
    else:
        out[...] = xp.take(table, idx, axis=0).T


ONE_HOT_BLOCK = 1 << 25   # elements of one block of a one-hot scatter matrix (128 MiB of float32)


def scatter_add_rows(dst, idx, src) -> None:
    """``dst[idx[n]] += src[n]`` for every row n, duplicates summed in the same order every run.

    ``dst`` (V, W), ``idx`` (N,), ``src`` (N, W). A one-hot product (V, n) @ (n, W), over blocks
    of at most ``ONE_HOT_BLOCK`` elements: exact up to the order of its sums, which a GEMM keeps
    from run to run (cuBLAS is reproducible on one GPU model; ``cupyx.scatter_add``'s float atomics
    are not). NumPy does a large V (over ``ONE_HOT_MAX_V``) by sort + reduceat instead (``np.add.at``
    is slow on rows).
    """
    xp = xp_of(dst)
    V, N = dst.shape[0], idx.shape[0]
    if row_sums(xp, V):
        rows, sums = sum_rows(idx, src)
        dst[rows] += sums
        return
    n = max(1, min(N, ONE_HOT_BLOCK // V))
    for a in range(0, N, n):
        m = min(n, N - a)
        onehot = xp.zeros((V, m), dtype=dst.dtype)                     # (V, m)
        onehot[idx[a:a + m], xp.arange(m)] = 1
        dst += matmul(onehot, src[a:a + m])


def row_sums(xp, V: int) -> bool:
    """Whether :func:`scatter_add_rows` into ``V`` rows goes through :func:`sum_rows` (NumPy, large V)."""
    return xp is np and V > ONE_HOT_MAX_V


def sum_rows(idx, src) -> tuple:
    """``(rows, sums)``: the distinct ids of ``idx`` (N,), sorted, and for each the sum of the rows
    of ``src`` (N, W) at its positions, added in the same order every run (a stable sort, then
    ``reduceat``). NumPy only: the row-sparse gradient of a table (:class:`rnnlm.core.layout.RowGrad`)."""
    order = np.argsort(idx, kind="stable")
    rows, starts = np.unique(idx[order], return_index=True)
    return rows, np.add.reduceat(src[order], starts, axis=0)                  # (n,), (n, W)


def swap01(dst, src) -> None:
    """``dst[i, j, :] = src[j, i, :]``: swap the two leading axes of a 3-d array into ``dst``.

    NumPy copies element by element along the short last axis (B, a few dozen), paying
    its inner-loop overhead once per row; viewing each row as one opaque item makes it
    a plain strided copy of whole rows, ~3x faster here. CuPy transposes on the device.
    """
    A, J, C = dst.shape
    if src.shape != (J, A, C):
        raise ValueError(f"swap01: source {src.shape} does not match destination {dst.shape} with its axes swapped")
    xp = xp_of(dst)
    if xp is np and dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype:
        row = np.dtype((np.void, dst.shape[2] * dst.itemsize))
        d = dst.reshape(dst.shape[0], -1).view(row)                  # (A, J) rows
        s = src.reshape(src.shape[0], -1).view(row)                  # (J, A) rows
        np.copyto(d, s.T)
        return
    xp.copyto(dst, src.transpose(1, 0, 2))


def transpose_panels(xp, R: int, C: int, dtype, b: int = 8):
    """Scratch for :func:`transpose_into` of an (R, C) matrix, or None where it has no use."""
    return np.empty((C // b, R, b), dtype=dtype) if (xp is np and C % b == 0) else None


def transpose_into(dst, src, panels=None) -> None:
    """``dst = src.T`` for a 2-d ``src`` (R, C) into a contiguous ``dst`` (C, R).

    NumPy copies a transposed view one strided element at a time (~2.6 ns each
    here); with ``panels``, a scratch (C // b, R, b) array, it first moves b-wide
    row pieces as whole items (:func:`swap01`), then transposes each (R, b) panel,
    which stays in cache: ~5x faster for a 2048 x 512 matrix.
    """
    xp = xp_of(dst)
    if xp is not np or panels is None:
        xp.copyto(dst, src.T)
        return
    n, R, b = panels.shape
    swap01(panels, src.reshape(R, n, b))                             # (C / b, R, b); a strided src is copied
    np.copyto(dst.reshape(n, b, R), panels.transpose(0, 2, 1))


def device_key(xp) -> str:
    """Names the device ``xp`` computes on now (``"numpy"`` or ``"cupy:<index>"``): objects
    holding device buffers are only reusable on the device that allocated them."""
    if xp is np:
        return "numpy"
    return f"cupy:{xp.cuda.Device().id}"
