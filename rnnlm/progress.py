"""The driver's progress on a terminal: one status line rewritten in place.

On a terminal (``stream.isatty()``) each round redraws
``round 12/60 [####....................]  20% | 0:14 < 0:56 | loss 2.310 | 41.2k tok/s | 1.20 MB/round``,
never wider than the terminal (the last fields go first); lines that report held-out scores,
and every other message, are printed above it, wrapped at their `` | `` separators. In a
log (not a terminal) nothing is redrawn or wrapped: every round is its own line, as before.
"""
from __future__ import annotations

import shutil
import sys
import time


def _clock(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _mb(n: float) -> str:
    # the unit chosen after rounding: 999,999,999 is 1.00 GB, not 1000.00 MB
    return f"{n / 1e6:.2f} MB" if n < 999.995e6 else f"{n / 1e9:.2f} GB"


def _rate(n: float) -> str:
    return f"{n:.0f}" if n < 9_999.5 else f"{n / 1e3:.1f}k" if n < 999_950 else f"{n / 1e6:.2f}M"


def wrap(line: str, columns: int, sep: str = " | ") -> str:
    """``line`` broken at its ``sep`` separators into lines of at most ``columns - 1`` characters
    (a terminal wraps a line that fills its last column), continuation lines indented; a single
    field longer than that stays whole."""
    out, cur = [], ""
    for field in line.split(sep):
        joined = f"{cur}{sep}{field}" if cur else field
        if cur and len(joined) > columns - 1:
            out.append(cur)
            joined = "  " + field
        cur = joined
    return "\n".join(out + [cur])


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
    columns : int, optional
        The terminal's width; default its size when each line is drawn (it may be resized).
    """

    def __init__(self, stream=None, tty: bool | None = None, width: int = 24, clock=time.monotonic,
                 columns: int | None = None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width, self.clock, self.columns = width, clock, columns
        self.t0 = None
        self.first = None        # the first round reported: the rate is measured from it (a resumed run's too)
        self.base = 0.0          # the run's own clock at that report (its first round, a resumed run's earlier time)
        self.loss = None         # the latest training loss: an async line without pushes carries none
        self.drawn = False

    def _columns(self) -> int:
        return self.columns or shutil.get_terminal_size((80, 24)).columns

    def message(self, text: str) -> None:
        """A line printed in full (above the bar on a terminal, wrapped to its width)."""
        self._clear()
        print(wrap(text, self._columns()) if self.tty else text, file=self.stream, flush=True)

    def status(self, text: str) -> None:
        """What the run is doing before its first round: on a terminal one line replaced by the next
        output (the bar, a message); in a log a line of its own."""
        if not self.tty:
            self.message(text)
            return
        self._clear()
        self.stream.write(text[:self._columns() - 1])
        self.stream.flush()
        self.drawn = True

    def update(self, m: dict, total: int, line: str) -> None:
        """Report the metrics line ``m`` of round ``m["round"]`` of ``total``; ``line`` is its log line."""
        if not self.tty:
            self.message(line)
            return
        now, r = self.clock(), m["round"]
        self.loss = m.get("train_loss", self.loss)
        if self.t0 is None:
            self.t0, self.first = now, r
            wall = m.get("wall_s")
            self.base = float(wall) if type(wall) in (int, float) and 0 <= wall < float("inf") else 0.0
        if any(k.startswith(("valid_", "test_")) for k in m):
            self.message(line)
        self._clear()
        self.stream.write(self.bar(m, total, now))
        self.stream.flush()
        self.drawn = True

    def bar(self, m: dict, total: int, now: float) -> str:
        """The status line, fields dropped from the end until it fits the terminal."""
        r = m["round"]
        done_of = min(r, total), max(1, total)      # rounded down: 199 of 200 rounds is 99%, its bar not full
        since = now - self.t0          # since the first round reported: the rate's span
        done = r - self.first
        eta = _clock(since / done * (total - r)) if done > 0 else "?"
        # the run's clock at the first report, then the bar's own: a sync run's wall_s leaves out its evaluations
        # and checkpoints, which the ETA, from the bar's clock, counts
        elapsed = self.base + since
        per_round = m.get("round_bytes_sent", 0) + m.get("round_bytes_broadcast", 0)
        fields = [f"{_clock(elapsed)} < {eta}", "loss -" if self.loss is None else f"loss {self.loss:.3f}"]
        if "tokens_per_s" in m:
            fields.append(f"{_rate(m['tokens_per_s'])} tok/s")
        fields.append(f"{_mb(per_round)}/round")
        room = self._columns() - 1
        for keep in range(len(fields), -1, -1):
            rest = "".join(f" | {f}" for f in fields[:keep])
            width = max(4, min(self.width, room - len(f"round {r}/{total} [] 100%{rest}")))
            fill = done_of[0] * width // done_of[1]
            line = f"round {r}/{total} [{'#' * fill}{'.' * (width - fill)}] {100 * done_of[0] // done_of[1]:3d}%{rest}"
            if len(line) <= room:
                return line
        return line[:room]

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
