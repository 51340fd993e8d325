"""Convergence against communication: figures from runs' ``metrics.jsonl`` (matplotlib, Agg).

Every function takes :class:`rnnlm.runs.Run` objects (:func:`rnnlm.runs.load_all`), labels
them by what differs in their configurations (:func:`rnnlm.runs.labels`), draws on a
given ``ax`` or a new figure, and returns the axes. The data drawn comes from functions
that return plain arrays (:func:`series`, :func:`frontier`, :func:`sync_fractions`), so
notebooks and tests can read the numbers behind a figure.

Install with the ``plots`` extra: ``pip install -e ".[plots]"``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import textwrap

import matplotlib
import numpy as np

from .config import ExchangeConfig
from .core.metrics import number
from .runs import labels as run_labels


def _bytes(m: dict) -> float | None:
    sent, broadcast = number(m.get("bytes_sent")), number(m.get("bytes_broadcast"))
    return None if sent is None or broadcast is None else sent + broadcast


# x axes: a metrics line's value (a finite float, or None) and the axis' label
X_AXES = {
    "tokens": (lambda m: number(m.get("tokens")), "tokens seen (all partitions)"),
    "syncs": (lambda m: number(m.get("syncs")), "all-reduces (async: pushes applied)"),
    "bytes": (_bytes, "bytes sent + broadcast"),
    "wall": (lambda m: number(m.get("wall_s")), "wall time (s)"),
}
Y_LABELS = {"train_loss": "training loss (nats/token)", "valid_loss": "validation loss (nats/token)",
            "valid_ppl": "validation perplexity", "valid_bpc": "validation bits/char",
            "test_ppl": "test perplexity", "train_ppl": "training perplexity"}
FORMATS = (".png", ".svg", ".pdf")
_EXCHANGE_DEFAULTS = dataclasses.asdict(ExchangeConfig())


def pyplot():
    """``matplotlib.pyplot``, on the Agg backend unless a notebook's inline one is in use."""
    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")        # headless: no display on executors, CI or a server
    import matplotlib.pyplot as plt
    return plt


def _value(m: dict, y: str) -> float | None:
    if y == "train_ppl":
        loss = number(m.get("train_loss"))
        return None if loss is None else math.exp(min(loss, 709.0))
    return number(m.get(y))


def series(run, x: str = "tokens", y: str = "train_loss") -> tuple:
    """The points of ``y`` against ``x`` in ``run``: the metrics lines that hold a finite ``y`` and ``x``.

    Returns
    -------
    xs, ys : float arrays of equal length
    """
    if x not in X_AXES:
        raise ValueError(f"x must be one of {', '.join(X_AXES)}, not {x!r}")
    fx = X_AXES[x][0]
    pts = [(u, v) for m in run.metrics for u, v in ((fx(m), _value(m, y)),) if u is not None and v is not None]
    return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)


def axes(ax=None, figsize=(6.4, 4.2)):
    """``ax``, or the axes of a new figure of ``figsize`` inches."""
    if ax is None:
        _, ax = pyplot().subplots(figsize=figsize)
    return ax


def smoothed(xs, ys, window: int) -> tuple:
    """The trailing mean of ``window`` points, at the last point of each window."""
    if window <= 1 or ys.size < window:
        return xs, ys
    return xs[window - 1:], np.convolve(ys, np.ones(window) / window, "valid")


def plain(label: str) -> str:
    """``label`` as matplotlib draws it verbatim: a ``$`` (a run's name, ``--labels``) starts math text,
    whose parse error stopped the figure."""
    return label.replace("$", r"\$")


def plot_metric(runs, x: str = "tokens", y: str = "train_loss", ax=None, labels=None, log_x: bool = False,
                marker: str | None = None, smooth: int = 1):
    """One line per run: ``y`` (any metrics key, or ``train_ppl``) against ``x``
    (``tokens``, ``syncs``, ``bytes`` or ``wall``); ``smooth`` > 1 draws the trailing
    mean of that many points (per-round training losses are noisy)."""
    ax = axes(ax)
    for run, label in zip(runs, labels or run_labels(runs)):
        xs, ys = smoothed(*series(run, x, y), smooth)
        if xs.size:
            ax.plot(xs, ys, label=plain(label), marker=marker or ("o" if xs.size < 12 else None), markersize=3)
    ax.set_xlabel(X_AXES[x][1])
    ax.set_ylabel(Y_LABELS.get(y, y))
    if log_x:
        ax.set_xscale("log")
    if x == "bytes":             # after the scale, which resets the formatter: ticks read 200 MB, not 2 x 1e8
        ax.xaxis.set_major_formatter(bytes_formatter())
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize="small", title=_caption(runs, labels), title_fontsize="small")
    return ax


def _caption(runs, labels) -> str | None:
    """The legend's title: what every run sends alike, where the labels are the automatic ones (given as
    ``run_labels(runs)`` too, as the notebook does), which leave it out."""
    return shared_exchange(runs) if labels is None or list(labels) == run_labels(runs) else None


def shared_exchange(runs) -> str | None:
    """What every run sends alike that automatic labels (what differs) leave out, e.g. ``all runs:
    softmax rows+fp16, hidden dense+fp16``; None when that is plain dense float32."""
    groups = ("embed", "softmax", "hidden")
    specs = [{g: (r.config or {}).get("exchange", {}).get(g, "dense") for g in groups} for r in runs]
    same = [f"{g} {specs[0][g]}" for g in groups if specs and all(s[g] == specs[0][g] for s in specs)
            and specs[0][g] != "dense"]
    return "all runs: " + ", ".join(same) if same else None


def plain_numbers(axis) -> None:
    """Tick labels on a log ``axis`` as plain numbers (400, 500, 700; not 4x10^2): within a decade
    its minor ticks too, over one or more decades the decades alone (every minor label ran together)."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return f"{x:.0f}" if x == round(x) else f"{x:g}"      # 1000000, not 1e+06; 2.4, not 2
    axis.set_major_formatter(Plain(labelOnlyBase=False))
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def bytes_formatter():
    """Tick labels in bytes with SI prefixes (kB, MB, GB): 2e8 reads ``200 MB``."""
    from matplotlib.ticker import EngFormatter
    return EngFormatter(unit="B", sep=" ")


def bytes_per_token(run) -> float | None:
    """Bytes sent and broadcast per training token, over the whole run so far (None: its last line
    lacks a count)."""
    m = run.metrics[-1]
    sent, tokens = _bytes(m), number(m.get("tokens"))
    return None if sent is None or tokens is None else sent / max(1.0, tokens)


def pareto(points) -> list:
    """Which ``(cost, value)`` points no other point beats on both (lower is better on both)."""
    return [not any(c2 <= c and v2 <= v and (c2 < c or v2 < v) for c2, v2 in points) for c, v in points]


def frontier(runs, y: str = "valid_ppl", pick: str = "best", labels=None) -> list:
    """One point per run holding ``y``: bytes per training token against its best (lowest)
    or final ``y``, and whether it is on the Pareto front.

    Returns
    -------
    list of dict
        ``label``, ``bytes_per_token``, ``value``, ``pareto`` (runs without ``y`` are left out).
    """
    if pick not in ("best", "final"):
        raise ValueError(f"pick must be 'best' or 'final', not {pick!r}")
    rows = []
    for run, label in zip(runs, labels or run_labels(runs)):
        _, ys = series(run, "tokens", y)
        cost = bytes_per_token(run)
        if ys.size and cost is not None:
            rows.append({"label": label, "bytes_per_token": cost,
                         "value": float(ys.min() if pick == "best" else ys[-1])})
    for r, on in zip(rows, pareto([(r["bytes_per_token"], r["value"]) for r in rows])):
        r["pareto"] = on
    return rows


def plot_frontier(runs, y: str = "valid_ppl", pick: str = "best", ax=None, labels=None):
    """Quality against communication: a point per run, the Pareto front joined and ringed."""
    ax = axes(ax)
    rows = frontier(runs, y, pick, labels)
    for r in rows:
        ax.scatter(r["bytes_per_token"], r["value"], s=28, zorder=3,
                   edgecolors="black" if r["pareto"] else "none", linewidths=1.2)
        ax.annotate(plain(r["label"]), (r["bytes_per_token"], r["value"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    front = sorted((r["bytes_per_token"], r["value"]) for r in rows if r["pareto"])
    if front:
        ax.plot(*zip(*front), "k--", lw=1, label="Pareto front", zorder=2)
        ax.legend(fontsize="small", title=_caption(runs, labels), title_fontsize="small")
    costs = [r["bytes_per_token"] for r in rows]
    if any(c <= 0 for c in costs):        # a run that sent nothing (one machine) stays on the axis, at 0
        ax.set_xscale("symlog", linthresh=min([c for c in costs if c > 0] or [1.0]))
    else:
        ax.set_xscale("log")
    plain_numbers(ax.xaxis)
    ax.set_xlabel("bytes sent + broadcast per training token")
    ax.set_ylabel(f"{pick} {Y_LABELS.get(y, y)}")
    ax.grid(alpha=0.3, which="both")
    return ax


def codec(cfg: dict) -> str:
    """A name of a run's exchange: ``dense``, or each group's spec and the settings that change what
    travels (``embed rows+onebit, softmax rows+onebit, hidden dense+onebit, frequent 0.02, ...``)."""
    ex, groups = cfg.get("exchange", {}), ("embed", "softmax", "hidden")
    parts = [f"{g} {ex.get(g, 'dense')}" for g in groups]
    parts += [f"{k} {ex[k]:g}" if isinstance(ex[k], float) else f"{k} {ex[k]}"
              for k, d in _EXCHANGE_DEFAULTS.items()
              if k not in groups and k in ex and ex[k] != d and (k != "mu" or ex.get("sampled_softmax"))]
    return "dense" if all(p.endswith(" dense") for p in parts) else ", ".join(parts)


def sync_fraction(run) -> float | None:
    """The median over rounds after the first of ``1 - compute_s / round_s``: the share of a
    round not spent in the slowest partition's local steps (broadcast, scheduling, the
    all-reduce, the driver's update). None for runs without round timings (async, one round)."""
    pairs = [(number(m.get("compute_s")), number(m.get("round_s"))) for m in run.metrics[1:]]
    # the slowest partition's steps are inside the round: a pair that says otherwise is not drawn
    fractions = [1 - c / r for c, r in pairs if c is not None and r and 0 <= c <= r]
    return statistics.median(fractions) if fractions else None


def setting(config: dict) -> str:
    """What a round's cost depends on besides K and the codec: the corpus, the model, the partitions and the
    batch, e.g. ``"ptb.train.txt, lstm 2x200, 2 partitions, batch 10"``."""
    d, m, t = (config.get(k, {}) if isinstance(config.get(k), dict) else {} for k in ("data", "model", "train"))
    name = str(d.get("train") or "").rstrip("/").rsplit("/", 1)[-1]
    return (f"{name + ', ' if name else ''}{m.get('cell', '?')} {m.get('layers', '?')}x{m.get('hidden', '?')}, "
            f"{d.get('partitions', '?')} partitions, batch {t.get('batch', '?')}")


def sync_fractions(runs) -> dict:
    """``{codec: [(K, sync fraction), ...] sorted by K}`` over the synchronous runs (repeats of
    one codec and K averaged); runs of several :func:`setting` s (another corpus, model, partitions or
    batch: another round's cost) are not averaged together: their keys are ``"codec; setting"``."""
    out = {}
    for run in runs:
        f = sync_fraction(run)
        k = run.config.get("train", {}).get("local_steps", 0)
        if f is not None and type(k) is int and 0 <= k <= 2 ** 53:     # a damaged run.json's 2**64 is no K
            out.setdefault((codec(run.config), setting(run.config)), {}).setdefault(k, []).append(f)
    several = len({s for _, s in out}) > 1
    return {f"{c}; {s}" if several else c: [(k, statistics.fmean(fs)) for k, fs in sorted(v.items())]
            for (c, s), v in sorted(out.items())}


def plot_sync_fraction(runs, ax=None, names: dict | None = None):
    """Sync fraction against local steps K, one line per codec (``names`` maps a :func:`codec`
    name to a legend label; long names are wrapped)."""
    ax = axes(ax)
    fractions = sync_fractions(runs)
    for name, pts in fractions.items():
        label = (names or {}).get(name) or textwrap.fill(name, 48)
        ax.plot([k for k, _ in pts], [f for _, f in pts], marker="o", label=plain(label))
    ax.set_xscale("symlog", linthresh=1)       # K = 0 (one pass per round) stays on the axis
    from matplotlib.ticker import NullLocator
    ks = sorted({k for pts in fractions.values() for k, _ in pts})
    ax.set_xticks(ks, [str(k) for k in ks])    # every K measured, named (10 and 20, not 10^1 alone)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("local steps between all-reduces (K; 0 = one pass)")
    ax.set_ylabel("sync fraction: 1 - compute_s / round_s")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return ax


def save(fig_or_ax, path: str) -> str:
    """Write a figure as PNG, SVG or PDF, chosen by the suffix of ``path``."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"{path}: the figure's format comes from its suffix: {', '.join(FORMATS)}")
    fig = getattr(fig_or_ax, "figure", fig_or_ax)
    try:
        fig.tight_layout()
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        # written beside it, then renamed: a write that fails (a full disk) leaves the figure there whole
        fd, tmp = tempfile.mkstemp(prefix=".rnnlm-plot-", suffix=ext, dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                fig.savefig(f, format=ext[1:], dpi=120)
            os.replace(tmp, path)
        except (OSError, ValueError, OverflowError):
            raise
        except Exception as e:          # matplotlib's PDF writer, its file cut short, fails as AttributeError
            raise OSError(f"writing the figure failed ({type(e).__name__}: {e})") from None
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    finally:
        pyplot().close(fig)
    return path
