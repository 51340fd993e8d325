"""Corpus RDDs: paragraphs, vocabulary by reduceByKey, contiguous partitions."""
import os

import numpy as np

from rnnlm.spark import corpus
from rnnlm.core.vocab import Vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "rnnlm", "data", "harbour.txt")


def test_paragraph_modes(spark, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a b\nc d\n\ne f\n\n\n\ng\n")
    sc = spark.sparkContext
    assert corpus.paragraphs(sc, str(f), "blank_line", "word").collect() == ["a b\nc d", "e f", "g"]
    assert corpus.paragraphs(sc, str(f), "line", "word").collect() == ["a b", "c d", "e f", "g"]
    assert corpus.paragraphs(sc, str(f), "blank_line", "char").collect()[1] == "e f\n\n"


def test_character_paragraphs_keep_every_character_of_the_raw_text(spark, tmp_path):
    raw = "First line,\nsecond line.\n\nAnother one.\n\n\nAfter two blank lines.\n\nLast.\n"
    f = tmp_path / "t.txt"
    f.write_text(raw)
    sc = spark.sparkContext
    # blank lines stay in the stream, as in the raw text; only the file's end gains one line break
    assert "".join(corpus.paragraphs(sc, str(f), "blank_line", "char").collect()) == raw + "\n"
    assert "".join(corpus.paragraphs(sc, str(f), "line", "char").collect()) == raw


def test_spark_vocabulary_equals_the_local_one(spark):
    sc = spark.sparkContext
    text = open(TEXT).read()
    for level, cap in (("char", 0), ("char", 20), ("word", 50)):
        paras = corpus.paragraphs(sc, TEXT, "blank_line", level)
        local = Vocab.build("".join(p + ("\n" if level == "word" else "") for p in paras.collect()), level, cap)
        assert corpus.build_vocab(paras, level, cap) == local
    assert len(corpus.build_vocab(corpus.paragraphs(sc, TEXT, "line", "char"), "char")) == len(set(text)) + 1


def test_contiguous_partitions_keep_order(spark):
    sc = spark.sparkContext
    paras = sc.parallelize([f"p{i}" for i in range(23)], 5)
    parts = corpus.contiguous_partitions(paras, 3).glom().collect()
    assert len(parts) == 3 and sum(parts, []) == [f"p{i}" for i in range(23)]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_encoded_partitions(spark):
    sc = spark.sparkContext
    vocab = Vocab.build("abc\n", "char")
    paras = corpus.contiguous_partitions(sc.parallelize(["ab\n", "cab\n", "zz\n"], 2), 2)
    recs = corpus.encode_partitions(paras, sc.broadcast(vocab)).collect()
    tokens = np.concatenate([r[1] for r in recs])
    assert vocab.decode(tokens) == "ab\ncab\n" + vocab.tokens[vocab.unk_id] * 2 + "\n"
    assert [r[0] for r in recs] == [0, 1] and all(r[2][0] == 0 for r in recs)
