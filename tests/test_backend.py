"""Array helpers of rnnlm.core.backend."""
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from rnnlm.core import backend


@pytest.mark.parametrize("shape", [(5, 7, 3), (1, 4, 32), (6, 1, 1)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_swap01_swaps_the_leading_axes(xp, shape, dtype):
    A, J, C = shape
    src = np.arange(A * J * C, dtype=dtype).reshape(J, A, C) * 1.5 - 7
    dst = xp.full((A, J, C), np.nan, dtype=dtype)
    backend.swap01(dst, xp.asarray(src))
    got = backend.to_numpy(dst)
    for i, j in itertools.product(range(A), range(J)):
        assert list(got[i, j]) == list(src[j, i])


def test_swap01_of_a_strided_source_or_destination():
    src = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    dst = np.zeros((6, 2, 8), dtype=np.float32)
    backend.swap01(dst[:, :, ::2], src)               # neither a contiguous destination...
    assert np.array_equal(dst[:, :, ::2], np.moveaxis(src, 0, 1))
    assert not dst[:, :, 1::2].any()                  # ...nor a write outside it
    out = np.zeros((6, 2, 2), dtype=np.float32)
    backend.swap01(out, src[:, :, 1:3])               # nor a contiguous source
    assert np.array_equal(out, np.moveaxis(src[:, :, 1:3], 0, 1))


@pytest.mark.parametrize("R,C", [(24, 16), (2048, 512), (5, 3)])
def test_transpose_into(xp, R, C):
    src = np.arange(R * C, dtype=np.float32).reshape(R, C) - 100
    dst = xp.zeros((C, R), dtype=np.float32)
    backend.transpose_into(dst, xp.asarray(src), backend.transpose_panels(xp, R, C, np.float32))
    got = backend.to_numpy(dst)
    for r, c in [(0, 0), (R - 1, C - 1), (R // 2, C // 3), (1, C - 1), (R - 1, 0)]:
        assert got[c, r] == src[r, c]
    assert np.array_equal(got, src.T)


def test_transpose_panels_only_where_the_shape_allows():
    assert backend.transpose_panels(np, 24, 16, np.float32).shape == (2, 24, 8)
    assert backend.transpose_panels(np, 24, 12, np.float32) is None


def test_swap01_refuses_shapes_that_do_not_match():
    with pytest.raises(ValueError, match="does not match"):
        backend.swap01(np.zeros((2, 3, 4)), np.zeros((3, 4, 2)))


def test_transpose_into_from_a_strided_source():
    big = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    src = big[:, ::2]                                   # (16, 12), not contiguous
    dst = np.zeros((12, 16), dtype=np.float32)
    backend.transpose_into(dst, src, backend.transpose_panels(np, 16, 12, np.float32))
    assert np.array_equal(dst, src.T)
    src = big[::2, :16]                                 # (8, 16): the panel path
    dst = np.zeros((16, 8), dtype=np.float32)
    backend.transpose_into(dst, src, backend.transpose_panels(np, 8, 16, np.float32))
    assert np.array_equal(dst, src.T)


@pytest.mark.parametrize("V,block", [(40, 1 << 25), (40, 40 * 7), (3000, 3000 * 64)])
def test_scatter_add_rows_sums_duplicates_in_blocks(xp, monkeypatch, V, block):
    """dst[idx[n]] += src[n] with repeated ids, the one-hot product over blocks of columns (7 and 64
    wide here) where it applies; the same bits on a second run (no atomics)."""
    monkeypatch.setattr(backend, "ONE_HOT_BLOCK", block)
    rng = np.random.default_rng(0)
    N, W = 300, 5
    idx = (rng.zipf(1.5, N) % V).astype(np.int32)
    src = rng.normal(size=(N, W))
    start = rng.normal(size=(V, W))
    want = start.copy()
    np.add.at(want, idx, src)
    got = []
    for _ in range(2):
        dst = xp.array(start)                              # a copy: NumPy would alias start
        backend.scatter_add_rows(dst, xp.asarray(idx), xp.asarray(src))
        got.append(backend.to_numpy(dst))
    assert np.allclose(got[0], want, rtol=0, atol=1e-12)
    assert np.array_equal(got[0], got[1])


def test_swap01_converts_between_dtypes():
    src = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 3     # not exact in float32
    dst = np.zeros((3, 2, 4), dtype=np.float64)
    backend.swap01(dst, src)              # rows of 16 and 32 bytes: no copy of raw rows can do this
    assert np.array_equal(dst, np.moveaxis(src, 0, 1).astype(np.float64))


class _Runtime:
    """What gpu_available asks of CuPy: its CUDA runtime's device count (a number, or an error)."""

    def __init__(self, count):
        self.count = count

    def getDeviceCount(self):
        if isinstance(self.count, Exception):
            raise self.count
        return self.count


@pytest.mark.parametrize("count,usable", [(0, False), (1, True), (2, True), (RuntimeError("no driver"), False)])
def test_gpu_available_counts_devices_and_survives_a_failing_runtime(monkeypatch, count, usable):
    import types
    runtime = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_Runtime(count)))
    monkeypatch.setattr(backend, "_cupy", runtime)
    assert backend.gpu_available() is usable
    monkeypatch.setattr(backend, "_cupy", None)                 # CuPy not installed
    assert backend.gpu_available() is False


def test_get_xp_without_a_gpu(monkeypatch):
    monkeypatch.setattr(backend, "_cupy", None)
    assert backend.get_xp("cpu") is np and backend.get_xp("auto") is np and backend.get_xp() is np
    with pytest.raises(RuntimeError, match="not available"):
        backend.get_xp("gpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        backend.get_xp("tpu")


def test_rng_for_draws_one_stream_per_seed_and_keys():
    """Each (seed, round, partition, purpose) its own stream, and the same one again for a retry."""
    draw = lambda *key: backend.rng_for(np, *key).random(4).tolist()           # noqa: E731
    streams = [draw(1234), draw(1234, 1, 0), draw(1234, 2, 0), draw(1234, 1, 1), draw(1234, 0, 1), draw(1235, 1, 0)]
    assert len({tuple(s) for s in streams}) == len(streams)
    assert draw(1234, 1, 0) == streams[1]


ARITHMETIC = """
import hashlib
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
from rnnlm.core import backend
blas = [i for i in threadpool_info() if i["user_api"] == "blas"][0]
print(backend.arithmetic(np))
print(f"{blas['internal_api']} {blas['version']} {blas['architecture']} x{blas['num_threads']}")
with threadpool_limits(1):
    print(backend.arithmetic(np))
x = np.linspace(-30, 30, 100_003, dtype=np.float32)
print(hashlib.md5(np.tanh(x).tobytes() + np.exp(x).tobytes() + np.log(np.abs(x) + 1).tobytes()).hexdigest())
"""


def arithmetic_in(**env):
    r = subprocess.run([sys.executable, "-c", ARITHMETIC], env=dict(os.environ, PYTHONPATH=ROOT, **env),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


@pytest.mark.parametrize("core, threads", [("Haswell", "2"), ("Sandybridge", "1")])
def test_arithmetic_names_the_blas_its_kernels_and_threads_as_threadpoolctl_reads_them(core, threads):
    """What a partition's numbers rest on besides the seed (``spark.task.cpus`` 1 and 2 end a PTB round in other
    parameters), read from the loaded OpenBLAS without threadpoolctl, and live: a limit set later shows."""
    ours, theirs, limited, _ = arithmetic_in(OPENBLAS_CORETYPE=core, OPENBLAS_NUM_THREADS=threads)
    blas, numpy = ours.split(", numpy ")
    assert blas.lower() == theirs.lower() and blas.endswith(f" {core} x{threads}"), ours
    assert numpy.startswith(np.__version__ + " ") and limited == f"{blas[:-len(threads)]}1, numpy {numpy}", ours


def test_arithmetic_tells_numpys_simd_code_apart_where_its_bits_differ():
    """NumPy's float32 tanh, exp and log give other bits without AVX2 (a CPU that lacks it, or NumPy told not to
    use it): executors of that kind compute other numbers with the same BLAS."""
    label, _, _, bits = arithmetic_in()
    label_v2, _, _, bits_v2 = arithmetic_in(NPY_DISABLE_CPU_FEATURES="X86_V3,X86_V4,AVX512_ICL,AVX512_SPR")
    if label.endswith("baseline(X86_V2)"):
        pytest.skip("this CPU runs NumPy's baseline code already")
    assert bits != bits_v2, "NumPy's SIMD code and its baseline agreed: this test cannot tell"
    assert label_v2.split(", numpy ")[0] == label.split(", numpy ")[0] and label_v2 != label, (label, label_v2)
