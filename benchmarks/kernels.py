"""Tokens/s of one full training step (forward, backward, clipped SGD update),
rnnlm (NumPy) next to PyTorch CPU on identical models, shapes and thread count.

    python benchmarks/kernels.py [--threads N] [--seconds S] [--shapes a,b]
    python benchmarks/kernels.py --device gpu --batch 128   # CuPy vs PyTorch CUDA

Prints one line per shape and, last, ``min_ratio_vs_torch=<number>``.
Character models take one-hot inputs in both (PyTorch: an LSTM whose input
width is V, fed ``one_hot(x)``), so parameters and FLOPs are identical.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SHAPES = {  # name: (cell, V, E, H, layers, T, B)
    "ptb-small": ("lstm", 10000, 200, 200, 2, 20, 20),
    "ptb-medium": ("lstm", 10000, 650, 650, 2, 35, 20),
    "char-rnn": ("rnn", 65, 0, 128, 1, 25, 32),
    "char-lstm": ("lstm", 65, 0, 512, 2, 64, 32),
}


def step_flops(cell, V, E, H, layers, T, B):
    """Matrix-multiply FLOPs of one step (forward + backward = 3x forward)."""
    G = 4 if cell == "lstm" else 1
    N = T * B
    f = 2 * N * H * V                                   # output projection
    for layer in range(layers):
        fan_in = (E if E else 0) if layer == 0 else H   # one-hot input is a gather
        f += 2 * N * fan_in * G * H + 2 * N * H * G * H
    return 3 * f


def matmul_gflops(xp, seconds=2.0, windows=5, sync=lambda: None):
    """Best float32 GEMM rate (1024^3) over several windows: the machine's usable peak."""
    import numpy as np
    n = 1024
    a = xp.asarray(np.random.default_rng(0).random((n, n), dtype=np.float32))
    b, c = a.copy(), a.copy()
    xp.matmul(a, b, out=c)
    best = 0.0
    for _ in range(windows):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / windows:
            xp.matmul(a, b, out=c)
            reps += 1
        sync()
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def time_loop(fn, seconds, sync=lambda: None):
    """Mean seconds per call over a window of at least ``seconds`` (and 3 calls)."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        fn()
        n += 1
    sync()
    return (time.perf_counter() - t0) / n


def interleaved(fns, seconds, rounds, sync):
    """Median seconds per call of each function, timed in alternating windows.

    This machine's speed drifts by tens of percent over minutes; alternating
    the libraries window by window exposes both to the same drift.
    """
    for fn in fns:               # warm-up: buffers, caches, lazy init
        fn()
        fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            times[k].append(time_loop(fn, seconds / rounds, sync))
    return [statistics.median(ts) for ts in times]


def make_rnnlm_step(xp, shape, B):
    import numpy as np

    from rnnlm.config import ModelConfig, OptimConfig
    from rnnlm.core.local import train_steps
    from rnnlm.core.strategies import Batch
    from rnnlm.core.model import RNNLM
    from rnnlm.core.optim import make_optimizer
    cell, V, E, H, L, T, _ = shape
    m = RNNLM(ModelConfig(cell=cell, vocab_size=V, embed=E, hidden=H, layers=L), xp=xp)
    opt = make_optimizer(OptimConfig(name="sgd", clip_norm=5.0))
    p = m.init_params(0)
    st = opt.init_state(p)
    r = np.random.default_rng(0)
    b = Batch(xp.asarray(r.integers(0, V, (T, B)).astype(np.int32)),
              xp.asarray(r.integers(0, V, (T, B)).astype(np.int32)))
    grads = xp.empty_like(p)
    state = [m.zero_state(B)]

    def step():
        res = train_steps(m, opt, p, st, [b], state[0], lr=0.1, clip_norm=5.0, grads=grads)
        state[0] = res.state
    return step


def make_torch_step(torch, shape, B, device):
    cell, V, E, H, L, T, _ = shape
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, E) if E else None
            rnn = nn.LSTM if cell == "lstm" else nn.RNN
            self.rnn = rnn(E or V, H, L)
            self.out = nn.Linear(H, V)

        def forward(self, x, state):
            inp = self.emb(x) if self.emb is not None else nn.functional.one_hot(x, V).float()
            h, state = self.rnn(inp, state)
            return self.out(h).view(-1, V), state

    net = Net().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randint(0, V, (T, B), device=device)
    y = torch.randint(0, V, (T * B,), device=device)
    z = torch.zeros(L, B, H, device=device)
    state = [(z, z.clone()) if cell == "lstm" else z]
    lossf = nn.CrossEntropyLoss(reduction="sum")

    def step():
        st = state[0]
        st = tuple(s.detach() for s in st) if cell == "lstm" else st.detach()
        opt.zero_grad(set_to_none=False)
        logits, st = net(x, st)
        loss = lossf(logits, y) / B
        loss.backward()
        nn.utils.clip_grad_norm_(net.parameters(), 5.0)
        opt.step()
        state[0] = st
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seconds", type=float, default=6.0, help="timing per shape and library")
    ap.add_argument("--rounds", type=int, default=3, help="alternating windows per shape")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--batch", type=int, default=0, help="override B for every shape")
    a = ap.parse_args(argv)
    os.environ["OPENBLAS_NUM_THREADS"] = str(a.threads)   # before NumPy loads OpenBLAS
    import torch

    from rnnlm.core import backend
    torch.set_num_threads(a.threads)
    xp = backend.get_xp(a.device)
    tdev = "cuda" if a.device == "gpu" else "cpu"

    def sync():
        if a.device == "gpu":
            xp.cuda.Device().synchronize()
            torch.cuda.synchronize()
    peak = matmul_gflops(xp, sync=sync)
    print(f"# device={a.device} xp={xp.__name__} threads={a.threads} numpy={xp.__version__} torch={torch.__version__}")
    print(f"# measured float32 matmul (1024^3): {peak:.1f} GFLOP/s")
    ratios = []
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        B = a.batch or shape[6]
        toks = shape[5] * B
        fns = [make_rnnlm_step(xp, shape, B), make_torch_step(torch, shape, B, tdev)]
        t_r, t_t = interleaved(fns, a.seconds, a.rounds, sync)
        gf = step_flops(*shape[:6], B) / t_r / 1e9
        ratio = t_t / t_r
        ratios.append(ratio)
        print(f"{name:11s} T={shape[5]:<3d} B={B:<4d} rnnlm {toks / t_r:9.0f} tok/s  torch {toks / t_t:9.0f} tok/s  "
              f"ratio {ratio:5.2f}  rnnlm {gf:6.1f} GFLOP/s = {100 * gf / peak:4.1f}% of matmul peak", flush=True)
    print(f"min_ratio_vs_torch={min(ratios):.3f}")


if __name__ == "__main__":
    sys.exit(main())
