"""The LSTM's per-step recurrent products on the CPU: what one costs against the batch width.

    python benchmarks/recurrent_gemm.py [--hidden 650] [--batches 1,4,16,20,32,64,128]

Times rnnlm's two recurrent products (:mod:`rnnlm.core.cells`): forward ``Whh (4H, H) @ h (H, B)``
and backward ``WhhT (H, 4H) @ dz (4H, B)``, through NumPy's BLAS on 1 and 2 threads, beside the
floor of reading the weights once (a matrix-vector product, B = 1), the forward product as a batch
of 32-row blocks (``W.reshape(4H / 32, 32, H) @ h``: NumPy loops over the blocks, and OpenBLAS runs
each through its small-matrix kernel, which packs nothing, on one core) and, where PyTorch is installed,
PyTorch's ``h @ W.T`` (its ``nn.LSTM`` layout) at the same B. A product whose time hardly grows
with B is paying for the weights, not for the arithmetic: OpenBLAS packs the whole weight matrix
on every call, and a matrix larger than the cores' L2 caches comes from L3 at every time step.
Prints one line per B and thread count, and the L2 size the OS reports.
"""
from __future__ import annotations

import argparse

import numpy as np

from kernels import time_loop          # benchmarks/kernels.py, beside this script


def per_call(fn, seconds):
    """Seconds per call of ``fn`` after one call to warm it."""
    fn()
    return time_loop(fn, seconds)


def l2_line():
    try:
        from pathlib import Path
        for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (idx / "level").read_text().strip() == "2":
                return f"L2 {(idx / 'size').read_text().strip()} per core"
    except OSError:
        pass
    return "L2 size unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=650)
    ap.add_argument("--batches", default="1,4,16,20,32,64,128")
    ap.add_argument("--seconds", type=float, default=0.5, help="timing per product")
    a = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits
    try:
        import torch
    except ImportError:
        torch = None
    H = a.hidden
    G = 4 * H
    r = np.random.default_rng(0)
    W = r.standard_normal((G, H), dtype=np.float32)                  # (4H, H), as cells.py holds it
    WT = np.ascontiguousarray(W.T)                                   # (H, 4H), its backward copy
    print(f"# weights {W.nbytes / 2 ** 20:.2f} MiB (H = {H}); {l2_line()}")
    for threads in (1, 2):
        with threadpool_limits(threads):
            if torch is not None:
                torch.set_num_threads(threads)
            for B in (int(b) for b in a.batches.split(",")):
                h = r.standard_normal((H, B), dtype=np.float32)
                dz = r.standard_normal((G, B), dtype=np.float32)
                z, dh = np.empty((G, B), np.float32), np.empty((H, B), np.float32)
                fwd = per_call(lambda: np.matmul(W, h, out=z), a.seconds)          # (4H, B)
                bwd = per_call(lambda: np.matmul(WT, dz, out=dh), a.seconds)       # (H, B)
                gf = 2 * G * H * B / 1e9
                line = (f"threads {threads} B {B:4d}  forward {fwd * 1e6:7.1f} us {gf / fwd:6.1f} GFLOP/s"
                        f"  backward {bwd * 1e6:7.1f} us {gf / bwd:6.1f} GFLOP/s")
                if G % 32 == 0:
                    Wb, zb = W.reshape(G // 32, 32, H), z.reshape(G // 32, 32, B)
                    fb = per_call(lambda: np.matmul(Wb, h, out=zb), a.seconds)      # (4H / 32, 32, B)
                    line += f"  forward in 32-row blocks {fb * 1e6:7.1f} us {gf / fb:6.1f} GFLOP/s"
                if torch is not None:
                    th, tw = torch.from_numpy(np.ascontiguousarray(h.T)), torch.from_numpy(W)
                    out = torch.empty((B, G))
                    tt = per_call(lambda: torch.mm(th, tw.t(), out=out), a.seconds)  # (B, 4H)
                    line += f"  torch h @ W.T {tt * 1e6:7.1f} us {gf / tt:6.1f} GFLOP/s"
                print(line, flush=True)


if __name__ == "__main__":
    main()
