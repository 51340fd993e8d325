import numpy as np
import pytest

from rnnlm.core.vocab import EOS, UNK_CHAR, UNK_WORD, Vocab, VocabError


def test_word_vocab_ranks_caps_and_unknowns():
    v = Vocab.build("a b a c\na a b\n\nd\n", "word", max_size=4)
    # counts: a 4, <eos> 3, b 2, c 1, d 1 -> keep a, <eos>, b; c, d fold into <unk>;
    # ties are ordered by the token, so <unk> (2) comes before b (2)
    assert v.tokens == ["a", "<eos>", "<unk>", "b"]
    assert v.counts.tolist() == [4, 3, 2, 2]
    ids = v.encode("a zebra b\n")
    assert ids.tolist() == [0, 2, 3, 1] and ids.dtype == np.int32
    assert v.decode(ids) == "a <unk> b\n"


def test_min_count_and_existing_unk():
    v = Vocab.build("x <unk> x y\n", "word", min_count=2)
    assert set(v.tokens) == {"x", UNK_WORD, EOS}      # <eos> is kept below min_count
    assert v.counts[v.unk_id] == 2 and v.counts[v.index["x"]] == 2   # own <unk> plus folded y


def test_char_vocab_reserved_unknown():
    v = Vocab.build("hello", "char")
    assert UNK_CHAR in v.index and v.counts[v.unk_id] == 0
    assert v.decode(v.encode("hex")) == "he" + UNK_CHAR
    assert v.tokens[0] == "l"


def test_json_round_trip():
    v = Vocab.build("the cat the end\n", "word")
    w = Vocab.from_json(v.to_json())
    assert w == v and w.index == v.index and w.level == "word"
    assert Vocab.from_json(Vocab.build("é€x", "char").to_json()).tokens[0] in "é€x"
    with pytest.raises(VocabError):
        Vocab.from_json('{"tokens": ["a"]}')
    with pytest.raises(VocabError):
        Vocab(["a"], [1], "word")   # no <unk>


def test_eos_at_line_ends():
    v = Vocab.build("a b\nc\n", "word")
    assert v.decode(v.encode("a b\nc\n")).split() == ["a", "b", "c"]
    assert (v.encode("a b\nc\n") == v.index[EOS]).sum() == 2
