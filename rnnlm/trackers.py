"""Experiment trackers: every metrics line also to TensorBoard or MLflow (``train --log``).

``tensorboard[:DIR]`` writes TensorBoard's event files itself (its record framing and the few
protocol-buffer fields of a scalar), so it needs no package; ``mlflow`` logs to the tracking
server MLflow's own client finds (``MLFLOW_TRACKING_URI``), the configuration as parameters.
A tracker that fails (a server gone, a full disk) says so once and stops; the run goes on, as its
metrics file is the record.
"""
from __future__ import annotations

import math
import os
import socket
import struct
import time

from . import config


class TrackerError(ValueError):
    """A ``--log`` value that cannot be used; the message is one line."""


KINDS = ("tensorboard[:DIR]", "mlflow")


def parse(specs: list, out: str, overwrite: bool = False) -> list:
    """``--log`` values as ``(kind, argument)``, checked before anything starts: TensorBoard's
    directory defaults to ``OUT/tensorboard`` for a local ``--out`` (``overwrite``: the run starts
    again there, and its earlier event files go, as its metrics do; a directory named is left as it is)."""
    parsed = []
    for spec in specs:
        kind, _, arg = spec.partition(":")
        if kind == "tensorboard":
            from .spark.hfs import default_fs, resolve
            local, path = resolve(out, default_fs())          # as Hadoop reads --out: file:, hdfs:, fs.defaultFS
            if not arg and not local:
                raise TrackerError(f"--log tensorboard: --out {out} is not a local directory; "
                                   "name one: --log tensorboard:DIR")
            directory = arg or os.path.join(path, "tensorboard")
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise TrackerError(f"--log tensorboard: {directory} is not a directory")
            parsed.append(("tensorboard", (directory, overwrite and not arg)))
        elif kind == "mlflow" and not arg:
            try:
                import mlflow  # noqa: F401
            except ImportError:
                raise TrackerError("--log mlflow needs MLflow's client: pip install mlflow-skinny") from None
            parsed.append(("mlflow", ""))
        else:
            raise TrackerError(f"--log {spec!r}: expected one of {', '.join(KINDS)}")
    return parsed


def start(parsed: list, cfg: config.Config, out: str, log=print, resume: bool = False) -> list:
    """The trackers of ``parsed`` (:func:`parse`), started for a run of ``cfg`` in ``out`` (``resume``:
    the run in ``out`` goes on). One that cannot start closes those started before it (an MLflow run
    left active would be ended FINISHED by MLflow's exit hook) and raises."""
    started = []
    try:
        for kind, arg in parsed:
            started.append(TensorBoard(*arg, log=log) if kind == "tensorboard" else MLflow(cfg, out, log, resume))
    except BaseException:
        for t in started:
            t.close(False)
        raise
    return started


def scalars(m: dict) -> dict:
    """The numbers of a metrics line (not its flags or labels)."""
    return {k: float(v) for k, v in m.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "round"}


class Tracker:
    """A sink of metrics lines that turns itself off at its first failure."""

    name = "tracker"

    def __init__(self, log):
        self.log, self.broken = log, False

    def line(self, m: dict) -> None:
        if not self.broken:
            self._guard(self._line, m)

    def close(self, ok: bool) -> None:
        if not self.broken:
            self._guard(self._close, ok)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:        # a tracker never stops the run
            self.broken = True
            self.log(f"warning: --log {self.name} failed, no more lines go there (metrics.jsonl has them): "
                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300] + self._hint())

    def _hint(self) -> str:
        """What the user can do about a failure, after the error's own words (cut: they can run long)."""
        return ""

    def _line(self, m: dict) -> None:
        raise NotImplementedError

    def _close(self, ok: bool) -> None:
        pass


# ------------------------------------------------------------------ TensorBoard
def _crc32c_table() -> list:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    n = struct.pack("<Q", len(data))
    return n + struct.pack("<I", _masked(crc32c(n))) + data + struct.pack("<I", _masked(crc32c(data)))


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protocol-buffer field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, scalars: dict | None = None, file_version: str | None = None,
          session_start: bool = False) -> bytes:
    """A serialised ``tensorflow.Event``: wall_time (1), step (2), file_version (3), a Summary (5)
    of simple values (Summary.value (1): tag (1), simple_value (2)) or a SessionLog (7) whose
    status (1) is START (1)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if session_start:
        out += _field(7, b"\x08\x01")
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", _float32(v)))
                          for tag, v in scalars.items())
        out += _field(5, values)
    return out


def _float32(v: float) -> float:
    """``v`` as float32 holds it: past its largest finite value (a perplexity of a loss above 88.7),
    infinite, where ``struct`` refuses it."""
    return v if not abs(v) > _F32_MAX else math.copysign(math.inf, v)


_F32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


class TensorBoard(Tracker):
    """An event file in ``directory`` (``tensorboard --logdir`` reads it): a scalar per number of
    each metrics line, at the round's step.

    Its first line's step opens a session (``SessionLog.START``): TensorBoard then drops what earlier
    files hold from that step on, the rounds a resumed run trains again. ``afresh`` (``--overwrite``):
    the earlier run's event files are deleted then, when this run has started."""

    name = "tensorboard"

    def __init__(self, directory: str, afresh: bool = False, log=print):
        super().__init__(log)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.rnnlm"
        self.path, self.afresh, self.started = os.path.join(directory, name), afresh, False
        try:        # its first record too: a full disk or a quota said only by a traceback, once Spark had started
            os.makedirs(directory, exist_ok=True)
            self.f = open(self.path, "ab")
            try:
                self._write(event(time.time(), 0, file_version="brain.Event:2"))
            except OSError:
                self.f.close()
                raise
        except OSError as e:
            raise TrackerError(f"--log tensorboard: cannot write {self.path}: {e.strerror or e}") from None

    def _write(self, data: bytes) -> None:
        self.f.write(record(data))
        self.f.flush()

    def _line(self, m: dict) -> None:
        step = int(m["round"])
        if not self.started:
            self.started = True
            if self.afresh:     # a run started again: the earlier run's curves would be drawn with its own
                directory, mine = os.path.split(self.path)
                for old in os.listdir(directory):
                    if old.startswith("events.out.tfevents.") and old.endswith(".rnnlm") and old != mine:
                        os.remove(os.path.join(directory, old))
            self._write(event(time.time(), step, session_start=True))
        self._write(event(time.time(), step, scalars(m)))

    def close(self, ok: bool) -> None:
        """Close the event file, also after a failed write stopped its lines (its descriptor stayed open
        for the rest of the process: a notebook's, a sweep's)."""
        if not self.broken:
            super().close(ok)       # a close that fails is said, as a write is
            return
        try:
            self.f.close()
        except OSError:             # the write that broke it, flushed again: said once already
            pass

    def _close(self, ok: bool) -> None:
        self.f.close()


# ----------------------------------------------------------------------- MLflow
def _experiment() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rnnlm"


def _where(out: str) -> str:
    """``out`` as MLflow's tag names it: where Hadoop puts it, a local one as its absolute path, no
    trailing slash (``runs/latest`` is every checkout's default: its relative name matched another's)."""
    from .spark.hfs import default_fs, resolve
    local, path = resolve(out, default_fs())
    return os.path.abspath(path) if local else path.rstrip("/")


class MLflow(Tracker):
    """An MLflow run named after ``out`` (in ``MLFLOW_EXPERIMENT_NAME``, default ``rnnlm``): the
    configuration as parameters, each metrics line's numbers as metrics at the round's step.

    ``resume``: the latest run tagged with ``out`` goes on (a resumed run's rounds in one MLflow run; the
    rounds it trains again are logged again at their steps, where MLflow keeps both values: the same
    training numbers, as a resume reproduces them, and new times); a key the resume changed is the tag
    ``rnnlm.resumed.KEY``."""

    name = "mlflow"

    def __init__(self, cfg: config.Config, out: str, log=print, resume: bool = False):
        super().__init__(log)
        import mlflow
        # a tracking server that does not answer costs seconds, not MLflow's default minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.mlflow, self.run = mlflow, None
        self._guard(self._start, cfg, out, resume)

    def _start(self, cfg, out: str, resume: bool) -> None:
        self.mlflow.set_experiment(_experiment())
        flat = {f"{s}.{k}": str(v) for s, sec in cfg.to_dict().items() for k, v in sec.items()}
        out = _where(out)
        earlier = self._earlier(out) if resume else None
        if earlier is None:
            self.run = self.mlflow.start_run(run_name=os.path.basename(out) or out)
            self.mlflow.log_params(flat)
            self.mlflow.set_tag("rnnlm.out", out)
            return
        # MLflow refuses a parameter's second value: the keys a resume may change are tagged instead
        self.run = self.mlflow.start_run(run_id=earlier.info.run_id)
        kept = earlier.data.params
        self.mlflow.log_params({k: v for k, v in flat.items() if k not in kept})
        changed = {f"rnnlm.resumed.{k}": v for k, v in flat.items() if k in kept and kept[k] != v}
        if changed:
            self.mlflow.set_tags(changed)

    def _hint(self) -> str:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            return (" (MLFLOW_TRACKING_URI names no tracking server: set it to one's http://HOST:PORT; MLflow's "
                    "default, a SQLite file, needs the full mlflow package)")
        if "://" not in uri or uri.startswith("file:"):
            if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
                return (" (MLflow 3 keeps runs in a local directory only with MLFLOW_ALLOW_FILE_STORE=true; a "
                        "tracking server's http://HOST:PORT needs nothing more)")
        return ""

    def _earlier(self, out: str):
        """The latest MLflow run of this experiment tagged with ``out``, or None."""
        client = self.mlflow.MlflowClient()
        exp = self.mlflow.get_experiment_by_name(_experiment())
        quote = next((q for q in "'\"" if q not in out), None)
        where = f"tags.`rnnlm.out` = {quote}{out}{quote}" if quote else ""
        runs = client.search_runs([exp.experiment_id], where, order_by=["attributes.start_time DESC"],
                                  max_results=1 if quote else 1000)
        return next((r for r in runs if r.data.tags.get("rnnlm.out") == out), None)

    def _line(self, m: dict) -> None:
        self.mlflow.log_metrics(scalars(m), step=int(m["round"]))

    def close(self, ok: bool) -> None:
        """End the MLflow run with the training's status, also after a failure stopped its lines: left
        active, MLflow's exit hook ended it as FINISHED, a failed run's record too."""
        if self.broken and self.run is not None:
            try:
                self.mlflow.end_run("FINISHED" if ok else "FAILED")
            except Exception:       # the server that broke the tracker: said once already
                pass
            return
        super().close(ok)

    def _close(self, ok: bool) -> None:
        self.mlflow.end_run("FINISHED" if ok else "FAILED")
