"""Reading training runs for plots and notebooks, without Spark or a JVM.

A run is the ``--out`` directory of ``jobs/train.py``: ``metrics.jsonl`` (one line per
round, or per ``data.partitions`` pushes in async mode), ``run.json`` (written when the
run starts: the resolved configuration, versions, master) and ``checkpoint/``. A run
still in progress reads fine: a last line cut short is dropped.

Paths are local (``runs/x``, ``file:///x``) or on HDFS through WebHDFS
(``webhdfs://namenode:9870/user/me/runs/x``, with the optional ``hdfs`` package:
``pip install -e ".[hdfs]"``; the user is ``$HADOOP_USER_NAME`` or the login name),
a thin adapter over HdfsCLI's client (``tests/test_hdfs.py`` reads runs on a real NameNode).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .core import files
from .core.metrics import MAX_JSON, MAX_METRICS, json_lines

WEBHDFS_TIMEOUT_S = 30          # a WebHDFS request's limit, to connect and between bytes


class RunError(ValueError):
    """A path that is not a readable run; the message is one line."""


class NotARun(RunError):
    """A path that holds no run at all (no directory, or no ``metrics.jsonl``)."""


@dataclass
class Run:
    """One training run.

    Attributes
    ----------
    path : str
    metrics : list of dict
        The lines of ``metrics.jsonl``, in order.
    config : dict
        The resolved configuration as ``{section: {key: value}}`` (from ``run.json``, else
        the checkpoint's ``config.json``; empty when neither exists yet).
    info : dict
        ``run.json`` (empty for runs written before it existed).
    """

    path: str
    metrics: list
    config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/")) or self.path

    def flat_config(self) -> dict:
        """``{"section.key": value}``."""
        return {f"{s}.{k}": v for s, keys in self.config.items() for k, v in keys.items()}


def _too_large(path: str, held: str, limit: int) -> RunError:
    """``held``: ``"N bytes, more"``, or ``"more"`` for a file that grew while read."""
    return RunError(f"{path}: {held} than the {files.amount(limit)} a run's {os.path.basename(path)} is read up to")


class _Local:
    def read(self, path: str, limit: int) -> bytes | None:
        try:
            return files.read_regular(path, limit)      # a run still writing: a line cut short is dropped
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except files.NotRegular:
            raise RunError(f"{path}: not a regular file") from None
        except files.TooLarge as e:
            raise _too_large(path, e.held(), limit) from None
        except OSError as e:                # no permission, an I/O error
            raise RunError(f"{path}: {e.strerror or e}") from None

    def children(self, path: str) -> list:
        if not os.path.isdir(path):
            return []
        try:
            names = os.listdir(path)
        except OSError as e:
            raise RunError(f"{path}: {e.strerror or e}") from None
        return sorted(os.path.join(path, n) for n in names if os.path.isdir(os.path.join(path, n)))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)


class _WebHDFS:
    """HdfsCLI (``hdfs`` package) over WebHDFS; paths are the URL's path part. Any failure of
    the client (HTTP, refused connection, permissions) becomes a one-line :class:`RunError`."""

    def __init__(self, netloc: str):
        try:
            from hdfs import InsecureClient
        except ImportError:
            raise RunError("webhdfs:// paths need the hdfs package: pip install -e \".[hdfs]\"") from None
        self.netloc = netloc
        # a NameNode that takes the connection and never answers stops the read, not the notebook
        self.client = InsecureClient(f"http://{netloc}", user=os.environ.get("HADOOP_USER_NAME"),
                                     timeout=WEBHDFS_TIMEOUT_S)

    def _call(self, path, fn):
        try:
            return fn()
        except RunError:
            raise
        except Exception as e:          # HdfsError, requests' errors: whatever the client raises
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RunError(f"webhdfs://{self.netloc}{path}: {first}") from None

    def read(self, path: str, limit: int) -> bytes | None:
        def read():
            status = self.client.status(path, strict=False)
            if status is None:
                return None
            if status.get("length", 0) > limit:
                raise _too_large(f"webhdfs://{self.netloc}{path}", f"{status['length']:,} bytes, more", limit)
            with self.client.read(path, length=limit) as f:
                data = f.read(limit + 1)        # a server that ignores length= sends no more than this
            if len(data) > limit:
                raise _too_large(f"webhdfs://{self.netloc}{path}", "more", limit)
            return data
        return self._call(path, read)

    def children(self, path: str) -> list:
        if not self.is_dir(path):
            return []
        return self._call(path, lambda: sorted(f"{path.rstrip('/')}/{n}" for n, s in self.client.list(path, status=True)
                                               if s["type"] == "DIRECTORY"))

    def is_dir(self, path: str) -> bool:
        s = self._call(path, lambda: self.client.status(path, strict=False))
        return s is not None and s["type"] == "DIRECTORY"


def env_paths(value: str, root: str) -> list:
    """The run paths of a comma-separated list (``$RNNLM_RUNS``), a relative local one taken
    from ``root``: a notebook's kernel runs in ``notebooks/``, not where its user started."""
    paths = [p.strip() for p in value.split(",") if p.strip()]
    return [p if _url(p).scheme or os.path.isabs(p) else os.path.join(root, p) for p in paths]


def _url(path: str):
    try:
        return files.parse_url(path)
    except files.PathError as e:        # a RunError, as everything that reading runs refuses
        raise RunError(str(e)) from None


def _fs(path: str):
    """``(filesystem, path on it, prefix that makes a path a URL again)``."""
    url = _url(path)
    if url.scheme == "webhdfs":
        return _WebHDFS(url.netloc), url.path, f"webhdfs://{url.netloc}"
    if url.scheme == "file":
        return _Local(), url.path, ""
    if url.scheme in ("hdfs", "viewfs", "s3a", "gs", "abfs"):
        raise RunError(f"{path}: reading runs without Spark goes through WebHDFS: use "
                       f"webhdfs://<namenode>:<http port>{url.path} (or read it with Spark)")
    if url.scheme:
        raise RunError(f"{path}: unknown scheme {url.scheme}://")
    return _Local(), path, ""


def _json(fs, path: str) -> dict:
    raw = fs.read(path, MAX_JSON)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def load(path: str) -> Run:
    """Read the run at ``path``.

    Raises
    ------
    RunError
        ``path`` holds no ``metrics.jsonl`` (or only an empty one).
    """
    fs, p, prefix = _fs(path)
    p = p.rstrip("/") or "/"
    raw = fs.read(f"{p}/metrics.jsonl", MAX_METRICS)
    if raw is None:           # a replace cut short by a crash leaves the previous file as .old
        raw = fs.read(f"{p}/metrics.jsonl.old", MAX_METRICS)
    if raw is None:
        if fs.read(f"{p}/run.json", MAX_JSON) is not None:        # started, its first round not ended
            raise RunError(f"{path}: a run with no metrics line yet (run.json, no metrics.jsonl)")
        what = "no such directory" if not fs.is_dir(p) else "no metrics.jsonl"
        raise NotARun(f"{path}: not a run ({what})")
    metrics = json_lines(raw)
    if not metrics:
        first, end, _ = raw.partition(b"\n")
        if end and first.strip():       # a whole line, not one being written
            raise RunError(f"{path}: metrics.jsonl's first line is not a metrics line (a JSON table)")
        raise RunError(f"{path}: metrics.jsonl holds no complete line yet")
    info = _json(fs, f"{p}/run.json")
    cfg = _sections(info.get("config")) or _sections(_json(fs, f"{p}/checkpoint/config.json"))
    return Run(prefix + p if prefix else path.rstrip("/"), metrics, cfg, info)


def _sections(cfg) -> dict:
    """The tables of sections of a configuration read back (a file edited or damaged holds other things)."""
    return {s: keys for s, keys in cfg.items() if isinstance(keys, dict)} if isinstance(cfg, dict) else {}


def load_all(paths, skipped: list | None = None) -> list:
    """Read every run named: a run directory, or a directory whose subdirectories are runs
    (``runs/strategies`` holding one run per strategy; searched two levels deep). A run that cannot be
    read (its metrics empty or damaged, a file refused, none yet), named or found in a directory, is
    left out where others are read, and why is appended to ``skipped``.

    Raises
    ------
    RunError
        A path that is neither (one line naming it).
    """
    out, unread = [], []
    for path in paths:
        fs, p, prefix = _fs(path)
        try:
            out.append(load(path))
            continue
        except NotARun as e:
            first = e
        except RunError as e:           # a run named that cannot be read (yet): left out beside others
            if skipped is None:
                raise
            unread.append(e)
            continue
        found = _find(fs, p.rstrip("/"), prefix, 2, [] if skipped is None else skipped)
        if not found:
            raise first
        out.extend(found)
    if unread and not out:
        raise unread[0]
    if unread:
        skipped.extend(str(e) for e in unread)
    return out


def _find(fs, p: str, prefix: str, depth: int, skipped: list) -> list:
    runs = []
    for child in fs.children(p):
        try:
            runs.append(load(prefix + child))
        except NotARun:
            if depth > 1:
                runs.extend(_find(fs, child, prefix, depth - 1, skipped))
        except RunError as e:
            skipped.append(str(e))
    return runs


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str) and "/" in value:
        return os.path.basename(value.rstrip("/")) or value
    return str(value)


def differing(runs) -> list:
    """The ``section.key`` names whose values differ between ``runs`` (sorted)."""
    flats = [r.flat_config() for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]


def distinguishing(runs) -> list:
    """A short list of differing ``section.key`` names that tells ``runs`` apart as well as their
    whole configurations do (greedy: each step adds the key that splits the runs most)."""
    flats = [r.flat_config() for r in runs]
    keys = differing(runs)

    def groups(ks):
        return len({tuple(json.dumps(f.get(k), sort_keys=True) for k in ks) for f in flats})
    target, chosen = groups(keys), []
    while groups(chosen) < target:
        chosen.append(max((k for k in keys if k not in chosen), key=lambda k: (groups(chosen + [k]), -_rank(k))))
    return sorted(chosen, key=_rank)


# among keys that split runs equally, the ones a reader names a run by come first
_FIRST = ("train.mode", "model.cell", "data.strategy", "train.local_steps", "exchange.", "server.", "model.",
          "optim.", "train.", "data.")


def _rank(key: str) -> int:
    return next(i for i, p in enumerate(_FIRST + ("",)) if key == p or (p.endswith(".") or not p) and
                key.startswith(p))


def labels(runs, keys=None) -> list:
    """A label per run made of what differs in their configurations (``local_steps=10,
    exchange.embed=rows``; a key's section is dropped where the key name alone is unique):
    ``keys``, or by default :func:`distinguishing`'s. Runs that configurations do not tell
    apart (repeats of one setting, runs without a recorded configuration) get their
    directory names."""
    known = [r for r in runs if r.config]
    keys = list(keys) if keys is not None else distinguishing(known) if len(known) > 1 else []
    names = [k.split(".", 1)[-1] for k in keys]
    short = {k: (n if names.count(n) == 1 else k) for k, n in zip(keys, names)}
    out = []
    for r in runs:
        f = r.flat_config()
        label = ", ".join(f"{short[k]}={_short(f.get(k))}" for k in keys) if f else ""
        out.append(label or r.name)
    if len(set(out)) < len(out):
        out = [f"{r.name}: {lab}" if lab != r.name else lab for r, lab in zip(runs, out)]
    return out
