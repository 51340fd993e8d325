import json

import numpy as np
import pytest

from rnnlm.core.vocab import EOS, UNK_CHAR, UNK_WORD, Vocab, VocabError, tokenize


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


_GOOD = {"level": "char", "tokens": ["a", "b", UNK_CHAR], "counts": [3, 1, 0]}


@pytest.mark.parametrize("change, needle", [
    ({"tokens": "ab" + UNK_CHAR}, "tokens must be a list of non-empty strings"),      # a string is a list of chars
    ({"tokens": [1, "b", UNK_CHAR]}, "tokens must be a list of non-empty strings"),
    ({"tokens": ["", "b", UNK_CHAR]}, "tokens must be a list of non-empty strings"),
    ({"tokens": ["ab", "b", UNK_CHAR]}, "a character vocabulary's tokens must be single characters"),
    ({"counts": [10 ** 30, 1, 0]}, "counts must be a list of integers in [0, 2**63)"),   # was an OverflowError
    ({"counts": [2 ** 63, 1, 0]}, "counts must be a list of integers in [0, 2**63)"),
    ({"counts": [3, -1, 0]}, "counts must be a list of integers in [0, 2**63)"),
    ({"counts": ["3", 1, 0]}, "counts must be a list of integers in [0, 2**63)"),
    ({"counts": [3.5, 1, 0]}, "counts must be a list of integers in [0, 2**63)"),
    ({"counts": [True, 1, 0]}, "counts must be a list of integers in [0, 2**63)"),
    ({"counts": {"a": 3}}, "counts must be a list of integers in [0, 2**63)"),
    ({"level": ["char"] * 1000}, "unknown vocabulary level ['char', 'char'"),
    ({"extra": 1}, "must be a table of level, tokens and counts"),
    ({"level": "word", "tokens": ["<unk>", "the", "x"]}, "a word vocabulary lacks its line end '<eos>'"),
])
def test_a_vocabulary_file_is_checked_field_by_field(change, needle):
    """What a checkpoint's vocab.json may hold: each field typed and in range, or one short line (a
    count beyond int64 was an OverflowError's traceback; a string of tokens, ints or negative counts
    were taken)."""
    with pytest.raises(VocabError) as e:
        Vocab.from_json(json.dumps({**_GOOD, **change}))
    assert needle in str(e.value) and len(str(e.value)) < 200, str(e.value)


def test_a_vocabulary_file_at_its_edges_loads():
    v = Vocab.from_json(json.dumps({**_GOOD, "counts": [2 ** 63 - 1, 0, 0]}))
    assert v.counts.tolist() == [2 ** 63 - 1, 0, 0] and v.tokens == _GOOD["tokens"]
    w = Vocab.from_json(json.dumps({"level": "word", "tokens": ["<unk>", "<eos>", "x"], "counts": [2, 1, 1]}))
    assert w.unk_id == 0 and len(w) == 3


def test_an_open_end_leaves_a_last_line_without_its_break_open():
    assert tokenize("a b\nc d", "word") == ["a", "b", EOS, "c", "d", EOS]
    assert tokenize("a b\nc d", "word", open_end=True) == ["a", "b", EOS, "c", "d"]
    # a line that ended is ended, open or not: whitespace after its break, or a break splitlines knows
    for closed in ("a b\n", "a b\r", "a b\n ", "a b\r\n\t", "a b\u2028", "a b\x0c"):
        assert tokenize(closed, "word", open_end=True) == ["a", "b", EOS], repr(closed)
    assert tokenize("a b\n c d ", "word", open_end=True) == ["a", "b", EOS, "c", "d"]
    v = Vocab.build("a b\n", "word")
    assert v.encode("a b", open_end=True).tolist() == [v.index["a"], v.index["b"]]
    assert tokenize("ab\n", "char", open_end=True) == ["a", "b", "\n"]


@pytest.mark.parametrize("level, prime, continuation, joined", [
    ("word", "the cat", "sat", "the cat sat"),           # words need a space between them...
    ("word", "the cat ", "sat", "the cat sat"),          # ...unless the prime ends in one
    ("word", "the cat", "\nsat", "the cat\nsat"),        # or the continuation begins a line
    ("word", "", "sat", "sat"),
    ("word", "the cat", "", "the cat"),
    ("char", "the ca", "t", "the cat"),                  # characters carry their own spaces
])
def test_join_puts_the_space_words_need_between_prime_and_continuation(level, prime, continuation, joined):
    v = Vocab.build("the cat sat\n", level)
    assert v.join(prime, continuation) == joined


def test_decode_spaces_words_and_breaks_lines_at_eos():
    v = Vocab.build("a b\nc d\n", "word")
    assert v.decode(v.encode("a b\nc d\n")) == "a b\nc d\n"
    assert v.decode(v.encode("\nd a")) == "d a\n"           # the empty line has no <eos>


def test_from_counts_defaults_ties_and_the_smallest_cap():
    v = Vocab.from_counts({"c": 2, "b": 2, "a": 2, "z": 0}, "char")      # no cap; a count of 0 is not kept
    assert v.tokens == ["a", "b", "c", UNK_CHAR] and v.counts.tolist() == [2, 2, 2, 0]
    capped = Vocab.from_counts({"c": 2, "b": 2, "a": 2}, "char", max_size=3)
    assert capped.tokens == ["a", "b", UNK_CHAR]                        # ties go to the first token, not the first seen
    assert capped.counts.tolist() == [2, 2, 2]
    w = Vocab.from_counts({"a": 2}, "word", max_size=3)                 # the smallest cap: one word
    assert w.tokens == ["a", EOS, UNK_WORD] and w.counts.tolist() == [2, 0, 0]
    with pytest.raises(VocabError, match="data.vocab_size must be 0 .no cap. or > 2"):
        Vocab.from_counts({"a": 2}, "word", max_size=2)


def test_a_vocabulary_is_unique_tokens_with_a_count_each_and_equal_only_to_its_like():
    with pytest.raises(VocabError, match="unique and match counts"):
        Vocab(["a", "a", UNK_CHAR], [1, 1, 0], "char")
    with pytest.raises(VocabError, match="unique and match counts"):
        Vocab(["a", UNK_CHAR], [1], "char")
    v = Vocab(["a", UNK_CHAR], [1, 0], "char")
    assert v == Vocab(["a", UNK_CHAR], [1, 0], "char")
    assert v != Vocab(["a", UNK_CHAR], [2, 0], "char") and v != Vocab(["a", UNK_WORD, EOS], [1, 0, 0], "word")
    assert v != "a" and v != Vocab(["a", UNK_CHAR, UNK_WORD], [1, 0, 0], "char")


@pytest.mark.parametrize("level", ["char", "word"])
def test_a_min_count_that_keeps_no_token_of_the_corpus_is_refused(level):
    """Every token read as the unknown one: the demo reported train_loss 0 and valid_ppl 1, a "perfect" model."""
    with pytest.raises(VocabError, match=f"^data.min_count = 4 keeps no {level}"):
        Vocab.build("ab ab ab\n", level, min_count=4)
    assert len(Vocab.build("ab ab ab\n", level, min_count=3)) > (2 if level == "word" else 1)
    # as Spark's build_vocab sends them: the kept candidates (none) and the forced tokens, with the corpus' total
    forced = {"<eos>": 1} if level == "word" else {}
    with pytest.raises(VocabError, match=f"^data.min_count = 4 keeps no {level}"):
        Vocab.from_counts(forced, level, 0, 4, total=4 if level == "word" else 9)
