"""``train.py --dry-run``: the resolved configuration, the model's size and what a round
moves under the chosen exchange, and with ``--bandwidth`` what that costs in seconds.

A synchronous run's figures are measured, not estimated: its first four rounds run for real on
the configured master in a scratch directory that is then deleted (nothing is kept or written
where the run would write), so the bytes are exactly what round 1 sends (blocks, averaged
optimizer state, carried hidden states, pickling) and what rounds 2-4 broadcast, and the compute
and per-round overhead are this master's. An async run's bytes are estimated from round 1's
batches (its pushes depend on timing).
"""
from __future__ import annotations

import dataclasses
import statistics
import tempfile

import numpy as np

from .. import config
from ..core.models import build as build_model
from ..exchange import plan
from .executor import make_source
from .linkcost import parse_latency, parse_rate, predict, tree_levels
from .stop import Interrupted
from .corpus import load_corpus, total_rounds, unpersist_corpus
from .allreduce import tree_aggregated
from .trainer import Trainer, steps_label


def round_words_task(cfg: config.Config):
    """Per partition: ``(pid, input words, all words)`` of round 1's batches."""
    def run(it):
        for pid, tokens, starts in it:
            batches = make_source(cfg, pid, tokens, starts).round_batches(1, cfg.train.local_steps)
            x = np.unique(np.concatenate([b.x.ravel() for b in batches]))
            y = np.unique(np.concatenate([b.y[b.y >= 0] for b in batches]))
            yield pid, x, np.union1d(x, y)
    return run


def estimate(layout, cfg, words: list) -> dict:
    """An async run's bytes per push window from the words each partition reads in round 1
    (``[(pid, input words, all words)]``).

    Each partition's change is taken as non-zero wherever training moves parameters (every
    row, but for the input table only the rows of the words read, as SGD moves them), then
    encoded as :func:`rnnlm.exchange.plan.encode` sends it. Returns ``sent`` (all partitions),
    ``dense`` (the same as float32 without selection) and ``model`` (the parameters as float32).
    """
    ex, P = cfg.exchange, cfg.data.partitions
    sent = 0
    for pid, x, all_words in words:
        change = np.ones(layout.size, np.float32)
        e = layout["embed"]
        rows = change[e.offset:e.end].reshape(e.shape[0], -1)                  # (V, E)
        keep = np.zeros(e.shape[0], bool)
        keep[x] = True
        rows[~keep] = 0
        blocks, _, _ = plan.encode(layout, change, ex, all_words, cfg.train.seed, 1, pid, P)
        sent += sum(b.nbytes for b in blocks.values())
    return {"sent": sent, "dense": P * layout.size * 4, "model": layout.size * 4}


def merge_levels(cfg: config.Config) -> int:
    """The levels a round's results are merged on executors before the driver: ``treeAggregate``'s,
    and none where they reach the driver one by one (lineage or the direct channel)."""
    return tree_levels(cfg.data.partitions, cfg.train.tree_depth) if tree_aggregated(cfg) else 0


def probe(spark, cfg: config.Config, data, rounds: int = 4, init=None) -> list:
    """The metrics lines of the run's first ``rounds`` rounds, trained in a scratch directory
    (deleted) without evaluation, from ``init``'s weights where given (``--init-from``): exactly
    what those rounds move and how long they take."""
    cfg = config.replace(cfg, "train", rounds=rounds, eval_every=0, checkpoint_every=0)
    with tempfile.TemporaryDirectory(prefix="rnnlm-dry-run-") as scratch:
        tr = Trainer(spark, cfg, f"file://{scratch}", log=lambda s: None)
        try:
            tr.run(data=dataclasses.replace(data, valid=None, test=None), init=init)
        except Interrupted as e:        # its checkpoint is in the scratch directory, deleted now
            raise Interrupted(f"dry run stopped after {len(tr.metrics)} of its {rounds} rounds; nothing was "
                              "written", e.exit_code - 128) from None
    return tr.metrics


def measured(lines: list, partitions: int, params: int) -> dict:
    """Round 1's bytes sent, and the median broadcast, compute and overhead of the rounds after the
    first (round 1 broadcasts the whole model and starts the executors' Python; under
    ``train.overlap`` round 2's job is defined from round 1's parameters, so it broadcasts no change)."""
    first, later = lines[0], lines[1:]
    return {"sent": first["round_bytes_sent"],
            "broadcast": statistics.median(one_copy(m) for m in later),
            "blocks": sum(v for k, v in first.items() if k.startswith("block_bytes.")),
            "first_broadcast": one_copy(first), "dense": partitions * params * 4,
            "model": params * 4, "compute_s": statistics.median(m["compute_s"] for m in later),
            "overhead_s": statistics.median(max(0.0, m["round_s"] - m["compute_s"]) for m in later)}


def one_copy(m: dict) -> int:
    """A round's broadcast bytes as one copy (its metrics count one per executor that read it)."""
    return m["round_bytes_broadcast"] // max(1, m["executors"])


def dry_run(spark, cfg: config.Config, log=print, bandwidth: str | None = None, latency: str = "0ms",
            init=None) -> dict:
    """Read the corpus as training would (every check included; ``init``: a run from a checkpoint's
    weights, :class:`rnnlm.spark.rundir.Init`, reads it with that checkpoint's vocabulary), print what
    the run would be."""
    link = (parse_rate(bandwidth), parse_latency(latency)) if bandwidth else None
    sc, sync = spark.sparkContext, cfg.train.mode != "async"
    steps = cfg.train.local_steps if sync else cfg.train.push_every
    data = load_corpus(sc, config.replace(cfg, "train", local_steps=steps), vocab=init and init.checkpoint.vocab)
    ended = False
    try:
        cfg = config.resolve(cfg, len(data.vocab))
        probe_cfg = config.replace(cfg, "train", local_steps=steps)
        layout = build_model(cfg.model).layout
        if sync:
            est = measured(probe(spark, probe_cfg, data, init=init), cfg.data.partitions, layout.size)
        else:
            words = data.train.mapPartitions(round_words_task(probe_cfg)).collect()
            est = estimate(layout, probe_cfg, words)
        rounds = total_rounds(probe_cfg, data)
        ended = True
    finally:
        unpersist_corpus(data, blocking=ended)
    P = cfg.data.partitions
    log(cfg.to_json())
    log(f"vocab {len(data.vocab):,} | params {layout.size:,} ({est['model'] / 1e6:.2f} MB as float32) | "
        f"train tokens {data.tokens:,} ({data.spread()})")
    t = cfg.train
    if t.global_batch or t.max_streams:
        key = "global_batch" if t.global_batch else "max_streams"
        log(f"train.{key} = {getattr(t, key)} on {P} partitions: train.batch = {t.batch} streams each, "
            f"{t.batch * P} in all")
    if not sync:
        log(f"{rounds:,} push windows of {steps_label(probe_cfg.train)} on {P} partitions")
        log(f"per push window, estimated from round 1's batches: partitions send {est['sent'] / 1e6:.3f} MB in "
            f"all ({est['sent'] / est['dense']:.1%} of dense float32's {est['dense'] / 1e6:.3f} MB)")
        return est
    log(f"{rounds:,} rounds of {steps_label(probe_cfg.train)} on {P} partitions")
    log(f"per round, measured on rounds 1-4 (run in a scratch directory, then deleted): partitions send "
        f"{est['sent']:,} bytes in all ({est['sent'] / est['dense']:.1%} of dense float32's "
        f"{est['dense'] / 1e6:.3f} MB, every partition's change of the weights uncoded): the change as coded "
        f"here {est['blocks']:,} bytes, the rest {est['sent'] - est['blocks']:,} (optimizer state, carried "
        f"hidden states, framing); the driver broadcasts {est['broadcast']:,} bytes, each executor a copy (the "
        f"median of rounds 2-4; round 1: {est['first_broadcast']:,}); compute {est['compute_s']:.2f} s, "
        f"overhead {est['overhead_s']:.2f} s on {sc.master}")
    if link:
        pr = predict(est["sent"], est["broadcast"], P, *link, overhead_s=est["overhead_s"],
                     compute_s=est["compute_s"])
        est["predicted"] = pr
        levels = merge_levels(cfg)
        if levels:
            log(f"note: at {P} partitions treeAggregate (train.tree_depth = {t.tree_depth}) merges on executors "
                f"first ({levels} level{'s' if levels > 1 else ''}): the bytes above count every hop, and the "
                "driver's link carries only the last, so the time below is an upper bound")
        log(f"at {bandwidth} (latency {latency}) per host link: sync {pr['sync_s']:.2f} s per round, the larger "
            f"of the overhead measured here ({pr['overhead_s']:.2f} s) and half of it plus the wire "
            f"({pr['overhead_s'] / 2:.2f} + {pr['wire_s']:.2f} s: results into the driver {pr['down_s']:.2f} s, "
            f"broadcast out {pr['up_s']:.2f} s, latency {pr['latency_s']:.2f} s; the other half is moving the "
            f"bytes, hidden behind a slow link); sync fraction {pr['sync_fraction']:.1%} at "
            f"{est['compute_s']:.2f} s of compute")
    return est
