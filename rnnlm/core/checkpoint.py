"""Checkpoints: a directory of ``.npy``/``.npz`` arrays and JSON, never pickle.

Files::

    params.npy     flat parameters (P,)
    optim.npz      optimizer accumulators, each (P,)
    hidden.npy     carried hidden states (optional)
    vocab.json     the vocabulary
    config.json    the full run configuration
    state.json     training position, optimizer step, schedule state, layout
    MANIFEST.json  size and sha256 of every file above (written last)

A checkpoint is serialised to bytes first (:func:`to_files`), so the same bytes
can go to a local directory (:func:`save`, atomic: temp directory + rename) or
through Spark's Hadoop FileSystem. Loading verifies the manifest, reads arrays
with ``allow_pickle=False`` and checks shapes, dtype and vocabulary against the
configuration.

A checkpoint may come from anywhere (a shared directory, a download), so loading
trusts nothing in it: the manifest may name only plain files of the checkpoint
directory, each of them a regular file; every array's header is checked before its
data is allocated; every field of ``state.json`` and every array's shape and dtype
is checked against the configuration. Whatever fails is one line.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import zipfile
from dataclasses import dataclass, field

import numpy as np

from .. import config as config_mod
from .files import LocalFS
from .models import build as build_model
from .vocab import Vocab, VocabError

MANIFEST = "MANIFEST.json"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")       # no directory, not hidden, not ".."
_OPTIM_KEY = re.compile(r"(p[0-9]+/)?[A-Za-z0-9_.]+")             # "<slot>", "p<pid>/<slot>", "outer.view", ...
_NPY_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt or does not match."""


@dataclass
class Checkpoint:
    """Everything needed to resume training or to use a model (host arrays)."""

    params: np.ndarray
    config: config_mod.Config
    vocab: Vocab
    optim: dict = field(default_factory=dict)        # name -> (P,) array
    position: dict = field(default_factory=dict)     # round, epoch, tokens, ...
    hidden: np.ndarray | None = None
    optim_t: int = 0
    schedule: dict = field(default_factory=dict)


def _npy_bytes(a) -> bytes:
    b = io.BytesIO()
    np.save(b, np.asarray(a), allow_pickle=False)
    return b.getvalue()


def to_files(ck: Checkpoint) -> dict:
    """Serialise ``ck`` to ``{file name: bytes}`` including the manifest."""
    model = build_model(ck.config.model)
    files = {
        "params.npy": _npy_bytes(ck.params),
        "vocab.json": ck.vocab.to_json().encode(),
        "config.json": ck.config.to_json().encode(),
        "state.json": json.dumps({
            "position": ck.position, "optim_t": int(ck.optim_t), "schedule": ck.schedule,
            "layout": model.layout.describe(), "format": 1}, indent=2).encode(),
    }
    b = io.BytesIO()
    np.savez(b, **{k: np.asarray(v) for k, v in ck.optim.items()})
    files["optim.npz"] = b.getvalue()
    if ck.hidden is not None:
        files["hidden.npy"] = _npy_bytes(ck.hidden)
    manifest = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                for name, data in files.items()}
    files[MANIFEST] = json.dumps(manifest, indent=2, sort_keys=True).encode()
    return files


def save(path: str, ck: Checkpoint) -> None:
    """Write ``ck`` to directory ``path`` atomically (an existing one is replaced).

    The directory is written by :meth:`rnnlm.core.files.LocalFS.write_dir_atomic`, as the
    trainer's local checkpoints are: a crash leaves the old or the new checkpoint,
    the old one possibly as ``<path>.old``, which :func:`load` moves back.
    """
    LocalFS().write_dir_atomic(os.path.abspath(path), to_files(ck))


def _read_local(path: str):
    def read(name):
        p = os.path.join(path, name)
        try:
            if not stat.S_ISREG(os.stat(p).st_mode):      # a fifo or /dev/zero would never end
                raise CheckpointError(f"{path}: {name} is not a regular file")
            with open(p, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    return read


def _load_npy(data: bytes, name: str) -> np.ndarray:
    """The array of a ``.npy`` file's bytes: its header is checked (no pickled objects, no more data
    declared than the file holds) before anything is allocated."""
    f = io.BytesIO(data)
    try:
        shape, fortran, dtype = _NPY_READERS[np.lib.format.read_magic(f)](f)
    except (KeyError, ValueError, SyntaxError, EOFError) as e:     # a zip, text, a truncated header...
        if data[:1] == b"\x80":                                     # pickle's PROTO opcode
            raise CheckpointError(f"{name} contains pickled data, refused (checkpoints are data only)") from None
        raise CheckpointError(f"{name} is not a NumPy array file ({type(e).__name__})") from None
    if dtype.hasobject:
        raise CheckpointError(f"{name} contains pickled data, refused (checkpoints are data only)")
    count = int(np.prod(shape, dtype=object))
    if count * dtype.itemsize != len(data) - f.tell():
        raise CheckpointError(f"{name} declares {count * dtype.itemsize} bytes of {dtype} in a "
                              f"{len(data)}-byte file")
    flat = np.frombuffer(data, dtype, count, f.tell())
    return flat.reshape(shape, order="F" if fortran else "C").copy()      # writable, owns its memory


def _load_npz(data: bytes, name: str, max_member: int) -> dict:
    """The arrays of a ``.npz`` file's bytes (each member at most ``max_member`` bytes, checked
    before it is decompressed)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            out = {}
            for info in z.infolist():
                if not info.filename.endswith(".npy") or info.file_size > max_member:
                    raise CheckpointError(f"{name} holds {info.filename!r:.60} ({info.file_size} bytes), not "
                                          f"an optimizer slot of at most {max_member} bytes")
                out[info.filename[:-4]] = _load_npy(z.read(info), f"{name}:{info.filename}")
            return out
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
        raise CheckpointError(f"{name} is not a zip of NumPy arrays: {e}") from None


def _manifest(raw: bytes, where: str) -> dict:
    """``{file name: {"size", "sha256"}}``: plain file names of the checkpoint directory only."""
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{where}: {MANIFEST} is corrupt") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: {MANIFEST} is not a table of files")
    for name, meta in manifest.items():
        if not _PLAIN_NAME.fullmatch(name):
            raise CheckpointError(f"{where}: {MANIFEST} names {name!r}, not a plain file name in the checkpoint")
        if not (isinstance(meta, dict) and type(meta.get("size")) is int and meta["size"] >= 0
                and isinstance(meta.get("sha256"), str)):
            raise CheckpointError(f"{where}: {MANIFEST}: {name} needs an integer size and a sha256")
    return manifest


def _verified(read, where: str) -> dict:
    """``{name: bytes}`` of every file the manifest names, each checked against its size and checksum."""
    raw = read(MANIFEST)
    if raw is None:
        raise CheckpointError(f"{where}: not a checkpoint (no {MANIFEST}; incomplete write?)")
    files = {}
    for name, meta in _manifest(raw, where).items():
        data = read(name)
        if data is None:
            raise CheckpointError(f"{where}: {name} is missing")
        if len(data) != meta["size"]:
            raise CheckpointError(f"{where}: {name} is truncated ({len(data)} of {meta['size']} bytes)")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise CheckpointError(f"{where}: {name} is corrupt (checksum mismatch)")
        files[name] = data
    for name in ("params.npy", "vocab.json", "config.json", "state.json", "optim.npz"):
        if name not in files:
            raise CheckpointError(f"{where}: manifest lacks {name}")
    return files


def _state(raw: bytes, where: str) -> tuple:
    """(position, schedule, optim_t) of ``state.json``, typed."""
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: state.json is not JSON: {e}") from None
    if not (isinstance(state, dict) and isinstance(state.get("position", {}), dict)
            and isinstance(state.get("schedule", {}), dict)):
        raise CheckpointError(f"{where}: state.json must be a table with position, schedule and optim_t")
    optim_t = state.get("optim_t", 0)
    if type(optim_t) is not int or optim_t < 0:
        raise CheckpointError(f"{where}: state.json: optim_t must be an integer >= 0, not {optim_t!r:.40}")
    return state.get("position", {}), state.get("schedule", {}), optim_t


def from_files(read, where: str, expect: config_mod.ModelConfig | None = None) -> Checkpoint:
    """Load from ``read(name) -> bytes | None`` (see :func:`load`)."""
    files = _verified(read, where)
    try:
        cfg = config_mod.from_json(files["config.json"].decode())
        vocab = Vocab.from_json(files["vocab.json"].decode())
    except (config_mod.ConfigError, VocabError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    position, schedule, optim_t = _state(files["state.json"], where)
    try:
        size = build_model(cfg.model).layout.size
        params = _load_npy(files["params.npy"], "params.npy")
        optim = _load_npz(files["optim.npz"], "optim.npz", max_member=4096 + 8 * size)      # float64 at most
        hidden = _load_npy(files["hidden.npy"], "hidden.npy") if "hidden.npy" in files else None
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    ck = Checkpoint(params=params, config=cfg, vocab=vocab, optim=optim, position=position, hidden=hidden,
                    optim_t=optim_t, schedule=schedule)
    _check(ck, where, expect)
    return ck


def _check(ck: Checkpoint, where: str, expect) -> None:
    m = ck.config.model
    if expect is not None and expect != m:
        diff = [k for k in m.__dataclass_fields__ if getattr(m, k) != getattr(expect, k)]
        raise CheckpointError(f"{where}: model configuration differs from the checkpoint's in {', '.join(diff)}")
    if len(ck.vocab) != m.vocab_size:
        raise CheckpointError(f"{where}: vocabulary has {len(ck.vocab)} tokens, model.vocab_size is {m.vocab_size}")
    model, dtype = build_model(m), np.dtype(m.dtype)
    size = model.layout.size
    if ck.params.shape != (size,) or ck.params.dtype != dtype:
        raise CheckpointError(f"{where}: params are {ck.params.dtype}{list(ck.params.shape)}, "
                              f"the configuration needs {m.dtype}[{size}]")
    for k, v in ck.optim.items():
        if not _OPTIM_KEY.fullmatch(k):        # the trainer parses "p<pid>/<slot>"
            raise CheckpointError(f"{where}: optimizer slot name {k!r:.60} is not one a trainer writes")
        if v.shape != (size,) or v.dtype not in (dtype, np.dtype(np.float32)):   # residuals may stay float32
            raise CheckpointError(f"{where}: optimizer slot {k} is {v.dtype}{list(v.shape)}, "
                                  f"the configuration needs {dtype}[{size}]")
    if ck.hidden is not None:       # the carried states: one (L, S, H, B) per partition, or one stream's
        stream = model.zero_state(ck.config.train.batch).shape                  # (the one-machine trainer's)
        per_partition = (ck.config.data.partitions, *stream)
        if ck.hidden.shape not in (per_partition, stream) or ck.hidden.dtype != dtype:
            raise CheckpointError(f"{where}: hidden.npy is {ck.hidden.dtype}{list(ck.hidden.shape)}, the "
                                  f"configuration needs {dtype}{list(per_partition)} (a state per partition) "
                                  f"or {dtype}{list(stream)} (one stream)")


def in_run(path: str, fs) -> str:
    """``path``, or ``path/checkpoint`` when ``path`` is a run directory (the ``--out`` of
    training) rather than a checkpoint; ``fs`` answers ``exists`` (a :class:`LocalFS` or
    Hadoop's)."""
    def is_checkpoint(p):
        return fs.exists(f"{p}/{MANIFEST}") or fs.exists(f"{p}.old/{MANIFEST}")
    path = path.rstrip("/") or path
    inner = f"{path}/checkpoint"
    return inner if not is_checkpoint(path) and is_checkpoint(inner) else path


def load(path: str, expect: config_mod.ModelConfig | None = None) -> Checkpoint:
    """Load and verify the checkpoint directory ``path`` (or the checkpoint of the run
    directory ``path``).

    Parameters
    ----------
    expect : ModelConfig, optional
        When given, the checkpoint's model configuration must equal it.

    Raises
    ------
    CheckpointError
        Missing, truncated, corrupt, pickled or mismatched content (one line).
    """
    path = in_run(os.path.abspath(path), LocalFS())
    # a save that died between its two renames left the last checkpoint as <path>.old
    LocalFS().restore(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    return from_files(_read_local(path), path, expect)
