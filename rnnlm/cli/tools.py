"""The commands that start no Spark job: generate, demo, plot, download, package, minicluster.

Each takes the namespace its parser (:mod:`.parsers`) makes and returns the exit code.
"""
from __future__ import annotations

import os
import secrets
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout


def say(kind: str, message) -> None:
    """``kind: message`` as one line on stderr: what a path or a file put in it that does not print as
    itself (a line break, ESC, a bidirectional override) is escaped (``\\n``, ``\\x1b``, ``\\u202e``), so
    it cannot read as a second message, recolour the terminal or reorder the line."""
    one = "".join(c if c.isprintable() or c == "\t" else ascii(c)[1:-1] for c in str(message))
    print(f"{kind}: {one}", file=sys.stderr)


def error(message, code: int = 2) -> int:
    """Say ``message`` as an error (:func:`say`); the exit code."""
    say("error", message)
    return code


def generate(a) -> int:
    from ..core import checkpoint
    from ..core.generate import generate as sample
    from ..core.models import build as build_model
    from .checks import load_checkpoint
    from .session import SparkStartError
    if not a.argmax and not (0 < a.temperature < float("inf")):      # before a checkpoint on HDFS starts Spark
        return error(f"--temperature must be a number > 0 (--argmax takes the likeliest token), not {a.temperature}")
    seed = a.seed
    if seed is None:          # a new sample each call, which the printed seed repeats
        seed = secrets.randbelow(2 ** 31)
    try:
        ck = checkpoint.finite(load_checkpoint(a.checkpoint), a.checkpoint)
        model = build_model(ck.config.model)
        text = sample(model, ck.params, ck.vocab, prime=a.prime, length=a.length,
                      temperature=a.temperature, argmax=a.argmax, seed=seed)
    except (checkpoint.CheckpointError, ValueError, SparkStartError) as e:     # the last: a checkpoint on HDFS
        return error(str(e))
    unknown = unknown_tokens(ck.vocab, a.prime)
    if unknown:
        print(f"note: --prime has {len(unknown)} {ck.vocab.level}{'s' * (len(unknown) != 1)} outside the model's "
              "vocabulary, read as its "
              f"unknown token: {', '.join(map(repr, unknown[:10]))}{' ...' if len(unknown) > 10 else ''}",
              file=sys.stderr)
    if a.argmax and a.temperature != 1.0:
        print("note: --temperature does not change --argmax's text (the likeliest token at any temperature)",
              file=sys.stderr)
    if a.seed is None and not a.argmax:
        print(f"seed {seed} (--seed {seed} repeats this sample)", file=sys.stderr)
    print(ck.vocab.join(a.prime, text))
    return 0


def unknown_tokens(vocab, text: str) -> list:
    """The distinct tokens of ``text`` the vocabulary does not hold, in order of appearance."""
    from ..core.vocab import tokenize
    seen = dict.fromkeys(t for t in tokenize(text, vocab.level, open_end=True) if t not in vocab.index)
    return list(seen)


def demo(a) -> int:
    from .. import config
    from ..core.generate import generate as sample
    from ..core.single import train
    from .checks import check_demo_out, locate_data
    path = a.config or os.path.join(ROOT, "conf", "demo.toml")
    try:
        if a.out is not None:
            check_demo_out(a.out)
        cfg = locate_data(config.load(path, a.set), path, strict=False)
        m = train(cfg, out=a.out)
    except (config.ConfigError, OSError, ValueError, RuntimeError, FloatingPointError) as e:
        return error(str(e))        # RuntimeError: no CUDA device for train.device = gpu; FloatingPointError: diverged
    for seed, temp in ((cfg.train.seed, 0.7), (cfg.train.seed + 1, 1.0)):      # one seed fixes every sampler
        text = sample(m["model"], m["params"], m["vocab"], prime=a.prime, length=200, temperature=temp, seed=seed)
        print(f"\n--- sample (temperature {temp}, seed {seed}) ---\n{m['vocab'].join(a.prime, text)}")
    return 0


def _missing(name: str, x: str, rs) -> str:
    """Why no run has a point of ``name``: no line holds it (and the keys it may be a slip for), or
    none holds it, and ``x``, as finite numbers."""
    import difflib
    held = {k for r in rs for m in r.metrics for k in m}
    if name in held or (name == "train_ppl" and "train_loss" in held):
        return f"no run has {name!r} against {x} as finite numbers in its metrics"
    keys = sorted({k for r in rs for m in r.metrics for k, v in m.items() if isinstance(v, (int, float))})
    close = difflib.get_close_matches(name, keys, n=3)
    return f"no run has {name!r} in its metrics" + (f" (did you mean {' or '.join(close)}?)" if close else "")


def plot(a) -> int:
    import numpy as np
    with np.errstate(all="ignore"):        # what NumPy would warn of inside matplotlib ends as one error line
        return _plot(a)


def _plot(a) -> int:
    from .. import runs
    try:
        from .. import plots
    except ImportError as e:
        return error(f"plotting needs matplotlib ({e}): pip install -e \".[plots]\"")
    if os.path.splitext(a.out)[1].lower() not in plots.FORMATS:
        return error(f"--out {a.out}: the suffix picks the format: {', '.join(plots.FORMATS)}")
    skipped = []
    try:
        rs = runs.load_all(a.runs, skipped)
    except runs.RunError as e:
        return error(str(e))
    for why in skipped:
        say("warning", f"left out {why}")
    if a.labels is not None and len(a.labels) != len(rs):
        found = ", ".join(r.name for r in rs)
        return error(f"--labels: {len(a.labels)} labels for {len(rs)} runs ({found})")
    if a.kind == "metric":
        if not any(plots.series(r, a.x, a.y)[0].size for r in rs):
            return error(_missing(a.y, a.x, rs))
        ax = plots.plot_metric(rs, a.x, a.y, labels=a.labels, log_x=a.log_x)
    elif a.kind == "frontier":
        if not plots.frontier(rs, a.y, a.pick):
            return error(_missing(a.y, "bytes per token", rs))
        ax = plots.plot_frontier(rs, a.y, a.pick, labels=a.labels)
    else:
        if a.labels is not None:
            return error("--labels names runs; --kind sync draws one line per codec")
        if not plots.sync_fractions(rs):
            return error("no synchronous run with round timings")
        ax = plots.plot_sync_fraction(rs)
    try:
        print(plots.save(ax, a.out))
    except OSError as e:
        return error(f"--out {a.out}: {e.strerror or e}")
    except (ValueError, OverflowError) as e:      # matplotlib's ticks over a span no float holds (+-1.7e308)
        return error(f"cannot draw the figure: {e}")
    return 0


def download(a) -> int:
    from ..download import CORPORA, DownloadError, fetch
    try:
        for c in a.corpora or list(CORPORA):
            fetch(c, a.dest, a.mirror)
    except DownloadError as e:
        return error(str(e))
    return 0


def package(a) -> int:
    from ..packaging import PackagingError, build_env, build_pyfiles
    try:
        print(build_pyfiles(a.out))
        if a.env:
            print(build_env(a.env))
    except PackagingError as e:
        return error(str(e))
    return 0


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def minicluster(a) -> int:
    from ..hadoop.minicluster import MiniCluster, MiniClusterError, build, hostname_not_on_loopback, missing_tools
    problem = missing_tools()
    if problem:
        return error(problem)
    if a.build:
        try:
            print(f"classpath {build()}")
        except MiniClusterError as e:
            return error(str(e), 1)
        return 0
    if not a.dir:
        return error("--dir is required (or --build)")
    try:
        os.makedirs(a.dir, exist_ok=True)
    except OSError as e:
        return error(f"--dir {a.dir}: {e.strerror}")
    warning = hostname_not_on_loopback()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    cluster = MiniCluster(a.dir, a.datanodes, a.nodemanagers, a.nm_memory_mb)
    try:
        cluster.start()
        print(cluster.endpoints.line(), flush=True)
        while cluster.proc.poll() is None:
            time.sleep(0.5)
        return error(f"the cluster's JVM exited (code {cluster.proc.returncode}; log: {cluster.log_path})", 1)
    except _Stop as e:
        print(f"stopping ({e})", file=sys.stderr)
        return 0
    except MiniClusterError as e:
        return error(str(e), 1)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):      # a second one must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
