"""Run configuration: frozen dataclasses loaded from TOML, overridable by ``--set``.

Every key is typed; unknown sections or keys, values of the wrong type, numbers
outside the range a run can have (:data:`RANGES`), strings holding control characters
and models larger than this machine's memory are errors (:class:`ConfigError`, one
line). The whole configuration is saved as JSON inside every checkpoint.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
import tomllib
import typing
import unicodedata
from dataclasses import dataclass, field

from .core import files


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line."""


@dataclass(frozen=True)
class DataConfig:
    train: str = ""
    valid: str = ""
    test: str = ""
    level: str = "char"            # char | word
    vocab_size: int = 0            # cap (0 = no cap)
    min_count: int = 1
    paragraphs: str = "blank_line"  # blank_line | line
    strategy: str = "streams"      # streams | paragraphs | windows | sampled_windows | sampled_paragraphs
    window_stride: int = 1
    sample_fraction: float = 0.1
    partitions: int = 2
    balance: str = "tokens"        # tokens | paragraphs: what partitions (and streams) of paragraphs hold alike
    eval_streams: int = 1          # held-out text as this many contiguous streams (1 = one stream)
    encoding_errors: str = "replace"  # replace | strict
    max_record_mb: int = 16        # a longer line (data.paragraphs = line) or paragraph is refused


@dataclass(frozen=True)
class ModelConfig:
    cell: str = "lstm"             # lstm | rnn | ffnn (Bengio et al.'s feed-forward NNLM, as Tai and Xu 2014 train it)
    context: int = 3               # ffnn: the previous words it reads (k)
    vocab_size: int = 0            # filled from the vocabulary when 0
    embed: int = 0                 # 0 = one-hot input (first layer indexes its input weights)
    hidden: int = 128
    layers: int = 1
    dropout: float = 0.0
    forget_bias: float = 0.0
    biases: str = "one"            # one | two: an input and a recurrent bias per gate, all biases drawn (Torch's LSTM)
    init: str = "uniform"          # uniform | normal
    init_scale: float = 0.1
    dtype: str = "float32"


@dataclass(frozen=True)
class OptimConfig:
    name: str = "sgd"              # sgd | momentum | adagrad | adam
    lr: float = 1.0
    momentum: float = 0.9
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 5.0         # 0 = off
    clip_value: float = 0.0        # 0 = off
    schedule: str = "constant"     # constant | epoch_decay | plateau
    decay: float = 0.5
    decay_after: int = 4           # epoch_decay: epochs at the initial rate
    min_lr: float = 0.0


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1234
    bptt: int = 20                 # T
    batch: int = 20                # B streams per partition
    global_batch: int = 0          # > 0: streams of all partitions together (>= partitions); batch = this // partitions
    max_streams: int = 0           # > 0: streams of all partitions together at most (then batch = this // partitions)
    grad_norm: str = "batch"       # batch: sum over T, mean over B (Zaremba) | token: mean over T*B
    local_steps: int = 0           # optimizer steps per partition between all-reduces; 0 = one pass
    rounds: int = 0
    epochs: float = 1.0            # used when rounds == 0
    tree_depth: int = 2            # treeAggregate depth (rounds with feedback or overlap merge on the driver)
    results: str = "spark"         # spark: through Spark's results | direct: frames to the driver (rnnlm.spark.channel)
    outer: str = "average"         # average | momentum | nesterov | auto (by data.partitions): the driver's step
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    optim_state: str = "average"   # average | reset | local: optimizer state across rounds
    eval_every: int = 10           # rounds; 0 = only at the end
    patience: int = 0              # > 0: evaluations in a row without a lower validation loss end the run early
    checkpoint_every: int = 0      # rounds; 0 = only at the end (and at each evaluation)
    checkpoint_s: float = 600.0    # ... and this long (s) after the last one (0 = off; async: server.checkpoint_s)
    device: str = "cpu"            # cpu | gpu | auto
    rebase_every: int = 0          # broadcast a new base at least every N rounds (0: by size only)
    rebase_fraction: float = 0.5   # ... or when what was sent since the base reaches this fraction of the model
    overlap: int = 0               # 1: round r+1 runs while round r's mean change is applied (arrives a round late)
    eager: bool = False            # with overlap: a partition starts from its own share of the late mean (Kale et al.)
    mode: str = "sync"             # sync: all-reduce rounds | async: a parameter server on the driver
    push_every: int = 20           # async: local steps between a worker's pushes (a push window)
    # sync: a task that has run this many times as long as the slowest task its stage finished (and at least
    # stall_s) is killed, and Spark runs it again (0 = never; async: server.stall_factor)
    stall_factor: float = 10.0
    stall_s: float = 60.0


@dataclass(frozen=True)
class ServerConfig:
    """The asynchronous mode's parameter server (see :mod:`rnnlm.server`)."""
    update: str = "add"            # add: params += pushed change | adagrad: per-parameter rates on the server
    lock: bool = False             # false: Hogwild!, pushes applied concurrently without a lock
    staleness: str = "ignore"      # ignore | divide: a change k versions behind is divided by 1 + k
    lr: float = 0.1                # update = adagrad: the server's step size
    eps: float = 1e-6              # update = adagrad
    host: str = ""                 # address executors reach ("" = spark.driver.host)
    port: int = 0                  # 0 = any free port
    max_frame_mb: float = 256.0    # larger frames are refused
    heartbeat_s: float = 2.0       # a worker's heartbeat period
    timeout_s: float = 30.0        # a worker silent this long is reported lost
    # a worker heard from that pushes no window for this many times the slowest window seen (and at least
    # timeout_s) is stuck: it ends, and Spark retries its task (0 = never)
    stall_factor: float = 10.0
    checkpoint_s: float = 60.0     # the server's state is checkpointed this often (0 = by pushes only)
    checkpoint_pushes: int = 0     # ... and every this many applied pushes (0 = by time only)


@dataclass(frozen=True)
class ExchangeConfig:
    """What partitions send of their change (see :mod:`rnnlm.exchange.plan`)."""
    embed: str = "dense"           # dense | rows, with +fp16, +bf16, +int8 or +onebit (e.g. rows+fp16)
    softmax: str = "dense"         # Wo and bo
    hidden: str = "dense"          # every other slot
    frequent: float = 0.0          # p: the most frequent fraction of the vocabulary, always in softmax rows
    random: float = 0.0            # q: a seeded fraction of rows (softmax V_beta; hidden rows)
    seed_groups: str = "partition"  # one | partition | log2 | pow064: partitions sharing random rows
    feedback: bool = False         # keep what was not sent (rows, codec error) and send it later
    broadcast: str = "rows"        # rows (exact) | delta, delta+fp16, delta+bf16, delta+int8
    sampled_softmax: bool = False  # train with a sampled softmax (evaluation stays full)
    mu: float = 0.05               # sampled softmax: the dummy words V_gamma, a fraction of the vocabulary
    sampled_variant: str = "corrected"  # corrected | literal (the paper's literal one, for its figure)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_CHOICES = {
    ("data", "level"): ("char", "word"),
    ("data", "paragraphs"): ("blank_line", "line"),
    ("data", "strategy"): ("streams", "paragraphs", "windows", "sampled_windows", "sampled_paragraphs"),
    ("data", "encoding_errors"): ("replace", "strict"),
    ("data", "balance"): ("tokens", "paragraphs"),
    ("model", "cell"): ("lstm", "rnn", "ffnn"),
    ("model", "init"): ("uniform", "normal"),
    ("model", "biases"): ("one", "two"),
    ("model", "dtype"): ("float32", "float64"),
    ("optim", "name"): ("sgd", "momentum", "adagrad", "adam"),
    ("optim", "schedule"): ("constant", "epoch_decay", "plateau"),
    ("train", "grad_norm"): ("batch", "token"),
    ("train", "device"): ("cpu", "gpu", "auto"),
    ("train", "outer"): ("average", "momentum", "nesterov", "auto"),
    ("train", "optim_state"): ("average", "reset", "local"),
    ("train", "mode"): ("sync", "async"),
    ("train", "results"): ("spark", "direct"),
    ("server", "update"): ("add", "adagrad"),
    ("server", "staleness"): ("ignore", "divide"),
    ("exchange", "seed_groups"): ("one", "partition", "log2", "pow064"),
    ("exchange", "sampled_variant"): ("corrected", "literal"),
    # no delta+onebit: executors training from a 1-bit view diverged on PTB (docs/exchange.md, "The broadcast")
    ("exchange", "broadcast"): ("rows", "delta", "delta+fp16", "delta+bf16", "delta+int8"),
}
_BLOCK_SPECS = tuple(f"{kind}{codec}" for kind in ("dense", "rows")
                     for codec in ("", "+fp16", "+bf16", "+int8", "+onebit"))
for _group in ("embed", "softmax", "hidden"):
    _CHOICES[("exchange", _group)] = _BLOCK_SPECS

_INF = math.inf
# The values a run can have, for every number: (low, high, brackets), "[" and "]" inclusive,
# "(" and ")" exclusive. Beyond them a run would crash after Spark starts (an overflow, an array too
# big, a socket timeout too long for the OS) or not finish (a layout of a million layers).
RANGES = {
    ("data", "vocab_size"): (0, 10_000_000, "[]"),
    ("data", "min_count"): (1, 10 ** 12, "[]"),
    ("data", "window_stride"): (1, 1_000_000, "[]"),
    ("data", "sample_fraction"): (0, 1, "(]"),
    ("data", "partitions"): (1, 10_000, "[]"),
    ("data", "eval_streams"): (1, 10_000, "[]"),
    ("data", "max_record_mb"): (1, 32, "[]"),        # a 64 MiB record crashed a Python worker
    ("model", "context"): (1, 64, "[]"),
    ("model", "vocab_size"): (0, 10_000_000, "[]"),
    ("model", "embed"): (0, 65_536, "[]"),
    ("model", "hidden"): (1, 65_536, "[]"),
    ("model", "layers"): (1, 64, "[]"),
    ("model", "dropout"): (0, 1, "[)"),
    ("model", "forget_bias"): (-100, 100, "[]"),
    ("model", "init_scale"): (0, 100, "(]"),
    ("optim", "lr"): (0, _INF, "()"),
    ("optim", "momentum"): (0, 1, "[)"),
    ("optim", "beta1"): (0, 1, "[)"),
    ("optim", "beta2"): (0, 1, "[)"),
    ("optim", "eps"): (0, 1, "(]"),
    ("optim", "clip_norm"): (0, _INF, "[)"),
    ("optim", "clip_value"): (0, _INF, "[)"),
    ("optim", "decay"): (0, 1, "(]"),
    ("optim", "decay_after"): (0, 1_000_000, "[]"),
    ("optim", "min_lr"): (0, _INF, "[)"),
    ("train", "seed"): (0, 2 ** 63 - 1, "[]"),
    ("train", "bptt"): (1, 100_000, "[]"),
    ("train", "batch"): (1, 100_000, "[]"),
    ("train", "global_batch"): (0, 100_000, "[]"),
    ("train", "max_streams"): (0, 100_000, "[]"),
    ("train", "local_steps"): (0, 10_000_000, "[]"),
    ("train", "rounds"): (0, 10_000_000, "[]"),
    ("train", "epochs"): (0, 10_000, "[]"),
    ("train", "tree_depth"): (1, 64, "[]"),
    ("train", "outer_lr"): (0, _INF, "()"),
    ("train", "outer_momentum"): (0, 1, "[)"),
    ("train", "eval_every"): (0, 10_000_000, "[]"),
    ("train", "patience"): (0, 10_000_000, "[]"),
    ("train", "checkpoint_every"): (0, 10_000_000, "[]"),
    ("train", "checkpoint_s"): (0, 1_000_000, "[]"),
    ("train", "rebase_every"): (0, 10_000_000, "[]"),
    ("train", "rebase_fraction"): (0, 16, "(]"),
    ("train", "overlap"): (0, 1, "[]"),
    ("train", "push_every"): (1, 1_000_000, "[]"),
    ("train", "stall_factor"): (0, 1_000_000, "[]"),
    ("train", "stall_s"): (0, 1_000_000, "(]"),
    ("server", "lr"): (0, _INF, "()"),
    ("server", "eps"): (0, 1, "(]"),
    ("server", "port"): (0, 65_535, "[]"),
    ("server", "max_frame_mb"): (0, 4096, "(]"),
    ("server", "heartbeat_s"): (0, 3600, "(]"),
    ("server", "timeout_s"): (0, 86_400, "(]"),
    ("server", "stall_factor"): (0, 1_000_000, "[]"),
    ("server", "checkpoint_s"): (0, 1_000_000, "[]"),
    ("server", "checkpoint_pushes"): (0, 10 ** 9, "[]"),
    ("exchange", "frequent"): (0, 1, "[]"),
    ("exchange", "random"): (0, 1, "[]"),
    ("exchange", "mu"): (0, 1, "[]"),
}


def _name(name: str) -> str:
    """A section or key name from a file, as a message shows it: as written when it prints as itself,
    else quoted with its control characters escaped (a name cannot forge a line or recolour a terminal)."""
    return name if name.isprintable() and len(name) <= 60 else f"{name!r:.62}"


def _section_class(name: str):
    hints = typing.get_type_hints(Config)
    if name not in hints:
        raise ConfigError(f"unknown config section [{_name(name)}]{_did_you_mean(name, list(hints))}; "
                          f"known: {', '.join(hints)}")
    return hints[name]


def _did_you_mean(name: str, known: list) -> str:
    """``" (did you mean X?)"`` for the closest of ``known`` to a mistyped ``name``, else ``""``."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


def _unknown_key(section: str, key: str) -> ConfigError:
    """A key its section does not have: the closest key of that section, else the section that has
    it (``model.rounds`` means ``train.rounds``), else the closest key of any section."""
    hints = typing.get_type_hints(_section_class(section))
    hint = _did_you_mean(key, list(hints))
    if hint:
        hint = hint.replace("mean ", f"mean {section}.", 1)
    else:
        every = [f"{s}.{k}" for s, cls in typing.get_type_hints(Config).items() for k in typing.get_type_hints(cls)]
        elsewhere = [sk for sk in every if sk.split(".", 1)[1] == key]
        hint = f" (did you mean {elsewhere[0]}?)" if elsewhere else _did_you_mean(f"{section}.{key}", every)
    return ConfigError(f"unknown config key {section}.{_name(key)}{hint}; known in [{section}]: {', '.join(hints)}")


def _coerce(section: str, key: str, value, typ):
    where = f"{section}.{key}"
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:       # an integer beyond any float (1 and 400 zeros)
                raise _out_of_range(section, key, value) from None
    elif typ is str:
        if isinstance(value, str):
            _refuse_control(where, value)
            choices = _CHOICES.get((section, key))
            if choices and value not in choices:
                raise ConfigError(f"{where} = {value!r:.80}: expected one of {', '.join(choices)}")
            return value
    raise ConfigError(f"{where} = {value!r:.80}: expected {typ.__name__}, got {type(value).__name__}")


# Cc: newlines, ESC, ...; Zl, Zp: U+2028 and U+2029, which editors and terminals may show as line
# breaks; and the bidirectional controls, among them U+202E, which prints the text after it reversed
# (not the rest of Cf: a zero-width joiner or non-joiner belongs in Persian or emoji names)
_UNPRINTABLE = ("Cc", "Zl", "Zp")
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _refuse_control(where: str, text: str) -> None:
    """A control character (a newline, ESC, a line separator, a bidirectional override) in a value
    would forge, hide or reorder lines of the messages that print it: refused, named by its code only."""
    bad = next((c for c in text if c in _BIDI or unicodedata.category(c) in _UNPRINTABLE), None)
    if bad is not None:
        raise ConfigError(f"{where}: the value holds a control character (U+{ord(bad):04X}); refused")


def _shown(value) -> str:
    """``value`` as an error message shows it: a number of many digits by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a number of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return f"{value!r:.60}" if isinstance(value, str) else f"{value!r}"


def _interval(low, high, brackets: str) -> str:
    return f"{brackets[0]}{low}, {high}{brackets[1]}"                 # (0, inf): every finite number above 0


def _within(value, low, high, brackets: str) -> bool:
    above = value > low if brackets[0] == "(" else value >= low
    below = value < high if brackets[1] == ")" else value <= high
    return bool(above and below)


def _out_of_range(section: str, key: str, value) -> ConfigError:
    where = f"{section}.{key}"
    return ConfigError(f"{where} = {_shown(value)} is out of range: a run takes {where} in "
                       f"{_interval(*RANGES[(section, key)])}")


def _build_section(name: str, values: dict):
    cls = _section_class(name)
    if not isinstance(values, dict):
        raise ConfigError(f"[{name}] must be a table")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise _unknown_key(name, key)
        kwargs[key] = _coerce(name, key, value, hints[key])
    return cls(**kwargs)


def from_dict(d: dict) -> Config:
    """Build a :class:`Config` from nested dicts, checking every key and type."""
    for name in d:
        _section_class(name)
    cfg = Config(**{name: _build_section(name, vals) for name, vals in d.items()})
    given = d.get("train", {})
    cfg = _streams_by_partitions(_outer_by_partitions(cfg, given), given)
    validate(cfg)
    return cfg


def streams_each(t: TrainConfig, partitions: int) -> int:
    """Streams a partition trains on ``partitions`` partitions: ``train.global_batch`` split between them
    (strong scaling), else ``train.batch`` each (weak scaling) until they reach ``train.max_streams`` in
    all, which they then split."""
    if t.global_batch > 0:
        return max(1, t.global_batch // partitions)
    if t.max_streams > 0:
        return max(1, min(t.batch, t.max_streams // partitions))
    return t.batch


def outer_for(t: TrainConfig, partitions: int) -> tuple:
    """``(outer, outer_lr, outer_momentum)`` that ``train.outer = "auto"`` resolves to. The mean of the
    partitions' changes moves the weights about as far as one partition's change, whatever the streams in
    all: with ``g`` times the streams of 2 partitions, a round reads ``g`` times the tokens, so the mean
    moves ``1/g`` as far per token. Nesterov's outer step with ``outer_lr`` 1 and momentum ``1 - 1/g``
    (``1 - 2/P`` at a fixed batch per partition) steps ``1 / (1 - momentum) = g`` means once its velocity
    has built up over a few rounds, as far per token as the mean at 2 partitions; up to ``g = 1``, the
    mean. In the asynchronous mode the server applies each push itself: there, the mean. Evidence:
    docs/results.md, "Adding executors"."""
    grow = partitions * streams_each(t, partitions) / (2 * streams_each(t, 2))
    if t.mode == "async" or grow <= 1:
        return "average", 1.0, 0.9
    return "nesterov", 1.0, round(1.0 - 1.0 / grow, 4)


def _outer_by_partitions(cfg: Config, given: dict) -> Config:
    """``train.outer = "auto"`` resolved once, at load: the outer step that :func:`outer_for` picks for
    the streams of ``data.partitions`` partitions, with any of ``train.outer_lr`` and
    ``train.outer_momentum`` the user set kept. A saved configuration holds the resolved step, so a
    resumed run keeps it."""
    t = cfg.train
    if t.outer != "auto" or not _streams_in_range(t) or not _partitions_in_range(cfg):
        return cfg                  # another step, or out of range: validate() names it
    outer, lr, momentum = outer_for(t, cfg.data.partitions)
    return replace(cfg, "train", outer=outer, outer_lr=t.outer_lr if "outer_lr" in given else lr,
                   outer_momentum=t.outer_momentum if "outer_momentum" in given else momentum)


def _partitions_in_range(cfg: Config) -> bool:
    return _within(cfg.data.partitions, *RANGES[("data", "partitions")])


def _streams_in_range(t: TrainConfig) -> bool:
    return all(_within(getattr(t, k), *RANGES[("train", k)]) for k in ("batch", "global_batch", "max_streams"))


def _streams_by_partitions(cfg: Config, given: dict) -> Config:
    """``train.batch`` = :func:`streams_each`: with ``train.global_batch`` = G, G streams in all split
    between the partitions, so the global batch stays G (or the nearest below it) as P grows; with
    ``train.max_streams`` = M, ``train.batch`` each until M in all, then M split. A ``train.batch`` given
    beside ``global_batch`` must be its value (a saved configuration holds both)."""
    t, P = cfg.train, cfg.data.partitions
    if not (t.global_batch or t.max_streams) or not _streams_in_range(t) or not _partitions_in_range(cfg):
        return cfg                  # off, or out of range: validate() names it
    per = streams_each(t, P)
    if t.global_batch and "batch" in given and given["batch"] != per:
        raise ConfigError(f"train.batch = {given['batch']} contradicts train.global_batch = {t.global_batch} "
                          f"on {P} partitions ({per} streams each): set train.global_batch = 0 to use train.batch, "
                          "or leave train.batch out (of the config file and --set) to use train.global_batch")
    return replace(cfg, "train", batch=per)


def _parse_value(section: str, key: str, text: str, typ):
    if typ is str:
        return text
    if typ is bool:
        low = text.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):      # RecursionError: arrays nested a thousand deep
        return text  # rejected with a typed message by _coerce
    except ValueError:      # more digits than Python converts (sys.get_int_max_str_digits())
        raise ConfigError(f"{section}.{key}: a number of {len(text)} characters is out of range: a run takes "
                          f"{section}.{key} in {_interval(*RANGES[(section, key)])}") from None


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` strings to the nested dict ``d`` (copied)."""
    out = {k: dict(v) for k, v in d.items()}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            key = item.split("=", 1)[0].strip()
            sections = [s for s, cls in typing.get_type_hints(Config).items() if key in typing.get_type_hints(cls)]
            hint = f" (did you mean {sections[0]}.{item.strip()}?)" if sections and "=" in item else ""
            raise ConfigError(f"--set {item!r}: expected section.key=value{hint}")
        path, text = item.split("=", 1)
        _refuse_control(f"--set {path.strip()!r:.60}", item)
        section, key = path.strip().split(".", 1)
        cls = _section_class(section)
        hints = typing.get_type_hints(cls)
        if key not in hints:
            raise _unknown_key(section, key)
        out.setdefault(section, {})[key] = _parse_value(section, key, text.strip(), hints[key])
    return out


MAX_CONFIG_FILE = 1 << 20           # a configuration is a few KiB; a checkpoint's config.json has the same cap


def _read_config_file(path: str) -> bytes:
    """The bytes of the regular file ``path``, at most :data:`MAX_CONFIG_FILE` of them: checked before a
    byte is read (``--config /dev/zero`` grew until memory ran out; a FIFO blocked forever)."""
    try:
        return files.read_regular(path, MAX_CONFIG_FILE)
    except files.NotRegular:
        raise ConfigError(f"config file {path} is not a regular file") from None
    except files.TooLarge:
        raise ConfigError(f"config file {path} is over {MAX_CONFIG_FILE >> 20} MiB: not a configuration") from None


def load(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML file (or the defaults when ``path`` is None) and apply overrides."""
    d: dict = {}
    if path is not None:
        try:
            d = tomllib.loads(_read_config_file(path).decode("utf-8-sig"))   # an editor's byte order mark: no text
        except ConfigError:
            raise
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as e:    # a directory, no permission
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config file {path} nests arrays or tables too deeply for a configuration") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}): TOML is UTF-8") from None
        except ValueError:      # an integer of more digits than Python converts
            raise ConfigError(f"config file {path} holds a number of more than {sys.get_int_max_str_digits()} "
                              "digits: out of range for every key") from None
        for section, keys in d.items():
            if not isinstance(keys, dict):
                raise ConfigError(f"config file {path}: {section} must be a table of keys ([{section}]), not "
                                  f"{'an array' if isinstance(keys, list) else type(keys).__name__}")
    return from_dict(apply_overrides(d, overrides or []))


# keys added since checkpoints were first written, and how a run whose saved configuration lacks one behaved
SAVED_BEFORE = {("data", "balance"): "paragraphs"}


def from_json(text: str) -> Config:
    """A configuration saved as JSON (a checkpoint's): ConfigError for anything but a table of sections,
    each a table of keys (ValueError for text that is not JSON). A key of :data:`SAVED_BEFORE` that a saved
    section lacks takes the value the run that saved it ran under, not today's default."""
    try:
        d = json.loads(text)
    except RecursionError:
        raise ConfigError("the configuration nests too deeply to be one") from None
    except ValueError as e:             # not JSON, or an integer of more digits than Python converts
        raise ConfigError(f"config.json is not a configuration's JSON ({str(e).split(':')[0]})") from None
    if not isinstance(d, dict) or not all(isinstance(v, dict) for v in d.values()):
        raise ConfigError("the configuration is not a table of sections, each a table of keys")
    for (section, key), was in SAVED_BEFORE.items():
        if section in d:
            d[section].setdefault(key, was)
    return from_dict(d)


def replace(cfg: Config, section: str, **changes) -> Config:
    """A copy of ``cfg`` with some keys of one section changed."""
    sec = dataclasses.replace(getattr(cfg, section), **changes)
    return dataclasses.replace(cfg, **{section: sec})


def resolve(cfg: Config, vocab_size: int) -> Config:
    """The run's configuration once its vocabulary is built: what the driver trains with, saves in
    checkpoints and ships to tasks (already validated: tasks do not parse or check it again); its
    size is checked against memory (:func:`check_memory`) now that it is known."""
    out = replace(cfg, "model", vocab_size=vocab_size)
    check_memory(out)
    return out


SAMPLED = ("sampled_windows", "sampled_paragraphs")


TINY = {"float32": 1.1754943508222875e-38, "float64": 2.2250738585072014e-308}    # numpy.finfo(dtype).tiny


def validate(cfg: Config) -> None:
    """Every number within its range (:data:`RANGES`, the one place a key's bounds are written), then
    the rules that tie keys together, which types and ranges alone cannot express."""
    for (section, key), bounds in RANGES.items():
        value = getattr(getattr(cfg, section), key)
        if not _within(value, *bounds):
            raise _out_of_range(section, key, value)
    d, m, t, o, x, sv = cfg.data, cfg.model, cfg.train, cfg.optim, cfg.exchange, cfg.server
    checks = [
        (not x.hidden.startswith("rows") or x.random > 0,
         "exchange.hidden = rows sends a seeded exchange.random fraction of rows: set exchange.random > 0"),
        (x.feedback or "onebit" not in (x.embed + x.softmax + x.hidden),
         "exchange onebit sends signs: without exchange.feedback = true the rest of the change is lost"),
        (d.vocab_size == 0 or d.vocab_size > 2, "data.vocab_size must be 0 (no cap) or > 2"),
        (m.cell != "ffnn" or (m.embed > 0 and m.layers == 1 and m.dropout == 0 and not x.sampled_softmax),
         "model.cell = 'ffnn' needs model.embed > 0, model.layers = 1, no dropout and no sampled softmax"),
        (m.cell != "ffnn" or m.biases == "one", "model.biases = 'two' is for the lstm and rnn cells"),
        (o.min_lr <= o.lr, "optim.min_lr must be in [0, optim.lr]"),
        (not (t.global_batch and t.max_streams), "train.global_batch and train.max_streams: set one (the first fixes "
         "the streams of all partitions together, the second caps them)"),
        (t.rounds > 0 or t.epochs > 0, "set train.rounds or train.epochs (both are 0)"),
        (not t.eager or (t.overlap == 1 and t.outer == "average"),
         "train.eager = true needs train.overlap = 1 and train.outer = 'average' (it stands in for a late mean "
         "change the driver adds as it is)"),
        (not t.overlap or t.optim_state != "average" or o.name == "sgd",
         "train.overlap = 1 starts a round before the averaged optimizer state it would read exists: "
         "use train.optim_state = 'local' or 'reset' (or optim.name = 'sgd', which keeps none)"),
        (t.mode == "sync" or (d.strategy not in SAMPLED and x.broadcast == "rows" and t.outer == "average"),
         "train.mode = 'async' needs a streams, paragraphs or windows strategy, exchange.broadcast = 'rows' "
         "and train.outer = 'average' (the server applies each push)"),
        (t.mode == "sync" or not (t.overlap or t.eager),
         "train.overlap and train.eager shape the rounds of train.mode = 'sync'; an async run has none (each push "
         "is applied as it lands): leave them at 0 and false"),
        (t.mode == "sync" or o.schedule != "plateau",
         "train.mode = 'async' has no rounds to decay on a plateau: use optim.schedule = constant or epoch_decay"),
        (t.mode == "sync" or not t.patience,
         "train.patience ends a run of synchronous rounds early; an async run's evaluations follow its pushes as they "
         "land: leave it at 0 (best/ holds the lowest validation loss either way)"),
        (sv.heartbeat_s < sv.timeout_s, "server: need heartbeat_s < timeout_s"),
        (t.stall_factor == 0 or t.stall_factor >= 1,
         "train: stall_factor is 0 (no stall watch) or at least 1 (below, a task no slower than its stage's "
         "slowest would count as stuck)"),
        (sv.stall_factor == 0 or sv.stall_factor >= 1,
         "server: stall_factor is 0 (no stall watch) or at least 1 (below, a window no slower than the slowest "
         "seen would count as a stall)"),
        (d.strategy not in SAMPLED or t.local_steps == 0,
         f"train.local_steps = {t.local_steps} contradicts data.strategy = {d.strategy!r}: a round trains on "
         "its whole sample (data.sample_fraction), so leave train.local_steps = 0"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    tiny = TINY[m.dtype]                # below it a rate or an epsilon is subnormal or 0 in the parameters' type
    for (section, key) in (("optim", "lr"), ("optim", "eps")) + ((("server", "lr"), ("server", "eps"))
                                                                 if t.mode == "async" else ()):
        value = getattr(getattr(cfg, section), key)
        if value < tiny:
            raise ConfigError(f"{section}.{key} = {value!r} is below model.dtype = {m.dtype}'s smallest normal "
                              f"number ({tiny:.3g}), 0 or nearly: an update of 0, or 0 / 0 for a parameter whose "
                              "gradient is 0")


OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2}   # state arrays (rnnlm.core.optim)


def param_count(m: ModelConfig, vocab_size: int = 0) -> int:
    """The parameters of the model ``m`` describes (its layout's size: rnnlm.core.model,
    rnnlm.core.ffnn), with ``vocab_size`` tokens (default: ``m.vocab_size``), counted without
    building it."""
    V, E, H, L = vocab_size or m.vocab_size, m.embed, m.hidden, m.layers
    output = V * H + V
    if m.cell == "ffnn":
        return V * E + H * m.context * E + H + output
    GH = (4 if m.cell == "lstm" else 1) * H
    biases = 2 if m.biases == "two" else 1
    return V * (E or GH) + GH * E + (L - 1) * GH * H + L * (GH * H + biases * GH) + output


def memory_bytes() -> int | None:
    """This machine's physical memory, None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg: Config, vocab_size: int = 0, memory: int | None = None) -> None:
    """Refuse a model whose parameters, gradient and optimizer state alone exceed ``memory`` (default:
    this machine's): it would fail to allocate after Spark starts. Before the vocabulary is built
    its size is taken as ``data.vocab_size`` (or 3, the least there is): a floor."""
    memory = memory_bytes() if memory is None else memory
    V = vocab_size or cfg.model.vocab_size or cfg.data.vocab_size or 3
    count = param_count(cfg.model, V)
    arrays = 2 + OPTIMIZER_SLOTS[cfg.optim.name]
    need = count * arrays * (8 if cfg.model.dtype == "float64" else 4)
    if memory is not None and need > memory:
        gib = 1 << 30
        raise ConfigError(f"the model has {count:,} parameters (vocabulary {V:,}): with its gradient and "
                          f"{cfg.optim.name}'s state it needs {need / gib:,.1f} GiB, more than this machine's "
                          f"{memory / gib:,.1f} GiB: make model.hidden, model.layers, model.embed or the "
                          "vocabulary smaller")


def check_run(cfg: Config) -> None:
    """What every trainer needs, the single-process one too: data to train on, and for a plateau
    schedule or ``train.patience`` evaluations while the run trains."""
    if not cfg.data.train:
        raise ConfigError("data.train is not set")
    if cfg.optim.schedule == "plateau" and not cfg.train.eval_every:    # one loss seen, after the last round
        raise ConfigError("optim.schedule = 'plateau' decays when the validation loss stops improving, which "
                          "train.eval_every = 0 measures only once the run has ended: set train.eval_every (a run "
                          "saved so goes on from its weights with --init-from)")
    if cfg.train.patience and not cfg.train.eval_every:
        raise ConfigError(f"train.patience = {cfg.train.patience} counts evaluations, and train.eval_every = 0 makes "
                          "one, once the run has ended: set train.eval_every")


def check_trainable(cfg: Config) -> None:
    """What a training run needs beyond :func:`validate`, before any data is read (the trainers and
    the command line's checks before Spark's JVM starts call it): the model must fit in memory to train
    (a checkpoint of it is loaded to sample or score anywhere)."""
    check_memory(cfg)
    t, P = cfg.train, cfg.data.partitions
    if t.global_batch and t.global_batch < P:       # a checkpoint saved so still loads (to sample, score, resume)
        raise ConfigError(f"train.global_batch = {t.global_batch} is fewer streams than data.partitions = {P} (each "
                          "trains one at least: a larger global batch than asked); raise it or use fewer partitions "
                          "(train.max_streams caps the streams instead, one each at least)")
    if cfg.optim.schedule == "plateau" and not cfg.data.valid:
        raise ConfigError("optim.schedule = 'plateau' decays when the validation loss stops "
                          "improving: set data.valid")
    if cfg.train.patience and not cfg.data.valid:
        raise ConfigError(f"train.patience = {cfg.train.patience} ends the run when the validation loss stops "
                          "improving: set data.valid")
    check_run(cfg)
