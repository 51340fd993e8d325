"""Plot runs: a metric against tokens, all-reduces, bytes or wall time; or the frontier.

    python jobs/plot.py --runs DIR [DIR ...] [--x tokens|syncs|bytes|wall] [--y train_loss|valid_ppl|...]
                        [--kind metric|frontier|sync] [--pick best|final] --out FIG.png|.svg|.pdf

A DIR is a run (the ``--out`` of train) or a folder of runs; ``webhdfs://host:port/path``
reads from HDFS (``pip install -e ".[hdfs]"``). No Spark is started.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rnnlm import runs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, metavar="DIR")
    ap.add_argument("--kind", choices=("metric", "frontier", "sync"), default="metric",
                    help="metric: --y against --x per run; frontier: best/final --y against bytes per token; "
                         "sync: sync fraction against K per codec")
    ap.add_argument("--x", choices=("tokens", "syncs", "bytes", "wall"), default="tokens")
    ap.add_argument("--y", default="train_loss", help="a metrics key: train_loss, valid_ppl, valid_bpc, ...")
    ap.add_argument("--pick", choices=("best", "final"), default="best")
    ap.add_argument("--log-x", action="store_true")
    ap.add_argument("--out", required=True, help="FIG.png, .svg or .pdf")
    a = ap.parse_args(argv)
    try:
        from rnnlm import plots
    except ImportError as e:
        print(f"error: plotting needs matplotlib ({e}): pip install -e \".[plots]\"", file=sys.stderr)
        return 2
    if os.path.splitext(a.out)[1].lower() not in plots.FORMATS:
        print(f"error: --out {a.out}: the suffix picks the format: {', '.join(plots.FORMATS)}", file=sys.stderr)
        return 2
    try:
        rs = runs.load_all(a.runs)
    except runs.RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.kind == "metric":
        if not any(plots.series(r, a.x, a.y)[0].size for r in rs):
            print(f"error: no run has {a.y!r} in its metrics", file=sys.stderr)
            return 2
        ax = plots.plot_metric(rs, a.x, a.y, log_x=a.log_x)
    elif a.kind == "frontier":
        if not plots.frontier(rs, a.y, a.pick):
            print(f"error: no run has {a.y!r} in its metrics", file=sys.stderr)
            return 2
        ax = plots.plot_frontier(rs, a.y, a.pick)
    else:
        if not plots.sync_fractions(rs):
            print("error: no synchronous run with round timings", file=sys.stderr)
            return 2
        ax = plots.plot_sync_fraction(rs)
    try:
        print(plots.save(ax, a.out))
    except OSError as e:
        print(f"error: --out {a.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
