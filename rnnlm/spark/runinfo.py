"""``<out>/run.json``: what a run is, written when it starts, so a run in progress can be
plotted and compared (see :mod:`rnnlm.runs`)."""
from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from importlib import metadata

from .. import __version__
from ..core.metrics import MAX_JSON

_PACKAGES = ("numpy", "pyspark", "cupy-cuda12x", "cupy-cuda11x", "cupy")
NAME = "run.json"


def _versions() -> dict:
    out = {"rnnlm": __version__, "python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def is_record(fs, out: str) -> bool:
    """Whether ``<out>/run.json`` is a run's record (a table with its configuration and start, as
    :func:`describe` writes it), not a file of the same name that something else left."""
    info = read(fs, out)
    return isinstance(info.get("config"), dict) and "started" in info


def describe(sc, cfg, resume_of: dict | None = None, devices: dict | None = None,
             init_from: dict | None = None, corpus: dict | None = None) -> dict:
    """The record of a run starting now on ``sc`` with the resolved ``cfg``; ``devices``: partition ->
    ``{"ran": "cpu" or "gpu N", "assigned": Spark's GPU addresses, "arithmetic": what else fixes its
    numbers}`` (:func:`rnnlm.spark.executor.probe_task`); ``init_from``: where its first
    weights came from (``--init-from``: path, round, optimizer ``fresh`` or ``kept``); ``corpus``: what it reads
    (:meth:`rnnlm.spark.corpus.Corpus.record`), which a resume must read again.

    ``resume_of`` is the record of the run being resumed: its start time and ``init_from`` are
    kept and this start is appended to its ``resumed`` list.
    """
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    info = {"config": cfg.to_dict(), "versions": _versions(), "spark": sc.version, "master": sc.master,
            "app_name": sc.appName,
            "partitions": cfg.data.partitions, "default_parallelism": sc.defaultParallelism,
            "application_id": sc.applicationId, "started": now, "resumed": [],
            "devices": {str(pid): d for pid, d in sorted((devices or {}).items())}}
    if resume_of is not None:          # {} for a run from before run.json: its start is unknown
        # what a damaged or edited record holds of each field that is not of its kind is unknown, not fatal
        started, resumed = resume_of.get("started"), resume_of.get("resumed")
        info["started"] = started if isinstance(started, str) else None
        info["resumed"] = [t for t in resumed if isinstance(t, str)] if isinstance(resumed, list) else []
        info["resumed"].append(now)
        init_from = resume_of.get("init_from") if isinstance(resume_of.get("init_from"), dict) else None
    if init_from is not None:
        info["init_from"] = init_from
    if corpus is not None:
        info["corpus"] = corpus
    return info


def read(fs, out: str) -> dict:
    """``<out>/run.json`` as a table; ``{}`` for none, or for a damaged record (or one too large), which
    the next :func:`write` replaces: never fatal to training."""
    try:
        raw = fs.read_at_most(f"{out}/{NAME}", MAX_JSON)
        info = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        info = {}
    return info if isinstance(info, dict) else {}


def write(fs, out: str, sc, cfg, resume: bool, devices: dict | None = None, init_from: dict | None = None,
          corpus: dict | None = None, check=None) -> dict:
    """Write (atomically) ``<out>/run.json`` for a run starting or resuming now (from ``init_from``'s weights, on
    ``corpus``); returns the record a resume replaced (``{}`` when there was none, or for a new run), which
    ``check`` (a callable) sees first and may refuse by raising, leaving the file as it was."""
    old = read(fs, out) if resume else None
    if check is not None:
        check(old or {})
    fs.write_atomic(f"{out}/{NAME}", json.dumps(describe(sc, cfg, old, devices, init_from, corpus),
                                                indent=2).encode())
    return old or {}
