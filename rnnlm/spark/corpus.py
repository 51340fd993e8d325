"""Corpora as Spark RDDs: vocabulary, encoding, and a run's corpus loaded, checked and cached
(:func:`load_corpus`) and held-out text scored (:func:`evaluate_rdd`) for both drivers and the dry run;
the text itself comes from :mod:`.reader`.

Nothing proportional to the corpus reaches the driver: the vocabulary is built
from ``reduceByKey`` counts (only the kept candidates are collected) and each
training partition holds its encoded tokens as one NumPy array.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from operator import add
from typing import NamedTuple

import numpy as np

from .. import config
from ..core.schedule import rounds_for
from ..core.vocab import EOS, UNK_CHAR, UNK_WORD, Vocab, tokenize
from .executor import eval_task, probe_task
from .memo import digest
from .reader import paragraphs
from .scan import CorpusError
from .session import release


def build_vocab(paras, level: str, max_size: int = 0, min_count: int = 1, name: str = "the corpus") -> Vocab:
    """Count tokens with ``reduceByKey`` and keep the top ones (see :meth:`Vocab.from_counts`);
    ``name`` names the text in the error that it is empty."""
    counts = paras.flatMap(lambda p: tokenize(p, level)).map(lambda t: (t, 1)).reduceByKey(add)
    counts.cache()
    try:
        total = counts.values().sum()
        if total == 0:
            raise CorpusError(f"{name} is empty")
        forced = {UNK_WORD, EOS} if level == "word" else {UNK_CHAR}
        cand = counts.filter(lambda kv: kv[1] >= min_count or kv[0] in forced)
        if max_size:            # the forced tokens' counts too, wherever they rank (a rare <eos> in long lines)
            top = cand.takeOrdered(max_size + len(forced), key=lambda kv: (-kv[1], kv[0]))
            top += counts.filter(lambda kv: kv[0] in forced).collect()
        else:
            top = cand.collect()   # distinct kept tokens: vocabulary-sized, not corpus-sized
    finally:
        release(rdds=[counts])
    return Vocab.from_counts(dict(top), level, max_size, min_count, total=total)


def contiguous_partitions(paras, n: int, shrink: bool = False, name: str = "the corpus",
                          level: str | None = None) -> tuple:
    """Re-partition ``paras`` into ``n`` partitions of consecutive paragraphs, order kept: balanced by their
    tokens of ``level`` (each paragraph goes to the partition its middle token falls in), or with no ``level``
    by paragraph count. Rounds move every partition the same number of steps, so a partition of fewer tokens
    would train its positions more often than the others in an epoch. Where a paragraph is longer than a
    partition's share of the tokens, which could leave a partition with none, the split is by paragraph count.

    With ``shrink`` a corpus of fewer than ``n`` paragraphs gets one partition each; ``name`` names
    the text in the error that it is empty. Returns the RDD and what it is balanced by: ``"tokens"`` or
    ``"paragraphs"``.
    """
    def summary(it):                    # paragraphs, tokens, the longest paragraph's tokens
        count = tokens = longest = 0
        for p in it:
            w = len(tokenize(p, level)) if level else 1
            count, tokens, longest = count + 1, tokens + w, max(longest, w)
        yield count, tokens, longest
    rows = paras.mapPartitions(summary).collect()
    total = sum(r[0] for r in rows)
    if total == 0:
        raise CorpusError(f"{name} is empty")
    if total < n and shrink:
        n = total
    elif total < n:
        raise CorpusError(f"{name}: {total:,} paragraph{'s' if total > 1 else ''}, fewer than data.partitions = "
                          f"{n} (data.paragraphs = \"line\" splits at every line)")
    weight = sum(r[1] for r in rows)
    by_tokens = level is not None and 0 < max(r[2] for r in rows) * n <= weight
    firsts = np.cumsum([0] + [r[0] for r in rows]).tolist()    # each input partition's first paragraph
    starts = np.cumsum([0] + [r[1] for r in rows]).tolist()    # and its first token

    def keyed(j, it):
        i, s = firsts[j], starts[j]
        for p in it:
            if by_tokens:
                w = len(tokenize(p, level))
                yield min(n - 1, (2 * s + w) * n // (2 * weight)), (i, p)
                s += w
            else:
                yield i * n // total, (i, p)
            i += 1
    rdd = (paras.mapPartitionsWithIndex(keyed)
           .partitionBy(n, lambda k: k)
           .mapPartitions(lambda it: [p for _, (_, p) in sorted(it, key=lambda kv: kv[1][0])],
                          preservesPartitioning=True))
    return rdd, "tokens" if by_tokens else "paragraphs"


def encode_partitions(paras, bc_vocab):
    """One ``(partition, tokens int32, paragraph starts int64)`` record per partition."""
    def enc(pid, it):
        vocab = bc_vocab.value
        arrays = [a for a in (vocab.encode(p) for p in it) if len(a)]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        tokens = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
        yield pid, tokens, starts[:len(arrays)]
    return paras.mapPartitionsWithIndex(enc, preservesPartitioning=True)


def unique_growth(sc, path: str, level: str = "word", mode: str = "line", partitions: int = 2,
                  longest: int = 1_000_000, draws: int = 8, seed: int = 0) -> tuple:
    """Patwary et al.'s (2018) U against N on a corpus: the mean number of distinct tokens in stretches of
    N consecutive tokens, measured in every partition (:func:`rnnlm.core.zipf.unique_counts`)
    and averaged over the partitions long enough for N. Only the (N, U) grid reaches the driver.

    Returns
    -------
    n, u : int64 and float64 arrays
    """
    from ..core import zipf
    ns = zipf.sizes(longest)

    def count(pid, paras):
        sums = zipf.unique_counts(zipf.token_ids(paras, level), ns, draws, seed=seed * 7919 + pid)
        for n, s in zip(ns, sums):
            if s:
                yield int(n), (float(s), draws)

    grid = paragraphs(sc, path, mode, level, partitions).mapPartitionsWithIndex(count) \
        .reduceByKey(lambda a, b: (a[0] + b[0], a[1] + b[1])).collect()
    grid.sort()
    return np.array([n for n, _ in grid], np.int64), np.array([s / d for _, (s, d) in grid])


class Scored(NamedTuple):
    """Tokens scored, all partitions (expected): by a round, and by an epoch (each target position a pass
    scores, once: :meth:`rnnlm.core.strategies.Source.epoch_tokens`); None where not counted."""
    round: float | None
    epoch: int | None


@dataclass
class Corpus:
    vocab: object
    train: object            # RDD of (pid, tokens, starts), persisted
    valid: object | None
    test: object | None
    tokens: int              # training tokens, all partitions
    scored: Scored           # tokens a round and an epoch train on, under `counted_for`
    held_out_tokens: dict = field(default_factory=dict)     # "valid", "test" -> tokens of that text
    devices: dict = field(default_factory=dict)             # pid -> {"ran", "assigned", "arithmetic"} (probe_task)
    counted_for: tuple = ()  # round_keys() of the configuration `scored` was counted under
    broadcasts: tuple = ()   # the vocabulary's, which the RDDs read again if a cached partition is lost
    digest: str | None = None   # of the partitions' tokens and paragraph starts, in order: what a resume trains on
    held_out_digests: dict = field(default_factory=dict)    # "valid", "test" -> its streams' digest, likewise
    balance: str = ""        # what the partitions are balanced by (contiguous_partitions): "tokens", "paragraphs"
    partition_tokens: tuple = ()    # each partition's training tokens, in order

    def spread(self) -> str:
        """The partitions' training tokens, least to most, and what they are balanced by."""
        least, most = min(self.partition_tokens), max(self.partition_tokens)
        return f"{least:,} to {most:,} a partition, balanced by {self.balance}"

    def record(self) -> dict:
        """What ``run.json`` says this run reads, for a resume to check (:meth:`rnnlm.spark.rundir.RunDir.write_info`):
        the training text's tokens, digest and what its partitions are balanced by, and under ``valid`` and
        ``test`` the held-out texts' tokens and digest (their scores pick the best checkpoint and step a plateau
        schedule)."""
        out = {"tokens": self.tokens, "digest": self.digest, "balance": self.balance}
        for name, tokens in self.held_out_tokens.items():
            out[name] = {"tokens": tokens, "digest": self.held_out_digests[name]}
        return out


def epoch_keys(cfg: config.Config) -> tuple:
    """The settings an epoch's tokens depend on."""
    d, t = cfg.data, cfg.train
    return d.strategy, d.window_stride, t.batch, t.bptt


def round_keys(cfg: config.Config) -> tuple:
    """The settings a round's expected tokens depend on (each round cuts its batches by its own run's):
    an epoch's, and these."""
    return epoch_keys(cfg) + (cfg.data.sample_fraction, cfg.train.local_steps)


def load_held_out(sc, cfg: config.Config, path: str, bc_vocab, what: str | None = None):
    """An encoded, persisted RDD of ``path`` cut into ``data.eval_streams`` contiguous streams (``what``: the
    setting naming it, for errors).

    Held-out text is laid out independently of ``data.partitions`` (the training layout),
    so the training log, ``jobs/evaluate.py`` and any other run agree on the same text.
    """
    d = cfg.data
    hp = paragraphs(sc, path, d.paragraphs, d.level, d.eval_streams, d.max_record_mb, what)
    _check_decodable(hp, path, d, what or path)
    streams, _ = contiguous_partitions(hp, d.eval_streams, shrink=True, name=path, level=_balanced_by(d))
    return encode_partitions(streams, bc_vocab).persist()


def _balanced_by(d: config.DataConfig) -> str | None:
    """:func:`contiguous_partitions`' ``level`` under ``data.balance``."""
    return d.level if d.balance == "tokens" else None


def _check_decodable(paras, path: str, d: config.DataConfig, what: str) -> None:
    """Under ``data.encoding_errors = "strict"`` a text holding undecodable bytes is refused (Hadoop
    decodes them as U+FFFD, and hands Python no bytes: a valid U+FFFD is refused too, and the message
    says so)."""
    if d.encoding_errors == "strict":
        bad = paras.filter(lambda p: "\ufffd" in p).count()
        if bad:
            records = ("line" if d.paragraphs == "line" else "paragraph") + ("s hold" if bad > 1 else " holds")
            raise CorpusError(f"{what}: {path}: {bad:,} {records} undecodable bytes (data.encoding_errors = "
                              "'strict'; Hadoop reads them as U+FFFD, so a text holding that character itself "
                              "reads so too: 'replace' takes it)")


def load_corpus(sc, cfg: config.Config, vocab=None, status=None) -> Corpus:
    """Read, count, encode and cache the corpus; validate every partition. ``status`` (a callable, e.g.
    :meth:`rnnlm.progress.Progress.status`) hears each phase as it starts; each phase's Spark jobs
    carry its name in Spark's UI."""
    d = cfg.data
    config.check_trainable(cfg)

    def phase(text: str) -> None:
        sc.setJobDescription(f"rnnlm: {text}")
        if status is not None:
            status(f"{text} ...")
    phase(f"reading {d.train}")
    paras = paragraphs(sc, d.train, d.paragraphs, d.level, d.partitions, d.max_record_mb, "data.train")
    _check_decodable(paras, d.train, d, "data.train")
    if vocab is None:
        phase(f"counting {d.level}s for the vocabulary")
        vocab = build_vocab(paras, d.level, d.vocab_size, d.min_count, name=d.train)
    bc_vocab = sc.broadcast(vocab)
    phase(f"encoding and caching {d.partitions} partitions")
    parts, balance = contiguous_partitions(paras, d.partitions, name=d.train, level=_balanced_by(d))
    enc = encode_partitions(parts, bc_vocab)
    enc = enc.persist()
    held_out, counts, digests = {}, {}, {}
    try:
        probe = _probe(cfg, enc)
        for name, path in (("valid", d.valid), ("test", d.test)):
            if path:
                phase(f"reading {name} text {path}")
                held_out[name] = load_held_out(sc, cfg, path, bc_vocab, f"data.{name}")
                # counted now (the text is cached here anyway) so that an evaluation can say how much it reads
                rows = held_out[name].map(lambda p: (p[0], len(p[1]), digest(p[1], p[2]))).collect()
                counts[name], digests[name] = sum(r[1] for r in rows), _joined(rows)
    except BaseException:       # a corpus error, a failed job, Ctrl-C: a shared session keeps nothing of it
        try:
            release([bc_vocab], [enc, *held_out.values()])
        except Exception:       # the context stopped: the error that stopped the load is the one to see
            pass
        raise
    sc.setJobDescription(None)
    return Corpus(vocab, enc, held_out.get("valid"), held_out.get("test"), sum(p[1] for p in probe),
                  _scored(probe), counts, {p[0]: p[5] for p in probe}, round_keys(cfg), (bc_vocab,),
                  _joined([(p[0], p[6]) for p in probe]), digests, balance,
                  tuple(p[1] for p in sorted(probe, key=lambda p: p[0])))


def _joined(rows: list) -> str:
    """A text's name for a resume to check, from rows ``(partition, ..., its digest)``: the partitions'
    digests (:func:`probe_task`'s, or a held-out stream's), in order."""
    return hashlib.blake2b(" ".join(r[-1] for r in sorted(rows, key=lambda r: r[0])).encode(),
                           digest_size=8).hexdigest()


def _scored(probe: list) -> Scored:
    return Scored(sum(p[2] for p in probe), sum(p[3] for p in probe))


def scored(cfg: config.Config, data: Corpus, rounds: bool = True) -> Scored:
    """The tokens an epoch and (with ``rounds``) a round of ``cfg`` train on (expected, all partitions):
    the corpus' counts when it was loaded under the same :func:`epoch_keys` and :func:`round_keys`, else
    counted again on its cached partitions (a corpus shared by runs of other settings, as the benchmarks'
    sweeps share one, which may differ in a round's steps alone)."""
    epoch = epoch_keys(cfg)             # round_keys() begins with them
    if data.counted_for == round_keys(cfg) or (not rounds and data.counted_for[:len(epoch)] == epoch):
        return data.scored if rounds else Scored(None, data.scored.epoch)
    return _scored(_probe(cfg, data.train))


def _probe(cfg: config.Config, rdd) -> list:
    """:func:`rnnlm.spark.executor.probe_task`'s rows of every partition; a partition too short for
    ``cfg``'s batches (or without its device) is a :class:`CorpusError`."""
    probe = rdd.mapPartitions(probe_task(cfg)).collect()
    errors = [f"partition {pid}: {err}" for pid, _, _, _, err, *_ in probe if err]
    if errors:
        raise CorpusError(f"{cfg.data.train}: {errors[0]} (strategy {cfg.data.strategy}, bptt {cfg.train.bptt}, "
                          f"batch {cfg.train.batch})")
    return probe


def total_rounds(cfg: config.Config, data: Corpus, counts: Scored | None = None) -> int:
    """``train.rounds``, or the rounds that train on ``train.epochs`` epochs (``counts``: :func:`scored`,
    when the caller has it). A whole number of rounds' worth, as 13 passes of one-pass rounds, is not
    rounded up by the quotient's last bit."""
    if cfg.train.rounds:
        return cfg.train.rounds
    counts = scored(cfg, data) if counts is None or counts.round is None else counts
    return rounds_for(cfg.train.epochs, counts.epoch, counts.round)


def unpersist_corpus(data: Corpus, blocking: bool = False) -> None:
    """Drop the corpus' cached partitions and its vocabulary's broadcast."""
    release(data.broadcasts, [r for r in (data.train, data.valid, data.test) if r is not None], blocking=blocking)


def evaluate_rdd(sc, cfg, params, rdd, last: bool = False) -> float:
    """Mean NLL per token of an encoded RDD under ``params`` (each partition one stream); ``last``:
    the session's last job, whose release waits for the executors' answers if it succeeded."""
    bc, parts = sc.broadcast(params), None
    try:
        parts = rdd.mapPartitions(eval_task(cfg, bc)).collect()
    finally:
        release([bc], blocking=last and parts is not None)
    total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
    if count == 0:              # a perplexity of 1 would be a figure of nothing
        raise CorpusError("the held-out text scores no token: each of its streams is shorter than 2 tokens "
                          "(fewer data.eval_streams, or a longer text)")
    return total / count
