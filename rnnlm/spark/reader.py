"""Text through Hadoop's readers: a corpus' files listed (:func:`check_path`), read as an RDD of paragraphs
(:func:`paragraphs`), and a record longer than ``data.max_record_mb``, which Hadoop's reader skips, refused:
found by a scan of the local files (:mod:`.scan`) or by the offsets Hadoop read the other records at
(:func:`check_skipped`).
"""
from __future__ import annotations

from typing import NamedTuple

from ..core.files import HADOOP_CODECS
from .scan import CorpusError, check_record_files, refused, subdirectory_error, too_long
from .session import hadoop_conf, hadoop_splits, jvm


_TEXT_INPUT = "org.apache.hadoop.mapreduce.lib.input.TextInputFormat"


# Hadoop's line readers skip a record this long instead of holding it (a 100 MB line with no newline
# killed the driver's JVM with OutOfMemoryError in Text.decode)
MAX_LINE = "mapreduce.input.linerecordreader.line.maxlength"


MAX_RECORD_MB = 16            # data.max_record_mb's default


class Listed(NamedTuple):
    """What :func:`check_path` found: ``path`` for Hadoop's input formats, ``local`` the files on the local disk
    (None on any other filesystem), ``size`` their bytes, ``files`` their URIs."""
    path: str
    local: list | None
    size: int
    files: tuple


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
        raise subdirectory_error(path, sub.toString() if ":" in path else sub.toUri().getPath())
    files, size = tuple(f for f, _, _ in found), sum(n for _, _, n in found)
    if not files:
        return Listed(path, local, size, ())
    if any(c in f for f in files for c in ",{}[]*?\\"):
        # the directories' files through a glob: a directory itself is listed in its disk's order
        return Listed(path.rstrip("/") + "/*" if all(st.isDirectory() for st in matches) else path, local, size, files)
    return Listed(",".join(files), local, size, files)


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
    (:func:`.scan.check_record_files`, unless the command line's check before Spark scanned the same files),
    one elsewhere (or compressed otherwise than by gzip) is read once through Hadoop and its records'
    offsets checked for what the reader skipped (:func:`check_skipped`). Errors name the corpus as ``what``
    (``data.train``), by default as ``path``.
    """
    listed, what = check_path(sc, path), what or path       # its files, in sorted order
    if listed.local is not None:
        check_record_files(listed.local, mode, max_record_mb, what)
    most = _hadoop_max(max_record_mb)
    if mode == "line":
        # bzip2, the codec Hadoop splits, is read a file a task: a split's offsets would start at a compressed one
        whole = any(f.endswith(SPLITTABLE) for f in listed.files)
        keyed = _lines(sc, listed.path, max(1, listed.size // max(1, min_partitions)), most, whole)
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
SPLITTABLE = (".bz2",)         # the files of the one codec Hadoop's line reader splits (BZip2Codec's suffix)


def _records(sc, path: str, delimiter: str, most: str):
    """``(offset, record)``: the records of the files under ``path`` cut at ``delimiter``, each file read whole
    by one task: Hadoop's reader reads the record after a split boundary that falls inside a run of delimiters which
    is not a whole number of them (``\n\n\n`` between paragraphs) in both splits, so a paragraph was
    trained twice wherever a 32 MiB (local) or 128 MiB (HDFS) block ended so. The trainer repartitions
    the records anyway (:func:`rnnlm.spark.corpus.contiguous_partitions`)."""
    return sc.newAPIHadoopFile(path, _TEXT_INPUT, "org.apache.hadoop.io.LongWritable", "org.apache.hadoop.io.Text",
                               conf={"textinputformat.record.delimiter": delimiter, MAX_LINE: most,
                                     SPLIT_MIN: str(1 << 62)})


def _lines(sc, path: str, split: int, most: str, whole: bool = False):
    """``(offset, line)``: the lines of the files under ``path``, in splits of at most ``split`` bytes (the corpus'
    bytes over the partitions asked for: about as many splits, as ``sc.textFile`` made), or (``whole``) a file a
    split. ``textFile`` takes no Hadoop configuration of its own: it read the line limit from the session's when its
    tasks ran, so a cached partition recomputed after another read had set another limit would have read with that
    one."""
    conf = {MAX_LINE: most, SPLIT_MAX: str(split), **({SPLIT_MIN: str(1 << 62)} if whole else {})}
    return sc.newAPIHadoopFile(path, _TEXT_INPUT, "org.apache.hadoop.io.LongWritable", "org.apache.hadoop.io.Text",
                               conf=conf)


def _line_end(sc, path: str, most: str) -> str:
    """``"\r\n"`` when the corpus' first line ends so (text made on Windows), else ``"\n"``: Hadoop
    splits records on one delimiter, and a blank line is two line ends."""
    first = _records(sc, path, "\n", most).values().take(1)
    return "\r\n" if first and first[0].endswith("\r") else "\n"


def check_skipped(sc, keyed, mode: str, max_record_mb: int, what: str, full_paths: bool) -> None:
    """Refuse a corpus read through Hadoop (``keyed``: :func:`_lines` or :func:`_records`, a compressed file in one
    split) from which the reader skipped a record longer than ``max_record_mb`` MiB, where no scan can look first
    (another filesystem, a codec other than gzip): one pass over the records' offsets, a task per split
    (:func:`_split_gaps`).

    The reader keys each record by the offset it started reading at, before any record it skipped, so in a split's
    records a skip shows as a key further on than the last record's bytes reach; and a record cut at the limit,
    which it hands over where a skip runs past its split's end, as a record longer than the limit. Across a file's
    splits each split's records start where the last one's ended, and the last reaches the file's end: a gap is a
    record skipped there. A compressed file's keys count its text's bytes, which the driver's JVM counts by
    inflating it (:func:`_text_bytes`). A file's first record is named as the local scan names it (the text one
    huge line, or one paragraph). ``full_paths``: name files by their URIs (else by their paths alone, for a
    corpus named so)."""
    limit, Path = max_record_mb << 20, jvm(sc).org.apache.hadoop.fs.Path
    found = sorted(keyed.mapPartitionsWithIndex(_split_gaps(limit)).collect())
    files = {}                  # path -> [(length, first, (last, end), issue), ...]: its splits, in order
    for (_, first, last, end, issue), (path, start, length) in zip(found, hadoop_splits(keyed)):
        files.setdefault(path, []).append((start + length, first, (last, end), issue))
    codecs = jvm(sc).org.apache.hadoop.io.compress.CompressionCodecFactory(hadoop_conf(sc))
    record = "line" if mode == "line" else "paragraph"
    for path, splits in files.items():
        codec = codecs.getCodec(Path(path))
        compressed = codec is not None
        name = path if full_paths else Path(path).toUri().getPath()
        if compressed and len(splits) > 1:      # its splits' keys would start at compressed offsets
            raise ValueError(f"check_skipped: {name} is compressed and read in {len(splits)} splits: read it whole")

        def refuse(at: int, upto: int | None):
            if at == 0:                         # the file's first record: is the text one line, one paragraph?
                raise CorpusError(too_long(what, name, mode, max_record_mb, 0, record))
            where = f"at byte {at:,}" if upto is None else f"between bytes {at:,} and {upto:,}"
            raise CorpusError(f"{what}: {name}: a {record} {where}{' of its text' if compressed else ''} is longer "
                              f"than {max_record_mb} MiB{'' if upto is None else ' (Hadoop skipped it)'}: "
                              + refused(max_record_mb))
        last = end = 0                          # where the last record started, where its bytes reach
        for _, first, reach, issue in splits:
            if issue is not None:
                refuse(*issue)
            if first is not None:
                if first - end > limit:
                    refuse(last, first)
                last, end = reach
        size = _text_bytes(sc, path, codec) if compressed else splits[-1][0]
        if size - end > limit:
            refuse(last, size)


def _text_bytes(sc, path: str, codec) -> int:
    """The bytes of a compressed file's text, as Hadoop's ``codec`` inflates it: counted in the driver's JVM."""
    j = jvm(sc)
    hpath = j.org.apache.hadoop.fs.Path(path)
    try:
        stream = codec.createInputStream(hpath.getFileSystem(hadoop_conf(sc)).open(hpath))
        try:
            return stream.transferTo(j.java.io.OutputStream.nullOutputStream())
        finally:
            stream.close()
    except Exception as e:
        raise CorpusError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def _split_gaps(limit: int):
    """A task over one split's ``(offset, record)`` pairs: ``(pid, first offset, last offset, where the last record's
    bytes reach, issue)``; the issue, None or where a record was skipped: ``(start, None)`` for a record longer than
    ``limit`` bytes, ``(start, the next record's offset)`` for a gap of more than ``limit`` bytes after a record
    (delimiters and a byte-order mark add a few bytes to a record's reach, a skipped record more than ``limit``).
    A record's bytes are counted at the least: Hadoop decodes each undecodable byte, or run of up to three, as
    U+FFFD, three bytes in the text Python is handed (a gap measured from a record's larger size hid a skip, and
    a record of Latin-1 text looked up to three times as long as it is); so counted, a record Hadoop read whole
    leaves no gap larger than ``limit`` (a gap so large would need more than ``limit / 2`` U+FFFDs standing for
    several bytes each: a record longer than Hadoop's limit)."""
    def task(pid, records):
        first = last = end = None
        for at, text in records:
            size = len(text.encode("utf-8", "surrogatepass")) - 2 * text.count("\ufffd")
            if size > limit:
                return [(pid, first, last, end, (at, None))]
            if end is not None and at - end > limit:
                return [(pid, first, last, end, (last, at))]
            first = at if first is None else first
            last, end = at, at + size
        return [(pid, first, last, end, None)]
    return task


def _paragraph_records(record: str) -> list:
    """A record with ``\n`` line ends (``\r\n`` and a lone ``\r`` are line ends, as to the line mode and
    the single-process trainer), cut at the blank lines its delimiter missed (in a corpus whose files end
    their lines differently from the first, or with ``\r`` alone)."""
    if "\r" in record:
        record = record.replace("\r\n", "\n").replace("\r", "\n")
    return record.split("\n\n")
