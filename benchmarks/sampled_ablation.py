"""What each part of the corrected sampled softmax does, in one process on PTB small.

    python benchmarks/sampled_ablation.py [--steps 1200] [--mu 0.05,0.2] [--variants full,literal,A,B,AB,corrected]
                                          [--presence windows|unigram]

2x200 LSTM, B=10 streams, T=20, SGD lr 1, clip 5; the sampled variants draw their sets as
a partition does (:class:`rnnlm.exchange.plan.SoftmaxSampler`: ``--frequent`` most frequent
words, 2% random rows redrawn every 20 steps, mu dummy words per step). Variants: ``full``
softmax; ``literal`` (dummy words without backward, no correction); ``A`` (the hidden
state's gradient over every word of v_f); ``B`` (the log-inclusion correction of the
logits only); ``AB`` (both); ``corrected`` (both, and the rows of v_all reweighted for
their own inclusion probability: the ``corrected`` variant). Prints, per run,
the mean training loss (as trained: the sampled loss for sampled runs) over the last
100 steps and the full-softmax perplexity on the first 10k validation tokens,
then the share of probability mass the model gives the 200
most frequent words and ranks 200-2,000 on those tokens against their true shares.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--mu", default="0.05")
    ap.add_argument("--variants", default="full,literal,A,B,AB,corrected")
    ap.add_argument("--data", default=os.path.join(ROOT, "data"))
    ap.add_argument("--frequent", type=float, default=0.02)
    ap.add_argument("--presence", choices=("windows", "unigram"), default="windows",
                    help="a word's chance of being in a stream's 20 targets: measured on 20-token windows, "
                         "or 1 - (1 - f)^20 from its unigram frequency f")
    a = ap.parse_args(argv)
    from rnnlm.config import ExchangeConfig, ModelConfig, OptimConfig
    from rnnlm.core import sampled
    from rnnlm.core.local import train_steps
    from rnnlm.core.model import RNNLM
    from rnnlm.core.optim import make_optimizer
    from rnnlm.core.strategies import StreamBlock
    from rnnlm.core.vocab import Vocab
    from rnnlm.exchange.plan import SoftmaxSampler

    text = open(os.path.join(a.data, "ptb.train.txt"), encoding="utf-8").read()
    vocab = Vocab.build(text, "word")
    train = vocab.encode(text)
    valid = vocab.encode(open(os.path.join(a.data, "ptb.valid.txt"), encoding="utf-8").read())[:10001]
    V, K = len(vocab), 20
    freq = sampled.presence(train, 20, V) if a.presence == "windows" else 1 - (1 - _unigram(train, V)) ** 20
    blk = StreamBlock(train, 10, 20)
    true_top = np.isin(valid[1:], np.arange(200)).mean()
    true_mid = np.isin(valid[1:], np.arange(200, 2000)).mean()
    print(f"V={V} steps={a.steps} true mass on valid: top-200 {true_top:.3f}, ranks 200-2000 {true_mid:.3f}")
    for mu in [float(m) for m in a.mu.split(",")]:
        for variant in a.variants.split(","):
            if variant == "full" and mu != float(a.mu.split(",")[0]):
                continue
            m = RNNLM(ModelConfig(cell="lstm", vocab_size=V, embed=200, hidden=200, layers=2, init_scale=0.1), xp=np)
            opt = make_optimizer(OptimConfig(name="sgd", lr=1.0, clip_norm=5.0))
            p = m.init_params(1)
            st = opt.init_state(p)
            ex = ExchangeConfig(frequent=a.frequent, random=0.02, seed_groups="one", sampled_softmax=True, mu=mu,
                                sampled_variant="literal" if variant == "literal" else "corrected")
            state, losses, t0 = m.zero_state(10), [], time.perf_counter()
            for r in range(math.ceil(a.steps / K)):
                sampler = SoftmaxSampler(V, ex, 1, r + 1, 0, 1, presence=freq)

                def sets(k, y, sampler=sampler):
                    s = sampler(k, y)
                    if variant == "A":
                        return s._replace(log_pi=None, log_pi_rows=None)
                    if variant == "B":
                        return s._replace(through_gamma=False, log_pi_rows=None)
                    if variant == "AB":
                        return s._replace(log_pi_rows=None)
                    return s
                batches = blk.batches(r * K, min(K, a.steps - r * K))
                res = train_steps(m, opt, p, st, batches, state, lr=1.0, clip_norm=5.0,
                                  softmax_sets=None if variant == "full" else sets)
                state = res.state
                losses.append(res.loss_sum / res.tokens)
            wall = time.perf_counter() - t0
            ppl, top, mid = _valid(m, p, valid)
            print(f"mu={mu:g} variant={variant:8s} train_loss(last 100 steps)={np.mean(losses[-5:]):.3f} "
                  f"valid_ppl={ppl:.1f} mass top-200 {top:.3f} ranks 200-2000 {mid:.3f} wall={wall:.0f}s",
                  flush=True)


def _unigram(tokens, V):
    return np.maximum(np.bincount(tokens, minlength=V), 0.5) / len(tokens)


def _valid(m, p, tokens, T=100):
    """Full-softmax perplexity of ``tokens`` as one stream, and the mean model mass on the
    200 most frequent words and on ranks 200-2000."""
    state = m.zero_state(1)
    nll, n, top, mid = 0.0, 0, 0.0, 0.0
    for s in range(0, len(tokens) - 1, T):
        x = tokens[s:s + T + 1]
        if len(x) < 2:
            break
        xs, ys = x[:-1, None], x[1:, None]
        for t in range(len(xs)):
            logits, state = m.next_logits(p, xs[t:t + 1], state)
            lg = logits[0] - logits[0].max()
            pr = np.exp(lg)
            pr /= pr.sum()
            nll -= math.log(pr[ys[t, 0]])
            top += pr[:200].sum()
            mid += pr[200:2000].sum()
            n += 1
    return math.exp(nll / n), top / n, mid / n


if __name__ == "__main__":
    main()
