"""What a round's bytes cost in seconds on a link of a given rate: the model behind
``train.py --dry-run --bandwidth``.
"""
from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(/s)?\s*$", re.I)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$", re.I)


class LinkError(ValueError):
    """A rate or a latency that cannot be read; the message is one line."""


def parse_rate(text: str) -> float:
    """Bits per second of ``"100mbit"``, ``"1gbit"``, ``"10Gbit/s"``, ``"2.5gbps"`` (decimal units, as tc's)."""
    m = _RATE.match(str(text))
    if not m:
        raise LinkError(f"bandwidth {text!r}: expected a number and a unit, e.g. 100mbit, 1gbit, 10gbit")
    bits = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not bits > 0:
        raise LinkError(f"bandwidth {text!r}: must be > 0")
    return bits


def parse_latency(text: str) -> float:
    """Seconds of ``"100us"``, ``"1ms"``, ``"0.5ms"``, ``"0s"``."""
    m = _TIME.match(str(text))
    if not m:
        raise LinkError(f"latency {text!r}: expected a number and a unit, e.g. 100us, 1ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2).lower()]
