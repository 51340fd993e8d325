"""rnnlm's training step against PyTorch's, from the same weights, in float64: the same numbers?

    python benchmarks/torch_equivalence.py [--hidden 200] [--steps 40] [--data DIR] [--biases one|two]

A word LSTM as ``conf/ptb_word_medium.toml`` builds it (2 layers, embedding = hidden, T = 35,
B = 20, V = 10,000, no dropout: the masks come from different generators), initialised by rnnlm
and copied into ``torch.nn.LSTM`` (gate order (i, f, o, g) mapped to PyTorch's (i, f, g, o);
rnnlm's one bias per gate as ``bias_ih``, ``bias_hh`` zero and frozen; with ``--biases two``,
rnnlm's ``model.biases = "two"``, its ``b`` and ``bh`` as PyTorch's two, both trained), then
trained ``--steps`` steps on the same PTB batches by both: SGD lr 1, the loss summed over T and averaged over B (the
trainer's ``grad_norm = "batch"``), the gradient's norm clipped at 5, the state carried. Prints
each step's loss from both, the largest relative difference over the run, and the largest
difference between the final weights. Float64 on the CPU, so any difference beyond rounding is
a difference in the maths (the loss, the gradient, the clip or the update), not in precision.
PyTorch is a benchmark-only dependency.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=os.path.join(ROOT, "data"))
    ap.add_argument("--biases", choices=("one", "two"), default="one", help="rnnlm's model.biases")
    a = ap.parse_args(argv)
    import numpy as np
    import torch
    from torch import nn

    from rnnlm.config import ModelConfig, OptimConfig
    from rnnlm.core.local import train_steps
    from rnnlm.core.model import RNNLM
    from rnnlm.core.optim import make_optimizer
    from rnnlm.core.strategies import StreamBlock
    from rnnlm.core.vocab import Vocab
    torch.set_num_threads(a.threads)
    text = open(os.path.join(a.data, "ptb.train.txt"), encoding="utf-8").read()
    vocab = Vocab.build(text, "word")
    H, T, B, V, CLIP = a.hidden, 35, 20, len(vocab), 5.0
    block = StreamBlock(vocab.encode(text), B, T)
    batches = [block.batch(k) for k in range(a.steps)]

    # rnnlm: float64, initialised as the trainer does (uniform +-0.05; biases zero, or drawn with two)
    m = RNNLM(ModelConfig(cell="lstm", vocab_size=V, embed=H, hidden=H, layers=2, init="uniform",
                          init_scale=0.05, biases=a.biases), dtype="float64")
    params = m.init_params(1)
    opt = make_optimizer(OptimConfig(name="sgd", lr=1.0, clip_norm=CLIP))
    opt_state = opt.init_state(params)
    p0 = {k: v.copy() for k, v in m.layout.views(params).items()}

    # PyTorch: the same weights; rnnlm's gate blocks (i, f, o, g) -> PyTorch's (i, f, g, o)
    perm = np.concatenate([np.arange(0, 2 * H), np.arange(3 * H, 4 * H), np.arange(2 * H, 3 * H)])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lstm, self.out = nn.Embedding(V, H), nn.LSTM(H, H, 2), nn.Linear(H, V)

    net = Model().double()
    with torch.no_grad():
        net.emb.weight.copy_(torch.from_numpy(p0["embed"]))
        for layer in range(2):
            getattr(net.lstm, f"weight_ih_l{layer}").copy_(torch.from_numpy(p0[f"Wx{layer}"][perm]))
            getattr(net.lstm, f"weight_hh_l{layer}").copy_(torch.from_numpy(p0[f"Whh{layer}"][perm]))
            getattr(net.lstm, f"bias_ih_l{layer}").copy_(torch.from_numpy(p0[f"b{layer}"][perm]))
            if a.biases == "two":
                getattr(net.lstm, f"bias_hh_l{layer}").copy_(torch.from_numpy(p0[f"bh{layer}"][perm]))
            else:
                getattr(net.lstm, f"bias_hh_l{layer}").zero_()
                getattr(net.lstm, f"bias_hh_l{layer}").requires_grad_(False)    # one bias per gate, as rnnlm
        net.out.weight.copy_(torch.from_numpy(p0["Wo"]))
        net.out.bias.copy_(torch.from_numpy(p0["bo"]))
    sgd = torch.optim.SGD([q for q in net.parameters() if q.requires_grad], lr=1.0)
    loss_fn = nn.CrossEntropyLoss()

    print(f"# torch={torch.__version__} float64, 2x{H} LSTM, V={V}, T={T}, B={B}, {a.steps} steps, "
          f"SGD lr 1, clip {CLIP}, biases {a.biases}")
    state, t_state, worst, clipped = m.zero_state(B), None, 0.0, 0
    for k, b in enumerate(batches):
        res = train_steps(m, opt, params, opt_state, [b], state, lr=1.0, clip_norm=CLIP, grad_norm="batch")
        state, ours = res.state, res.loss_sum / res.tokens
        x, y = torch.from_numpy(b.x.astype(np.int64)), torch.from_numpy(b.y.astype(np.int64))
        if t_state is not None:
            t_state = tuple(s.detach() for s in t_state)
        h, t_state = net.lstm(net.emb(x), t_state)
        loss = loss_fn(net.out(h).reshape(-1, V), y.reshape(-1))
        sgd.zero_grad()
        (loss * T).backward()
        # clipped as the maths says, CLIP / max(norm, CLIP): clip_grad_norm_ divides by norm + 1e-6,
        # a relative 1e-7 at these norms that the dynamics at lr 1 amplify over a few dozen steps
        trained = sgd.param_groups[0]["params"]
        norm = torch.sqrt(sum((q.grad ** 2).sum() for q in trained))
        for q in trained:
            q.grad.mul_(CLIP / torch.clamp(norm, min=CLIP))
        clipped += bool(norm > CLIP)
        sgd.step()
        rel = abs(ours - loss.item()) / loss.item()
        worst = max(worst, rel)
        print(f"step {k + 1:3d}  rnnlm {ours:.12f}  torch {loss.item():.12f}  rel diff {rel:.1e}", flush=True)

    p = m.layout.views(params)
    final = {"embed": net.emb.weight, "Wo": net.out.weight, "bo": net.out.bias}
    for layer in range(2):
        inv = np.argsort(perm)
        final[f"Wx{layer}"] = getattr(net.lstm, f"weight_ih_l{layer}")[inv]
        final[f"Whh{layer}"] = getattr(net.lstm, f"weight_hh_l{layer}")[inv]
        final[f"b{layer}"] = getattr(net.lstm, f"bias_ih_l{layer}")[inv]
        if a.biases == "two":
            final[f"bh{layer}"] = getattr(net.lstm, f"bias_hh_l{layer}")[inv]
    moved = max(float(np.abs(p[n] - p0[n]).max()) for n in final)
    diff = max(float(np.abs(p[n] - final[n].detach().numpy()).max()) for n in final)
    print(f"clipped in {clipped} of {a.steps} steps; largest step-loss relative difference "
          f"{worst:.1e}; final weights: largest difference {diff:.1e} (largest change from the start {moved:.2e})")


if __name__ == "__main__":
    main()
