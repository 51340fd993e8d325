"""Batch sources of the data strategies, the all-reduce value, and the downloader."""
import hashlib
import math
import pickle

import numpy as np
import pytest

from rnnlm import download
from rnnlm.exchange.aggregate import Aggregate
from rnnlm.exchange.round import SyncRound
from rnnlm.core.strategies import Source, TooShort

TOK = np.arange(100, dtype=np.int32)
STARTS = np.array([0, 30, 45, 80])          # paragraphs of 30, 15, 35, 20 tokens


def comb_op(a, b):
    """Fold ``b`` into ``a`` at once, as a tree node does when its value leaves it."""
    return a.merge(b)


def scored_windows(batches):
    """Start token of every scored window (column) in ``batches``; unscored columns score nothing."""
    starts = []
    for b in batches:
        assert b.x.shape == (9, 4) and b.reset[0].all() and not b.reset[1:].any()
        for col in range(b.x.shape[1]):
            if b.y[0, col] < 0:
                assert (b.y[:, col] == -1).all()            # a padded slot scores nothing at all
            else:
                assert np.array_equal(b.y[:, col], b.x[:, col] + 1)   # next token of the same window
                starts.append(int(b.x[0, col]))
    return starts


def test_windows_cover_every_offset_exactly_once_per_pass():
    src = Source("windows", TOK, STARTS, B=4, T=9, stride=3)
    expected = list(range(0, 100 - 10 + 1, 3))               # 31 windows of 10 tokens: 0, 3, ..., 90
    one_pass = src.round_batches(1, 0)                       # local_steps = 0: one whole pass
    assert len(one_pass) == 8                                # ceil(31 / 4): the last step has one padded slot
    assert scored_windows(one_pass) == expected              # each once, in order, none repeated
    # K local steps per round continue where the last round stopped, and wrap to a new pass
    k3 = [b for r in (1, 2, 3) for b in src.round_batches(r, 3)]
    assert scored_windows(k3[:8]) == expected and scored_windows(k3[8:]) == expected[:4]


def test_sampled_windows_train_on_the_whole_sample_seeded_per_round_and_partition():
    def pool(rnd, partition=1, fraction=0.2):
        src = Source("sampled_windows", TOK, STARTS, B=4, T=9, fraction=fraction, seed=7, partition=partition)
        return scored_windows(src.round_batches(rnd, 0))
    first = pool(3)
    assert len(first) == len(set(first)) == math.ceil(0.2 * 91)          # 91 windows at stride 1
    assert set(first) <= set(range(91))
    assert first == pool(3)                                              # a retried task draws the same
    assert set(first) != set(pool(4)) and set(first) != set(pool(3, partition=2))
    assert len(pool(3, fraction=0.5)) == math.ceil(0.5 * 91)             # the fraction sets the round's work
    assert sorted(pool(5, fraction=1.0)) == list(range(91))
    src = Source("sampled_windows", TOK, STARTS, B=4, T=9, fraction=0.2)
    assert src.round_tokens(0) == math.ceil(0.2 * 91) * 9


def test_paragraph_lanes_reset_at_starts_and_never_score_across():
    src = Source("paragraphs", TOK, STARTS, B=2, T=10)
    one_pass = src.round_batches(1, 0)
    assert len(one_pass) == src.steps_per_pass
    b0 = one_pass[0]
    xs = np.concatenate([b.x for b in one_pass])
    ys = np.concatenate([b.y for b in one_pass])
    rs = np.concatenate([b.reset for b in one_pass])
    assert b0.reset[0].all()
    for lane in range(2):
        for t in np.nonzero(rs[:, lane])[0]:
            assert xs[t, lane] in STARTS                        # a reset sits on a paragraph start
        scored = ys[:, lane] >= 0
        assert np.all(ys[scored, lane] == xs[scored, lane] + 1)  # within one paragraph
        ends = set((np.append(STARTS[1:], 100) - 1).tolist())
        assert not any(xs[t, lane] in ends for t in np.nonzero(scored)[0])
    assert (ys >= 0).sum() == 100 - 4                            # every in-paragraph successor once
    assert src.steps_per_pass == 5          # lanes of 30 + 20 and 15 + 35: 50 rows, 49 successors in chunks of 10


def paragraphs_in(batches):
    """Paragraph ids whose first token starts a lane segment, and the tokens scored."""
    firsts = [int(b.x[t, lane]) for b in batches for t, lane in zip(*np.nonzero(b.reset))
              if int(b.x[t, lane]) in STARTS]
    return sorted(STARTS.tolist().index(f) for f in firsts), sum(int((b.y >= 0).sum()) for b in batches)


def test_sampled_paragraphs_train_on_the_whole_sample():
    lengths = np.diff(np.append(STARTS, 100))
    seen = []
    for rnd in range(1, 9):
        src = Source("sampled_paragraphs", TOK, STARTS, B=2, T=10, fraction=0.5, seed=1)
        picked, scored = paragraphs_in(src.round_batches(rnd, 0))
        assert len(picked) == 2 and len(set(picked)) == 2               # ceil(0.5 * 4) paragraphs, each once
        assert scored == sum(lengths[i] - 1 for i in picked)             # every in-paragraph successor once
        assert (picked, scored) == paragraphs_in(src.round_batches(rnd, 0))
        seen.append(tuple(picked))
    assert len(set(seen)) > 1                                            # rounds draw different samples
    whole = Source("sampled_paragraphs", TOK, STARTS, B=2, T=10, fraction=1.0, seed=1)
    assert paragraphs_in(whole.round_batches(1, 0)) == ([0, 1, 2, 3], 100 - 4)


@pytest.mark.parametrize("strategy, local_steps", [("streams", 3), ("streams", 0), ("paragraphs", 2),
                                                   ("paragraphs", 0), ("windows", 0), ("windows", 3),
                                                   ("sampled_windows", 0)])
def test_round_tokens_counts_what_a_round_trains_on(strategy, local_steps):
    """What ``train.epochs`` is counted in, as the ``epoch`` metric counts: the targets a round scores,
    not its padding (the lanes' ends, a paragraph's last token, the last step's slots past the windows).
    Counting every position made ``epochs = 10`` of short paragraphs train 4 passes."""
    src = Source(strategy, TOK, STARTS, B=2, T=9, fraction=0.3, seed=1)
    if local_steps == 0 or strategy.startswith("sampled"):
        batches = src.round_batches(1, local_steps)
    else:              # rounds of local_steps that cover whole passes: their mean is the expectation
        rounds = src.steps_per_pass // math.gcd(src.steps_per_pass, local_steps)
        batches = [b for r in range(1, rounds + 1) for b in src.round_batches(r, local_steps)]
        assert len(batches) % src.steps_per_pass == 0
    scored = sum(int((b.y >= 0).sum()) for b in batches)
    assert src.round_tokens(local_steps) * len(batches) / max(1, local_steps or len(batches)) == \
        pytest.approx(scored, rel=1e-12)
    if strategy == "streams":
        assert scored == sum(b.x.size for b in batches)
    if strategy == "paragraphs":
        assert Source(strategy, TOK, STARTS, B=2, T=9).round_tokens(0) == 100 - 4    # each paragraph's last
        assert scored < sum(b.x.size for b in batches)


@pytest.mark.parametrize("strategy, stride", [("streams", 1), ("paragraphs", 1), ("windows", 1), ("windows", 4),
                                              ("windows", 9), ("windows", 13), ("sampled_windows", 4),
                                              ("sampled_paragraphs", 1)])
def test_an_epoch_is_each_target_position_a_pass_scores_once(strategy, stride):
    """``train.epochs`` and the ``epoch`` metric: streams and paragraphs score each position once a pass,
    and fewer positions than the partition holds (so its length was more than a pass); overlapping windows
    score a position up to T times a pass, and an epoch is the positions they cover."""
    src = Source(strategy, TOK, STARTS, B=2, T=9, stride=stride, fraction=1.0, seed=1)
    scored = sum(int((b.y >= 0).sum()) for b in src.round_batches(1, 0))
    if "windows" in strategy:       # the targets of windows starting every stride-th token: (start, start + 9]
        covered = {p for start in range(0, len(TOK) - 10 + 1, stride) for p in range(start + 1, start + 10)}
        assert src.epoch_tokens() == len(covered) <= scored
        assert (src.epoch_tokens() == scored) == (stride >= 9)
    else:
        assert src.epoch_tokens() == scored < len(TOK)
    if not strategy.startswith("sampled"):
        assert src.round_tokens(0) == scored


def test_round_tokens_of_sampled_paragraphs_is_the_samples_expected_score():
    """Two of the four paragraphs a round (half, rounded up), each scoring all but its last token:
    2 x (100 - 4) / 4 = 48 expected (the fraction of all tokens, 50, counted the last tokens)."""
    lengths = np.diff(np.append(STARTS, 100))
    src = Source("sampled_paragraphs", TOK, STARTS, B=2, T=10, fraction=0.5, seed=1)
    drawn = [sum(lengths[i] - 1 for i in paragraphs_in(src.round_batches(rnd, 0))[0]) for rnd in range(1, 41)]
    scored = [sum(int((b.y >= 0).sum()) for b in src.round_batches(rnd, 0)) for rnd in range(1, 41)]
    assert drawn == scored and src.round_tokens(0) == 48.0 and abs(np.mean(scored) - 48.0) < 5
    odd = Source("sampled_paragraphs", TOK, STARTS, B=2, T=10, fraction=0.3, seed=1)     # 1.2 paragraphs: 2
    assert odd.round_tokens(0) == 48.0


def test_paragraphs_that_cannot_score_are_too_short_not_a_round_of_nothing():
    """B or more one-token paragraphs (blank lines at character level) filled lanes that scored
    nothing: the run counted 0 tokens a round and divided by it."""
    ones = np.arange(6, dtype=np.int32)
    for strategy in ("paragraphs", "sampled_paragraphs"):
        with pytest.raises(TooShort, match="no paragraph of 2 or more tokens"):
            Source(strategy, ones, np.arange(6), B=2, T=3, fraction=1.0, seed=1)
    # a sample that draws only one-token paragraphs is a round that scores nothing, not a failed task
    mixed = Source("sampled_paragraphs", np.arange(8, dtype=np.int32), np.array([0, 1, 2, 3, 4, 5]), B=2, T=3,
                   fraction=0.2, seed=1)           # five of one token, one of three
    rounds = [mixed.round_batches(r, 0) for r in range(1, 30)]
    scored = [sum(int((b.y >= 0).sum()) for b in bs) for bs in rounds]
    assert 0 in scored and 2 in scored and set(scored) == {0, 2}


def test_too_short():
    with pytest.raises(TooShort):
        Source("windows", TOK[:5], np.array([0]), B=2, T=9)
    with pytest.raises(TooShort):
        Source("streams", TOK[:15], np.array([0]), B=2, T=9)


def test_the_smallest_partition_each_strategy_takes_trains_and_one_token_less_is_too_short():
    """Streams of exactly T + 1 tokens, one window of T + 1 (its step's other slot padded), one paragraph
    of 2 tokens, a sample of one paragraph: each makes whole (T, B) batches; one token fewer is refused."""
    for strategy, n in (("streams", 20), ("windows", 10), ("sampled_windows", 10), ("paragraphs", 2),
                        ("sampled_paragraphs", 2)):
        src = Source(strategy, TOK[:n], np.array([0]), B=2, T=9, fraction=0.5, seed=1)
        batches = src.round_batches(1, 0)
        assert all(b.x.shape == b.y.shape == b.reset.shape == (9, 2) for b in batches), strategy
        scored = sum(int((b.y >= 0).sum()) for b in batches)
        assert scored == {"streams": 18, "paragraphs": 1, "sampled_paragraphs": 1}.get(strategy, 9), strategy
        with pytest.raises(TooShort):
            Source(strategy, TOK[:n - 1], np.array([0]), B=2, T=9, fraction=0.5, seed=1).round_batches(1, 0)
    # 18 tokens a stream: one chunk of 9 and its successors; a second chunk would lack its last successor
    assert Source("streams", TOK[:36], np.array([0]), B=2, T=9).steps_per_pass == 1


def leaf(w, v, pid):
    return Aggregate.contribution(w, {"p": np.full(3, v, np.float32)}, {pid: {"s": pid}}, words=[pid + 1, 9],
                                  tokens=int(w), loss_sum=float(w) / 2, steps=1, compute_s=pid / 10)


def test_aggregate_is_the_weighted_mean_whatever_the_order():
    vals = [(3, 0.1), (5, -2.5), (7, 1e-3), (11, 4.0)]
    ref = sum(w * np.float64(np.float32(v)) for w, v in vals) / sum(w for w, _ in vals)
    orders = [[0, 1, 2, 3], [3, 1, 0, 2]]
    outs = []
    for order in orders:
        acc = Aggregate()
        for i in order:
            acc = comb_op(acc, leaf(vals[i][0], vals[i][1], i))
        outs.append(acc)
    tree = comb_op(comb_op(leaf(*vals[0], 0), leaf(*vals[1], 1)), comb_op(leaf(*vals[2], 2), leaf(*vals[3], 3)))
    for a in outs + [tree]:
        assert np.array_equal(a.mean("p"), outs[0].mean("p"))
        assert a.mean("p")[0] == np.float32(ref)
        assert a.stats == {"tokens": 26, "loss_sum": 13.0, "steps": 4, "compute_s": 0.3}     # the zero value adds none
        assert sorted(a.local) == [0, 1, 2, 3] and a.words.tolist() == [1, 2, 3, 4, 9] and a.wire_bytes == 0


def test_a_failed_partition_merges_with_healthy_ones_at_any_depth():
    vals = {0: (3, 0.5), 1: (5, -1.0), 3: (2, 4.0)}
    failed = SyncRound.failed(2, "loss became nan at local step 1")
    hop = lambda a: pickle.loads(pickle.dumps(a))          # noqa: E731  (a hop between processes)
    parts = lambda: {**{pid: hop(leaf(w, v, pid)) for pid, (w, v) in vals.items()}, 2: hop(failed)}  # noqa: E731
    ref = sum(w * np.float64(np.float32(v)) for w, v in vals.values()) / 10
    trees = [lambda p: comb_op(comb_op(p[0], p[1]), comb_op(p[2], p[3])),
             lambda p: comb_op(hop(comb_op(hop(comb_op(p[2], p[0])), p[1])), p[3]),     # the failure at the bottom
             lambda p: comb_op(p[0], hop(comb_op(p[1], hop(comb_op(p[3], p[2]))))),
             lambda p: comb_op(comb_op(comb_op(comb_op(Aggregate(), p[2]), p[1]), p[3]), p[0])]
    for tree in trees:
        a = tree(parts())
        assert a.errors() == ["partition 2: loss became nan at local step 1"]
        assert a.mean("p")[0] == np.float32(ref) and a.weight == 10
        assert sorted(a.local) == [0, 1, 2, 3] and a.stats["tokens"] == 10


def test_wire_bytes_count_every_pickled_hop():
    a = leaf(2, 1.0, 0)
    once = pickle.loads(pickle.dumps(a))
    assert once.wire_bytes > 12 and once.mean("p")[0] == 1.0
    twice = pickle.loads(pickle.dumps(once))
    assert twice.wire_bytes > once.wire_bytes
    other = pickle.loads(pickle.dumps(leaf(2, 3.0, 1)))
    expected = once.wire_bytes + other.wire_bytes
    merged = comb_op(once, other)                          # merges in place into ``once``
    assert merged.wire_bytes == expected and merged.mean("p")[0] == 2.0


def test_downloader_mirror_checksums(tmp_path, monkeypatch):
    data = b"hello corpus\n"
    entry = ("https://example.invalid/toy.txt", hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(download.CORPORA, "toy", {"toy.txt": entry})
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "toy.txt").write_bytes(data)
    dest = tmp_path / "data"
    assert download.fetch("toy", str(dest), str(mirror), log=lambda s: None) == [str(dest / "toy.txt")]
    assert (dest / "toy.txt").read_bytes() == data
    (mirror / "toy.txt").write_bytes(b"hellO corpus\n")              # its size, not its bytes
    (dest / "toy.txt").unlink()
    with pytest.raises(download.DownloadError, match="checksum mismatch"):
        download.fetch("toy", str(dest), str(mirror), log=lambda s: None)
    assert list(dest.iterdir()) == []                     # nothing half-written is left
    with pytest.raises(download.DownloadError, match="unknown corpus"):
        download.fetch("nope", str(dest))


def test_shared_corpora_verify(tmp_path, shared_data):
    paths = download.fetch("tinyshakespeare", str(tmp_path), shared_data, log=lambda s: None)
    train, valid = open(paths[1]).read(), open(paths[2]).read()
    assert train + valid == open(paths[0]).read() and train.endswith("\n\n") and 0.85 < len(train) / 1115394 < 0.9
