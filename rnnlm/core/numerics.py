"""What fixes the bits of this process's NumPy arithmetic besides its inputs: the BLAS (the library,
the kernels it picked, its threads) and NumPy's own SIMD code for exp, tanh and log.

OpenBLAS picks its kernels by CPU when it loads (``OPENBLAS_CORETYPE`` overrides that) and splits a
product differently on one thread and on two, so the same round on ``spark.task.cpus = 1`` and ``2``
ends in other numbers; NumPy's float32 exp, tanh and log give other bits on a CPU without AVX2 (or
under ``NPY_DISABLE_CPU_FEATURES``) than with it. A Spark run records this per partition and a resume
onto other arithmetic says so (``docs/cluster.md``).

The BLAS is read as threadpoolctl reads it, without it: the loaded library found in
``/proc/self/maps`` (Linux), asked through ctypes for its configuration, kernels and threads.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

# OpenBLAS's own symbols, and those of the copy NumPy's wheels bundle (scipy-openblas, 64-bit ints)
_PREFIXES = (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "64_"), ("openblas_", ""))


def _loaded_openblas() -> str | None:
    """The path of the OpenBLAS this process has loaded, or None (another BLAS, or not Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if "openblas" in line.lower()}
    except OSError:
        return None
    paths = sorted(p for p in paths if os.path.basename(p).startswith("lib") and ".so" in p)
    return paths[0] if paths else None


def _call(lib, name: str, restype):
    for prefix, suffix in _PREFIXES:
        fn = getattr(lib, f"{prefix}{name}{suffix}", None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, []
            return fn()
    return None


def describe() -> str:
    """``openblas 0.3.31 Haswell x2, numpy 2.4.6 X86_V4``: :func:`blas` and :func:`simd`."""
    return f"{blas()}, numpy {np.__version__} {simd()}"


def simd() -> str:
    """The SIMD targets NumPy's float32 exp, tanh and log run here (``X86_V4``; ``baseline(X86_V2)``
    where the CPU lacks AVX2), ``?`` where NumPy cannot say (before 2.0)."""
    try:
        from numpy.lib.introspect import opt_func_info
        info = opt_func_info(func_name="^(exp|tanh|log)$", signature="float32")
        targets = sorted({sig["current"] for fn in info.values() for sig in fn.values()})
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return "?"
    return "/".join(t.replace(" ", "") for t in targets) or "?"


def blas() -> str:
    """``openblas 0.3.31 Haswell x2``: the library, its version, the kernels it runs and its threads;
    for another BLAS what NumPy was built with and ``x?`` (its threads unknown)."""
    path = _loaded_openblas()
    if path is not None:
        try:
            lib = ctypes.CDLL(path)
            config = (_call(lib, "get_config", ctypes.c_char_p) or b"").decode("ascii", "replace").split()
            core = (_call(lib, "get_corename", ctypes.c_char_p) or b"?").decode("ascii", "replace")
            threads = _call(lib, "get_num_threads", ctypes.c_int)
        except OSError:
            config, core, threads = [], "?", None
        version = config[1] if len(config) > 1 and config[0] == "OpenBLAS" else "?"
        if threads is not None:
            return f"openblas {version} {core} x{threads}"
    try:
        built = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{built.get('name', '?')} {built.get('version', '?')} x?"
    except (KeyError, TypeError, ValueError):
        return "unknown BLAS"
