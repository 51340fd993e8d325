"""Local files written crash-safely, and the replacement logic every filesystem shares.

Replacing a file or directory is crash-safe on any filesystem whose rename is atomic (a local
disk, HDFS), even without an atomic overwrite: the new content is written under a temporary
name ``<path>.tmp``, the old one is moved to the fixed backup name ``<path>.old``, the new
one is renamed into place and the backup is deleted. A crash between the two renames leaves
only ``<path>.old``, which readers read where it lies (:meth:`readable`, :meth:`read`) and the
writer moves back (:meth:`restore`, at a run's start) or replaces (its next save). A crash
before them leaves ``<path>.tmp``, which the next replacement (or deletion) clears.
One process is assumed to write a given path at a time. :class:`rnnlm.spark.hfs.HadoopFS`
runs the same logic over Hadoop's FileSystem client. On an object store (S3A, GCS) a directory's
rename is a copy, then a delete: a crash inside it can leave a partial ``<path>`` beside a whole
``<path>.old``, which the readers do not prefer (docs/cluster.md lists object stores as untested).
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from urllib.parse import urlparse

BACKUP = ".old"
TEMPORARY = ".tmp"


def backup(path: str) -> str:
    """The fixed name ``path`` is moved to while it is being replaced."""
    return path + BACKUP


def temporary(path: str) -> str:
    """The fixed name ``path``'s replacement is written under (a fixed name, not one per process,
    so that what a crashed writer left is cleared by the next one and cannot pile up)."""
    return path + TEMPORARY


def _local_write(p: str, data: bytes, mode: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
    with open(p, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class ReplaceSafely:
    """Crash-safe replacement and recovery, written once over a few primitives.

    Subclasses provide ``exists``, ``mkdirs``, ``rename``, ``write``, ``_remove``, ``_read(p, limit=None)``
    (bytes, at most ``limit + 1`` of them where a limit is given, or None when the file is missing) and
    ``size`` (bytes before any is read, None when missing).
    """

    def restore(self, p: str) -> bool:
        """Finish an interrupted replacement of ``p``: move ``<p>.old`` back if ``p`` is missing. The
        writer's (a run's start): readers read a backup where it lies (:meth:`readable`), since one that
        moved it back while its writer was between the two renames made the writer's second rename fail
        (on HDFS, where a rename onto a directory moves into it, put the new checkpoint inside the old).

        Returns
        -------
        bool
            Whether ``p`` exists now.
        """
        if self.exists(p):
            return True
        if not self.exists(backup(p)):
            return False
        try:
            self.rename(backup(p), p)
        except OSError:
            pass            # another reader restored it first
        return self.exists(p)

    def readable(self, p: str) -> str | None:
        """``p``, or ``<p>.old`` where a replacement of ``p`` was cut (or is under way) between its two
        renames: the last whole content, read where it lies; None when neither exists. (``p`` is asked
        again last: a replacement that ended meanwhile removed the backup.)"""
        for q in (p, backup(p), p):
            if self.exists(q):
                return q
        return None

    def read(self, p: str) -> bytes | None:
        """The file's bytes (``<p>.old``'s where a replacement is cut: :meth:`readable`), or None when it
        does not exist."""
        for q in (p, backup(p), p):
            data = self._read(q)
            if data is not None:
                return data
        return None

    def read_at_most(self, p: str, limit: int) -> bytes | None:
        """:meth:`read`, refused (ValueError, one line) before a byte is read when ``p`` holds more than
        ``limit`` bytes or is not a regular file (a FIFO, /dev/zero: read forever); and once ``limit + 1``
        are read where its size said less (it grew, or HDFS's status left out a block being written)."""
        q = self.readable(p)
        if q is None:
            return None
        n = self.size(q)
        if n is not None and n > limit:
            raise ValueError(f"{q}: {n:,} bytes, more than the {amount(limit)} it is read up to")
        data = self._read(q, limit)
        if data is not None and len(data) > limit:
            raise ValueError(f"{q}: more than the {amount(limit)} it is read up to")
        return data

    def delete(self, p: str) -> None:
        """Delete file or directory ``p``, its backup (or :meth:`read` would bring it back) and
        what a crashed replacement left. A crash midway leaves ``p`` whole or gone: it is moved aside to
        ``<p>.tmp`` (which no reader reads, and the next replacement or deletion clears) before it is
        removed, where a directory removed in place could be left half (a checkpoint without its arrays)."""
        self._remove(temporary(p))
        self._remove(backup(p))
        if self.exists(p):
            self.rename(p, temporary(p))
        self._remove(temporary(p))
        self._remove(p)                 # what exists() does not see (a dangling link)

    def write_atomic(self, p: str, data: bytes) -> None:
        """Replace file ``p`` by ``data``; a crash leaves the old or the new content."""
        tmp = temporary(p)
        self.write(tmp, data)
        self._replace(tmp, p)

    def write_dir_atomic(self, d: str, files: dict) -> None:
        """Write ``{name: bytes}`` as directory ``d``, replacing it only once complete."""
        tmp = temporary(d)
        self._remove(tmp)                  # what a writer that crashed midway left
        self.mkdirs(tmp)
        for name, data in files.items():
            self.write(f"{tmp}/{name}", data)
        self._replace(tmp, d)

    def _replace(self, tmp: str, p: str) -> None:
        # Never delete p before the new content is in place: move it to the fixed
        # backup name, which a later reader finds if we die between the renames.
        old = backup(p)
        if self.exists(p):
            self._remove(old)          # p is whole, so a backup left by an earlier crash is stale
            self.rename(p, old)
        self.rename(tmp, p)
        self._remove(old)


class LocalFS(ReplaceSafely):
    """The local disk through Python's file I/O (same methods as :class:`HadoopFS`)."""

    def local_path(self, p: str) -> str:
        """``p`` on the local disk (every path is)."""
        return p

    def exists(self, p: str) -> bool:
        return os.path.exists(p)

    def size(self, p: str) -> int | None:
        """Bytes in the regular file ``p``, None when it does not exist; ValueError for anything else."""
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{p} is not a regular file")
        return st.st_size

    def mkdirs(self, p: str) -> None:
        os.makedirs(p, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def write(self, p: str, data: bytes) -> None:
        """Write ``data`` to ``p`` (overwriting), flushed to disk."""
        _local_write(p, data, "wb")

    def write_atomic(self, p: str, data: bytes) -> None:
        """Replace file ``p`` by ``data`` in one ``os.replace`` (atomic on POSIX)."""
        tmp = temporary(p)
        self.write(tmp, data)
        os.replace(tmp, p)
        self._remove(backup(p))         # stale: p is whole

    def append(self, p: str, data: bytes, whole=None) -> None:
        """Append ``data`` to ``p`` (``whole`` is unused: local files can be appended to)."""
        _local_write(p, data, "ab")

    def _remove(self, p: str) -> None:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.remove(p)

    def _read(self, p: str, limit: int | None = None) -> bytes | None:
        return read_file(p, limit)

    def read_at_most(self, p: str, limit: int) -> bytes | None:
        """:meth:`ReplaceSafely.read_at_most` through :func:`read_regular`: checked on the file it reads, so
        one that grows while read or is swapped for a FIFO after the check is refused too."""
        q = self.readable(p)
        if q is None:
            return None
        try:
            return read_regular(q, limit)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise NotRegular(f"{q} is not a regular file") from None
        except TooLarge as e:
            raise ValueError(f"{q}: {e.held()} than the {amount(limit)} it is read up to") from None


def amount(nbytes: int) -> str:
    """A limit in bytes as a message says it: ``16 MiB``, or ``100 bytes`` below a whole MiB."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes:,} bytes"


def read_file(p: str, limit: int | None = None) -> bytes | None:
    """A local file's bytes (at most ``limit + 1`` of them where a limit is given), or None when it
    does not exist."""
    try:
        with open(p, "rb") as f:
            return f.read(-1 if limit is None else limit + 1)
    except FileNotFoundError:
        return None


class NotRegular(ValueError):
    """What :func:`read_regular` refuses: a FIFO, a device, a socket (a directory is IsADirectoryError)."""


# the codecs Hadoop reads, by a file's name, that Python's standard library does not (fast); gzip it does
HADOOP_CODECS = (".bz2", ".deflate", ".lz4", ".snappy", ".zst")


class TooLarge(ValueError):
    """What :func:`read_regular` refuses: a regular file of more than ``limit`` bytes; ``size`` is what
    it said it held, or None where it said no more and held more (it grew, or is one of /proc's)."""

    def __init__(self, path: str, size: int | None, limit: int):
        super().__init__(f"{path}: {'more than' if size is None else f'{size:,} bytes, more than'} {limit:,}")
        self.size, self.limit = size, limit

    def held(self) -> str:
        """``"N bytes, more"`` or ``"more"``: the start of a message's "... than the limit"."""
        return "more" if self.size is None else f"{self.size:,} bytes, more"


def read_regular(p: str, limit: int) -> bytes:
    """The bytes of the regular file ``p``, checked before a byte is read: a FIFO would block a plain
    open and ``/dev/zero`` is read forever (:class:`NotRegular`), a file of more than ``limit`` bytes
    would fill memory (:class:`TooLarge`, also where it holds more than its size said: it grew while
    read, or is one of /proc's, which say 0). A directory raises IsADirectoryError; a missing file and
    the system's other errors pass through."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), p)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{p} is not a regular file")
        if st.st_size > limit:
            raise TooLarge(p, st.st_size, limit)
        with open(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(p, None, limit)
    return data


class PathError(ValueError):
    """A path that is not one: a URL Python cannot parse (``hdfs://[nn/x``). The message is one line."""


def parse_url(path: str, what: str = ""):
    """``urlparse(path)``, or :class:`PathError` naming ``path`` and ``what`` it is (urlparse's own
    ValueError names neither)."""
    try:
        return urlparse(path)
    except ValueError as e:
        raise PathError(f"{what + ' = ' if what else ''}{path}: not a path or a URL ({e})") from None
