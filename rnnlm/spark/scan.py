"""A local corpus checked before Spark reads it, at C speed and without Spark (the command line runs these
before the JVM starts; :func:`rnnlm.spark.reader.paragraphs` runs the record scan under ``spark-submit`` too):
what Hadoop would refuse in its files (:func:`check_local_input`) and the records longer than
``data.max_record_mb`` that Hadoop's reader would skip (:func:`check_local_records`).
"""
from __future__ import annotations

import glob
import gzip
import os
import re
import zlib

from ..core.files import HADOOP_CODECS


class CorpusError(ValueError):
    """A corpus that cannot be trained on (missing, empty, undecodable, too short)."""


def check_local_records(path: str, mode: str, max_record_mb: int, what: str) -> None:
    """Refuse a local corpus (a file, a directory of files or a glob) holding a record longer than
    ``max_record_mb`` MiB (a line with ``mode = "line"``, else a blank-line paragraph): Hadoop would
    skip it (:func:`check_record_files`, on the files Hadoop reads for ``path``)."""
    check_record_files(_local_files(path), mode, max_record_mb, what)


# the local files scanned in this process, with their inodes, sizes and times: the command line scans a corpus before
# Spark starts and the corpus' reader would scan it again (it scans alone under spark-submit or in a notebook)
_SCANNED: set = set()


def check_record_files(names: list, mode: str, max_record_mb: int, what: str) -> None:
    """Refuse local corpus files (in the corpus' order) holding a record longer than ``max_record_mb`` MiB (a line
    with ``mode = "line"``, else a blank-line paragraph): Hadoop would skip it. Files are scanned at C speed
    (:func:`_long_record`), gzip ones inflated on the way; those of other codecs are left to Hadoop's limit.
    Files scanned before with the same sizes and times are not scanned again.

    Raises
    ------
    CorpusError
        Naming the file, where the record starts, the limit and how to raise it; or naming a gzip file
        that is not whole (cut short, not gzip, a failed checksum).
    """
    try:
        # a copy that keeps its source's time and size (cp -p, rsync -a) still has a new inode and change time
        key = (mode, max_record_mb, tuple((os.path.abspath(n), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                           st.st_ctime_ns) for n in names for st in [os.stat(n)]))
    except OSError:
        key = None              # a file gone meanwhile: Hadoop says so in its own words
    if key in _SCANNED:
        return
    limit, corpus_end = max_record_mb << 20, None
    for name in names:
        opener = gzip.open if name.endswith(".gz") else None if name.endswith(HADOOP_CODECS) else open
        if opener is None:
            continue
        try:
            with opener(name, "rb") as f:
                own = _blank_line(f.read(1 << 16))
                # Hadoop cuts every file at the blank lines of the first (its first line's end): so does the scan
                corpus_end = corpus_end or own
                f.seek(0)
                found = _long_record(f, mode, limit, corpus_end)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            # Hadoop's reader fails on it inside a Python worker, whose crash is all the driver hears of it
            raise CorpusError(f"{what}: {name} is not a whole gzip file ({_gzip_fault(e)})") from None
        except OSError:                   # unreadable: Hadoop reports it in its own words
            continue
        if found is not None:
            message = too_long(what, name, mode, max_record_mb, *found)
            if mode != "line" and own not in (None, corpus_end):
                message += (f" (its lines end with {own[:len(own) // 2]!r}, the corpus' first file's with "
                            f"{corpus_end[:len(corpus_end) // 2]!r}, and Hadoop finds the blank lines of the first "
                            "in every file: make them end alike)")
            raise CorpusError(message)
    if key is not None:
        _SCANNED.add(key)


def _gzip_fault(e: Exception) -> str:
    """What is wrong with a gzip file, in a few words, from the error reading it raised."""
    if isinstance(e, EOFError):
        return "it ends before its compressed data does: a copy cut short?"
    return (str(e).splitlines() or [type(e).__name__])[0][:120]


def _blank_line(head: bytes) -> bytes | None:
    """The blank line of a text whose first bytes are ``head``, as Hadoop's reader is told it: two of
    its first line's end (``\r\n`` or ``\n``); None when ``head`` holds no line end."""
    i = head.find(b"\n")
    return None if i < 0 else b"\r\n\r\n" if head[i - 1:i] == b"\r" else b"\n\n"


def check_local_input(path: str, what: str) -> None:
    """Refuse, before Spark's JVM starts, a local corpus that :func:`rnnlm.spark.reader.check_path` or the read
    would refuse after it: a directory holding a subdirectory, or files that hold no byte (inflated)."""
    if "{" in path:                 # Hadoop's own glob syntax: left to Hadoop
        return
    matches = [m for m in _matches(path) if os.path.exists(m)]
    for match in matches:
        subs = sorted(n for n in os.listdir(match) if not n.startswith(("_", ".")) and
                      os.path.isdir(os.path.join(match, n))) if os.path.isdir(match) else []
        if subs:
            raise subdirectory_error(path, os.path.join(match, subs[0]))
    names = _local_files(path)
    if matches and not names and any(os.path.isfile(m) for m in matches):
        raise CorpusError(f"{what}: {path}: Hadoop reads no file whose name starts with _ or . (it takes them "
                          "for its own, as _SUCCESS)")
    if matches and all(_holds_nothing(f) for f in names):
        raise CorpusError(f"{what}: {path} is empty")


def subdirectory_error(path: str, shown: str) -> CorpusError:
    return CorpusError(f"{path}: {shown} is a directory: a corpus directory is read as its files, not its "
                       f"subdirectories (name them with a glob, such as {path.rstrip('/')}/*/*)")


def _holds_nothing(name: str) -> bool:
    """Whether a corpus file holds no byte as Hadoop reads it (a gzip one inflated; another codec's: unknown)."""
    try:
        if name.endswith(".gz"):
            with gzip.open(name, "rb") as f:
                return f.read(1) == b""
        return not name.endswith(HADOOP_CODECS) and os.path.getsize(name) == 0
    except (OSError, EOFError):          # unreadable, or a broken gzip: Hadoop says so in its own words
        return False


def _matches(path: str) -> list:
    """A local ``path``'s glob matches, or the path itself where it holds no glob."""
    return sorted(glob.glob(path)) if glob.has_magic(path) else [path]


def _local_files(path: str) -> list:
    """The files Hadoop reads for a local ``path``: a glob's matches, a directory's visible files."""
    if "{" in path:                 # Hadoop's own glob syntax: left to Hadoop
        return []
    out = []
    for match in _matches(path):
        if os.path.isdir(match):
            out += [os.path.join(match, n) for n in sorted(os.listdir(match))
                    if not n.startswith(("_", ".")) and os.path.isfile(os.path.join(match, n))]
        elif os.path.isfile(match) and not os.path.basename(match).startswith(("_", ".")):
            out.append(match)
    return sorted(out)          # as check_path names them to Hadoop


def _long_record(f, mode: str, limit: int, blank_line: bytes | None = None) -> tuple | None:
    """``(offset, alone)`` of the first record of stream ``f`` longer than ``limit`` bytes, or None.
    ``alone``, for a stream that starts with that record (else None): ``"line"`` when its first ``limit``
    bytes hold no line end (always, with ``mode = "line"``), ``"paragraph"`` when they hold ``\\n``, ``"cr"``
    when they hold only ``\\r`` (lines that end with it alone, as old Macs wrote them).

    Records end as Hadoop ends them: at each line end (``\\r`` and ``\\n`` alike, so ``\\r\\n`` leaves
    an empty record), or at each blank line (``blank_line``, the corpus' own; else ``\\r\\n\\r\\n``
    when the stream's first line end is ``\\r\\n``, else ``\\n\\n``), matched left to right without
    overlap (three line ends: a blank line, then a record opening with a line end). The stream is
    read in chunks of at most half the limit, so only the records that meet a chunk's ends can be too
    long; the open record's last bytes, where a delimiter may begin, are carried to the next chunk,
    and a stream with no delimiter stops being read past the limit."""
    chunk = max(1, min(limit // 2, 8 << 20))
    # paragraphs: the corpus' blank line (its first file's), else told by the stream's first line end
    delim = b"\n" if mode == "line" else blank_line
    pos, start, ends, tail = 0, 0, set(), b""       # tail's offset; the open record's; line ends early in it

    def found():
        return start, None if start else "paragraph" if b"\n" in ends else "cr" if ends else "line"
    while more := f.read(chunk):
        data = tail + (more.replace(b"\r", b"\n") if mode == "line" else more)
        if delim is None:
            delim = _blank_line(data)
        if delim is None:
            first, last = -1, len(data)
        elif mode == "line":        # one byte: its first and last occurrences bound the records it ends
            first, last = data.find(delim), len(data) - data.rfind(delim) - 1
        else:                       # split: left to right without overlap, at C speed
            pieces = data.split(delim)
            first, last = (len(pieces[0]) if len(pieces) > 1 else -1), len(pieces[-1])
        if start == 0:              # the stream's first record: a line end in its first limit bytes?
            n = min(len(data) if first < 0 else first, limit - pos)
            if b"\n" in data[:n]:
                ends.add(b"\n")
            if re.search(rb"\r[^\n]", data[:n + 1]):     # a lone one
                ends.add(b"\r")
        if first >= 0:
            if pos + first - start > limit:
                return found()
            start = pos + len(data) - last          # the records between are shorter than a chunk
        tail = data[len(data) - min(last, 3 if delim is None else len(delim) - 1):]
        if pos + len(data) - len(tail) - start > limit:
            return found()
        pos += len(data) - len(tail)
    return found() if pos + len(tail) - start > limit else None


def refused(mb: int) -> str:
    return f"records longer than data.max_record_mb = {mb} MiB are refused (--set data.max_record_mb=N raises it)"


def too_long(what: str, name: str, mode: str, mb: int, offset: int, alone: str | None) -> str:
    """The error for a record longer than ``mb`` MiB at byte ``offset`` of file ``name``; ``alone`` for the file's
    first record: ``"line"`` (its first ``mb`` MiB hold no line end), ``"paragraph"`` (they hold line ends but no
    blank line), ``"cr"`` (a paragraph whose lines end with a lone ``\\r``, which no blank line is made of)."""
    record = "line" if mode == "line" else "paragraph"
    raise_it = refused(mb)
    if alone == "line":
        return f"{what}: {name} has no line end in its first {mb} MiB: it is one huge line, and {raise_it}"
    if alone in ("paragraph", "cr"):
        why = (" (its lines end with a lone '\\r': a blank line is two '\\n' or two '\\r\\n')"
               if alone == "cr" else "")
        return (f"{what}: {name} has no blank line in its first {mb} MiB{why}: it is one paragraph, and {raise_it}; "
                "data.paragraphs = 'line' reads it line by line")
    return f"{what}: {name}: the {record} at byte {offset:,} is longer than {mb} MiB: {raise_it}"
