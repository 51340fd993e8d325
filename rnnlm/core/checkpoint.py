"""Checkpoints: a directory of ``.npy``/``.npz`` arrays and JSON, never pickle.

Files::

    params.npy     flat parameters (P,)
    optim.npz      optimizer accumulators, each (P,)
    hidden.npy     carried hidden states (optional)
    vocab.json     the vocabulary
    config.json    the full run configuration
    state.json     training position, optimizer step (and each partition's own), schedule state, layout
    MANIFEST.json  size and sha256 of every file above (written last)

A checkpoint is serialised to bytes first (:func:`to_files`), so the same bytes
can go to a local directory (:func:`save`, atomic: temp directory + rename) or
through Spark's Hadoop FileSystem. Loading verifies the manifest, reads arrays
(never an object array: nothing is unpickled) and checks shapes, dtype and vocabulary
against the configuration.

A checkpoint may come from anywhere (a shared directory, a download), so loading
trusts nothing in it: the manifest may name only the checkpoint's own files, each a
regular file (a link is refused, not followed); each file's size, from ``lstat`` before
a byte is read, must be the manifest's and within what the configuration holds
(:data:`JSON_LIMITS`, :data:`HEADER_BYTES` and the parameters' bytes,
:func:`optimizer_arrays` such arrays in ``optim.npz``, counted from the zip's end record
before anything is inflated); every array's header is checked against the configuration
before its memory is allocated, then the file is read straight into it and hashed on the
way; every field of ``state.json`` is typed. Whatever fails is one line.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np

from .. import config as config_mod
from .files import LocalFS
from .metrics import number
from .models import build as build_model
from .vocab import Vocab, VocabError

MANIFEST = "MANIFEST.json"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")       # no directory, not hidden, not ".."
_OPTIM_KEY = re.compile(r"(p[0-9]+/)?[A-Za-z0-9_.]+")             # "<slot>", "p<pid>/<slot>", "outer.view", ...
FORMAT = 1                 # state.json's "format": how the parameters are packed, with its "layout"
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
    optim_t_local: dict = field(default_factory=dict)    # pid -> its own optimizer's step count


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
            # a plateau schedule's best before its first evaluation is infinite: null (JSON has no Infinity)
            "position": ck.position, "optim_t": int(ck.optim_t),
            "schedule": {k: None if k == "best" and v == math.inf else v for k, v in ck.schedule.items()},
            "optim_t_local": {str(pid): int(t) for pid, t in sorted(ck.optim_t_local.items())},
            "layout": model.layout.describe(), "format": FORMAT}, indent=2).encode(),
    }
    optim = {k: np.asarray(v) for k, v in ck.optim.items()}
    if any(a.dtype.hasobject for a in optim.values()):      # np.savez would pickle them; the loader refuses pickles
        raise ValueError("optim: object arrays cannot be written (a checkpoint is data only)")
    b = io.BytesIO()
    np.savez(b, **optim)
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
    the old one possibly as ``<path>.old``, which :func:`load` reads where it lies.
    """
    LocalFS().write_dir_atomic(os.path.abspath(path), to_files(ck))


# the files a checkpoint holds, and the most bytes its JSON ones may have (vocab.json: per token)
JSON_LIMITS = {"config.json": 1 << 20, "state.json": 64 << 20}
VOCAB_BYTES = (1 << 20, 1024)               # vocab.json: 1 MiB + 1 KiB per token of model.vocab_size
HEADER_BYTES = 4096                          # an array file's header (NumPy writes 128)
MANIFEST_LIMIT = 1 << 20
ARRAYS = ("params.npy", "optim.npz", "hidden.npy")
FILES = ("config.json", "vocab.json", "state.json") + ARRAYS
_CHUNK = 1 << 20


class _Directory:
    """A local checkpoint directory. Each file is looked at with ``lstat`` before it is opened: a
    symbolic link is refused without being followed (nor its target named), as is anything but a
    regular file; its size comes from there, before any byte is read."""

    def __init__(self, path: str):
        self.path = path

    def size(self, name: str) -> int | None:
        try:
            st = os.lstat(os.path.join(self.path, name))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointError(f"{self.path}: {name} cannot be read ({e.strerror})") from None
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(f"{self.path}: {name} is a symbolic link, refused (a checkpoint holds regular "
                                  "files only)")
        if not stat.S_ISREG(st.st_mode):      # a fifo or /dev/zero would never end
            raise CheckpointError(f"{self.path}: {name} is not a regular file")
        return st.st_size

    def open(self, name: str):
        """The file, opened without following a link (one swapped in since :meth:`size` is refused)."""
        try:
            fd = os.open(os.path.join(self.path, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise CheckpointError(f"{self.path}: {name} cannot be read ({e.strerror})") from None
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            raise CheckpointError(f"{self.path}: {name} is not a regular file")
        return f


class _Reader:
    """Checkpoint files from ``read(name) -> bytes | None`` (Hadoop's client, WebHDFS), checked as a
    local one is: each file's size from ``size(name) -> int | None`` where the filesystem tells it
    before a byte is read (then read whole once that size passed), else from reading it whole."""

    def __init__(self, read, size=None):
        self.read, self.stat, self.data = read, size, {}

    def size(self, name: str) -> int | None:
        if self.stat is not None:
            return self.stat(name)
        data = self.read(name)
        if data is None:
            return None
        self.data[name] = data
        return len(data)

    def open(self, name: str):
        data = self.data.pop(name) if name in self.data else self.read(name)
        if data is None:
            raise CheckpointError(f"{name} went missing while the checkpoint was read")
        return io.BytesIO(data)


class _Hashed(io.RawIOBase):
    """A file read once, front to back, into its sha256 (what the manifest vouches for)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.sha.update(memoryview(b)[:n])
        return n

    def close(self) -> None:
        self.f.close()
        super().close()

    def verify(self, where: str, name: str, digest: str) -> None:
        """The checksum of the whole file (what is left is read too) must be the manifest's."""
        buf = bytearray(_CHUNK)
        while self.readinto(buf):
            pass
        if self.sha.hexdigest() != digest:
            raise CheckpointError(f"{where}: {name} is corrupt (checksum mismatch)")


class _Counting:
    """A stream's bytes, counted as NumPy's header reader takes them (it reads exactly what it asks)."""

    def __init__(self, f):
        self.f, self.count, self.first = f, 0, b""

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        self.first = self.first or data[:1]
        self.count += len(data)
        return data


def _npy_header(f, name: str) -> tuple:
    """(shape, fortran order, dtype, header bytes) of an open ``.npy`` stream; pickled objects refused."""
    counted = _Counting(f)
    try:
        shape, fortran, dtype = _NPY_READERS[np.lib.format.read_magic(counted)](counted)
    except (KeyError, ValueError, SyntaxError, EOFError) as e:     # a zip, text, a truncated header...
        if counted.first == b"\x80":                               # pickle's PROTO opcode
            raise CheckpointError(f"{name} contains pickled data, refused (checkpoints are data only)") from None
        raise CheckpointError(f"{name} is not a NumPy array file ({type(e).__name__})") from None
    if dtype.hasobject:
        raise CheckpointError(f"{name} contains pickled data, refused (checkpoints are data only)")
    return shape, fortran, dtype, counted.count


def _read_npy(f, name: str, size: int, expect) -> np.ndarray:
    """The array of an open ``.npy`` stream of ``size`` bytes. Its header is checked before anything is
    allocated: no pickled objects, no more data declared than the file holds, and ``expect(shape,
    dtype)`` (a message, or None when the array is one the configuration has); then it is read into
    its array by chunks."""
    shape, fortran, dtype, header = _npy_header(f, name)
    count = int(np.prod(shape, dtype=object))
    if count * dtype.itemsize != size - header:
        raise CheckpointError(f"{name} declares {count * dtype.itemsize} bytes of {dtype} in a {size}-byte file")
    problem = expect(tuple(shape), dtype)
    if problem:
        raise CheckpointError(problem)
    memory = config_mod.memory_bytes()      # the size a configuration bounds is not the memory this machine has
    if memory is not None and count * dtype.itemsize > memory:
        raise CheckpointError(f"{name} holds {count * dtype.itemsize:,} bytes of {dtype}, more than this machine's "
                              f"{memory / (1 << 30):,.1f} GiB of memory")
    try:
        out = np.empty(count, dtype)
    except MemoryError:
        raise CheckpointError(f"{name}: {count * dtype.itemsize:,} bytes of {dtype} do not fit in the memory "
                              "free here") from None
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):             # straight into the array: no copy of the file is held
        n = f.readinto(view[done:done + _CHUNK])
        if not n:
            raise CheckpointError(f"{name} is truncated")
        done += n
    return out.reshape(shape, order="F" if fortran else "C")


_EOCD = struct.Struct("<4s4H2LH")        # the zip's end record: signature, disks, entries, directory size...
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")


def _zip_directory(f, size: int, name: str) -> tuple:
    """(members, central directory bytes) a zip declares in its end records, read before ``zipfile``
    reads (and allocates) its directory. NumPy's zips end in a record without a comment, preceded by
    a ZIP64 record and its locator when large."""
    if size < _EOCD.size:
        raise CheckpointError(f"{name} is not a zip of NumPy arrays (too short)")
    f.seek(size - _EOCD.size)
    sig, _, _, _, members, directory, _, comment = _EOCD.unpack(f.read(_EOCD.size))
    if sig != b"PK\x05\x06" or comment:
        raise CheckpointError(f"{name} is not a zip of NumPy arrays (no end record)")
    at = size - _EOCD.size - _EOCD64_LOCATOR.size
    if at >= _EOCD64.size:
        f.seek(at)
        locator = _EOCD64_LOCATOR.unpack(f.read(_EOCD64_LOCATOR.size))
        if locator[0] == b"PK\x06\x07":
            record = at - _EOCD64.size
            f.seek(record)
            fields = _EOCD64.unpack(f.read(_EOCD64.size))
            if fields[0] != b"PK\x06\x06" or locator[2] != record:
                raise CheckpointError(f"{name} is not a zip of NumPy arrays (a ZIP64 locator without its record)")
            members, directory = fields[7], fields[8]
    f.seek(0)
    return members, directory


def _read_npz(f, name: str, size: int, most: int, member_bytes: int, expect) -> dict:
    """The arrays of an open ``.npz`` of ``size`` bytes: at most ``most`` members of at most
    ``member_bytes`` each (so at most ``most * member_bytes`` in all), counted from the zip's end
    record and its directory, each member's declared size checked before it is inflated, and each
    read as :func:`_read_npy` reads (``expect(key, shape, dtype)``)."""
    members, directory = _zip_directory(f, size, name)
    if members > most or directory > most * 1024:
        raise CheckpointError(f"{name} declares {members} members in a {directory}-byte directory: a run of this "
                              f"configuration writes at most {most} optimizer arrays")
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
            if len(infos) > most:
                raise CheckpointError(f"{name} holds {len(infos)} members: a run of this configuration writes at "
                                      f"most {most} optimizer arrays")
            for info in infos:
                if not info.filename.endswith(".npy") or info.file_size > member_bytes:
                    raise CheckpointError(f"{name} holds {info.filename!r:.60} ({info.file_size} bytes), not "
                                          f"an optimizer slot of at most {member_bytes} bytes")
                # NumPy writes members stored (savez) or deflated (savez_compressed); zipfile inflates a bzip2
                # or lzma member a whole block at a time, past its declared size, and an encrypted one raises
                if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 1:
                    raise CheckpointError(f"{name} holds {info.filename!r:.60} compressed or encrypted as NumPy "
                                          "never writes it (a zip member stored or deflated)")
            out = {}
            for info in infos:
                key = info.filename[:-4]
                with z.open(info) as member:
                    out[key] = _read_npy(member, f"{name}:{info.filename}", info.file_size,
                                         lambda shape, dtype: expect(key, shape, dtype))
            return out
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError, zlib.error) as e:
        raise CheckpointError(f"{name} is not a zip of NumPy arrays: {e}") from None


def _manifest(raw: bytes, where: str) -> dict:
    """``{file name: {"size", "sha256"}}``: plain file names of the checkpoint directory only, each
    a file a checkpoint holds."""
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{where}: {MANIFEST} is corrupt") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: {MANIFEST} is not a table of files")
    for name, meta in manifest.items():
        if not _PLAIN_NAME.fullmatch(name):
            raise CheckpointError(f"{where}: {MANIFEST} names {name!r}, not a plain file name in the checkpoint")
        if name not in FILES:
            raise CheckpointError(f"{where}: {MANIFEST} names {name!r:.60}, not a file of a checkpoint")
        if not (isinstance(meta, dict) and type(meta.get("size")) is int and meta["size"] >= 0
                and isinstance(meta.get("sha256"), str)):
            raise CheckpointError(f"{where}: {MANIFEST}: {name} needs an integer size and a sha256")
    for name in FILES[:-1]:
        if name not in manifest:
            raise CheckpointError(f"{where}: manifest lacks {name}")
    return manifest


class _Files:
    """The files of one checkpoint, each opened once its size (from ``lstat``, before any byte is read)
    is the manifest's and at most what the configuration allows."""

    def __init__(self, source, where: str):
        self.source, self.where = source, where
        size = source.size(MANIFEST)
        if size is None:
            raise CheckpointError(f"{where}: not a checkpoint (no {MANIFEST}; incomplete write?)")
        if size > MANIFEST_LIMIT:
            raise CheckpointError(f"{where}: {MANIFEST} has {size} bytes, more than a checkpoint's ({MANIFEST_LIMIT})")
        with source.open(MANIFEST) as f:
            self.manifest = _manifest(f.read(MANIFEST_LIMIT), where)

    def open(self, name: str, limit: int) -> _Hashed:
        """File ``name``, read through its checksum (:meth:`_Hashed.verify`)."""
        meta, size = self.manifest[name], self.source.size(name)
        if size is None:
            raise CheckpointError(f"{self.where}: {name} is missing")
        if size < meta["size"]:
            raise CheckpointError(f"{self.where}: {name} is truncated ({size} of {meta['size']} bytes)")
        if size > meta["size"]:
            raise CheckpointError(f"{self.where}: {name} has {size} bytes, its manifest entry {meta['size']}")
        if size > limit:
            raise CheckpointError(f"{self.where}: {name} has {size} bytes, more than a checkpoint of its "
                                  f"configuration holds ({limit})")
        return _Hashed(self.source.open(name))

    def text(self, name: str, limit: int) -> str:
        """A JSON file's text, checksummed."""
        with self.open(name, limit) as f:
            chunks, got = [], 0
            while got <= limit and (chunk := f.read(min(_CHUNK, limit + 1 - got))):
                chunks.append(chunk)
                got += len(chunk)
            if got > limit:             # its size was checked: it grew since
                raise CheckpointError(f"{self.where}: {name} grew past {limit} bytes as it was read")
            f.verify(self.where, name, self.manifest[name]["sha256"])
        data = b"".join(chunks)
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.where}: {name} is not UTF-8 text") from None

    def array(self, name: str, limit: int, expect) -> np.ndarray:
        with self.open(name, limit) as f:
            try:
                out = _read_npy(f, name, self.manifest[name]["size"], expect)
            except CheckpointError as e:
                raise CheckpointError(f"{self.where}: {e}") from None
            f.verify(self.where, name, self.manifest[name]["sha256"])
        return out

    def arrays(self, name: str, limit: int, **bounds) -> dict:
        """An ``.npz`` file's arrays: checksummed first (a zip is read out of order), then read."""
        with self.open(name, limit) as f:
            f.verify(self.where, name, self.manifest[name]["sha256"])
            raw = f.f
            try:
                return _read_npz(raw, name, self.manifest[name]["size"], **bounds)
            except CheckpointError as e:
                raise CheckpointError(f"{self.where}: {e}") from None


_TOTAL_KEY = re.compile(r"(refused|attempts|windows|workers)_[a-z_]{1,40}")  # a metrics line's other keys stay its own
_COUNTS = ("round", "version", "step")                                  # integers >= 0
_AMOUNTS = ("tokens", "bytes_sent", "bytes_broadcast", "wall_s", "eval_s", "epoch", "pending_lr")   # numbers >= 0
# what the asynchronous trainer reads back from the last metrics line it keeps (the checkpoint's, or the file's)
LINE_AMOUNTS = ("bytes_sent", "bytes_broadcast", "wall_s")
# what a trainer reads back from a checkpoint's position when it resumes, by the train.mode that wrote it
RESUME_POSITION = {"sync": ("round", "tokens", "bytes_sent", "bytes_broadcast", "wall_s"),
                   "async": ("round", "version", "done", "totals")}


def _amount(v) -> bool:
    """A finite number >= 0 (an integer of 400 digits is none: it has no float)."""
    return number(v) is not None and v >= 0


def _loss(v) -> bool:
    """A best loss as a plateau schedule keeps it: a number >= 0, infinite before the first evaluation."""
    return type(v) is float and v >= 0 or _amount(v)


def _position(pos: dict, partitions: int) -> str | None:
    """What is wrong with ``state.json``'s position (the keys it has), or None."""
    for k in _COUNTS:
        if k in pos and not (type(pos[k]) is int and pos[k] >= 0):
            return f"{k} must be an integer >= 0, not {pos[k]!r:.40}"
    for k in _AMOUNTS:
        if k in pos and not _amount(pos[k]):
            return f"{k} must be a finite number >= 0, not {pos[k]!r:.40}"
    if "done" in pos and not (isinstance(pos["done"], list) and len(pos["done"]) == partitions
                              and all(type(d) is int and d >= 0 for d in pos["done"])):
        return f"done must be a list of {partitions} integers >= 0 (one per partition)"
    if "totals" in pos and not (isinstance(pos["totals"], dict) and all(
            _TOTAL_KEY.fullmatch(k) and type(v) is int and v >= 0 for k, v in pos["totals"].items())):
        return "totals must be a table of the server's counters (refused_*, attempts_*, ...), integers >= 0"
    if "best" in pos and not (pos["best"] is None or isinstance(pos["best"], dict)):
        return "best must be a table or null"
    line = pos.get("line")
    if line is not None and not (isinstance(line, dict) and all(type(line.get(k)) is int and line[k] >= 0
                                                                for k in ("round", "syncs"))
                                 and all(_amount(line.get(k)) for k in LINE_AMOUNTS)):
        return f"line must be a metrics line with integer round and syncs, and {', '.join(LINE_AMOUNTS)} >= 0"
    return None


def _state(raw: str, where: str, partitions: int, layout: list) -> tuple:
    """(position, schedule, optim_t, optim_t_local) of ``state.json``, each field of a known key typed; its
    format and parameters' ``layout`` (:meth:`rnnlm.core.layout.Layout.describe`) the ones this code writes."""
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: state.json is not JSON: {e}") from None
    if not (isinstance(state, dict) and isinstance(state.get("position", {}), dict)
            and isinstance(state.get("schedule", {}), dict)):
        raise CheckpointError(f"{where}: state.json must be a table with position, schedule and optim_t")
    if state.get("format", FORMAT) != FORMAT or state.get("layout", layout) != layout:
        raise CheckpointError(f"{where}: state.json: its parameters are packed as format {state.get('format')!r:.20} "
                              f"with another layout than this rnnlm's (format {FORMAT}): written by another version")
    optim_t = state.get("optim_t", 0)
    if type(optim_t) is not int or optim_t < 0:
        raise CheckpointError(f"{where}: state.json: optim_t must be an integer >= 0, not {optim_t!r:.40}")
    local = state.get("optim_t_local", {})
    if not (isinstance(local, dict) and all(re.fullmatch(r"[0-9]{1,5}", k) and int(k) < partitions
                                            and type(t) is int and t >= 0 for k, t in local.items())):
        raise CheckpointError(f"{where}: state.json: optim_t_local must be a table of integers >= 0 by "
                              f"partition (0 to {partitions - 1})")
    position, schedule = state.get("position", {}), state.get("schedule", {})
    problem = _position(position, partitions)
    if problem:
        raise CheckpointError(f"{where}: state.json: position: {problem}")
    if schedule and not (set(schedule) == {"lr", "best"} and _amount(schedule["lr"])
                         and (schedule["best"] is None or _loss(schedule["best"]))):
        raise CheckpointError(f"{where}: state.json: schedule must be empty or hold a finite lr >= 0 and a best loss")
    if schedule and schedule["best"] is None:               # none yet (older checkpoints wrote Infinity)
        schedule = dict(schedule, best=math.inf)
    return position, schedule, optim_t, {int(k): t for k, t in local.items()}


def _resumable(ck: Checkpoint, where: str) -> None:
    """A checkpoint to resume must hold what its trainer reads back (a one-machine run's does not)."""
    mode = ck.config.train.mode
    lacks = [k for k in RESUME_POSITION[mode] if k not in ck.position]
    if lacks:
        raise CheckpointError(f"{where}: state.json's position has no {lacks[0]}: not a checkpoint a {mode} run "
                              "can resume (rnnlm generate and evaluate can use it)")


def optimizer_arrays(cfg: config_mod.Config) -> int:
    """The most model-sized arrays a run of ``cfg`` writes in ``optim.npz``: the optimizer's slots,
    averaged and per partition, the outer momentum and the executors' view, two per partition of
    what it holds between rounds, and the parameter server's accumulator."""
    slots, P = config_mod.OPTIMIZER_SLOTS[cfg.optim.name], cfg.data.partitions
    return slots * (1 + P) + 2 + 2 * P + 1


def from_files(read, where: str, expect: config_mod.ModelConfig | None = None, resume: bool = False,
               size=None) -> Checkpoint:
    """Load from ``read(name) -> bytes | None`` (see :func:`load`); ``size(name) -> int | None``, where
    the filesystem tells a file's size without reading it, bounds each file before it is read."""
    return _load(_Reader(read, size), where, expect, resume)


def _load(source, where: str, expect, resume: bool) -> Checkpoint:
    """Read and check a checkpoint from ``source`` (:class:`_Directory` or :class:`_Reader`): the
    manifest, the JSON files (the configuration first: it bounds every other file), then the arrays."""
    files = _Files(source, where)
    cfg, vocab = _described(files, where)
    model = build_model(cfg.model)          # small to build: the configuration's ranges and memory check came first
    position, schedule, optim_t, optim_t_local = _state(files.text("state.json", JSON_LIMITS["state.json"]),
                                                        where, cfg.data.partitions, model.layout.describe())
    m = cfg.model
    if expect is not None and expect != m:
        diff = [k for k in m.__dataclass_fields__ if getattr(m, k) != getattr(expect, k)]
        raise CheckpointError(f"{where}: model configuration differs from the checkpoint's in {', '.join(diff)}")
    if len(vocab) != m.vocab_size:
        raise CheckpointError(f"{where}: vocabulary has {len(vocab)} tokens, model.vocab_size is {m.vocab_size}")
    params, optim, hidden = _arrays(files, cfg, model)
    acc = optim.get("server.acc")
    if acc is not None and not (np.isfinite(acc).all() and (acc >= 0).all()):
        raise CheckpointError(f"{where}: the parameter server's AdaGrad sums (server.acc) must be finite and >= 0")
    ck = Checkpoint(params=params, config=cfg, vocab=vocab, optim=optim, position=position, hidden=hidden,
                    optim_t=optim_t, schedule=schedule, optim_t_local=optim_t_local)
    if resume:
        _resumable(ck, where)
    return ck


def _described(files: _Files, where: str) -> tuple:
    """(configuration, vocabulary) of the checkpoint, each file within its limit."""
    try:
        cfg = config_mod.from_json(files.text("config.json", JSON_LIMITS["config.json"]))
        vocab = Vocab.from_json(files.text("vocab.json", VOCAB_BYTES[0] + VOCAB_BYTES[1] * cfg.model.vocab_size))
    except CheckpointError:
        raise
    except (config_mod.ConfigError, VocabError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    return cfg, vocab


def _arrays(files: _Files, cfg: config_mod.Config, model) -> tuple:
    """(params, optimizer state, hidden states or None), each checked against what ``cfg`` (and its
    ``model``) holds."""
    m, dtype = cfg.model, np.dtype(cfg.model.dtype)
    size = model.layout.size
    member = HEADER_BYTES + dtype.itemsize * size
    params = files.array("params.npy", member, lambda shape, dt: None if (shape, dt) == ((size,), dtype) else
                         f"params are {dt}{list(shape)}, the configuration needs {m.dtype}[{size}]")
    most = optimizer_arrays(cfg)
    optim = files.arrays("optim.npz", most * (member + 1024) + (1 << 16), most=most, member_bytes=member,
                         expect=_slot(dtype, size))
    if "hidden.npy" not in files.manifest:
        return params, optim, None
    stream = tuple(model.zero_state(cfg.train.batch).shape)
    shapes = ((cfg.data.partitions, *stream), stream)
    hidden = files.array("hidden.npy", HEADER_BYTES + dtype.itemsize * int(np.prod(shapes[0])),
                         lambda shape, dt: None if shape in shapes and dt == dtype else
                         f"hidden.npy is {dt}{list(shape)}, the configuration needs {dtype}{list(shapes[0])} "
                         f"(a state per partition) or {dtype}{list(stream)} (one stream)")
    return params, optim, hidden


def _slot(dtype, size: int):
    """``expect`` of an optimizer slot: a name a trainer writes, the parameters' shape, their dtype or
    float32 (residuals may stay float32)."""
    def expect(key, shape, dt):
        if not _OPTIM_KEY.fullmatch(key):        # the trainer parses "p<pid>/<slot>"
            return f"optimizer slot name {key!r:.60} is not one a trainer writes"
        if shape != (size,) or dt not in (dtype, np.dtype(np.float32)):
            return f"optimizer slot {key} is {dt}{list(shape)}, the configuration needs {dtype}[{size}]"
        return None
    return expect


def finite(ck: Checkpoint, where: str) -> Checkpoint:
    """``ck``, refused when its parameters are not all finite (a model that scores and samples nothing)."""
    if not np.isfinite(ck.params).all():
        raise CheckpointError(f"{where}: the parameters hold NaN or infinite values: not a model to use")
    return ck


def in_run(path: str, fs) -> str:
    """``path``, or ``path/checkpoint`` when ``path`` is a run directory (the ``--out`` of
    training) rather than a checkpoint; ``fs`` answers ``exists`` (a :class:`LocalFS` or
    Hadoop's)."""
    def is_checkpoint(p):
        return fs.exists(f"{p}/{MANIFEST}") or fs.exists(f"{p}.old/{MANIFEST}")
    path = path.rstrip("/") or path
    inner = f"{path}/checkpoint"
    return inner if not is_checkpoint(path) and is_checkpoint(inner) else path


def load(path: str, expect: config_mod.ModelConfig | None = None, resume: bool = False) -> Checkpoint:
    """Load and verify the checkpoint directory ``path`` (or the checkpoint of the run
    directory ``path``).

    Parameters
    ----------
    expect : ModelConfig, optional
        When given, the checkpoint's model configuration must equal it.
    resume : bool
        The checkpoint is to be resumed: its ``state.json`` must hold what its trainer reads back
        (:data:`RESUME_POSITION`).

    Raises
    ------
    CheckpointError
        Missing, truncated, corrupt, pickled, linked, oversized or mismatched content (one line).
    """
    fs = LocalFS()
    path = in_run(os.path.abspath(path), fs)
    # a save cut (or under way) between its two renames has the last checkpoint as <path>.old: read there
    path = fs.readable(path) or path
    if not os.path.isdir(path):
        raise CheckpointError(not_found(path, os.path.isfile(path)))
    return _load(_Directory(path), path, expect, resume)


def not_found(path: str, is_file: bool) -> str:
    """The line for a ``path`` that holds no checkpoint: nothing there, or a file."""
    if is_file:
        return f"not a checkpoint: {path} is a file (give a checkpoint directory, or the run directory holding one)"
    return f"checkpoint not found: {path}"
