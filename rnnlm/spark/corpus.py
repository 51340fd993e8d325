"""Corpora as Spark RDDs: paragraphs from any Hadoop path, vocabulary, encoding, and a run's
corpus loaded, checked and cached (:func:`load_corpus`) and held-out text scored (:func:`evaluate_rdd`)
for both drivers and the dry run.

Nothing proportional to the corpus reaches the driver: the vocabulary is built
from ``reduceByKey`` counts (only the kept candidates are collected) and each
training partition holds its encoded tokens as one NumPy array.
"""
from __future__ import annotations

import glob
import gzip
import os
from dataclasses import dataclass, field
from operator import add
from typing import NamedTuple

import numpy as np

from .. import config
from ..core.files import HADOOP_CODECS
from ..core.schedule import rounds_for
from ..core.vocab import EOS, UNK_CHAR, UNK_WORD, Vocab, tokenize
from .executor import eval_task, probe_task
from .session import hadoop_conf, hadoop_splits, jvm, release

_TEXT_INPUT = "org.apache.hadoop.mapreduce.lib.input.TextInputFormat"
# Hadoop's line readers skip a record this long instead of holding it (a 100 MB line with no newline
# killed the driver's JVM with OutOfMemoryError in Text.decode)
MAX_LINE = "mapreduce.input.linerecordreader.line.maxlength"
MAX_RECORD_MB = 16            # data.max_record_mb's default


class CorpusError(ValueError):
    """A corpus that cannot be trained on (missing, empty, undecodable, too short)."""


class Listed(NamedTuple):
    """What :func:`check_path` found: ``path`` for Hadoop's input formats, ``local`` the files on the local disk
    (None on any other filesystem), ``size`` their bytes."""
    path: str
    local: list | None
    size: int


def check_path(sc, path: str) -> Listed:
    """Fail with a one-line error when ``path`` matches no file, or names a directory holding a
    subdirectory (any Hadoop filesystem); else the files it names, in the order of their paths, as
    Hadoop's input formats take several (comma-separated).

    A directory is listed in whatever order its filesystem gives (a local one: the order of the
    directory's entries on that disk), and its files' order is the corpus' order, so the same
    corpus copied elsewhere would train on other partitions: the files are named in sorted order.
    Where a name holds a comma or a glob character, which Hadoop would read as syntax, Hadoop's glob
    names them instead (``DIR/*`` for directories; a glob as given), whose matches it sorts by path.

    Hadoop reads a directory's files and fails on a subdirectory (a NullPointerException or an
    IOException tens of lines long), as Spark's ``textFile`` does unless asked to recurse. It is
    refused here rather than read recursively: a recursive read would silently take in whatever
    lies below (an old copy, a backup), and a glob names the files as precisely.
    """
    hpath = jvm(sc).org.apache.hadoop.fs.Path(path)
    try:
        fs = hpath.getFileSystem(hadoop_conf(sc))
        matches = fs.globStatus(hpath)
        sub = next((d for st in matches or [] if st.isDirectory() for d in _subdirectories(fs, st)), None)
        found = sorted((c.getPath().toString(), c.getPath().toUri().getPath(), c.getLen()) for st in matches or []
                       for c in (fs.listStatus(st.getPath()) if st.isDirectory() else [st])
                       if c.isFile() and not c.getPath().getName().startswith(("_", ".")))
        local = [name for _, name, _ in found] if fs.getUri().getScheme() == "file" else None
    except Exception as e:
        raise CorpusError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if matches is None or len(matches) == 0:
        raise CorpusError(f"input path does not exist: {path}")
    if sub is not None:
        raise _subdirectory(path, sub.toString() if ":" in path else sub.toUri().getPath())
    files, size = [f for f, _, _ in found], sum(n for _, _, n in found)
    if not files:
        return Listed(path, local, size)
    if any(c in f for f in files for c in ",{}[]*?\\"):
        # the directories' files through a glob: a directory itself is listed in its disk's order
        return Listed(path.rstrip("/") + "/*" if all(st.isDirectory() for st in matches) else path, local, size)
    return Listed(",".join(files), local, size)


def _subdirectories(fs, status):
    """The paths of the subdirectories Hadoop's input formats would meet in a directory (they skip
    names starting with ``_`` or ``.``, as ``_temporary``)."""
    for child in fs.listStatus(status.getPath()):
        if child.isDirectory() and not child.getPath().getName().startswith(("_", ".")):
            yield child.getPath()


def paragraphs(sc, path: str, mode: str = "blank_line", level: str = "char", min_partitions: int = 2,
               max_record_mb: int = MAX_RECORD_MB, what: str | None = None):
    """RDD of paragraph strings, in file order.

    ``mode='blank_line'`` splits on blank lines (Hadoop's record delimiter
    ``\\n\\n``, or ``\\r\\n\\r\\n`` for text made on Windows: ``\\r\\n`` is read as
    ``\\n``), ``'line'`` makes every line a paragraph. Word paragraphs get
    ``<eos>`` at every line end from the tokenizer, and blank lines carry no word.
    Character paragraphs keep their line breaks, the blank line that ends them
    included, so the characters of the corpus are those of the raw text (as
    ``rnnlm.core.single`` and published character-level figures read it): a
    blank-line paragraph ends with ``\\n\\n``, a line with ``\\n``, and an
    empty line is a paragraph ``\\n`` of its own. (Only two normalisations
    remain: blank-line paragraphs of whitespace alone, and the last
    paragraph of a file, which also ends with ``\\n\\n``.) Hadoop decodes UTF-8
    with U+FFFD for undecodable bytes; gzip and other codecs are read as usual.

    A record (a line, or a blank-line paragraph) longer than ``max_record_mb`` MiB is skipped by
    Hadoop's reader, which never holds it, and refused here: a corpus on the local disk is scanned
    (:func:`check_record_files`, unless the command line's check before Spark scanned the same files),
    one elsewhere (or compressed otherwise than by gzip) is read once through Hadoop and its records'
    offsets checked for what the reader skipped (:func:`check_skipped`). Errors name the corpus as ``what``
    (``data.train``), by default as ``path``.
    """
    listed, what = check_path(sc, path), what or path       # its files, in sorted order
    if listed.local is not None:
        check_record_files(listed.local, mode, max_record_mb, what)
    most = _hadoop_max(max_record_mb)
    if mode == "line":
        keyed = _lines(sc, listed.path, max(1, listed.size // max(1, min_partitions)), most)
    else:
        keyed = _records(sc, listed.path, 2 * _line_end(sc, listed.path, most), most)
    if listed.local is None or any(name.endswith(HADOOP_CODECS) for name in listed.local):
        check_skipped(sc, keyed, mode, max_record_mb, what, full_paths=":" in path)
    if mode == "line":
        rdd = keyed.values()
        if level == "char":
            return rdd.map(lambda p: p + "\n")
    else:
        rdd = keyed.values().flatMap(_paragraph_records)
    rdd = rdd.filter(lambda p: p.strip() != "")
    if level == "char" and mode == "blank_line":
        # the delimiter is part of the text: a record that starts with newlines keeps them
        return rdd.map(lambda p: p.rstrip("\n") + "\n\n")
    return rdd.map(lambda p: p.strip("\n"))


def _hadoop_max(max_record_mb: int) -> str:
    """Hadoop's line length limit for records of at most ``max_record_mb`` MiB (with their delimiter)."""
    return str((max_record_mb << 20) + 8)


# the smallest split Hadoop makes of a file read with a delimiter of its own: none (a file is one split)
SPLIT_MIN = "mapreduce.input.fileinputformat.split.minsize"
SPLIT_MAX = "mapreduce.input.fileinputformat.split.maxsize"


def _records(sc, path: str, delimiter: str, most: str):
    """``(offset, record)``: the records of the files under ``path`` cut at ``delimiter``, each file read whole
    by one task: Hadoop's reader reads the record after a split boundary that falls inside a run of delimiters which
    is not a whole number of them (``\n\n\n`` between paragraphs) in both splits, so a paragraph was
    trained twice wherever a 32 MiB (local) or 128 MiB (HDFS) block ended so. The trainer repartitions
    the records anyway (:func:`contiguous_partitions`)."""
    return sc.newAPIHadoopFile(path, _TEXT_INPUT, "org.apache.hadoop.io.LongWritable", "org.apache.hadoop.io.Text",
                               conf={"textinputformat.record.delimiter": delimiter, MAX_LINE: most,
                                     SPLIT_MIN: str(1 << 62)})


def _lines(sc, path: str, split: int, most: str):
    """``(offset, line)``: the lines of the files under ``path``, in splits of at most ``split`` bytes (the corpus'
    bytes over the partitions asked for: about as many splits, as ``sc.textFile`` made). ``textFile`` takes no Hadoop
    configuration of its own: it read the line limit from the session's when its tasks ran, so a cached partition
    recomputed after another read had set another limit would have read with that one."""
    return sc.newAPIHadoopFile(path, _TEXT_INPUT, "org.apache.hadoop.io.LongWritable", "org.apache.hadoop.io.Text",
                               conf={MAX_LINE: most, SPLIT_MAX: str(split)})


def _line_end(sc, path: str, most: str) -> str:
    """``"\r\n"`` when the corpus' first line ends so (text made on Windows), else ``"\n"``: Hadoop
    splits records on one delimiter, and a blank line is two line ends."""
    first = _records(sc, path, "\n", most).values().take(1)
    return "\r\n" if first and first[0].endswith("\r") else "\n"


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
        Naming the file, where the record starts, the limit and how to raise it.
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
        except (OSError, EOFError):       # unreadable, or a broken gzip: Hadoop reports it in its own words
            continue
        if found is not None:
            message = _too_long(what, name, mode, max_record_mb, *found)
            if mode != "line" and own not in (None, corpus_end):
                message += (f" (its lines end with {own[:len(own) // 2]!r}, the corpus' first file's with "
                            f"{corpus_end[:len(corpus_end) // 2]!r}, and Hadoop finds the blank lines of the first "
                            "in every file: make them end alike)")
            raise CorpusError(message)
    if key is not None:
        _SCANNED.add(key)


def _blank_line(head: bytes) -> bytes | None:
    """The blank line of a text whose first bytes are ``head``, as Hadoop's reader is told it: two of
    its first line's end (``\r\n`` or ``\n``); None when ``head`` holds no line end."""
    i = head.find(b"\n")
    return None if i < 0 else b"\r\n\r\n" if head[i - 1:i] == b"\r" else b"\n\n"


def check_local_input(path: str, what: str) -> None:
    """Refuse, before Spark's JVM starts, a local corpus that :func:`check_path` or the read would refuse
    after it: a directory holding a subdirectory, or files that hold no byte (inflated)."""
    if "{" in path:                 # Hadoop's own glob syntax: left to Hadoop
        return
    matches = [m for m in _matches(path) if os.path.exists(m)]
    for match in matches:
        subs = sorted(n for n in os.listdir(match) if not n.startswith(("_", ".")) and
                      os.path.isdir(os.path.join(match, n))) if os.path.isdir(match) else []
        if subs:
            raise _subdirectory(path, os.path.join(match, subs[0]))
    names = _local_files(path)
    if matches and not names and any(os.path.isfile(m) for m in matches):
        raise CorpusError(f"{what}: {path}: Hadoop reads no file whose name starts with _ or . (it takes them "
                          "for its own, as _SUCCESS)")
    if matches and all(_holds_nothing(f) for f in names):
        raise CorpusError(f"{what}: {path} is empty")


def _subdirectory(path: str, shown: str) -> CorpusError:
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
    bytes hold no line end (always, with ``mode = "line"``), ``"paragraph"`` when they do.

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
    pos, start, lines, tail = 0, 0, False, b""      # tail's offset; the open record's; a line end early in it

    def found():
        return start, None if start else "paragraph" if lines else "line"
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
            lines = lines or b"\n" in data[:min(len(data) if first < 0 else first, limit - pos)]
        if first >= 0:
            if pos + first - start > limit:
                return found()
            start = pos + len(data) - last          # the records between are shorter than a chunk
        tail = data[len(data) - min(last, 3 if delim is None else len(delim) - 1):]
        if pos + len(data) - len(tail) - start > limit:
            return found()
        pos += len(data) - len(tail)
    return found() if pos + len(tail) - start > limit else None


def check_skipped(sc, keyed, mode: str, max_record_mb: int, what: str, full_paths: bool) -> None:
    """Refuse a corpus read through Hadoop (``keyed``: :func:`_lines` or :func:`_records`) from which the reader
    skipped a record longer than ``max_record_mb`` MiB, where no scan can look first (another filesystem, a codec
    other than gzip): one pass over the records' offsets, a task per split (:func:`_split_gaps`).

    The reader keys each record by the offset it started reading at, before any record it skipped, so in a split's
    records a skip shows as a key further on than the last record's bytes reach; and a record cut at the limit,
    which it hands over where a skip runs past its split's end, as a record longer than the limit. Across a file's
    splits each split's records start where the last one's ended, and the last reaches the file's end: a gap is a
    record skipped there. A compressed file's keys count its text's bytes, which the driver's JVM counts by
    inflating it (:func:`_text_bytes`); those of a file a splittable codec (bzip2) cuts into several splits start
    at compressed offsets, so there only the skips inside a split are seen. ``full_paths``: name files by their
    URIs (else by their paths alone, for a corpus named so)."""
    limit, Path = max_record_mb << 20, jvm(sc).org.apache.hadoop.fs.Path
    found = sorted(keyed.mapPartitionsWithIndex(_split_gaps(limit)).collect())
    files = {}                  # path -> [(start, length, first, last, end), ...]: its splits, in order
    for (_, first, last, end, issue), (path, start, length) in zip(found, hadoop_splits(keyed)):
        files.setdefault(path, []).append((start, length, first, last, end, issue))
    codecs = jvm(sc).org.apache.hadoop.io.compress.CompressionCodecFactory(hadoop_conf(sc))
    for path, splits in files.items():
        compressed = codecs.getCodec(Path(path)) is not None

        def refuse(at: int, upto: int | None, start: int = 0, length: int = 0):
            if start and compressed:                # a splittable codec's keys: the split's start, then its text's
                where = f"in its compressed bytes {start:,} to {start + length:,}"
            else:
                where = (f"at byte {at:,}" if upto is None else f"between bytes {at:,} and {upto:,}") \
                    + (" of its text" if compressed else "")
            name = path if full_paths else Path(path).toUri().getPath()
            record = "line" if mode == "line" else "paragraph"
            raise CorpusError(f"{what}: {name}: a {record} {where} is longer than {max_record_mb} MiB (Hadoop's "
                              f"reader skips it): {_refused(max_record_mb)}")
        for start, length, *_, issue in splits:
            if issue is not None:
                refuse(*issue, start, length)
        if compressed and len(splits) > 1:
            continue
        last = end = 0                          # where the last record started, where its bytes reach
        for _, _, first, *reach, _ in splits:
            if first is not None:
                if first - end > limit:
                    refuse(last, first)
                last, end = reach
        size = _text_bytes(sc, path) if compressed else sum(splits[-1][:2])
        if size - end > limit:
            refuse(last, size)


def _text_bytes(sc, path: str) -> int:
    """The bytes of a compressed file's text, as Hadoop's codec inflates it: counted in the driver's JVM."""
    j, conf = jvm(sc), hadoop_conf(sc)
    hpath = j.org.apache.hadoop.fs.Path(path)
    try:
        stream = j.org.apache.hadoop.io.compress.CompressionCodecFactory(conf).getCodec(hpath) \
            .createInputStream(hpath.getFileSystem(conf).open(hpath))
        try:
            return stream.transferTo(j.java.io.OutputStream.nullOutputStream())
        finally:
            stream.close()
    except Exception as e:
        raise CorpusError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def _split_gaps(limit: int):
    """A task over one split's ``(offset, record)`` pairs: ``(pid, first offset, last offset, where the last record's
    bytes end, issue)``; the issue, None or where a record was skipped: ``(start, None)`` for a record longer than
    ``limit`` bytes, ``(start, the next record's offset)`` for a skip between two records. Delimiters and a byte-order
    mark add a few bytes to a record's reach, a skipped record more than ``limit``."""
    def task(pid, records):
        first = last = end = None
        for at, text in records:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > limit:
                return [(pid, first, last, end, (at, None))]
            if end is not None and at - end > limit:
                return [(pid, first, last, end, (last, at))]
            first = at if first is None else first
            last, end = at, at + size
        return [(pid, first, last, end, None)]
    return task


def _refused(mb: int) -> str:
    return f"records longer than data.max_record_mb = {mb} MiB are refused (--set data.max_record_mb=N raises it)"


def _too_long(what: str, name: str, mode: str, mb: int, offset: int, alone: str | None) -> str:
    record = "line" if mode == "line" else "paragraph"
    raise_it = _refused(mb)
    if alone == "line":
        return f"{what}: {name} has no line end in its first {mb} MiB: it is one huge line, and {raise_it}"
    if alone == "paragraph":
        return (f"{what}: {name} has no blank line in its first {mb} MiB: it is one paragraph, and {raise_it}; "
                "data.paragraphs = 'line' reads it line by line")
    return f"{what}: {name}: the {record} at byte {offset:,} is longer than {mb} MiB: {raise_it}"


def _paragraph_records(record: str) -> list:
    """A record with ``\n`` line ends (``\r\n`` and a lone ``\r`` are line ends, as to the line mode and
    the single-process trainer), cut at the blank lines its delimiter missed (in a corpus whose files end
    their lines differently from the first, or with ``\r`` alone)."""
    if "\r" in record:
        record = record.replace("\r\n", "\n").replace("\r", "\n")
    return record.split("\n\n")


def build_vocab(paras, level: str, max_size: int = 0, min_count: int = 1, name: str = "the corpus") -> Vocab:
    """Count tokens with ``reduceByKey`` and keep the top ones (see :meth:`Vocab.from_counts`);
    ``name`` names the text in the error that it is empty."""
    counts = paras.flatMap(lambda p: tokenize(p, level)).map(lambda t: (t, 1)).reduceByKey(add)
    counts.cache()
    try:
        total = counts.values().sum()
        if total == 0:
            raise CorpusError(f"{name} is empty")
        forced = {UNK_WORD, EOS} if level == "word" else {UNK_CHAR}
        cand = counts.filter(lambda kv: kv[1] >= min_count or kv[0] in forced)
        if max_size:            # the forced tokens' counts too, wherever they rank (a rare <eos> in long lines)
            top = cand.takeOrdered(max_size + len(forced), key=lambda kv: (-kv[1], kv[0]))
            top += counts.filter(lambda kv: kv[0] in forced).collect()
        else:
            top = cand.collect()   # distinct kept tokens: vocabulary-sized, not corpus-sized
    finally:
        release(rdds=[counts])
    return Vocab.from_counts(dict(top), level, max_size, min_count, total=total)


def contiguous_partitions(paras, n: int, shrink: bool = False, name: str = "the corpus"):
    """Re-partition ``paras`` into ``n`` partitions of consecutive paragraphs, order kept.

    With ``shrink`` a corpus of fewer than ``n`` paragraphs gets one partition each; ``name`` names
    the text in the error that it is empty.
    """
    counts = paras.mapPartitions(lambda it: [sum(1 for _ in it)]).collect()
    total = sum(counts)
    if total == 0:
        raise CorpusError(f"{name} is empty")
    if total < n and shrink:
        n = total
    elif total < n:
        raise CorpusError(f"the corpus has {total} paragraphs, fewer than data.partitions={n} "
                          "(data.paragraphs = \"line\" splits at every line)")
    return (paras.zipWithIndex()
            .map(lambda pi: (pi[1] * n // total, (pi[1], pi[0])))
            .partitionBy(n, lambda k: k)
            .mapPartitions(lambda it: [p for _, (_, p) in sorted(it, key=lambda kv: kv[1][0])],
                           preservesPartitioning=True))


def encode_partitions(paras, bc_vocab):
    """One ``(partition, tokens int32, paragraph starts int64)`` record per partition."""
    def enc(pid, it):
        vocab = bc_vocab.value
        arrays = [a for a in (vocab.encode(p) for p in it) if len(a)]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        tokens = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
        yield pid, tokens, starts[:len(arrays)]
    return paras.mapPartitionsWithIndex(enc, preservesPartitioning=True)


def unique_growth(sc, path: str, level: str = "word", mode: str = "line", partitions: int = 2,
                  longest: int = 1_000_000, draws: int = 8, seed: int = 0) -> tuple:
    """Patwary et al.'s (2018) U against N on a corpus: the mean number of distinct tokens in stretches of
    N consecutive tokens, measured in every partition (:func:`rnnlm.core.zipf.unique_counts`)
    and averaged over the partitions long enough for N. Only the (N, U) grid reaches the driver.

    Returns
    -------
    n, u : int64 and float64 arrays
    """
    from ..core import zipf
    ns = zipf.sizes(longest)

    def count(pid, paras):
        sums = zipf.unique_counts(zipf.token_ids(paras, level), ns, draws, seed=seed * 7919 + pid)
        for n, s in zip(ns, sums):
            if s:
                yield int(n), (float(s), draws)

    grid = paragraphs(sc, path, mode, level, partitions).mapPartitionsWithIndex(count) \
        .reduceByKey(lambda a, b: (a[0] + b[0], a[1] + b[1])).collect()
    grid.sort()
    return np.array([n for n, _ in grid], np.int64), np.array([s / d for _, (s, d) in grid])


class Scored(NamedTuple):
    """Tokens scored, all partitions (expected): by a round, and by an epoch (each target position a pass
    scores, once: :meth:`rnnlm.core.strategies.Source.epoch_tokens`); None where not counted."""
    round: float | None
    epoch: int | None


@dataclass
class Corpus:
    vocab: object
    train: object            # RDD of (pid, tokens, starts), persisted
    valid: object | None
    test: object | None
    tokens: int              # training tokens, all partitions
    scored: Scored           # tokens a round and an epoch train on, under `counted_for`
    held_out_tokens: dict = field(default_factory=dict)     # "valid", "test" -> tokens of that text
    devices: dict = field(default_factory=dict)             # pid -> {"ran", "assigned", "arithmetic"} (probe_task)
    counted_for: tuple = ()  # round_keys() of the configuration `scored` was counted under
    broadcasts: tuple = ()   # the vocabulary's, which the RDDs read again if a cached partition is lost


def epoch_keys(cfg: config.Config) -> tuple:
    """The settings an epoch's tokens depend on."""
    d, t = cfg.data, cfg.train
    return d.strategy, d.window_stride, t.batch, t.bptt


def round_keys(cfg: config.Config) -> tuple:
    """The settings a round's expected tokens depend on (each round cuts its batches by its own run's):
    an epoch's, and these."""
    return epoch_keys(cfg) + (cfg.data.sample_fraction, cfg.train.local_steps)


def load_held_out(sc, cfg: config.Config, path: str, bc_vocab):
    """An encoded, persisted RDD of ``path`` cut into ``data.eval_streams`` contiguous streams.

    Held-out text is laid out independently of ``data.partitions`` (the training layout),
    so the training log, ``jobs/evaluate.py`` and any other run agree on the same text.
    """
    d = cfg.data
    hp = paragraphs(sc, path, d.paragraphs, d.level, d.eval_streams, d.max_record_mb)
    _check_decodable(hp, path, d.encoding_errors)
    return encode_partitions(contiguous_partitions(hp, d.eval_streams, shrink=True, name=path), bc_vocab).persist()


def _check_decodable(paras, path: str, errors: str) -> None:
    """Under ``data.encoding_errors = "strict"`` a text holding undecodable bytes is refused (Hadoop
    decodes them as U+FFFD, and hands Python no bytes: a valid U+FFFD is refused too, and the message
    says so)."""
    if errors == "strict":
        bad = paras.filter(lambda p: "\ufffd" in p).count()
        if bad:
            raise CorpusError(f"{path}: {bad} paragraphs hold undecodable bytes (data.encoding_errors=strict; "
                              "Hadoop reads them as U+FFFD, so a text holding that character itself reads so "
                              "too: 'replace' takes it)")


def load_corpus(sc, cfg: config.Config, vocab=None, status=None) -> Corpus:
    """Read, count, encode and cache the corpus; validate every partition. ``status`` (a callable, e.g.
    :meth:`rnnlm.progress.Progress.status`) hears each phase as it starts; each phase's Spark jobs
    carry its name in Spark's UI."""
    d = cfg.data
    config.check_trainable(cfg)

    def phase(text: str) -> None:
        sc.setJobDescription(f"rnnlm: {text}")
        if status is not None:
            status(f"{text} ...")
    phase(f"reading {d.train}")
    paras = paragraphs(sc, d.train, d.paragraphs, d.level, d.partitions, d.max_record_mb, "data.train")
    _check_decodable(paras, d.train, d.encoding_errors)
    if vocab is None:
        phase(f"counting {d.level}s for the vocabulary")
        vocab = build_vocab(paras, d.level, d.vocab_size, d.min_count, name=d.train)
    bc_vocab = sc.broadcast(vocab)
    phase(f"encoding and caching {d.partitions} partitions")
    enc = encode_partitions(contiguous_partitions(paras, d.partitions, name=d.train), bc_vocab)
    enc = enc.persist()
    held_out, counts = {}, {}
    try:
        probe = _probe(cfg, enc)
        for name, path in (("valid", d.valid), ("test", d.test)):
            if path:
                phase(f"reading {name} text {path}")
                held_out[name] = load_held_out(sc, cfg, path, bc_vocab)
                # counted now (the text is cached here anyway) so that an evaluation can say how much it reads
                counts[name] = held_out[name].map(lambda p: len(p[1])).sum()
    except BaseException:       # a corpus error, a failed job, Ctrl-C: a shared session keeps nothing of it
        try:
            release([bc_vocab], [enc, *held_out.values()])
        except Exception:       # the context stopped: the error that stopped the load is the one to see
            pass
        raise
    sc.setJobDescription(None)
    return Corpus(vocab, enc, held_out.get("valid"), held_out.get("test"), sum(p[1] for p in probe),
                  _scored(probe), counts, {p[0]: p[5] for p in probe}, round_keys(cfg), (bc_vocab,))


def _scored(probe: list) -> Scored:
    return Scored(sum(p[2] for p in probe), sum(p[3] for p in probe))


def scored(cfg: config.Config, data: Corpus, rounds: bool = True) -> Scored:
    """The tokens an epoch and (with ``rounds``) a round of ``cfg`` train on (expected, all partitions):
    the corpus' counts when it was loaded under the same :func:`epoch_keys` and :func:`round_keys`, else
    counted again on its cached partitions (a corpus shared by runs of other settings, as the benchmarks'
    sweeps share one, which may differ in a round's steps alone)."""
    epoch = epoch_keys(cfg)             # round_keys() begins with them
    if data.counted_for == round_keys(cfg) or (not rounds and data.counted_for[:len(epoch)] == epoch):
        return data.scored if rounds else Scored(None, data.scored.epoch)
    return _scored(_probe(cfg, data.train))


def _probe(cfg: config.Config, rdd) -> list:
    """:func:`rnnlm.spark.executor.probe_task`'s rows of every partition; a partition too short for
    ``cfg``'s batches (or without its device) is a :class:`CorpusError`."""
    probe = rdd.mapPartitions(probe_task(cfg)).collect()
    errors = [f"partition {pid}: {err}" for pid, _, _, _, err, _ in probe if err]
    if errors:
        raise CorpusError(f"{cfg.data.train}: {errors[0]} (strategy {cfg.data.strategy}, bptt {cfg.train.bptt}, "
                          f"batch {cfg.train.batch})")
    return probe


def total_rounds(cfg: config.Config, data: Corpus, counts: Scored | None = None) -> int:
    """``train.rounds``, or the rounds that train on ``train.epochs`` epochs (``counts``: :func:`scored`,
    when the caller has it). A whole number of rounds' worth, as 13 passes of one-pass rounds, is not
    rounded up by the quotient's last bit."""
    if cfg.train.rounds:
        return cfg.train.rounds
    counts = scored(cfg, data) if counts is None or counts.round is None else counts
    return rounds_for(cfg.train.epochs, counts.epoch, counts.round)


def unpersist_corpus(data: Corpus, blocking: bool = False) -> None:
    """Drop the corpus' cached partitions and its vocabulary's broadcast."""
    release(data.broadcasts, [r for r in (data.train, data.valid, data.test) if r is not None], blocking=blocking)


def evaluate_rdd(sc, cfg, params, rdd, last: bool = False) -> float:
    """Mean NLL per token of an encoded RDD under ``params`` (each partition one stream); ``last``:
    the session's last job, whose release waits for the executors' answers if it succeeded."""
    bc, parts = sc.broadcast(params), None
    try:
        parts = rdd.mapPartitions(eval_task(cfg, bc)).collect()
    finally:
        release([bc], blocking=last and parts is not None)
    total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
    if count == 0:              # a perplexity of 1 would be a figure of nothing
        raise CorpusError("the held-out text scores no token: each of its streams is shorter than 2 tokens "
                          "(fewer data.eval_streams, or a longer text)")
    return total / count
