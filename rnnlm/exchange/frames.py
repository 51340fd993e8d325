"""Blocks and a partition's round contribution as a wire frame's ``(fields, arrays)``, and back,
every field checked (no Spark, no sockets: :mod:`rnnlm.server.wire` moves the frames).

Whatever arrives is checked against what the receiver expects before anything is decoded:
block names and shapes from the model's layout, each codec's payload dtype and shape for the
rows it names (so decoding allocates at most the slot's size), row ids sorted, unique and in
range, scales finite, statistics plain finite numbers, the carried hidden state and optimizer
state in their expected shapes and finite, as are the averaged optimizer state's blocks, and an
error report one printable line. A refusal raises :class:`Malformed` with a one-line reason.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .aggregate import Aggregate
from .blocks import CODECS, FP16_EXPS, Block, wire_shapes
from .round import OPT, Carry

# the dtype each codec's payload must arrive in (anything else is refused); f32 blocks of a
# float64 model travel as float64
DATA_DTYPE = {"f32": np.float32, "fp16": np.float16, "bf16": np.uint16, "int8": np.int8, "onebit": np.uint8}
STAT_MAX = 2 ** 53              # counts and sums: exact in float64, far above any real round's
_STAT_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}")
_MAX_STATS, _MAX_ERROR = 256, 2000
# C0 and C1 controls, DEL, line and paragraph separators, bidi and zero-width format characters
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


class Malformed(ValueError):
    """A frame that does not describe what the receiver expects; the message is one line."""


def real(v) -> float | None:
    """A JSON number as a finite float, or None (a string, a bool, NaN, infinity, a 400-digit integer)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        x = float(v)            # OverflowError for an integer beyond float's range
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def printable(text: str) -> bool:
    """Whether ``text`` holds no control, line-separator or bidi character (it prints as one line,
    as itself: no forged second line, no terminal escape)."""
    return not _UNPRINTABLE.search(text)


def one_line(text) -> str:
    """``text`` made :func:`printable`: those characters become spaces, runs of whitespace one space."""
    return " ".join(_UNPRINTABLE.sub(" ", str(text)).split())


# ------------------------------------------------------------------ blocks
def block_to_wire(name: str, b: Block) -> tuple:
    """``(meta, arrays)`` of block ``b`` sent under ``name``: arrays ``<name>.data``, ``.ids``, ``.scale``."""
    scalar = not isinstance(b.scale, np.ndarray)
    arrays = {f"{name}.data": b.data}
    if b.ids is not None:
        arrays[f"{name}.ids"] = b.ids
    if not scalar:
        arrays[f"{name}.scale"] = b.scale
    return {"codec": b.codec, "scale": float(b.scale) if scalar else None}, arrays


def block_from_wire(name: str, shape: tuple, meta, arrays: dict, f32=np.float32) -> Block:
    """The block sent under ``name`` for a slot of ``shape``, every array checked; nothing decoded.
    ``f32``: the dtype of an ``f32`` block's values (the model's)."""
    if not isinstance(meta, dict) or meta.get("codec") not in CODECS:
        raise Malformed(f"{name}: unknown codec")
    codec = meta["codec"]
    R, C = shape[0], math.prod(shape[1:])
    ids = _row_ids(name, arrays.get(f"{name}.ids"), R)
    data_shape, scale_shape = wire_shapes(codec, R if ids is None else len(ids), C)
    data, dtype = arrays.get(f"{name}.data"), np.dtype(f32 if codec == "f32" else DATA_DTYPE[codec])
    if not isinstance(data, np.ndarray) or data.dtype != dtype or data.shape != data_shape:
        raise Malformed(f"{name}: {codec} data must be a {dtype.name}{list(data_shape)} array")
    if scale_shape is None:
        scale = _scalar_scale(name, codec, meta.get("scale"), arrays)
    else:
        scale = _scale_rows(name, codec, arrays.get(f"{name}.scale"), scale_shape)
    b = Block.__new__(Block)
    b.__setstate__((tuple(shape), ids, codec, data, scale))
    return b


def _row_ids(name: str, ids, R: int, what: str = "row ids"):
    if ids is None:
        return None
    # each neighbour compared, not np.diff: int32 differences wrap ([0, 2e9, -2e9, 5] read as increasing)
    ordered = (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype == np.int32
               and (ids.size == 0 or (ids[0] >= 0 and ids[-1] < R and bool(np.all(ids[1:] > ids[:-1])))))
    if not ordered:
        raise Malformed(f"{name}: {what} must be sorted unique int32 in [0, {R})")
    return ids


def _scalar_scale(name: str, codec: str, scale, arrays: dict) -> float:
    if f"{name}.scale" in arrays:
        raise Malformed(f"{name}: carries an array {name}.scale the {codec} codec does not have")
    x = real(scale)
    if codec == "fp16":
        lo, hi = FP16_EXPS
        if x is None or not 2.0 ** lo <= x <= 2.0 ** hi or math.frexp(x)[0] != 0.5:
            raise Malformed(f"{name}: the fp16 scale must be a power of two in [2^{lo}, 2^{hi}]")
    elif x != 1.0:
        raise Malformed(f"{name}: the {codec} scale must be 1")
    return x


def _scale_rows(name: str, codec: str, scale, shape: tuple):
    if not isinstance(scale, np.ndarray) or scale.dtype != np.float32 or scale.shape != shape:
        raise Malformed(f"{name}: {codec} scale must be a float32{list(shape)} array")
    if not np.isfinite(scale).all():
        raise Malformed(f"{name}: {codec} scale must hold finite values")
    return scale


# ------------------------------------------------------------ contributions
@dataclass(frozen=True)
class Expected:
    """What a round's contributions must look like (the driver's knowledge of the run).

    blocks : name -> shape of every block a healthy contribution sends (``params.<slot>``,
        ``opt.<slot>`` when the optimizer state is averaged)
    partitions : pids are in ``[0, partitions)``
    vocab : word ids are in ``[0, vocab)``
    state : the carried hidden state's shape, or None when partitions carry none
    opt : the names of the optimizer slots a partition carries (``train.optim_state = "local"``;
        possibly none, as SGD's: its step count alone), or None when partitions carry none
    size : the flat parameter count (an optimizer slot's length)
    dtype : the model's float dtype (its f32 blocks, state and optimizer slots)
    """

    blocks: dict
    partitions: int
    vocab: int
    state: tuple | None
    opt: tuple | None
    size: int
    dtype: str = "float32"


def contribution_to_wire(pid: int, agg: Aggregate) -> tuple:
    """``(fields, arrays)`` of partition ``pid``'s leaf ``agg`` (from
    :meth:`rnnlm.exchange.round.SyncRound.contribution` or ``.failed``)."""
    carry = agg.local[pid]
    error = None if carry.error is None else one_line(carry.error)[:_MAX_ERROR] or "failed"   # as the receiver takes it
    fields = {"pid": pid, "weight": agg.weight, "stats": dict(agg.stats), "blocks": {},
              "error": error, "state": carry.state is not None,
              "opt": None if carry.opt is None else sorted(k for k in carry.opt if k != "t"),
              "t": None if carry.opt is None else int(carry.opt.get("t", 0))}
    arrays = {"words": np.asarray(agg.words, np.int32)}
    for name, b in agg.dense.items():
        fields["blocks"][name], more = block_to_wire(name, b)
        arrays.update(more)
    if carry.state is not None:
        arrays["carry.state"] = carry.state
    for k in fields["opt"] or ():
        arrays[f"carry.opt.{k}"] = carry.opt[k]
    return fields, arrays


def contribution_from_wire(fields: dict, arrays: dict, expect: Expected) -> tuple:
    """``(pid, leaf Aggregate)`` of a frame from :func:`contribution_to_wire`, checked against ``expect``."""
    pid = fields.get("pid")
    if not is_int(pid) or not 0 <= pid < expect.partitions:
        raise Malformed(f"pid {pid!r:.40} is not a partition of this run (0..{expect.partitions - 1})")
    error = fields.get("error")
    if error is not None:
        if (not isinstance(error, str) or not 0 < len(error) <= _MAX_ERROR or fields.get("blocks")
                or set(arrays) - {"words"}):
            raise Malformed(f"partition {pid}: an error is a string of 1 to {_MAX_ERROR} characters, sent alone")
        if not printable(error):        # it becomes the run's stop message
            raise Malformed(f"partition {pid}: an error is one line without control characters")
        return pid, Aggregate.contribution(0.0, {}, {pid: Carry(error=error)})
    weight = real(fields.get("weight"))
    if weight is None or not 0 <= weight <= STAT_MAX:
        raise Malformed(f"partition {pid}: weight must be a finite number in [0, 2**53]")
    stats = _stats(pid, fields.get("stats"))
    meta = fields.get("blocks")
    if not isinstance(meta, dict) or set(meta) != set(expect.blocks):
        raise Malformed(f"partition {pid}: blocks must be exactly {sorted(expect.blocks)[:4]}...")
    carry = _carry(pid, fields, arrays, expect)
    known = {"words"} | ({"carry.state"} if carry.state is not None else set()) | \
        {f"carry.opt.{k}" for k in (carry.opt or ()) if k != "t"} | \
        {f"{n}.{part}" for n in meta for part in ("data", "ids", "scale")}
    if set(arrays) - known:
        raise Malformed(f"partition {pid}: unknown arrays {sorted(set(arrays) - known)[:3]}")
    blocks = {n: block_from_wire(n, shape, meta[n], arrays, expect.dtype) for n, shape in expect.blocks.items()}
    _finite_state(pid, blocks, carry)
    words = _row_ids(f"partition {pid}", arrays.get("words", 0), expect.vocab, "words")
    leaf = Aggregate.contribution(weight, blocks, {pid: carry})
    leaf.words, leaf.stats = words, stats
    return pid, leaf


def is_int(v) -> bool:
    """A JSON integer (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _stats(pid: int, stats) -> dict:
    if not isinstance(stats, dict) or len(stats) > _MAX_STATS:
        raise Malformed(f"partition {pid}: stats must be an object of at most {_MAX_STATS} numbers")
    out = {}
    for k, v in stats.items():
        x = real(v)
        if not _STAT_KEY.fullmatch(k) or x is None or abs(x) > STAT_MAX:
            raise Malformed(f"partition {pid}: stat {k!r:.40} must be a finite number named [A-Za-z0-9_.]")
        out[k] = v if is_int(v) else x
    for k in ("tokens", "steps"):
        if not is_int(out.get(k)) or out[k] < 0:
            raise Malformed(f"partition {pid}: stat {k} must be a non-negative integer")
    return out


def _finite_state(pid: int, blocks: dict, carry: Carry) -> None:
    """Refuse non-finite values in what the driver keeps as they come: the averaged optimizer state's
    blocks (decoded: their shapes were checked), the carried hidden and optimizer state. (The parameters'
    change is checked once averaged and applied: a non-finite one stops the run.)"""
    with np.errstate(over="ignore", invalid="ignore"):         # an overflow is what this looks for
        kept = {name: b.decode() for name, b in blocks.items() if name.startswith(OPT)}
    if carry.state is not None:
        kept["the hidden state"] = carry.state
    kept.update({f"optimizer slot {k}": v for k, v in (carry.opt or {}).items() if k != "t"})
    for name, values in kept.items():
        if not np.isfinite(values).all():
            raise Malformed(f"partition {pid}: {name} holds non-finite values")


def _carry(pid: int, fields: dict, arrays: dict, expect: Expected) -> Carry:
    """The partition's carry: its hidden state and optimizer state, each present exactly when the run
    carries it, in the expected shape."""
    state = None
    if fields.get("state") is not (expect.state is not None):
        raise Malformed(f"partition {pid}: state must be {'true' if expect.state else 'false'} in this run")
    if expect.state is not None:
        state = arrays.get("carry.state")
        if not isinstance(state, np.ndarray) or state.dtype != expect.dtype or state.shape != expect.state:
            raise Malformed(f"partition {pid}: the hidden state must be a {expect.dtype}{list(expect.state)} array")
    names, opt = fields.get("opt"), None
    if expect.opt is None:
        if names is not None or fields.get("t") is not None:
            raise Malformed(f"partition {pid}: this run's partitions carry no optimizer state")
        return Carry(state=state)
    t = fields.get("t")
    if names != sorted(expect.opt) or not is_int(t) or not 0 <= t <= STAT_MAX:
        raise Malformed(f"partition {pid}: its optimizer state must name {sorted(expect.opt)} and a step count")
    opt = {"t": t}
    for k in names:
        a = arrays.get(f"carry.opt.{k}")
        if not isinstance(a, np.ndarray) or a.dtype != expect.dtype or a.shape != (expect.size,):
            raise Malformed(f"partition {pid}: optimizer slot {k} must be a {expect.dtype}[{expect.size}] array")
        opt[k] = a
    return Carry(state=state, opt=opt)
