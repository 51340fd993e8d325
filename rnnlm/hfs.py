"""Files through Spark's Hadoop FileSystem client: ``hdfs://``, ``s3a://``, ``file://``...

Used for checkpoints and metrics so that a run on a cluster writes them where
its corpus lives. Writes are atomic: a temporary name, then ``rename``.
"""
from __future__ import annotations

import os


class HadoopFS:
    """The Hadoop FileSystem of ``path`` (scheme and authority decide which)."""

    def __init__(self, sc, path: str):
        self._jvm = sc._jvm
        self._conf = sc._jsc.hadoopConfiguration()
        self.fs = self._path(path).getFileSystem(self._conf)

    def _path(self, p: str):
        return self._jvm.org.apache.hadoop.fs.Path(p)

    def exists(self, p: str) -> bool:
        return bool(self.fs.exists(self._path(p)))

    def mkdirs(self, p: str) -> None:
        self.fs.mkdirs(self._path(p))

    def delete(self, p: str) -> None:
        self.fs.delete(self._path(p), True)

    def rename(self, src: str, dst: str) -> None:
        if not self.fs.rename(self._path(src), self._path(dst)):
            raise OSError(f"rename {src} -> {dst} failed")

    def read(self, p: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        path = self._path(p)
        if not self.fs.exists(path):
            return None
        stream = self.fs.open(path)
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def write(self, p: str, data: bytes) -> None:
        """Write ``data`` to ``p`` (overwriting), flushed and closed."""
        stream = self.fs.create(self._path(p), True)
        try:
            view = memoryview(data)
            for i in range(0, len(view), 1 << 24):   # py4j copies each chunk as one byte[]
                stream.write(bytearray(view[i:i + (1 << 24)]))
            stream.hflush()
        finally:
            stream.close()

    def write_atomic(self, p: str, data: bytes) -> None:
        tmp = f"{p}.tmp-{os.getpid()}"
        self.write(tmp, data)
        if self.exists(p):
            self.delete(p)
        self.rename(tmp, p)

    def write_dir_atomic(self, d: str, files: dict) -> None:
        """Write ``{name: bytes}`` as directory ``d``, replacing it only once complete."""
        tmp, old = f"{d}.tmp-{os.getpid()}", f"{d}.old-{os.getpid()}"
        if self.exists(tmp):
            self.delete(tmp)
        self.mkdirs(tmp)
        for name, data in files.items():
            self.write(f"{tmp}/{name}", data)
        if self.exists(d):
            self.rename(d, old)
        self.rename(tmp, d)
        if self.exists(old):
            self.delete(old)
