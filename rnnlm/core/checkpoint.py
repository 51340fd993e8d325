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
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field

import numpy as np

from .. import config as config_mod
from .files import LocalFS
from .model import build as build_model
from .vocab import Vocab, VocabError

MANIFEST = "MANIFEST.json"


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
        try:
            with open(os.path.join(path, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    return read


def _load_npy(data: bytes, name: str):
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e):
            raise CheckpointError(f"{name} contains pickled data, refused (checkpoints are data only)") from None
        raise CheckpointError(f"{name} is not a valid NumPy file: {e}") from None
    except Exception as e:  # truncated headers raise assorted errors
        raise CheckpointError(f"{name} is not a valid NumPy file: {e}") from None


def from_files(read, where: str, expect: config_mod.ModelConfig | None = None) -> Checkpoint:
    """Load from ``read(name) -> bytes | None`` (see :func:`load`)."""
    raw = read(MANIFEST)
    if raw is None:
        raise CheckpointError(f"{where}: not a checkpoint (no {MANIFEST}; incomplete write?)")
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise CheckpointError(f"{where}: {MANIFEST} is corrupt") from None
    files = {}
    for name, meta in manifest.items():
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
    try:
        cfg = config_mod.from_json(files["config.json"].decode())
        vocab = Vocab.from_json(files["vocab.json"].decode())
        state = json.loads(files["state.json"])
    except (config_mod.ConfigError, VocabError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    params = _load_npy(files["params.npy"], "params.npy")
    try:
        with np.load(io.BytesIO(files["optim.npz"]), allow_pickle=False) as z:
            optim = {k: z[k] for k in z.files}
    except ValueError as e:
        raise CheckpointError(f"optim.npz refused: {e}") from None
    hidden = _load_npy(files["hidden.npy"], "hidden.npy") if "hidden.npy" in files else None
    ck = Checkpoint(params=params, config=cfg, vocab=vocab, optim=optim,
                    position=state.get("position", {}), hidden=hidden,
                    optim_t=int(state.get("optim_t", 0)), schedule=state.get("schedule", {}))
    _check(ck, where, expect)
    return ck


def _check(ck: Checkpoint, where: str, expect) -> None:
    m = ck.config.model
    if expect is not None and expect != m:
        diff = [k for k in m.__dataclass_fields__ if getattr(m, k) != getattr(expect, k)]
        raise CheckpointError(f"{where}: model configuration differs from the checkpoint's in {', '.join(diff)}")
    if len(ck.vocab) != m.vocab_size:
        raise CheckpointError(f"{where}: vocabulary has {len(ck.vocab)} tokens, model.vocab_size is {m.vocab_size}")
    size = build_model(m).layout.size
    if ck.params.shape != (size,) or ck.params.dtype != np.dtype(m.dtype):
        raise CheckpointError(f"{where}: params are {ck.params.dtype}{list(ck.params.shape)}, "
                              f"the configuration needs {m.dtype}[{size}]")
    for k, v in ck.optim.items():
        if v.shape != (size,):
            raise CheckpointError(f"{where}: optimizer slot {k} has shape {v.shape}, expected ({size},)")


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
