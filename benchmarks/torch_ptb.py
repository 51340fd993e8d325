"""One PyTorch process training PTB small or medium: the wall-time reference for the Spark trainer.

    python benchmarks/torch_ptb.py [--model small|medium] [--epochs 2] [--threads 2] [--evals-per-epoch 2]
                                   [--device cpu|cuda] [--data DIR] [--rnnlm-biases] [--set optim.KEY=VALUE]

Zaremba et al.'s "small" model as ``conf/ptb_word_small.toml`` has it (2x200 LSTM,
embedding 200, no dropout, T=20, B=20, SGD lr 1, gradient norm clipped at 5, init
uniform +-0.1; lr halving starts after epoch 4), or
``--model medium`` as ``conf/ptb_word_medium.toml`` has it (2x650, embedding 650,
T=35, B=20, init +-0.05, dropout 0.5 on the embedding, between the layers and before
the softmax, as the trainer places it; lr divided by 1.2 after epoch 6), with the learning
rate of the trainer's schedule (``rnnlm.core.schedule`` over the config's ``[optim]``), on
the same vocabulary and token ids (``rnnlm.core.vocab``) and the same batching
(``rnnlm.core.strategies.StreamBlock``: B contiguous streams, state carried).
Validation reads the held-out text as one stream in chunks of 100, as the
trainer's evaluation does. Prints one line per evaluation (``--evals-per-epoch 0``: at the
end only): epoch, training wall time (evaluation excluded; on CUDA, cuDNN's LSTM, timed to the
device's end of each stretch), valid ppl; and at the end the test perplexity, read the same way,
where DIR has ``ptb.test.txt``. PyTorch's LSTM has two bias vectors per gate (``bias_ih``, ``bias_hh``,
as Zaremba et al.'s Torch code has), both drawn uniformly and both trained, so plain SGD moves
their sum at twice the learning rate; ``--rnnlm-biases`` gives it rnnlm's one bias per gate,
starting at zero (``bias_hh`` zero and frozen), the output bias at zero too: then its step is
rnnlm's (``benchmarks/torch_equivalence.py``). ``--set optim.KEY=VALUE`` changes the schedule as
``rnnlm train --set`` changes the conf's (e.g. ``optim.decay=0.8``); the rest of the model is fixed
here. PyTorch is a benchmark-only dependency.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("small", "medium"), default="small")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--evals-per-epoch", type=int, default=2, help="0: once, at the end")
    ap.add_argument("--data", default=os.path.join(ROOT, "data"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rnnlm-biases", action="store_true", help="one bias per gate, from zero, as rnnlm")
    ap.add_argument("--set", action="append", default=[], metavar="optim.KEY=VALUE",
                    help="override the conf's schedule, as rnnlm train --set (repeatable)")
    a = ap.parse_args(argv)
    for s in a.set:
        if not s.startswith("optim."):
            ap.error(f"--set {s}: only optim.* keys apply here (the model is fixed by --model)")
    import numpy as np
    import torch
    from torch import nn

    from rnnlm import config
    from rnnlm.core.metrics import EVAL_BPTT
    from rnnlm.core.schedule import Schedule
    from rnnlm.core.strategies import StreamBlock
    from rnnlm.core.vocab import Vocab
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    train_text = open(os.path.join(a.data, "ptb.train.txt"), encoding="utf-8").read()
    vocab = Vocab.build(train_text, "word")
    train = vocab.encode(train_text)
    valid = vocab.encode(open(os.path.join(a.data, "ptb.valid.txt"), encoding="utf-8").read())
    test_path = os.path.join(a.data, "ptb.test.txt")
    try:
        optim = config.load(os.path.join(ROOT, "conf", f"ptb_word_{a.model}.toml"), a.set).optim
    except config.ConfigError as e:
        ap.error(str(e))
    sched = Schedule(optim)
    H, T, scale, drop = {"small": (200, 20, 0.1, 0.0), "medium": (650, 35, 0.05, 0.5)}[a.model]
    V, B = len(vocab), 20

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lstm, self.out = nn.Embedding(V, H), nn.LSTM(H, H, 2, dropout=drop), nn.Linear(H, V)
            self.drop = nn.Dropout(drop)
            for p in self.parameters():
                nn.init.uniform_(p, -scale, scale)
            if a.rnnlm_biases:
                with torch.no_grad():
                    for name, p in self.named_parameters():
                        if "bias" in name:
                            p.zero_()
                            p.requires_grad_("bias_hh" not in name)

        def forward(self, x, state):
            h, state = self.lstm(self.drop(self.emb(x)), state)
            return self.out(self.drop(h)), state

    dev = torch.device(a.device)
    model = Model().to(dev)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=1.0)
    loss_fn = nn.CrossEntropyLoss()
    block = StreamBlock(train, B, T)
    steps_per_epoch = block.steps_per_pass
    total = int(a.epochs * steps_per_epoch)
    every = max(1, steps_per_epoch // a.evals_per_epoch) if a.evals_per_epoch > 0 else total

    def evaluate(ids):
        model.eval()
        nll, n, state = 0.0, 0, None
        with torch.no_grad():
            for i in range(0, len(ids) - 1, EVAL_BPTT):
                x = torch.from_numpy(ids[i:i + EVAL_BPTT].astype(np.int64))[:, None].to(dev)
                y = torch.from_numpy(ids[i + 1:i + 1 + EVAL_BPTT].astype(np.int64)).to(dev)
                x = x[:len(y)]
                logits, state = model(x, state)
                nll += float(loss_fn(logits[:, 0], y)) * len(y)
                n += len(y)
        model.train()
        return math.exp(nll / n)

    print(f"# torch={torch.__version__} device={a.device} threads={a.threads} model={a.model} V={V} "
          f"steps/epoch={steps_per_epoch} biases={'rnnlm' if a.rnnlm_biases else 'torch'} "
          f"schedule={optim.schedule} lr={optim.lr} decay={optim.decay} after={optim.decay_after}", flush=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    state, wall, t0 = None, 0.0, time.perf_counter()
    for k in range(total):
        b = block.batch(k)
        x, y = torch.from_numpy(b.x.astype(np.int64)).to(dev), torch.from_numpy(b.y.astype(np.int64)).to(dev)
        if k % block.steps_per_pass == 0:
            state = None                              # a new pass: streams start from zero
        if state is not None:
            state = tuple(s.detach() for s in state)
        logits, state = model(x, state)
        # summed over the T steps, averaged over the B streams: the trainer's grad_norm = "batch"
        # (Zaremba et al.), which the clip at 5 and lr 1 assume; a mean over T * B steps 20x smaller
        loss = loss_fn(logits.reshape(-1, V), y.reshape(-1)) * T
        for group in opt.param_groups:
            group["lr"] = sched.lr(k / steps_per_epoch)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(trained, 5.0)
        opt.step()
        if (k + 1) % every == 0 or k + 1 == total:
            sync()
            wall += time.perf_counter() - t0
            print(f"epoch {(k + 1) / steps_per_epoch:.2f}  train_wall_s {wall:.1f}  "
                  f"valid_ppl {evaluate(valid):.1f}", flush=True)
            t0 = time.perf_counter()
    if os.path.isfile(test_path):
        print(f"test_ppl {evaluate(vocab.encode(open(test_path, encoding='utf-8').read())):.2f}", flush=True)


if __name__ == "__main__":
    main()
