"""Files for checkpoints and metrics, on the filesystem a path means to Hadoop.

A path is resolved as Hadoop resolves it (:func:`resolve`): a ``file:`` URI, or a
scheme-less path while Hadoop's default filesystem (``fs.defaultFS``) is the local
one, is read and written with Python's own file I/O (py4j copies bytes slowly: 2.7 s
for an 18 MB read); any other path goes through Spark's Hadoop FileSystem client.
So ``--out runs/x`` lands where ``--data runs/x`` would be read from: on HDFS when
the cluster's default filesystem is HDFS, not on a container's scratch disk.

Replacing a file or directory is crash-safe (see :mod:`rnnlm.core.files`, whose
logic this module runs over Hadoop's client too).
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET

from ..core import checkpoint, files
from ..core.files import LocalFS, ReplaceSafely, parse_url, read_file
from .launcher import launcher_property, spark_conf_dir
from .session import hadoop_conf, jvm

MAX_SITE_XML = 16 << 20         # bytes of core-site.xml read at most (Hadoop's are kilobytes)
_MAX_ARRAY = (1 << 31) - 9     # the longest byte[] a JVM makes


def resolve(path: str, default_fs: str = "file:///") -> tuple[bool, str]:
    """Where Hadoop would put ``path``: on the local disk, or elsewhere.

    Parameters
    ----------
    path : str
        A URI (``hdfs://nn/x``, ``file:///x``) or a scheme-less path (``runs/x``).
    default_fs : str
        Hadoop's ``fs.defaultFS``, against which scheme-less paths are resolved.

    Returns
    -------
    (is_local, path) : (bool, str)
        ``(True, absolute local path)`` for a ``file:`` URI, or a scheme-less path
        when ``default_fs`` is local; otherwise ``(False, path)`` unchanged, for
        Hadoop to qualify (a relative path is then relative to the filesystem's
        working directory, ``/user/<name>`` on HDFS).
    """
    url = parse_url(path)
    if url.scheme == "file" and url.netloc in ("", "localhost"):
        # the text after the authority, as Hadoop's Path takes it: "%20" literally, and "#" and "?" as
        # part of the name (urlparse would cut a fragment and a query off: file:///runs/x#2 is not /runs/x)
        rest = path[len("file:"):]
        if rest.startswith("//"):
            rest = rest[2 + len(url.netloc):]
        return True, os.path.abspath(rest)
    if url.scheme:
        return False, path
    if parse_url(fix_name(default_fs), "fs.defaultFS").scheme == "file":
        return True, os.path.abspath(path)
    return False, path


def fix_name(fs_name: str) -> str:
    """``fs.defaultFS`` as Hadoop's ``FileSystem.fixName`` reads it: ``local`` is ``file:///``, and a name
    without a ``/`` an HDFS authority (``namenode`` is ``hdfs://namenode``, deprecated but still so)."""
    if fs_name == "local":
        return "file:///"
    if "/" not in fs_name:
        return f"hdfs://{fs_name}"
    return fs_name


def default_fs(conf_dir: str | None = None) -> str:
    """``fs.defaultFS`` read without a JVM, as Spark's launcher finds it: ``spark.hadoop.fs.defaultFS``
    given to the launcher (:func:`launcher_property`), which Spark copies over Hadoop's; else the
    one in the ``core-site.xml`` Hadoop loads, the first on the classpath: in ``conf_dir``, or by default
    in Spark's conf directory, else ``$HADOOP_CONF_DIR``, else ``$YARN_CONF_DIR`` (its deprecated name
    ``fs.default.name`` where ``fs.defaultFS`` is not set); else ``file:///``. As Hadoop reads it
    (:func:`fix_name`)."""
    given = launcher_property("spark.hadoop.fs.defaultFS")
    if given:
        return fix_name(given)
    dirs = [conf_dir] if conf_dir is not None else [
        spark_conf_dir(), os.environ.get("HADOOP_CONF_DIR") or os.environ.get("YARN_CONF_DIR", "")]
    for d in dirs:
        site = os.path.join(d, "core-site.xml") if d else ""
        if not site or not os.path.exists(site):
            continue
        try:    # a FIFO would block the parse, an unknown encoding raised LookupError through every command
            root = ET.fromstring(files.read_regular(site, MAX_SITE_XML))
        except (OSError, ET.ParseError, ValueError, LookupError):
            return "file:///"
        found = {}
        for prop in root.iter("property"):
            name = (prop.findtext("name") or "").strip()
            if name in ("fs.defaultFS", "fs.default.name"):
                found[name] = (prop.findtext("value") or "").strip() or "file:///"
        value = found.get("fs.defaultFS", found.get("fs.default.name"))
        if value is None:
            return "file:///"
        parse_url(fix_name(value), f"fs.defaultFS in {site}")
        return fix_name(value)
    return "file:///"


class HadoopFS(ReplaceSafely):
    """The filesystem of each path as Hadoop resolves it (see :func:`resolve`).

    Parameters
    ----------
    sc : SparkContext
    path : str
        The root the caller will work under; when it is not local, its Hadoop
        FileSystem is looked up now, so that a bad scheme or cluster fails here.
    local : bool, optional
        None (default): each path by :func:`resolve`. False: Hadoop's FileSystem for
        every path, ``file:`` ones included. True: Python I/O, and a ValueError for any
        path that is not local.

    Attributes
    ----------
    local : bool
        Whether ``path`` is handled with Python I/O.
    default_fs : str
        Hadoop's ``fs.defaultFS`` when the object was made.
    fs : JavaObject or None
        The Hadoop FileSystem of ``path``, None when it is local.
    """

    def __init__(self, sc, path: str, local: bool | None = None):
        self._jvm, self._conf = jvm(sc), hadoop_conf(sc)
        self.default_fs = self._conf.get("fs.defaultFS") or "file:///"
        self._mode, self._local = local, LocalFS()
        self.local = self.local_path(path) is not None
        self.fs = None if self.local else self._fs(path)

    # ------------------------------------------------------------ mapping
    def local_path(self, p: str) -> str | None:
        """``p`` on the local disk when Python I/O handles it, else None (Hadoop does)."""
        if self._mode is False:
            return None
        is_local, q = resolve(p, self.default_fs)
        if not is_local and self._mode:
            raise ValueError(f"{p} is not a local path (default filesystem {self.default_fs})")
        return q if is_local else None

    def _path(self, p: str):
        return self._jvm.org.apache.hadoop.fs.Path(p)

    def _fs(self, p: str):
        # Hadoop caches FileSystem instances: a lookup per call costs one py4j round trip
        return self._path(p).getFileSystem(self._conf)

    # --------------------------------------------------------- primitives
    def size(self, p: str) -> int | None:
        """Bytes in the file ``p`` as Hadoop's file status says (before a byte is read), None when missing."""
        q = self.local_path(p)
        if q is not None:
            return self._local.size(q)
        fs, path = self._fs(p), self._path(p)
        return int(fs.getFileStatus(path).getLen()) if fs.exists(path) else None

    def exists(self, p: str) -> bool:
        q = self.local_path(p)
        return self._local.exists(q) if q is not None else bool(self._fs(p).exists(self._path(p)))

    def mkdirs(self, p: str) -> None:
        q = self.local_path(p)
        if q is not None:
            self._local.mkdirs(q)
        else:
            self._fs(p).mkdirs(self._path(p))

    def rename(self, src: str, dst: str) -> None:
        q, r = self.local_path(src), self.local_path(dst)
        if (q is None) != (r is None):
            raise OSError(f"rename {src} -> {dst}: not on one filesystem")
        if q is not None:
            self._local.rename(q, r)
        elif not self._fs(src).rename(self._path(src), self._path(dst)):
            raise OSError(f"rename {src} -> {dst} failed")

    def write(self, p: str, data: bytes) -> None:
        """Write ``data`` to ``p`` (overwriting), flushed and closed."""
        q = self.local_path(p)
        if q is not None:
            self._local.write(q, data)
            return
        stream = self._fs(p).create(self._path(p), True)
        try:
            view = memoryview(data)
            for i in range(0, len(view), 1 << 24):   # py4j copies each chunk as one byte[]
                stream.write(bytearray(view[i:i + (1 << 24)]))
            stream.hflush()
        finally:
            stream.close()

    def _remove(self, p: str) -> None:
        q = self.local_path(p)
        if q is not None:
            self._local._remove(q)
        else:
            self._fs(p).delete(self._path(p), True)

    def _read(self, p: str, limit: int | None = None) -> bytes | None:
        q = self.local_path(p)
        if q is not None:
            return read_file(q, limit)
        fs, path = self._fs(p), self._path(p)
        if not fs.exists(path):
            return None
        stream = fs.open(path)
        try:
            if limit is not None:           # InputStream.readNBytes (Java 11): never more than asked
                return bytes(stream.readNBytes(min(limit + 1, _MAX_ARRAY)))
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    # ------------------------------------------------ local fast paths
    def write_atomic(self, p: str, data: bytes) -> None:
        """Replace file ``p`` by ``data``; a crash leaves the old or the new content."""
        q = self.local_path(p)
        if q is not None:
            self._local.write_atomic(q, data)
        else:
            super().write_atomic(p, data)

    def append(self, p: str, data: bytes, whole) -> None:
        """Append ``data`` to ``p``; where the filesystem cannot append (local Hadoop,
        object stores), rewrite ``p`` atomically with the bytes ``whole()`` returns."""
        q = self.local_path(p)
        if q is not None:
            self._local.append(q, data)
            return
        try:
            if not self.exists(p):
                raise OSError("no file to append to")
            stream = self._fs(p).append(self._path(p))
        except Exception:
            self.write_atomic(p, whole())
            return
        try:
            stream.write(bytearray(data))
            stream.hflush()
        finally:
            stream.close()


def read_checkpoint(fs, path: str, resume: bool = False):
    """The checkpoint directory ``path`` through ``fs`` (a :class:`HadoopFS` or a LocalFS): a local one
    by :func:`rnnlm.core.checkpoint.load` (each file's ``lstat`` before a byte: no link followed, no
    fifo read), any other with each file's size from Hadoop's status checked before it is read whole."""
    local = fs.local_path(path)
    if local is not None:
        return checkpoint.load(local, resume=resume)
    return checkpoint.from_files(lambda n: fs.read(f"{path}/{n}"), path, resume=resume,
                                 size=lambda n: fs.size(f"{path}/{n}"))
