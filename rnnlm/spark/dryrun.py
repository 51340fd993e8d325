"""``train.py --dry-run``: the resolved configuration, the model's size and what a round
moves under the chosen exchange, without training (nothing is written)."""
from __future__ import annotations

import numpy as np

from .. import config
from ..core.model import build as build_model
from ..core.optim import make_optimizer
from ..exchange import plan
from ..exchange.rebase import changed_rows, delta_blocks, size
from .executor import make_source
from .trainer import _steps, load_corpus, total_rounds


def round_words_task(cfg_json: str):
    """Per partition: ``(pid, input words, all words)`` of round 1's batches."""
    def run(it):
        cfg = config.from_json(cfg_json)
        for pid, tokens, starts in it:
            batches = make_source(cfg, pid, tokens, starts).round_batches(1, cfg.train.local_steps)
            x = np.unique(np.concatenate([b.x.ravel() for b in batches]))
            y = np.unique(np.concatenate([b.y[b.y >= 0] for b in batches]))
            yield pid, x, np.union1d(x, y)
    return run


def estimate(layout, cfg, words: list) -> dict:
    """Bytes of round 1 from the words each partition reads (``[(pid, input words, all words)]``).

    Each partition's change is taken as non-zero wherever training moves parameters (every
    row, but for the input table only the rows of the words read, as SGD moves them), then
    encoded as :func:`rnnlm.exchange.plan.encode` sends it. Returns ``sent`` (all partitions),
    ``dense`` (the same as float32 without selection), ``broadcast`` (the next round's: the rows
    the union of what was sent changes, and the averaged optimizer state where it travels) and
    ``model`` (the parameters as float32: the first broadcast).
    """
    ex, P = cfg.exchange, cfg.data.partitions
    sent, mean = 0, np.zeros(layout.size, np.float32)
    for pid, x, all_words in words:
        change = np.ones(layout.size, np.float32)
        e = layout["embed"]
        rows = change[e.offset:e.end].reshape(e.shape[0], -1)                  # (V, E)
        keep = np.zeros(e.shape[0], bool)
        keep[x] = True
        rows[~keep] = 0
        blocks, _, _ = plan.encode(layout, change, ex, all_words, cfg.train.seed, 1, pid, P)
        sent += sum(b.nbytes for b in blocks.values())
        for slot in layout:
            b = blocks[f"params.{slot.name}"]
            view = mean[slot.offset:slot.end].reshape(slot.shape[0], -1)
            view[slice(None) if b.ids is None else b.ids] += b.decode().reshape(b.rows, -1) / P
    base = np.zeros(layout.size, np.float32)
    kind, codec = ex.broadcast.partition("+")[::2]
    if kind == "delta":
        bcast = sum(b.nbytes for b in delta_blocks(layout, mean, codec).values())
    else:
        amount = size(changed_rows(layout, mean, base))
        rebase = amount >= cfg.train.rebase_fraction * layout.size
        bcast = layout.size * 4 if rebase else amount * 4
    if cfg.train.optim_state == "average":       # the averaged optimizer state travels whole every round
        bcast += len(make_optimizer(cfg.optim).slots) * layout.size * 4
    return {"sent": sent, "dense": P * layout.size * 4, "broadcast": bcast, "model": layout.size * 4}


def dry_run(sc, cfg: config.Config, log=print) -> dict:
    """Read the corpus as training would (every check included), print what the run would be."""
    steps = cfg.train.push_every if cfg.train.mode == "async" else cfg.train.local_steps
    probe = config.replace(cfg, "train", local_steps=steps)
    data = load_corpus(sc, probe)
    try:
        cfg = config.replace(cfg, "model", vocab_size=len(data.vocab))
        probe = config.replace(probe, "model", vocab_size=len(data.vocab))
        layout = build_model(cfg.model).layout
        words = data.train.mapPartitions(round_words_task(probe.to_json())).collect()
        est = estimate(layout, probe, words)
        rounds = total_rounds(probe, data)
    finally:
        for rdd in (data.train, data.valid, data.test):
            if rdd is not None:
                rdd.unpersist()
    log(cfg.to_json())
    log(f"vocab {len(data.vocab):,} | params {layout.size:,} ({est['model'] / 1e6:.2f} MB as float32) | "
        f"train tokens {data.tokens:,}")
    unit = "push window" if cfg.train.mode == "async" else "round"
    log(f"{rounds:,} {unit}s of {_steps(probe.train)} on {cfg.data.partitions} partitions")
    log(f"per {unit}, from round 1's batches: partitions send {est['sent'] / 1e6:.3f} MB in all "
        f"({est['sent'] / est['dense']:.1%} of dense float32's {est['dense'] / 1e6:.3f} MB)"
        + ("" if cfg.train.mode == "async" else
           f"; the driver broadcasts {est['broadcast'] / 1e6:.3f} MB (the first round: the whole "
           f"model, {est['model'] / 1e6:.3f} MB)"))
    return est
