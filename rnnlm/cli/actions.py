"""What the jobs do, as importable functions (the jobs are thin ``main()``s)."""
from __future__ import annotations

import sys


from ..core import checkpoint
from ..core.files import PathError
from .. import config
from ..spark import corpus
from ..spark.linkcost import LinkError, parse_latency, parse_rate
from ..core.metrics import loss_fields, number
from ..spark.rundir import TrainingError
from ..spark.session import job_errors, job_failure, jvm_ended, release
from ..spark.stall import StallWatch
from ..spark.stop import Interrupted
from ..spark.trainer import Trainer
from ..core.vocab import VocabError
from ..progress import Progress
from .. import trackers
from . import signals
from .tools import error
from .session import SparkStartError, read_checkpoint, spark_session, stop_now

EXPECTED = (config.ConfigError, corpus.CorpusError, checkpoint.CheckpointError, TrainingError,
            VocabError, FileNotFoundError, LinkError, trackers.TrackerError, PathError, SparkStartError)


def guarded(fn) -> int:
    """Run ``fn``; expected failures become one line on stderr and exit code 2, as does Spark's JVM ending
    under it; Ctrl-C one line and exit code 130, SIGTERM one line and 143 (:mod:`.signals`)."""
    try:
        return fn() or 0
    except Interrupted as e:
        return error(e, e.exit_code)
    except KeyboardInterrupt as e:
        return signals.report(e)
    except Exception as e:
        if (stop := signals.stopped()) is not None:      # a failure of the clean-up a signal began
            return signals.report(stop)
        if isinstance(e, job_errors()):     # a job Spark aborted outside a round (which says its own line)
            return error(f"a Spark job failed: {job_failure(str(e))}")
        if isinstance(e, EXPECTED):
            return error(e)
        if jvm_ended():             # every call into it failed, the clean-up's too: this is what ended the command
            return error("Spark's JVM ended under this command (killed, or out of memory: the system's log says "
                         "which); a run's --resume continues from its last checkpoint")
        raise


def make_trainer(spark, cfg, out: str, log=print, progress=None, fs=None, sinks=()):
    """The driver for ``cfg.train.mode``: the synchronous :class:`Trainer` or the parameter server's
    (``spark`` None with a LocalFS ``fs``: a resumed run already at its length, which needs no Spark);
    ``sinks``: :mod:`rnnlm.trackers` that receive its metrics lines too."""
    if cfg.train.mode == "async":
        from ..spark.async_trainer import AsyncTrainer
        return AsyncTrainer(spark, cfg, out, log, progress, fs, sinks)
    return Trainer(spark, cfg, out, log, progress, fs, sinks)


def train(a) -> int:
    from ..core.files import LocalFS
    from .checks import check_device, check_init_from, check_init_outside, check_train, checked_init, finished_run
    cfg = config.load(a.config, a.set)
    bandwidth, latency = getattr(a, "bandwidth", None), getattr(a, "latency", None)
    if (bandwidth or latency) and not a.dry_run:
        raise LinkError("--bandwidth and --latency go with --dry-run")
    if bandwidth:
        parse_rate(bandwidth)
    if latency:
        if not bandwidth:
            raise LinkError("--latency needs --bandwidth")
        parse_latency(latency)
    init_from, keep = getattr(a, "init_from", None), getattr(a, "keep_optimizer", False)
    if init_from and getattr(a, "overwrite", False) and not a.dry_run:
        check_init_outside(init_from, a.out)            # path by path: under spark-submit too
    if init_from and a.resume:
        raise config.ConfigError("--init-from starts a new run from a checkpoint's weights; --resume continues "
                                 "the run in --out: not both")
    if keep and not init_from:
        raise config.ConfigError("--keep-optimizer goes with --init-from")
    logs = getattr(a, "log", [])
    if logs and a.dry_run:
        raise trackers.TrackerError("--log goes with training, not --dry-run")
    logs = trackers.parse(logs, a.out, getattr(a, "overwrite", False))
    # what can be checked without Spark is, before its JVM takes 13-16 s to start
    check_device(cfg, a.master)
    cfg = check_train(cfg, a.config, a.out, a.resume, getattr(a, "overwrite", False), a.dry_run)
    init = check_init_from(cfg, init_from, keep) if init_from else None
    if a.dry_run:
        from ..spark.dryrun import dry_run
        with spark_session("rnnlm-dry-run", a.master, a.verbose) as spark:
            if init_from and init is None:           # a Hadoop path, read by this session's Hadoop client
                init = checked_init(read_checkpoint(spark.sparkContext, init_from), cfg, init_from, keep)
            dry_run(spark, cfg, bandwidth=bandwidth, latency=latency or "0ms", init=init)
        return 0
    done = finished_run(cfg, a.out, a.resume, getattr(a, "overwrite", False))
    if done is not None:        # nothing to do, said without Spark
        tr = make_trainer(None, cfg, done, fs=LocalFS())
        return _report(tr, tr.run(resume=True), a.samples)
    bar = Progress() if sys.stdout.isatty() else None
    sinks, ok = [], False
    try:
        with spark_session("rnnlm-train", a.master, a.verbose, progress=bar) as spark:
            try:
                if init_from and init is None:           # a Hadoop path, read by this session's Hadoop client
                    init = checked_init(read_checkpoint(spark.sparkContext, init_from), cfg, init_from, keep)
                log = bar.message if bar else print
                sinks = trackers.start(logs, cfg, a.out, log, resume=a.resume and not getattr(a, "overwrite", False))
                tr = make_trainer(spark, cfg, a.out, log=log, progress=bar, sinks=sinks)
                last, ok = tr.run(resume=a.resume, overwrite=getattr(a, "overwrite", False), init=init), True
            except (Interrupted, KeyboardInterrupt):
                stop_now(spark)       # cancels what runs and releases the executors before the process exits
                raise
    finally:
        for t in sinks:
            t.close(ok)
        if bar:
            bar.close()
    return _report(tr, last, a.samples)


def _report(tr, last: dict, samples: int) -> int:
    """The run's last line (``done: ...``) and ``samples`` texts from its model."""
    from ..core.generate import generate
    from ..core.models import build as build_model
    # an async run's last line may count no push, and so carry no loss: the latest of its round is reported
    loss = next((v for m in reversed(tr.metrics)
                 if m.get("round") == last["round"] and (v := number(m.get("train_loss"))) is not None), None)
    ppl = number(last.get("valid_ppl"))
    print(f"done: round {last['round']}" + (f" | train_loss {loss:.4f}" if loss is not None else "")
          + (f" | valid_ppl {ppl:.2f}" if ppl is not None else "") + f" | checkpoint {tr.dir.ck_path}")
    model = build_model(tr.cfg.model)
    for s in range(samples):
        print(f"--- sample {s + 1} ---")
        try:
            print(generate(model, tr.params, tr.vocab, length=300, temperature=0.8, seed=tr.cfg.train.seed + s))
        except ValueError as e:          # weights that overflow on the text: the run is done, its sample is not
            return error(f"no sample: {e}")
    return 0


def evaluate(a) -> int:
    """Score ``a.data`` under the checkpoint ``a.checkpoint``: nothing else of the training
    run (its data paths, its partitions) is read."""
    from .checks import check_checkpoint, check_device, check_input, check_records
    if a.streams is not None:       # data.eval_streams' range, checked where every key's is
        try:
            config.load(None, [f"data.eval_streams={a.streams}"])
        except config.ConfigError as e:
            raise config.ConfigError(f"--streams: {e}") from None
    # a GPU asked for where every executor runs here and there is none: said now, not after 4 tries per task
    check_device(config.replace(config.load(None, []), "train", device=a.device), a.master, "--device")
    check_input(a.data, "--data")
    ck = check_checkpoint(a.checkpoint)          # a local one, read and verified before Spark starts
    if ck is not None:
        checkpoint.finite(ck, a.checkpoint)
        check_records(a.data, ck.config.data, "--data")
    with spark_session("rnnlm-evaluate", a.master, a.verbose) as spark:
        sc = spark.sparkContext
        ck = ck or checkpoint.finite(read_checkpoint(sc, a.checkpoint), a.checkpoint)
        cfg = config.replace(ck.config, "train", device=a.device)      # where this machine scores it
        if a.streams is not None:
            cfg = config.replace(cfg, "data", eval_streams=a.streams)
        rdd, loss = corpus.load_held_out(sc, cfg, a.data, sc.broadcast(ck.vocab)), None
        streams = rdd.getNumPartitions()       # one per paragraph where the text holds fewer than asked
        if streams < cfg.data.eval_streams:
            asked = (f"--streams {a.streams}" if a.streams is not None
                     else f"data.eval_streams = {cfg.data.eval_streams}")
            unit = "line" if cfg.data.paragraphs == "line" else "paragraph"
            print(f"note: {asked}: {a.data} holds {streams} {unit}{'s' * (streams != 1)}, scored as "
                  f"{streams} stream{'s' * (streams != 1)}")
        try:
            unk = ck.vocab.unk_id
            unknown, tokens = rdd.map(lambda p: (int((p[1] == unk).sum()), len(p[1]))) \
                .fold((0, 0), lambda x, y: (x[0] + y[0], x[1] + y[1]))
            # a stuck task killed and run again as in training, by the checkpoint's train.stall_* keys
            watch = StallWatch(sc, None, cfg.train.stall_factor, cfg.train.stall_s)
            loss = watch.run(lambda: corpus.evaluate_rdd(sc, cfg, ck.params, rdd, last=True), f"scoring {a.data}")
        finally:        # the session stops next: a release that ended well waits for the executors' answers
            release(rdds=[rdd], blocking=loss is not None)
    if unknown:         # outside the checkpoint's vocabulary (or the text's own <unk>): a perplexity of fewer words
        print(f"note: {unknown:,} of {tokens:,} tokens ({100 * unknown / tokens:.1f}%) read as "
              f"{ck.vocab.tokens[unk]!r}, the checkpoint's unknown token")
    fields = loss_fields(loss, cfg.data.level, "")
    # the result is named by the file scored, whichever split it is
    print(f"{a.data}: " + " | ".join(f"{k.lstrip('_')} {v:.4f}" for k, v in fields.items()))
    print(f"ppl={fields['_ppl']:.4f}")
    return 0
