"""How one partition's tokens become training batches (the Spark RNN report, section 5.2).

Every source maps (round, step) to a :class:`Batch` with no other
state, so a retried Spark task or a resumed run draws exactly the same data.
A partition holds its tokens as one int32 array plus paragraph start offsets.

========================  =====================================================
``streams``               the tokens as B contiguous streams, state carried
                          (Zaremba / char-rnn batching; the quality reference)
``paragraphs``            paragraphs packed into B lanes in order, state carried
                          within a paragraph and reset at its start
``windows``               every window of T + 1 tokens (stride s), B per step,
                          zero initial state
``sampled_windows``       a seeded fraction of those windows per round, drawn
                          as offsets (the N x T windows are never materialised)
``sampled_paragraphs``    a seeded fraction of paragraphs per round, in lanes
========================  =====================================================

A round trains on ``train.local_steps`` consecutive steps of the fixed
strategies (0 = one whole pass per round). The sampled strategies follow seed
001's meaning of an iteration: each round draws a fresh sample of
``data.sample_fraction`` of the partition's windows or paragraphs (seeded by
``(seed, round, partition)``) and trains on all of it, once, before the
all-reduce; their step count per round follows from the fraction, so
``train.local_steps`` must be 0 for them (the configuration rejects anything
else). Every window or paragraph of a pass is trained exactly once: the slots
of the last step that run past the pool's end are padded and not scored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    """One truncated-BPTT chunk: inputs, targets (-1 = not scored), resets; all (T, B)."""

    x: np.ndarray
    y: np.ndarray
    reset: np.ndarray | None = None


class StreamBlock:
    """A token array cut into B contiguous streams (the Zaremba / char-rnn batching).

    Step ``k`` reads positions ``[kT, kT + T]`` of every stream; after the last full
    chunk the pass restarts at 0 with the streams' states reset. Batches depend only
    on ``k``, so a retried or resumed run sees the same data.

    Parameters
    ----------
    tokens : int array (n,)
    B, T : int
        Streams and chunk length; each stream needs at least T + 1 tokens.
    """

    def __init__(self, tokens, B: int, T: int):
        n = len(tokens) // B
        if n < T + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill {B} streams of {T + 1} tokens")
        self.B, self.T = B, T
        self.streams = np.ascontiguousarray(np.asarray(tokens[:n * B]).reshape(B, n).T)  # (n, B)
        self.steps_per_pass = (n - 1) // T
        self.scored_per_pass = self.steps_per_pass * T * B       # every position predicts the next

    def batch(self, k: int) -> Batch:
        j = k % self.steps_per_pass
        a = j * self.T
        x = self.streams[a:a + self.T]                                  # (T, B)
        y = self.streams[a + 1:a + self.T + 1]
        reset = None
        if j == 0:
            reset = np.zeros(x.shape, dtype=bool)
            reset[0] = True
        return Batch(x, y, reset)

    def batches(self, first: int, count: int):
        return (self.batch(k) for k in range(first, first + count))


STRATEGIES = ("streams", "paragraphs", "windows", "sampled_windows", "sampled_paragraphs")
CARRY_STATE = ("streams", "paragraphs")     # strategies whose hidden state runs on from round to round
_SAMPLE_KEY = 0x5A11


class TooShort(ValueError):
    """A partition too small for the requested batching."""


def _lanes(tokens, starts, order, B):
    """Pack paragraphs (in ``order``) into B lanes, each taking the next paragraph
    when it is the shortest; return (tokens, resets, scored) as (L, B) arrays."""
    ends = np.append(starts[1:], len(tokens))
    lanes = [[] for _ in range(B)]
    length = np.zeros(B, dtype=np.int64)
    for i in order:
        b = int(np.argmin(length))
        lanes[b].append(i)
        length[b] += ends[i] - starts[i]
    L = int(length.max())
    tok = np.zeros((L, B), dtype=np.int32)
    reset = np.zeros((L, B), dtype=bool)
    scored = np.zeros((L, B), dtype=bool)   # position p predicts p + 1 in the same paragraph
    for b, idx in enumerate(lanes):
        pos = 0
        for i in idx:
            n = ends[i] - starts[i]
            tok[pos:pos + n, b] = tokens[starts[i]:ends[i]]
            reset[pos, b] = True
            scored[pos:pos + n - 1, b] = True
            pos += n
    return tok, reset, scored


class LaneSource:
    """Paragraphs in B lanes: chunks of T steps, hidden state reset at paragraph starts."""

    def __init__(self, tokens, starts, B, T, order=None):
        order = np.arange(len(starts)) if order is None else order
        tok, self.reset, scored = _lanes(tokens, starts, order, B)     # (a sample may score nothing)
        self.T = T
        self.x = tok
        self.y = np.where(scored, np.roll(tok, -1, axis=0), -1).astype(np.int32)
        self.steps_per_pass = max(1, math.ceil((len(tok) - 1) / T))
        self.scored_per_pass = int((self.y >= 0).sum())    # not the lanes' padding, nor a paragraph's last

    def batch(self, k: int) -> Batch:
        a = (k % self.steps_per_pass) * self.T
        x, y, r = self.x[a:a + self.T], self.y[a:a + self.T], self.reset[a:a + self.T].copy()
        if len(x) < self.T:   # the last chunk of a pass is padded and scores nothing past the end
            pad = self.T - len(x)
            x = np.concatenate([x, np.zeros((pad, x.shape[1]), np.int32)])
            y = np.concatenate([y, np.full((pad, y.shape[1]), -1, np.int32)])
            r = np.concatenate([r, np.zeros((pad, r.shape[1]), bool)])
        if k % self.steps_per_pass == 0:
            r[0] = True   # a new pass starts from zero state
        return Batch(x, y, r)


class WindowSource:
    """Windows of T + 1 tokens at ``offsets``, B per step, each from zero state."""

    def __init__(self, tokens, offsets, B, T):
        if len(offsets) == 0:
            raise TooShort(f"partition has {len(tokens)} tokens, fewer than one window of {T + 1}")
        self.tokens, self.offsets, self.B, self.T = tokens, offsets, B, T
        self.steps_per_pass = max(1, math.ceil(len(offsets) / B))
        self.scored_per_pass = len(offsets) * T                   # not the last step's slots past the end
        self._ar = np.arange(T + 1)
        self._reset = np.zeros((T, B), dtype=bool)
        self._reset[0] = True

    def batch(self, k: int) -> Batch:
        n = len(self.offsets)
        i = (k % self.steps_per_pass) * self.B + np.arange(self.B)
        past = i >= n                       # the last step of a pass: slots past the pool's end
        w = self.tokens[self.offsets[np.where(past, 0, i)][None, :] + self._ar[:, None]]     # (T + 1, B)
        y = w[1:]
        if past.any():
            y = np.where(past[None, :], -1, y).astype(np.int32)
        return Batch(w[:-1], y, self._reset)


def window_offsets(n_tokens: int, T: int, stride: int) -> np.ndarray:
    """Start offsets of every window of T + 1 tokens."""
    last = n_tokens - (T + 1)
    return np.arange(0, last + 1, stride, dtype=np.int64) if last >= 0 else np.zeros(0, np.int64)


class Source:
    """The batches of one partition under a strategy.

    Parameters
    ----------
    strategy : str
        One of :data:`STRATEGIES`.
    tokens : int32 array (n,)
    starts : int64 array
        Paragraph start offsets into ``tokens`` (first is 0).
    B, T : int
    stride, fraction : window stride and sample fraction
    seed, partition : int
        With the round, they seed the sampled strategies.
    """

    def __init__(self, strategy, tokens, starts, B, T, stride=1, fraction=0.1, seed=0, partition=0):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown data.strategy {strategy!r}")
        self.strategy, self.tokens, self.starts = strategy, tokens, np.asarray(starts, np.int64)
        self.B, self.T, self.fraction, self.seed, self.partition = B, T, fraction, seed, partition
        self.carries_state = strategy in CARRY_STATE
        if strategy in ("paragraphs", "sampled_paragraphs"):
            if len(self.starts) == 0:
                raise TooShort("partition has no paragraphs")
            if not (np.diff(np.append(self.starts, len(tokens))) >= 2).any():     # one-token paragraphs alone
                raise TooShort("partition has no paragraph of 2 or more tokens")
        if strategy == "streams":
            if len(tokens) // B < T + 1:
                raise TooShort(f"partition has {len(tokens)} tokens, fewer than {B} streams of {T + 1}")
            self._fixed = StreamBlock(tokens, B, T)
        elif strategy == "paragraphs":
            self._fixed = LaneSource(tokens, self.starts, B, T)
        elif strategy in ("windows", "sampled_windows"):
            self._offsets = window_offsets(len(tokens), T, stride)
            self._fixed = WindowSource(tokens, self._offsets, B, T)
        else:
            self._fixed = None
        self.steps_per_pass = self._fixed.steps_per_pass if self._fixed is not None else None

    def _rng(self, rnd):
        return np.random.default_rng(np.random.SeedSequence([self.seed, rnd, self.partition, _SAMPLE_KEY]))

    def _pool(self, items: int) -> int:
        return max(1, math.ceil(self.fraction * items))

    def round_source(self, rnd: int):
        """What the steps of round ``rnd`` read: the fixed source or this round's sample."""
        if self.strategy == "sampled_windows":
            pick = self._rng(rnd).choice(len(self._offsets), size=self._pool(len(self._offsets)), replace=False)
            return WindowSource(self.tokens, self._offsets[pick], self.B, self.T)
        if self.strategy == "sampled_paragraphs":
            pick = self._rng(rnd).choice(len(self.starts), size=self._pool(len(self.starts)), replace=False)
            return LaneSource(self.tokens, self.starts, self.B, self.T, order=pick)
        return self._fixed

    def round_batches(self, rnd: int, local_steps: int) -> list:
        """The batches of round ``rnd`` (from 1): ``local_steps`` consecutive steps of the
        fixed strategies (0 = one whole pass), or one pass over the round's sample."""
        src = self.round_source(rnd)
        if self.strategy.startswith("sampled") or local_steps == 0:
            return [src.batch(k) for k in range(src.steps_per_pass)]
        first = (rnd - 1) * local_steps
        return [src.batch(k) for k in range(first, first + local_steps)]

    def round_tokens(self, local_steps: int) -> float:
        """Expected tokens a round scores (what ``train.epochs`` and the ``epoch`` metric are counted
        in, against :meth:`epoch_tokens`: padding is not trained on)."""
        if self.strategy == "sampled_windows":
            return self._pool(len(self._offsets)) * self.T
        if self.strategy == "sampled_paragraphs":   # the pool's paragraphs, each scoring all but its last token
            return self._pool(len(self.starts)) / len(self.starts) * (len(self.tokens) - len(self.starts))
        per_pass = self._fixed.scored_per_pass
        return per_pass * local_steps / self.steps_per_pass if local_steps else per_pass

    def epoch_tokens(self) -> int:
        """An epoch's tokens: each target position a pass over the partition scores, counted once. For
        streams and paragraphs that is a pass (each position scored once); overlapping windows score a
        position up to T times a pass, so their epoch is the positions they cover. Not the partition's
        length: a pass of streams leaves each lane's last tokens out, and an epoch counted in the
        partition's tokens made ``train.epochs = 13`` of one-pass rounds train 14."""
        if self.strategy in ("windows", "sampled_windows"):
            gaps = np.diff(self._offsets)               # window_offsets: increasing
            return int(np.minimum(gaps, self.T).sum()) + self.T if len(self._offsets) else 0
        if self.strategy == "sampled_paragraphs":
            return len(self.tokens) - len(self.starts)
        return self._fixed.scored_per_pass
