"""Metric fields and log lines shared by the one-machine and the Spark trainers."""
from __future__ import annotations

import json
import math

EVAL_BPTT = 100   # chunk length when held-out text is scored as one stream
# what a run's files may weigh before they are read: a metrics line is about 1 kB (256 MiB: some
# 200,000 rounds); run.json and config.json hold a configuration
MAX_METRICS, MAX_JSON = 256 << 20, 16 << 20


def number(v) -> float | None:
    """A metrics field as a finite float, or None: a line read from a file may hold anything there
    (a string, null, a bool, an integer of 400 digits)."""
    if type(v) not in (int, float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def loss_fields(loss: float, level: str, prefix: str) -> dict:
    """``<prefix>_loss`` (nats/token), ``_ppl`` (infinite past float64's range, NaN for a NaN loss), and
    ``_bpc`` for characters."""
    try:
        ppl = math.exp(loss)
    except OverflowError:               # past exp(709.78)
        ppl = math.inf
    out = {f"{prefix}_loss": loss, f"{prefix}_ppl": ppl}
    if level == "char":
        out[f"{prefix}_bpc"] = loss / math.log(2)
    return out


def due(round_: int, every: int, last: int) -> bool:
    """Whether an every-N-rounds action (0 = only at the end) falls on ``round_``."""
    return (every > 0 and round_ % every == 0) or round_ == last


def log_line(m: dict, skip=()) -> str:
    return " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in m.items() if not k.startswith(tuple(skip)))


def json_table(line: str) -> dict | None:
    """The JSON table (object) on ``line``, or None: not JSON (a line cut short), or JSON of another kind."""
    try:
        m = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return m if isinstance(m, dict) else None


def json_lines(data: bytes) -> list:
    """The JSON tables of ``data``, one per line, up to the first line that is not one (a line cut
    short by a crash or still being written ends the record, as does any other line)."""
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        m = json_table(line)
        if m is None:
            break
        out.append(m)
    return out
