"""Single-process training: the core loop on one machine, no Spark.

The quality reference for the distributed trainer and the engine of the demo.
"""
from __future__ import annotations

import gzip
import io
import os
import time
import zlib
from collections import Counter

from . import backend, checkpoint, files
from .. import config
from .local import held_out_nll, train_steps
from .strategies import StreamBlock
from .metrics import due, log_line, loss_fields
from .models import build as build_model
from .optim import make_optimizer
from .schedule import Schedule, early_stop, improves, rounds_for
from .vocab import Vocab, tokenize


def read_text(path: str, errors: str = "replace") -> str:
    """Read a UTF-8 text file; undecodable bytes become U+FFFD (or fail with ``errors='strict'``).
    ValueError, before a byte is read, for what is not a regular file (``/dev/zero`` is read forever) or
    holds more than a sixteenth of this machine's memory (its words, ids and vocabulary as Python objects
    take ~12 times the text: the trainer of one process is for texts that fit; Spark's reads any). Every
    message names the file."""
    most = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 16
    if path.endswith(files.HADOOP_CODECS):
        raise ValueError(f"{path}: the single-process trainer reads plain or gzip text (Hadoop reads this "
                         "codec): train it with Spark, or decompress it")
    try:
        data = files.read_regular(path, most)
        if path.endswith(".gz"):              # as Hadoop reads it: by its name
            data = _inflated(path, data, most)
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory") from None
    except FileNotFoundError:       # was "[Errno 2] No such file or directory: 'data/ptb.train.txt'"
        preset = path.split("/")[0] == "data"                   # where the presets name their corpora
        raise ValueError(f"{path}: No such file" + (" (rnnlm download fetches the corpora the presets name)"
                                                    if preset else "")) from None
    except files.TooLarge as e:
        raise ValueError(f"{path}: {e.held()} than the {most >> 20:,} MiB (a sixteenth of this "
                         "machine's memory) the single-process trainer reads: train it with Spark") from None
    try:
        text = data.decode("utf-8-sig", errors=errors)     # a leading byte order mark is no text, as to Hadoop
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason}; data.encoding_errors = 'strict'): 'replace' "
                         "reads such bytes as U+FFFD") from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text   # universal newlines


def _inflated(path: str, data: bytes, most: int) -> bytes:
    """A gzip file's text, at most ``most`` bytes of it (a small file can inflate without bound)."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            text = f.read(most + 1)
    except (OSError, EOFError, zlib.error) as e:      # BadGzipFile is an OSError
        raise ValueError(f"{path} is not gzip text ({e})") from None
    if len(text) > most:
        raise files.TooLarge(path, None, most)
    return text


# what Spark's trainers read that this one does not: a key set to other than its default is named at the start
IGNORED = (("data", "strategy"), ("data", "sample_fraction"), ("data", "eval_streams"), ("data", "test"),
           ("exchange", "sampled_softmax"), ("train", "mode"))


def ignored(cfg: config.Config) -> list:
    """``["section.key = value"]`` of :data:`IGNORED` keys ``cfg`` sets to other than their defaults."""
    defaults = config.Config()
    return [f"{s}.{k} = {getattr(getattr(cfg, s), k)!r}" for s, k in IGNORED
            if getattr(getattr(cfg, s), k) != getattr(getattr(defaults, s), k)]


def train(cfg: config.Config, out: str | None = None, log=print) -> dict:
    """Train ``cfg`` on one machine; return the final metrics.

    Validation is ``data.valid`` or, when empty, the last 10% of ``data.train``.
    Runs ``train.rounds`` rounds of ``train.local_steps`` steps (or
    ``train.epochs`` passes), evaluating every ``train.eval_every`` rounds, and
    saves a checkpoint to ``out`` at the end.
    """
    d, t = cfg.data, cfg.train
    config.check_run(cfg)
    text = read_text(d.train, d.encoding_errors)
    tokens = tokenize(text, d.level)
    # without data.valid the last 10% is held out, its tokens counted for nothing (the vocabulary included)
    cut = len(tokens) if d.valid else int(len(tokens) * 0.9)
    vocab = Vocab.from_counts(Counter(tokens[:cut]), d.level, d.vocab_size, d.min_count)
    cfg = config.resolve(cfg, len(vocab))
    ids = vocab.ids(tokens)                 # the text split once
    ids, valid = ids[:cut], (vocab.encode(read_text(d.valid, d.encoding_errors)) if d.valid else ids[cut:])
    if len(valid) < 2:              # known now, not after a round of training
        raise ValueError(f"the validation text has {len(valid)} token{'s' * (len(valid) != 1)}: "
                         f"{'data.valid' if d.valid else 'the last 10% of data.train'} must hold at least 2")
    xp = backend.get_xp(t.device)
    model = build_model(cfg.model, xp=xp)
    opt, sched = make_optimizer(cfg.optim), Schedule(cfg.optim)
    params = model.init_params(t.seed)
    opt_state = opt.init_state(params)
    block = StreamBlock(ids, t.batch, t.bptt)
    K = t.local_steps or block.steps_per_pass          # 0: one pass per round
    rounds = t.rounds or rounds_for(t.epochs, block.steps_per_pass, K)      # config: epochs > 0 here
    state = model.zero_state(t.batch)
    step, wall, eval_s, metrics = 0, 0.0, 0.0, {}       # wall_s: training alone, as Spark's trainer counts it
    best = None                                         # {"round", "valid_loss"}: the lowest validation loss
    unread = ignored(cfg)
    if unread:
        log(f"note: this trainer of one process trains streams with the full softmax and scores data.valid; it "
            f"ignores {', '.join(unread)} (Spark's trainer reads them)")
    if t.global_batch or t.max_streams:     # the streams of all partitions together: this trains one's share
        log(f"note: this trainer of one process trains train.batch = {t.batch} streams, one partition's share of "
            f"{'train.global_batch' if t.global_batch else 'train.max_streams'} on data.partitions = "
            f"{d.partitions}; for {d.partitions * t.batch} streams set data.partitions = 1")
    log(f"vocab {len(vocab):,} | params {model.layout.size:,} | train tokens {len(ids):,} | "
        f"{block.steps_per_pass} steps per epoch | {rounds} rounds x {K} steps")
    for r in range(1, rounds + 1):
        epoch = step / block.steps_per_pass
        lr = sched.lr(epoch)
        drop_rng = backend.rng_for(xp, t.seed, r, 0) if cfg.model.dropout else None
        t0 = time.perf_counter()
        res = train_steps(model, opt, params, opt_state, block.batches(step, K), state,
                          lr=lr, clip_norm=cfg.optim.clip_norm, clip_value=cfg.optim.clip_value,
                          grad_norm=t.grad_norm, dropout_rng=drop_rng)
        wall += time.perf_counter() - t0
        state, step = res.state, step + res.steps
        metrics = {"round": r, "epoch": round(step / block.steps_per_pass, 4), "lr": lr,
                   "train_loss": res.loss_sum / res.tokens, "wall_s": round(wall, 3)}
        if due(r, t.eval_every, rounds):
            t0 = time.perf_counter()
            vl, vn = held_out_nll(model, params, [valid])        # one stream, however short
            eval_s += time.perf_counter() - t0
            loss = vl / vn
            metrics.update(loss_fields(loss, d.level, "valid"), eval_s=round(eval_s, 3))
            sched.observe(loss)
            if improves(best, loss):
                best = {"round": r, "valid_loss": loss}
            log(log_line(metrics))
            stopped = early_stop(t, r, best) if r < rounds else None
            if stopped is not None:
                log(f"stopped early after round {r} of {rounds}: {stopped}")
                break
    if out:
        checkpoint.save(out, checkpoint.Checkpoint(
            params=backend.to_numpy(params), config=cfg, vocab=vocab,
            optim={k: backend.to_numpy(v) for k, v in opt_state.items() if k != "t"},
            optim_t=opt_state["t"], position={"round": metrics.get("round", rounds), "step": step},
            hidden=backend.to_numpy(state), schedule=sched.state))
        log(f"checkpoint written to {out}")
    metrics["model"], metrics["params"], metrics["vocab"] = model, params, vocab
    return metrics
