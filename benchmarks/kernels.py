"""Tokens/s of one full training step (forward, backward, clipped SGD update),
rnnlm (NumPy) next to PyTorch CPU on identical models, shapes and thread count.

    python benchmarks/kernels.py [--threads N] [--seconds S] [--shapes a,b]
    python benchmarks/kernels.py --device gpu --batch 128   # CuPy vs PyTorch CUDA
    python benchmarks/kernels.py --sampled 0.05             # full vs sampled softmax
    python benchmarks/kernels.py --profile --shapes char-lstm   # where rnnlm's step spends its time, its products
    python benchmarks/kernels.py --torch-onednn off         # against PyTorch's LSTM without oneDNN
    python benchmarks/kernels.py --heap default             # glibc's malloc as it starts (see steady_heap)

Prints one line per shape and, last, ``min_ratio_vs_torch=<number>``.
Character models take one-hot inputs in both (PyTorch: an LSTM whose input
width is V, fed ``one_hot(x)``), so parameters and FLOPs are identical.

``--sampled MU`` instead times rnnlm's full training step against the same step
with the sampled softmax (no PyTorch), both variants (:mod:`rnnlm.core.sampled`:
the corrected one and the paper's literal one), on the word shapes, over real PTB
batches (frequency-rank ids; synthetic Zipf targets when the file is missing).
Each step's sets (and the corrected variant's inclusion probabilities, from the
batches' words, :func:`rnnlm.core.sampled.presence`) are built as the trainer would, inside the timed step:
v_all = the batch's targets, the top 1% ids and a random 1% (beta), and
v_f = v_all plus a random MU of the vocabulary. Prints one line per shape (with the
host's time building the sets, a share of the step), a second line with the ceiling:
the full step over a vocabulary of |v_f| words and of |v_all| words (the same GEMMs as the
sampled step's, with no sets, gathers or scatters; :func:`vocab_of`), and, last,
``max_sampled_speedup=<number>`` (the |v_all| ceiling: no sampled step with these sets can
beat it) and ``min_sampled_speedup=<number>`` (the corrected variant's).
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


def blas_line():
    """Which BLAS NumPy runs and with which kernels (threadpoolctl), and the variables that force them.

    OpenBLAS picks its kernels by CPU when it loads; ``OPENBLAS_CORETYPE`` overrides that
    (this project's machines set it to ``Haswell``, AVX2, where an old OpenBLAS misbehaved).
    """
    try:
        from threadpoolctl import threadpool_info
        libs = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} x{i.get('num_threads')}"
                for i in threadpool_info() if i.get("user_api") == "blas"]
    except ImportError:
        libs = ["(threadpoolctl not installed)"]
    forced = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    return f"# numpy blas: {', '.join(libs) or 'none found'}; forced: {forced or 'nothing'}"


def steady_heap() -> str:
    """Fix glibc's malloc in its steady state for both libraries, from the start of the process.

    By default glibc serves blocks over 128 KiB by mmap and returns a freed heap top of over 128 KiB
    to the system, until freeing a large mmapped block raises the mmap threshold to its size (up to
    32 MiB) and the trim threshold to twice that. PyTorch's autograd allocates and frees blocks of
    MiBs every step, so until then it page-faults fresh zeroed memory every step, and its speed
    depended on what had run before it in the process: char-lstm alone 11.7-12.5k tok/s, after the
    word shapes (whose frees raise the thresholds) 14.9-17.5k. rnnlm preallocates and did not change.
    Returns the header line saying what was set.
    """
    import ctypes
    import ctypes.util
    settings = {"M_MMAP_THRESHOLD": (-3, 32 << 20), "M_TRIM_THRESHOLD": (-1, 1 << 30), "M_TOP_PAD": (-2, 256 << 20)}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        done = [k for k, (param, value) in settings.items() if libc.mallopt(param, value) == 1]
    except (OSError, AttributeError):        # not glibc
        done = []
    return "# heap: " + (", ".join(f"{k}={settings[k][1] >> 20} MiB" for k in done) or "as the C library sets it")


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


def make_rnnlm_step(xp, shape, B, per_call=1, cuda_graphs=True):
    """rnnlm's training step as a function of no arguments running ``per_call`` steps (one
    ``train_steps`` call: one read from the device, as a trainer's K local steps make)."""
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
        res = train_steps(m, opt, p, st, [b] * per_call, state[0], lr=0.1, clip_norm=5.0, grads=grads,
                          cuda_graphs=cuda_graphs)
        state[0] = res.state
    return step


PTB_TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "ptb.train.txt")


def sampled_batches(shape, B, count=64, seed=0):
    """``count`` consecutive (T, B) batches of frequency-rank ids, and where they came from.

    PTB's training text as the trainer streams it when the file is there, otherwise
    targets drawn from a Zipf law (``zipf(1.1)`` ranks, clipped to V - 1).
    """
    import numpy as np

    from rnnlm.core.strategies import Batch, StreamBlock
    from rnnlm.core.vocab import Vocab
    V, T = shape[1], shape[5]
    if os.path.exists(PTB_TRAIN):
        text = open(PTB_TRAIN, encoding="utf-8").read()
        vocab = Vocab.build(text, "word", max_size=V)
        block = StreamBlock(vocab.encode(text), B, T)
        return [block.batch(k) for k in range(count)], f"ptb.train.txt (|vocab|={len(vocab)})"
    r = np.random.default_rng(seed)
    ids = (np.minimum(r.zipf(1.1, count * T * B + 1), V) - 1).astype(np.int32)
    out = []
    for k in range(count):
        a = ids[k * T * B:(k + 1) * T * B + 1]
        out.append(Batch(a[:-1].reshape(T, B), a[1:].reshape(T, B)))
    return out, "synthetic zipf(1.1) ranks"


def make_rnnlm_loop(xp, shape, B, batches, mu=None, seed=0, variant="corrected", per_call=1, ahead=False):
    """``per_call`` training steps per call (one ``train_steps`` call) over ``batches`` in turn; with
    ``mu``, the sampled softmax (``variant``: corrected or literal); ``ahead``: each batch's sets
    built once, before the steps (the step's wall time without the host building them).

    Returns the step and a list that collects (|v_all|, |v_f|, seconds building them on the host)
    of every sampled step.
    """
    import math

    import numpy as np

    from rnnlm.config import ModelConfig, OptimConfig
    from rnnlm.core.local import train_steps
    from rnnlm.core.model import RNNLM
    from rnnlm.core.optim import make_optimizer
    from rnnlm.core.sampled import Sets, corrected_sets, presence, softmax_sets
    cell, V, E, H, L, T, _ = shape
    m = RNNLM(ModelConfig(cell=cell, vocab_size=V, embed=E, hidden=H, layers=L), xp=xp)
    opt = make_optimizer(OptimConfig(name="sgd", clip_norm=5.0))
    p = m.init_params(0)
    st = opt.init_state(p)
    grads = xp.empty_like(p)
    state = [m.zero_state(B)]
    r = np.random.default_rng(seed)
    one = math.ceil(0.01 * V)
    betas = [np.sort(r.choice(V, one, replace=False)) for _ in batches]   # the exchange's random rows
    sizes, k = [], [0]
    freq = presence(np.concatenate([b.y.T.ravel() for b in batches]), T, V)

    def sets(i, y):
        t0 = time.perf_counter()
        beta = betas[(k[0] + i) % len(betas)]
        if variant == "corrected":
            s = corrected_sets(y, V, one, beta, mu, r, freq)
        else:
            s = Sets(*softmax_sets(y, V, one, beta, mu, r))
        sizes.append((len(s.v_all), len(s.v_f), time.perf_counter() - t0))
        return s
    built = [sets(j, b.y) for j, b in enumerate(batches)] if ahead else None

    def sets_ahead(i, y):
        return built[(k[0] + i) % len(batches)]

    def step():                 # host batches, as the trainer's: train_steps copies them to the device
        run = [batches[(k[0] + j) % len(batches)] for j in range(per_call)]
        res = train_steps(m, opt, p, st, run, state[0], lr=0.1, clip_norm=5.0, grads=grads,
                          softmax_sets=None if mu is None else sets_ahead if ahead else sets)
        state[0] = res.state
        k[0] += per_call
    return step, sizes


def sampled_main(a, xp, sync):
    """Full against sampled softmax training steps on the word shapes (``--sampled MU``)."""
    import numpy as np
    peak = matmul_gflops(xp, sync=sync)
    print(f"# device={a.device} xp={xp.__name__} threads={a.threads} numpy={np.__version__} "
          f"sampled softmax mu={a.sampled}: v_all = targets + top 1% + random 1%, v_f = v_all + random mu")
    print(blas_line())
    print(f"# measured float32 matmul (1024^3): {peak:.1f} GFLOP/s")
    K = steps_per_call(a)
    print(f"# {K} step(s) per train_steps call, every variant")
    speedups, bounds = [], []
    for name in (a.shapes or "ptb-small,ptb-medium").split(","):
        shape = SHAPES[name]
        B = a.batch or shape[6]
        toks = shape[5] * B
        batches, source = sampled_batches(shape, B)
        full, _ = make_rnnlm_loop(xp, shape, B, batches, per_call=K)
        samp, sizes = make_rnnlm_loop(xp, shape, B, batches, mu=a.sampled, per_call=K)
        seed, _ = make_rnnlm_loop(xp, shape, B, batches, mu=a.sampled, variant="literal", per_call=K)
        ahead, _ = make_rnnlm_loop(xp, shape, B, batches, mu=a.sampled, per_call=K, ahead=True)
        for _ in range(-(-8 // K)):
            samp()                                  # the sets' mean sizes, for the ceilings below
        ceilings = []
        for n in np.mean(sizes, axis=0)[1::-1]:                     # over |v_f| words, then |v_all|
            small, folded = vocab_of(shape, batches, round(n))
            ceilings.append(make_rnnlm_loop(xp, small, B, folded, per_call=K)[0])
        times = interleaved([full, samp, seed, ahead, *ceilings], a.seconds, a.rounds, sync)
        t_f, t_s, t_0, t_a, t_cf, t_ca = (t / K for t in times)    # seconds per step
        n_all, n_f, t_sets = np.mean(sizes, axis=0)
        speedups.append(t_f / t_s)
        bounds.append(t_f / t_ca)
        print(f"{name:11s} T={shape[5]:<3d} B={B:<4d} V={shape[1]} full {toks / t_f:9.0f} tok/s  "
              f"corrected {toks / t_s:9.0f} tok/s  speedup {t_f / t_s:5.2f}  "
              f"literal {toks / t_0:9.0f} tok/s  speedup {t_f / t_0:5.2f}  "
              f"mean |v_all| {n_all:6.1f}  |v_f| {n_f:6.1f}  sets built on the host {1e6 * t_sets:5.0f} us "
              f"({100 * t_sets / t_s:4.1f}% of the corrected step)  targets: {source}", flush=True)
        print(f"{'':11s} corrected with its sets built before the step {toks / t_a:9.0f} tok/s = {t_f / t_a:5.2f}x "
              f"(the step's wall time less {1e6 * (t_s - t_a):5.0f} us)", flush=True)
        print(f"{'':11s} ceiling: the full step over a {round(n_f)}-word vocabulary (|v_f|) {toks / t_cf:9.0f} tok/s "
              f"= {t_f / t_cf:5.2f}x, over {round(n_all)} words (|v_all|) {toks / t_ca:9.0f} tok/s "
              f"= {t_f / t_ca:5.2f}x", flush=True)
    print(f"max_sampled_speedup={min(bounds):.3f}   # no sampled step with these sets can be faster")
    print(f"min_sampled_speedup={min(speedups):.3f}")


def vocab_of(shape, batches, n):
    """``shape`` and ``batches`` with an ``n``-word vocabulary (ids folded into [0, n)): a full
    softmax over n words does the sampled step's GEMMs over n rows and nothing else (no sets,
    gathers or scatters), so its step bounds any sampled step's speed over sets of n words."""
    import numpy as np
    fold = [type(b)(b.x % n, np.where(b.y >= 0, b.y % n, b.y), b.reset) for b in batches]
    return (shape[0], n) + shape[2:], fold


def profile_main(a, xp, steps=20):
    """Where rnnlm's step spends its time: cProfile's own time per function over ``steps`` steps.

    The kernels call NumPy directly, so a function's own time is the NumPy work it issues: every
    product goes through ``backend.matmul`` (its own time is the BLAS calls, per-step and chunk-wide),
    ``lstm_forward`` / ``_lstm_step_backward`` / ``rnn_*`` are the loops' elementwise work,
    ``swap01`` / ``transpose_into`` the layout changes.
    """
    import cProfile
    import pstats
    if a.device != "cpu":
        raise SystemExit("--profile times NumPy's step on the CPU: leave out --device gpu")
    print(blas_line())
    for name in (a.shapes or ",".join(SHAPES)).split(","):
        shape = SHAPES[name]
        B = a.batch or shape[6]
        step = make_rnnlm_step(xp, shape, B)
        step()
        step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(lambda: [step() for _ in range(steps)])
        ms = (time.perf_counter() - t0) / steps * 1e3
        print(f"== {name}: {ms:.1f} ms per step under the profiler ({shape[5] * B / ms * 1e3:.0f} tok/s)")
        stats = pstats.Stats(prof).stats
        rows = sorted(((tt / steps * 1e3, f"{func[2]} ({os.path.basename(func[0])})")
                       for func, (_, _, tt, _, _) in stats.items()), reverse=True)
        for own, label in rows[:12]:
            print(f"  {own:7.2f} ms  {label}")
        products(xp, step, steps)


def products(np, step, steps):
    """``step``'s matrix products by their operands' shapes, timed one by one (no profiler): ms a step,
    calls a step and GFLOP/s, then their sum beside the step's own time."""
    import collections
    real, seen = np.matmul, collections.defaultdict(lambda: [0, 0.0, 0.0])

    def timed(a, b, out=None):
        t0 = time.perf_counter()
        r = real(a, b, out=out)
        row = seen[(a.shape, b.shape)]
        row[0] += 1
        row[1] += time.perf_counter() - t0
        row[2] += 2.0 * a.size * (b.size // b.shape[-2] if b.ndim > 1 else 1)     # 2 M K N (a batch: each)
        return r
    np.matmul = timed
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ms = (time.perf_counter() - t0) / steps * 1e3
    finally:
        np.matmul = real
    total = sum(t for _, t, _ in seen.values()) / steps * 1e3
    print(f"  products, one by one: {total:.1f} ms of a {ms:.1f} ms step")
    for (sa, sb), (n, t, flops) in sorted(seen.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"  {t / steps * 1e3:7.2f} ms  {n / steps:4.0f} a step  {flops / t / 1e9:5.0f} GFLOP/s  {sa} @ {sb}")


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


def steps_per_call(a) -> int:
    """``--steps-per-call``, by default 1 on the CPU and 10 (the confs' ``train.local_steps``) on a GPU."""
    return a.steps_per_call or (10 if a.device == "gpu" else 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seconds", type=float, default=6.0, help="timing per shape and library")
    ap.add_argument("--rounds", type=int, default=3, help="alternating windows per shape")
    ap.add_argument("--shapes", default=None, help="default: all; ptb-small,ptb-medium with --sampled")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--batch", type=int, default=0, help="override B for every shape")
    ap.add_argument("--profile", action="store_true",
                    help="profile rnnlm's step (cProfile, own time per function) instead of timing against PyTorch")
    ap.add_argument("--sampled", type=float, default=None, metavar="MU",
                    help="time full against sampled softmax (v_f adds MU of the vocabulary), no PyTorch")
    ap.add_argument("--steps-per-call", type=int, default=0,
                    help="rnnlm steps per train_steps call (one device read each; --sampled too); default 1 "
                         "on CPU, 10 on a GPU (the conf's train.local_steps: PyTorch's step does not sync either)")
    ap.add_argument("--no-graphs", action="store_true", help="GPU: run every step eagerly (no CUDA graphs)")
    ap.add_argument("--torch-tf32", choices=("default", "off"), default="default",
                    help="off: PyTorch's cuDNN in strict float32 as rnnlm computes (its default lets cuDNN use TF32)")
    ap.add_argument("--heap", choices=("steady", "default"), default="steady",
                    help="CPU: glibc's malloc fixed in its steady state for both libraries (steady_heap), "
                         "or as it starts")
    ap.add_argument("--torch-onednn", choices=("default", "off"), default="default",
                    help="CPU, off: PyTorch's LSTM without oneDNN's RNN primitive (which packs the weights once per "
                         "sequence), its generic per-step products, as rnnlm's")
    a = ap.parse_args(argv)
    os.environ["OPENBLAS_NUM_THREADS"] = str(a.threads)   # before NumPy loads OpenBLAS
    print(steady_heap() if a.device == "cpu" and a.heap == "steady" else "# heap: as the C library sets it")
    from rnnlm.core import backend
    xp = backend.get_xp(a.device)
    if a.sampled is not None:
        def xp_sync():
            if a.device == "gpu":
                xp.cuda.Device().synchronize()
        return sampled_main(a, xp, xp_sync)
    if a.profile:
        return profile_main(a, xp)
    import torch

    torch.set_num_threads(a.threads)
    tdev = "cuda" if a.device == "gpu" else "cpu"
    if a.torch_tf32 == "off":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if a.torch_onednn == "off":
        torch.backends.mkldnn.enabled = False

    def sync():
        if a.device == "gpu":
            xp.cuda.Device().synchronize()
            torch.cuda.synchronize()
    peak = matmul_gflops(xp, sync=sync)
    print(f"# device={a.device} xp={xp.__name__} threads={a.threads} numpy={xp.__version__} torch={torch.__version__}")
    print(blas_line())
    print(f"# measured float32 matmul (1024^3): {peak:.1f} GFLOP/s")
    K = steps_per_call(a)
    print(f"# rnnlm: {K} step(s) per train_steps call; CUDA graphs {'off' if a.no_graphs else 'on where usable'}; "
          f"torch TF32: cudnn {torch.backends.cudnn.allow_tf32}, matmul {torch.backends.cuda.matmul.allow_tf32}; "
          f"torch oneDNN {torch.backends.mkldnn.enabled}")
    ratios = []
    for name in (a.shapes or ",".join(SHAPES)).split(","):
        shape = SHAPES[name]
        B = a.batch or shape[6]
        toks = shape[5] * B
        fns = [make_rnnlm_step(xp, shape, B, K, not a.no_graphs), make_torch_step(torch, shape, B, tdev)]
        t_r, t_t = interleaved(fns, a.seconds, a.rounds, sync)
        t_r /= K                                                      # seconds per step
        gf = step_flops(*shape[:6], B) / t_r / 1e9
        ratio = t_t / t_r
        ratios.append(ratio)
        print(f"{name:11s} T={shape[5]:<3d} B={B:<4d} rnnlm {toks / t_r:9.0f} tok/s  torch {toks / t_t:9.0f} tok/s  "
              f"ratio {ratio:5.2f}  rnnlm {gf:6.1f} GFLOP/s = {100 * gf / peak:4.1f}% of matmul peak", flush=True)
    print(f"min_ratio_vs_torch={min(ratios):.3f}")


if __name__ == "__main__":
    sys.exit(main())
