"""What a round's bytes cost in seconds on a link of a given rate: the model behind
``train.py --dry-run --bandwidth``.
"""
from __future__ import annotations

import math
import re

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:([kmgt]?)(bit|bps)(/s)?)?\s*$", re.I)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$", re.I)


class LinkError(ValueError):
    """A rate or a latency that cannot be read; the message is one line."""


def parse_rate(text: str) -> float:
    """Bits per second of ``"100mbit"``, ``"1gbit"``, ``"10Gbit/s"``, ``"2.5gbps"``, read as tc reads them:
    decimal units, ``bit`` bits and ``bps`` bytes per second (``2.5gbps`` is 20 Gbit/s), a bare number bits."""
    m = _RATE.match(str(text))
    if not m:
        raise LinkError(f"bandwidth {text!r}: expected a number and a unit, e.g. 100mbit, 1gbit, 10gbit "
                        "(bit: bits, bps: bytes per second, as tc reads them)")
    bits = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()] * (8 if (m.group(3) or "").lower() == "bps" else 1)
    if not bits > 0:
        raise LinkError(f"bandwidth {text!r}: must be > 0")
    return bits


def parse_latency(text: str) -> float:
    """Seconds of ``"100us"``, ``"1ms"``, ``"0.5ms"``, ``"0s"``."""
    m = _TIME.match(str(text))
    if not m:
        raise LinkError(f"latency {text!r}: expected a number and a unit, e.g. 100us, 1ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2).lower()]


# TCP/IP headers on a 1500-byte MTU: what a link of rate R carries as payload (measured here: 96-97%)
PAYLOAD = 0.96
# latencies a synchronous round waits for: the tasks' launch, the broadcast's fetch, the results'
# fetch (Spark sends task results over 1 MB through the block manager: a request, then the data)
# and the tasks' completion; each is a request and its answer, two one-way latencies
ROUND_TRIPS = 4


def broadcast_copies(partitions: int) -> float:
    """Copies of a broadcast that leave the driver: Spark's torrent broadcast lets an executor
    fetch a block from a peer that already has it, so fewer than one per executor do. Measured
    through the driver's link (``benchmarks/links.py``): 1.6-1.9 at 2 executors, 2.5 at 4; taken
    as (P + 1) / 2."""
    return (partitions + 1) / 2


def tree_levels(partitions: int, depth: int) -> int:
    """The levels ``treeAggregate`` merges on executors before the driver (PySpark's own loop): 0 up to
    4 partitions at depth 2, where every partition's result reaches the driver directly."""
    n, scale, levels = partitions, max(math.ceil(partitions ** (1.0 / depth)), 2), 0
    while n > scale + n / scale:
        n /= scale
        levels += 1
    return levels


def predict(sent: float, broadcast: float, partitions: int, bits_per_s: float, latency_s: float = 0.0,
            overhead_s: float = 0.0, compute_s: float | None = None) -> dict:
    """Seconds a synchronous round spends outside its computation on links of ``bits_per_s``.

    Every byte of ``treeAggregate`` and of the broadcast passes through the driver's one link:
    ``sent`` (all partitions' results, which reach the driver directly while the tree has one
    level: up to 4 partitions at ``tree_depth = 2``) in, and :func:`broadcast_copies` of the
    broadcast out. Down and up do not overlap: the broadcast is fetched when the tasks start,
    the results travel when they end.

    ``overhead_s`` is the round's cost on a free network (Spark's scheduling, the driver's own
    work, serialising and copying the bytes), measured by the dry run. About half of it is the
    CPU work of moving the bytes, which a slower link hides behind the wire (fitted on the
    measured 10 and 1 Gbit/s cells, ``benchmarks/links.py``): the round pays the larger of the
    overhead and half of it plus the wire time.
    """
    rate = bits_per_s / 8 * PAYLOAD
    down_s, up_s = sent / rate, broadcast_copies(partitions) * broadcast / rate
    wire_s = down_s + up_s + 2 * ROUND_TRIPS * latency_s
    sync_s = max(overhead_s, overhead_s / 2 + wire_s)
    out = {"sync_s": sync_s, "down_s": down_s, "up_s": up_s, "latency_s": wire_s - down_s - up_s, "wire_s": wire_s,
           "overhead_s": overhead_s}
    if compute_s is not None:
        out["round_s"] = compute_s + sync_s
        out["sync_fraction"] = sync_s / (compute_s + sync_s)
    return out
