"""Corpus RDDs: paragraphs, vocabulary by reduceByKey, contiguous partitions."""
import gzip
import os

import numpy as np
import pytest

from rnnlm.spark import corpus, reader, scan
from rnnlm.core.vocab import Vocab

from conftest import HARBOUR as TEXT


def test_paragraph_modes(spark, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a b\nc d\n\ne f\n\n\n\ng\n")
    sc = spark.sparkContext
    assert reader.paragraphs(sc, str(f), "blank_line", "word").collect() == ["a b\nc d", "e f", "g"]
    assert reader.paragraphs(sc, str(f), "line", "word").collect() == ["a b", "c d", "e f", "g"]
    assert reader.paragraphs(sc, str(f), "blank_line", "char").collect()[1] == "e f\n\n"


def test_character_paragraphs_keep_every_character_of_the_raw_text(spark, tmp_path):
    raw = "First line,\nsecond line.\n\nAnother one.\n\n\nAfter two blank lines.\n\nLast.\n"
    f = tmp_path / "t.txt"
    f.write_text(raw)
    sc = spark.sparkContext
    # blank lines stay in the stream, as in the raw text; only the file's end gains one line break
    assert "".join(reader.paragraphs(sc, str(f), "blank_line", "char").collect()) == raw + "\n"
    assert "".join(reader.paragraphs(sc, str(f), "line", "char").collect()) == raw


def test_spark_vocabulary_equals_the_local_one(spark, tmp_path):
    sc = spark.sparkContext
    text = open(TEXT).read()
    long_lines = tmp_path / "long.txt"                  # <eos> (one a line) ranks below the top 7 words
    long_lines.write_text(("a b c d e f g h " * 20 + "\n") * 2 + "\n" + "i j\n")
    for level, cap, path in (("char", 0, TEXT), ("char", 20, TEXT), ("word", 50, TEXT), ("word", 5, str(long_lines))):
        paras = reader.paragraphs(sc, path, "blank_line", level)
        local = Vocab.build("".join(p + ("\n" if level == "word" else "") for p in paras.collect()), level, cap)
        assert corpus.build_vocab(paras, level, cap) == local, (level, cap)
    assert len(corpus.build_vocab(reader.paragraphs(sc, TEXT, "line", "char"), "char")) == len(set(text)) + 1


def test_a_byte_order_mark_is_no_token_to_either_trainer(spark, tmp_path):
    """Hadoop's reader drops a UTF-8 file's leading byte order mark; the single-process trainer learnt the
    word '\ufeffThe' and the character U+FEFF from it, so the two trainers' vocabularies differed."""
    from rnnlm.core.single import read_text
    f = tmp_path / "bom.txt"
    f.write_bytes(b"\xef\xbb\xbfThe cat\nsat on\n\nthe mat.\n")
    for level in ("word", "char"):          # (Spark's character paragraphs end with a blank line: other counts)
        local = Vocab.build(read_text(str(f)), level)
        paras = reader.paragraphs(spark.sparkContext, str(f), "blank_line", level)
        assert sorted(corpus.build_vocab(paras, level).tokens) == sorted(local.tokens), level
        assert not any("\ufeff" in t for t in local.tokens), level


def test_contiguous_partitions_keep_order(spark):
    sc = spark.sparkContext
    paras = sc.parallelize([f"p{i}" for i in range(23)], 5)
    rdd, balance = corpus.contiguous_partitions(paras, 3)
    parts = rdd.glom().collect()
    assert balance == "paragraphs" and len(parts) == 3 and sum(parts, []) == [f"p{i}" for i in range(23)]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def _lengths(n_paras: int, seed: int) -> list:
    """Paragraphs of 1 to 400 characters, long and short ones in runs (as a play's speeches come)."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(1, 40)) if (i // 7) % 2 else int(rng.integers(100, 400)) for i in range(n_paras)]


def test_contiguous_partitions_balance_tokens(spark):
    """Each partition within one paragraph of its share of the tokens, order kept, where a split by
    paragraph count leaves the largest partition several times the smallest's tokens."""
    sc = spark.sparkContext
    texts = [chr(97 + i % 26) * w for i, w in enumerate(_lengths(120, 0))]
    n, total, longest = 6, sum(map(len, texts)), max(map(len, texts))
    rdd, balance = corpus.contiguous_partitions(sc.parallelize(texts, 4), n, level="char")
    parts = rdd.glom().collect()
    sizes = [sum(map(len, p)) for p in parts]
    assert balance == "tokens" and len(parts) == n and sum(parts, []) == texts
    assert all(abs(s - total / n) <= longest for s in sizes), sizes    # half a paragraph at either end
    by_count = [sum(map(len, p)) for p in corpus.contiguous_partitions(sc.parallelize(texts, 4), n)[0].glom().collect()]
    assert max(by_count) > 1.5 * min(by_count), by_count       # what the token split mends
    words = [" ".join(["w"] * w) + "\n" for w in _lengths(60, 1)] + [" \n"]    # the last holds no word
    parts = corpus.contiguous_partitions(sc.parallelize(words, 3), 4, level="word")[0].glom().collect()
    assert sum(parts, []) == words and parts[-1][-1] == " \n"
    sizes = [sum(len(p.split()) + 1 for p in part) for part in parts]
    assert max(sizes) - min(sizes) <= 2 * max(_lengths(60, 1)) + 2, sizes


def test_contiguous_partitions_by_count_where_a_paragraph_outweighs_a_share(spark):
    """A paragraph longer than a partition's share of the tokens could leave a partition empty: the
    split is then by paragraph count, and every partition holds text."""
    sc = spark.sparkContext
    texts = ["a", "b", "c" * 50, "d", "e", "f", "g", "h"]       # 57 characters, 3 partitions: 19 each
    rdd, balance = corpus.contiguous_partitions(sc.parallelize(texts, 2), 3, level="char")
    parts = rdd.glom().collect()
    assert balance == "paragraphs" and parts == [texts[:3], texts[3:6], texts[6:]]
    rdd, balance = corpus.contiguous_partitions(sc.parallelize(texts, 2), 2, level="char", shrink=True)
    assert balance == "paragraphs" and len(rdd.glom().collect()) == 2      # 50 > 57 / 2 too
    assert corpus.contiguous_partitions(sc.parallelize(texts, 2), 1, level="char")[1] == "tokens"


def test_encoded_partitions(spark):
    sc = spark.sparkContext
    vocab = Vocab.build("abc\n", "char")
    paras, _ = corpus.contiguous_partitions(sc.parallelize(["ab\n", "cab\n", "zz\n"], 2), 2)
    recs = corpus.encode_partitions(paras, sc.broadcast(vocab)).collect()
    tokens = np.concatenate([r[1] for r in recs])
    assert vocab.decode(tokens) == "ab\ncab\n" + vocab.tokens[vocab.unk_id] * 2 + "\n"
    assert [r[0] for r in recs] == [0, 1] and all(r[2][0] == 0 for r in recs)


def test_text_made_on_windows_reads_as_the_same_paragraphs(spark, tmp_path):
    """CRLF line ends: blank_line mode saw one paragraph (with two partitions, a misleading "1 paragraphs"
    error; with one, \\r became a token). \\r\\n is a line end, as in the line mode and the one-machine trainer,
    and so is a lone \\r (blank_line mode read \\r\\r as no paragraph break and \\r as a character)."""
    raw = "First line,\nsecond line.\n\nAnother one.\n\n\nAfter two blank lines.\n\nLast.\n"
    lf, crlf = tmp_path / "lf.txt", tmp_path / "crlf.txt"
    lf.write_bytes(raw.encode())
    crlf.write_bytes(raw.replace("\n", "\r\n").encode())
    sc = spark.sparkContext
    for mode in ("blank_line", "line"):
        for level in ("char", "word"):
            got = reader.paragraphs(sc, str(crlf), mode, level).collect()
            assert got == reader.paragraphs(sc, str(lf), mode, level).collect(), (mode, level, got)
            assert not any("\r" in p for p in got)
    assert len(reader.paragraphs(sc, str(crlf), "blank_line", "word").collect()) == 4
    cr = tmp_path / "cr.txt"                            # a lone \r ends a line too (classic Mac OS)
    cr.write_bytes(raw.replace("\n", "\r").encode())
    for level in ("char", "word"):
        assert (reader.paragraphs(sc, str(cr), "blank_line", level).collect()
                == reader.paragraphs(sc, str(lf), "blank_line", level).collect()), level


def test_a_paragraph_after_a_split_boundary_in_a_run_of_blank_lines_is_read_once(spark, tmp_path):
    """Hadoop's reader with a delimiter of its own reads the record after a split boundary that falls inside
    a run of delimiters which is not a whole number of them in both splits: the paragraph was trained twice
    wherever a block ended so (32 MiB locally). Splits of 50 bytes put a boundary at every offset."""
    from rnnlm.spark.session import hadoop_conf
    conf = hadoop_conf(spark.sparkContext)
    key = "mapreduce.input.fileinputformat.split.maxsize"
    before = conf.get(key)
    conf.set(key, "50")
    try:
        for sep in ("\n\n\n", "\n" * 5, "\r\n" * 3):
            d, want = tmp_path / str(len(sep)), []
            d.mkdir()
            for shift in range(10):                         # files read in the order of their names
                paragraphs = ["h" * shift] * bool(shift) + [f"p{i:02d} text" for i in range(20)]
                (d / f"{shift}.txt").write_bytes(sep.join(paragraphs).encode())
                want += paragraphs
            assert reader.paragraphs(spark.sparkContext, str(d), "blank_line", "word").collect() == want, repr(sep)
    finally:
        conf.unset(key) if before is None else conf.set(key, before)


def test_files_with_either_line_end_in_one_corpus(spark, tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.txt").write_bytes(b"a b\r\nc\r\n\r\nd e\r\n")
    (d / "b.txt").write_bytes(b"f g\n\nh\n")
    got = sorted(reader.paragraphs(spark.sparkContext, str(d), "blank_line", "word").collect())
    assert got == ["a b\nc", "d e", "f g", "h"]


def test_a_corpus_directory_holding_a_subdirectory_is_refused_in_one_line(spark, tmp_path):
    """Hadoop reads a directory's files, not its subdirectories: a subdirectory ended in a 76-line
    NullPointerException (blank_line) or an IOException (line). Names Hadoop hides (_x, .x) do not count."""
    d = tmp_path / "corpus"
    (d / "_temporary").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / "a.txt").write_text("a b\n\nc d\n")
    sc = spark.sparkContext
    assert reader.paragraphs(sc, str(d), "blank_line", "word").collect() == ["a b", "c d"]
    (d / "more").mkdir()
    (d / "more" / "b.txt").write_text("e f\n")
    for mode in ("blank_line", "line"):
        with pytest.raises(scan.CorpusError) as e:
            reader.paragraphs(sc, str(d), mode, "word")
        assert str(e.value) == (f"{d}: {d}/more is a directory: a corpus directory is read as its files, not "
                                f"its subdirectories (name them with a glob, such as {d}/*/*)")


def test_a_path_that_matches_nothing_is_one_line_and_local_files_are_named_for_their_scan(spark, tmp_path):
    """check_path: a missing file, or a glob that matches none, is ``input path does not exist``; a corpus on the
    local disk is listed by its paths (the records' scan reads those files before Hadoop does), without the
    files Hadoop hides."""
    sc = spark.sparkContext
    for missing in (tmp_path / "none.txt", tmp_path / "none" / "*.txt", tmp_path / "n*ne.txt"):
        with pytest.raises(scan.CorpusError) as e:
            reader.check_path(sc, str(missing))
        assert str(e.value) == f"input path does not exist: {missing}"
    (tmp_path / "b.txt").write_text("b\n")
    (tmp_path / "a.txt").write_text("a a\n")
    listed = reader.check_path(sc, f"file://{tmp_path}/*.txt")
    assert listed.local == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")] and listed.size == 6
    assert listed.files == (f"file:{tmp_path}/a.txt", f"file:{tmp_path}/b.txt")
    # a directory written by Spark or Hadoop: its _SUCCESS marker and .crc files are none of the corpus
    (tmp_path / "out").mkdir()
    for name, text in (("part-00000", "a a\n"), ("_SUCCESS", ""), (".part-00000.crc", "crc")):
        (tmp_path / "out" / name).write_text(text)
    listed = reader.check_path(sc, str(tmp_path / "out"))
    assert listed.local == [str(tmp_path / "out" / "part-00000")] and listed.size == 4


def test_a_directorys_files_are_read_in_the_order_of_their_names(spark, tmp_path):
    """A local directory is listed in the order of its entries on that disk, and that order was the
    corpus' (its paragraphs, its partitions): the same corpus copied elsewhere trained on other data.
    Its files are now read in sorted order, as HDFS lists them and as the checks before Spark scan them."""
    d = tmp_path / "corpus"
    d.mkdir()
    names = [f"part-{i:02d}.txt" for i in range(12)]
    for i in np.random.default_rng(3).permutation(12):          # made in another order than their names'
        (d / names[i]).write_text(f"w{i} x\n\ny{i}\n")
    sc = spark.sparkContext
    for mode in ("blank_line", "line"):
        got = reader.paragraphs(sc, str(d), mode, "word", min_partitions=1).collect()
        assert got == [p for i in range(12) for p in (f"w{i} x", f"y{i}")], (mode, got)
    glob = reader.paragraphs(sc, f"{d}/part-0*.txt", "line", "word", min_partitions=1).collect()
    assert glob == [p for i in range(10) for p in (f"w{i} x", f"y{i}")]
    # names Hadoop would read as syntax (a comma splits paths; braces, brackets, * and ? are globs): the directory
    # went to Hadoop as given, which read its files in the disk's order (a,b-04, a,b-01, ... on ext4)
    odd = tmp_path / "odd"
    odd.mkdir()
    names = ["a,b-{i:02d}.txt", "c[{i:02d}].txt", "d{{{i:02d}}}.txt", "e*{i:02d}?.txt"]
    for i in np.random.default_rng(4).permutation(12):
        (odd / names[i % 4].format(i=i)).write_text(f"w{i}\n")
    assert os.listdir(odd) != sorted(os.listdir(odd))              # else this test could not tell
    expected = [f"w{i}" for _, i in sorted((names[i % 4].format(i=i), i) for i in range(12))]
    assert reader.paragraphs(sc, str(odd), "line", "word", min_partitions=1).collect() == expected
    assert reader.paragraphs(sc, f"{odd}/", "blank_line", "word", min_partitions=1).collect() == expected


def test_a_file_whose_line_ends_differ_from_the_first_files_is_scanned_as_hadoop_reads_it(tmp_path):
    """Hadoop finds the blank lines of the corpus' first file in every file: a CRLF file after an LF one is
    one record to it, which it skipped (a whole file gone, with an INFO line) when over the limit, while
    the scan before Spark, cutting each file at its own blank lines, had passed it."""
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.txt").write_bytes(b"a b\n\nc\n")
    (d / "b.txt").write_bytes(b"word word word\r\n\r\n" * 80_000)        # 1.3 MB of short paragraphs
    with pytest.raises(scan.CorpusError) as e:
        scan.check_local_records(str(d), "blank_line", 1, "data.train")
    assert str(e.value).startswith(f"data.train: {d}/b.txt has no blank line in its first 1 MiB: it is one "
                                   "paragraph") and "its lines end with b'\\r\\n', the corpus' first file's with " \
        "b'\\n'" in str(e.value), str(e.value)
    (d / "a.txt").write_bytes(b"a b\r\n\r\nc\r\n")                      # alike: read as it is cut
    scan.check_local_records(str(d), "blank_line", 1, "data.train")


def test_a_broken_gzip_is_not_called_empty_and_the_record_scan_names_it(tmp_path):
    """Only a file that holds no text is "empty"; a gzip that is not one, or one cut short, is refused by the
    record scan before Spark, naming the file: Hadoop's reader failed on it inside a Python worker, and the
    driver heard only that the worker crashed (a review's `rnnlm evaluate --data cut.txt.gz`: 108 lines)."""
    bad = tmp_path / "part.txt.gz"
    bad.write_bytes(b"not gzip at all\n")
    scan.check_local_input(str(bad), "data.train")
    empty = tmp_path / "empty.txt.gz"
    empty.write_bytes(gzip.compress(b""))
    with pytest.raises(scan.CorpusError, match="^data.train: .*empty.txt.gz is empty$"):
        scan.check_local_input(str(empty), "data.train")
    whole = gzip.compress(b"a b c\n\nd e f\n" * 2000)
    cut = tmp_path / "cut.txt.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    scan.check_local_input(str(cut), "--data")         # it holds text: not empty
    corrupt = tmp_path / "crc.txt.gz"
    corrupt.write_bytes(whole[:-8] + bytes(4) + whole[-4:])     # its CRC-32 zeroed
    for path, why in ((bad, r"Not a gzipped file"), (cut, r"ends before its compressed data does"),
                      (corrupt, r"CRC check failed")):
        with pytest.raises(scan.CorpusError, match=f"^--data: {path} is not a whole gzip file \\(.*{why}"):
            scan.check_local_records(str(path), "blank_line", 1, "--data")
    scan.check_local_records(str(empty), "blank_line", 1, "--data")     # whole: nothing to refuse
