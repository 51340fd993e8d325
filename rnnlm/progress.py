"""The driver's progress on a terminal: one status line rewritten in place.

On a terminal (``stream.isatty()``) each round redraws
``round 12/60 [#####.....] 20% | 0:14 < 0:56 | loss 2.310 | 1.2 MB/round``; lines that
report held-out scores, and every other message, are printed in full above it. In a
log (not a terminal) nothing is redrawn: every round is its own line, as before.
"""
from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


class Progress:
    """Per-round reports for :class:`rnnlm.spark.trainer.Trainer` (its ``progress`` argument).

    Parameters
    ----------
    stream : file, default sys.stdout
    tty : bool, optional
        Redraw in place; default ``stream.isatty()``.
    width : int
        Characters of the bar.
    clock : callable
        Seconds, monotonic (tests pass their own).
    """

    def __init__(self, stream=None, tty: bool | None = None, width: int = 24, clock=time.monotonic):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width, self.clock = width, clock
        self.t0 = None
        self.first = None        # the first round reported: the rate is measured from it (a resumed run's too)
        self.loss = None         # the latest training loss: an async line without pushes carries none
        self.drawn = False

    def message(self, text: str) -> None:
        """A line printed in full (above the bar on a terminal)."""
        self._clear()
        print(text, file=self.stream, flush=True)

    def update(self, m: dict, total: int, line: str) -> None:
        """Report the metrics line ``m`` of round ``m["round"]`` of ``total``; ``line`` is its log line."""
        if not self.tty:
            self.message(line)
            return
        now, r = self.clock(), m["round"]
        self.loss = m.get("train_loss", self.loss)
        if self.t0 is None:
            self.t0, self.first = now, r
        if any(k.startswith(("valid_", "test_")) for k in m):
            self.message(line)
        self._clear()
        self.stream.write(self.bar(m, total, now))
        self.stream.flush()
        self.drawn = True

    def bar(self, m: dict, total: int, now: float) -> str:
        r = m["round"]
        frac = min(1.0, r / max(1, total))
        fill = int(round(frac * self.width))
        elapsed = now - self.t0
        done = r - self.first
        eta = _clock(elapsed / done * (total - r)) if done > 0 else "?"
        per_round = m.get("round_bytes_sent", 0) + m.get("round_bytes_broadcast", 0)
        loss = "-" if self.loss is None else f"{self.loss:.3f}"
        return (f"round {r}/{total} [{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:3.0f}% | "
                f"{_clock(elapsed)} < {eta} | loss {loss} | {_mb(per_round)}/round")

    def _clear(self):
        if self.drawn:
            self.stream.write("\r\033[K")
            self.drawn = False

    def close(self) -> None:
        """End the bar's line (the next output starts on a fresh line)."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
