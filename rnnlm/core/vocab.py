"""Vocabulary of characters or words, ordered by frequency rank.

Ids are frequency ranks (0 = most frequent, ties broken by the token), so
samplers can draw by rank (Zipf). Words: ``<unk>`` for everything outside the
vocabulary and ``<eos>`` at each line end (the PTB convention). Characters: the
reserved character U+FFFD stands for any character not in the vocabulary.
"""
from __future__ import annotations

import json
from collections import Counter

import numpy as np

UNK_WORD, EOS = "<unk>", "<eos>"
UNK_CHAR = "\ufffd"


class VocabError(ValueError):
    """A vocabulary file or request that cannot be used."""


def tokenize(text: str, level: str, open_end: bool = False) -> list:
    """Characters, or whitespace-split words with ``<eos>`` after every line.

    With ``open_end`` (a prime to continue) a last line without its line break is
    left open: no ``<eos>`` follows it, so a continuation goes on in the sentence.
    """
    if level == "char":
        return list(text)
    out, lines = [], text.splitlines(keepends=True)
    for line in lines:
        words = line.split()
        if words:
            out.extend(words)
            out.append(EOS)
    # open: the words end the text with no line break after them (any splitlines knows: \u2028, \x0c too)
    if open_end and lines and lines[-1].split() and lines[-1].splitlines()[0] == lines[-1]:
        out.pop()
    return out


class Vocab:
    """Token <-> id maps with counts.

    Parameters
    ----------
    tokens : list of str
        In id order (descending count).
    counts : list of int
    level : {"char", "word"}
    """

    def __init__(self, tokens, counts, level):
        if level not in ("char", "word"):
            raise VocabError(f"unknown vocabulary level {level!r:.40}")
        if len(tokens) != len(counts) or len(set(tokens)) != len(tokens):
            raise VocabError("vocabulary tokens must be unique and match counts")
        self.level = level
        self.tokens = list(tokens)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        unk = UNK_WORD if level == "word" else UNK_CHAR
        if unk not in self.index:
            raise VocabError(f"vocabulary lacks its unknown token {unk!r}")
        if level == "word" and EOS not in self.index:    # every line ends in it: without, line ends read as <unk>
            raise VocabError(f"a word vocabulary lacks its line end {EOS!r}")
        self.unk_id = self.index[unk]

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_counts(cls, counts: dict, level: str, max_size: int = 0, min_count: int = 1,
                    total: int | None = None) -> "Vocab":
        """Keep the most frequent tokens (count >= ``min_count``, at most ``max_size``).

        The unknown token (and ``<eos>`` for words) is always kept; the counts of
        dropped tokens go to the unknown token. ``counts`` may hold only the
        candidates (as Spark sends them) when ``total``, the corpus' token count,
        is given.
        """
        unk = UNK_WORD if level == "word" else UNK_CHAR
        forced = [unk] + ([EOS] if level == "word" else [])
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        kept = [(t, c) for t, c in ranked if c >= min_count and t not in forced]
        total = sum(counts.values()) if total is None else total      # Spark sends the kept candidates alone
        if not kept and total > sum(counts.get(t, 0) for t in forced):   # a model of the unknown token alone
            raise VocabError(f"data.min_count = {min_count} keeps no {level}{'acter' * (level == 'char')} of the "
                             f"corpus: every one would read as {unk!r}, a model that learns nothing")
        if max_size:
            if max_size <= len(forced):
                raise VocabError(f"data.vocab_size must be 0 (no cap) or > {len(forced)}")
            kept = kept[:max_size - len(forced)]
        if level == "word":
            kept.append((EOS, counts.get(EOS, 0)))
        kept.append((unk, total - sum(c for _, c in kept)))
        kept.sort(key=lambda kv: (-kv[1], kv[0]))
        return cls([t for t, _ in kept], [c for _, c in kept], level)

    @classmethod
    def build(cls, text: str, level: str, max_size: int = 0, min_count: int = 1) -> "Vocab":
        """Count the tokens of ``text`` (small corpora; Spark builds counts for big ones)."""
        return cls.from_counts(Counter(tokenize(text, level)), level, max_size, min_count)

    def encode(self, text: str, open_end: bool = False) -> np.ndarray:
        """Token ids (int32) of ``text``; unknown tokens map to the unknown id
        (``open_end``: see :func:`tokenize`)."""
        return self.ids(tokenize(text, self.level, open_end))

    def ids(self, tokens) -> np.ndarray:
        """Token ids (int32) of ``tokens`` already split (:func:`tokenize`)."""
        get, unk = self.index.get, self.unk_id
        return np.fromiter((get(t, unk) for t in tokens), dtype=np.int32)

    def join(self, prime: str, continuation: str) -> str:
        """``prime`` followed by a decoded ``continuation``, with the space words need between them."""
        if (self.level == "word" and prime and continuation and not prime[-1].isspace()
                and not continuation.startswith("\n")):
            return f"{prime} {continuation}"
        return prime + continuation

    def decode(self, ids) -> str:
        toks = [self.tokens[int(i)] for i in ids]
        if self.level == "char":
            return "".join(toks)
        out = []
        for t in toks:
            if t == EOS:
                out.append("\n")
            else:
                out.append(t if not out or out[-1] == "\n" else " " + t)
        return "".join(out)

    def to_json(self) -> str:
        return json.dumps({"level": self.level, "tokens": self.tokens,
                           "counts": self.counts.tolist()}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "Vocab":
        """The vocabulary of :meth:`to_json`'s text (a checkpoint's ``vocab.json``), every field checked."""
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise VocabError(f"invalid vocabulary JSON: {type(e).__name__}") from None
        if not (isinstance(d, dict) and set(d) == {"level", "tokens", "counts"}):
            raise VocabError("a vocabulary file must be a table of level, tokens and counts")
        tokens, counts = d["tokens"], d["counts"]
        if not (isinstance(tokens, list) and all(isinstance(t, str) and t for t in tokens)):
            raise VocabError("vocabulary tokens must be a list of non-empty strings")
        if d["level"] == "char" and any(len(t) != 1 for t in tokens):
            raise VocabError("a character vocabulary's tokens must be single characters")
        if not (isinstance(counts, list) and all(type(c) is int and 0 <= c < 2 ** 63 for c in counts)):
            raise VocabError("vocabulary counts must be a list of integers in [0, 2**63)")
        return cls(tokens, counts, d["level"])

    def __eq__(self, other) -> bool:
        return (isinstance(other, Vocab) and self.level == other.level
                and self.tokens == other.tokens and bool(np.array_equal(self.counts, other.counts)))
