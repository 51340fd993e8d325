"""Building what ``spark-submit`` ships to a cluster: the ``rnnlm`` package as a zip for
``--py-files``, and a packed Python environment with NumPy for ``--archives``."""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile


class PackagingError(RuntimeError):
    """The environment cannot be built; the message is one line."""


def _under_file(dest: str) -> str | None:
    """``"PATH is a file, not a directory"`` for the nearest existing parent of ``dest`` when it is a file (making
    the directories under it says only "File exists"), else None."""
    path = os.path.dirname(os.path.abspath(dest))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return None if os.path.isdir(path) else f"{path} is a file, not a directory"


def _replaceable(dest: str) -> None:
    """Refuse a ``dest`` that exists and is not a regular file: the rename would replace a directory
    entry such as ``/dev/full`` (as root) or a FIFO by the archive."""
    try:
        st = os.lstat(dest)
    except OSError:                 # missing, or under a file: the write says so
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):      # a directory: the callers say so
        raise PackagingError(f"cannot write {dest}: not a regular file (not replaced)")


def build_pyfiles(dest: str) -> str:
    """Write ``rnnlm`` (code and its small data files) to the zip ``dest``; return its path."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(pkg)
    _replaceable(dest)
    tmp = f"{dest}.{os.getpid()}.tmp"       # this process's: two builds of one dest never write one file
    try:
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        # strict_timestamps off: a file dated before 1980 (a Nix store's, SOURCE_DATE_EPOCH=0) is stored as 1980
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, strict_timestamps=False) as z:
            for d, dirs, files in os.walk(pkg):
                dirs[:] = sorted(x for x in dirs if x != "__pycache__")
                for f in sorted(files):
                    if f.endswith((".py", ".txt")):
                        full = os.path.join(d, f)
                        z.write(full, os.path.relpath(full, root))
        os.replace(tmp, dest)
    except OSError as e:        # dest a directory, under a file, not writable
        raise PackagingError(f"cannot write {dest}: {_under_file(dest) or e.strerror or e}") from None
    finally:                    # failed, or interrupted (Ctrl-C): no part of a zip stays
        if os.path.isfile(tmp):
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return dest


def executor_requirements() -> list:
    """What executors need besides ``rnnlm`` (which travels with ``--py-files``) and PySpark
    (which Spark ships itself): NumPy, at the driver's version, so both compute alike."""
    import numpy
    return [f"numpy=={numpy.__version__}"]


def build_env(dest: str, requirements: list | None = None, python: str = sys.executable) -> str:
    """Pack a new virtual environment holding ``requirements`` into ``dest`` (``.tar.gz``).

    The environment is made by ``python -m venv`` and packed by venv-pack (the ``cluster``
    extra), whose archives keep the interpreter's absolute path: every node needs that
    Python at the same path, as nodes installed from one image have. ``spark-submit
    --archives dest#env`` unpacks it in each container as ``./env``.
    """
    if not dest.endswith((".tar.gz", ".tgz")):      # Spark and YARN unpack an archive by its suffix
        raise PackagingError(f"cannot write {dest}: an environment is packed as .tar.gz (or .tgz); Spark "
                             "unpacks an archive by its suffix")
    try:
        import venv_pack
    except ImportError:
        raise PackagingError("packing an environment needs venv-pack: pip install -e \".[cluster]\"") from None
    requirements = requirements or executor_requirements()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    except OSError as e:
        raise PackagingError(f"cannot write {dest}: {_under_file(dest) or e.strerror}") from None
    if os.path.isdir(dest):     # known now, not after minutes of building the environment
        raise PackagingError(f"cannot write {dest}: a directory")
    _replaceable(dest)
    work = tempfile.mkdtemp(prefix="rnnlm-env.")
    try:
        env = os.path.join(work, "env")
        for cmd, what in (([python, "-m", "venv", env], "creating the virtual environment"),
                          ([os.path.join(env, "bin", "python"), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", *requirements], f"installing {' '.join(requirements)}")):
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                raise PackagingError(f"{what} took more than 900 s") from None
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                raise PackagingError(f"{what} failed: {last}")
        tmp = os.path.join(work, "env.tar.gz")
        venv_pack.pack(prefix=env, output=tmp, verbose=False)
        # copied beside it (this process's name), then renamed: a copy cut short never replaces a whole one
        beside = f"{dest}.{os.getpid()}.tmp"
        try:
            if os.path.isdir(dest):
                raise IsADirectoryError(21, "a directory")
            _replaceable(dest)
            shutil.copyfile(tmp, beside)
            os.replace(beside, dest)
        except OSError as e:
            raise PackagingError(f"cannot write {dest}: {e.strerror or e}") from None
        finally:                     # failed, or interrupted (Ctrl-C): no part of a copy stays
            if os.path.isfile(beside):
                with contextlib.suppress(OSError):
                    os.remove(beside)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
