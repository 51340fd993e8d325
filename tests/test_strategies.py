"""Batch sources of the data strategies, the all-reduce value, and the downloader."""
import hashlib
import pickle

import numpy as np
import pytest

from rnnlm import download
from rnnlm.aggregate import Aggregate, merge as comb_op
from rnnlm.strategies import Source, TooShort, window_offsets

TOK = np.arange(100, dtype=np.int32)
STARTS = np.array([0, 30, 45, 80])          # paragraphs of 30, 15, 35, 20 tokens


def test_windows_cover_every_offset_once_per_pass():
    src = Source("windows", TOK, STARTS, B=4, T=9, stride=3)
    offs = window_offsets(100, 9, 3)
    assert offs[0] == 0 and offs[-1] <= 90 and np.all(np.diff(offs) == 3)
    seen = []
    for k in range(src.steps_per_pass):
        b = src.round_source(1).batch(k)
        assert b.x.shape == (9, 4) and np.array_equal(b.y, b.x + 1)   # next token of the same window
        assert b.reset[0].all() and not b.reset[1:].any()
        seen += list(b.x[0])
    assert set(seen) == set(offs.tolist())


def test_sampled_windows_are_seeded_per_round_and_partition():
    a = Source("sampled_windows", TOK, STARTS, B=4, T=9, fraction=0.2, seed=7, partition=1)
    b = Source("sampled_windows", TOK, STARTS, B=4, T=9, fraction=0.2, seed=7, partition=1)
    first = [x.x for x in a.batches(3, 0, 5)]
    assert all(np.array_equal(p, q) for p, q in zip(first, [x.x for x in b.batches(3, 0, 5)]))
    other_round = [x.x for x in a.batches(4, 0, 5)]
    other_part = Source("sampled_windows", TOK, STARTS, B=4, T=9, fraction=0.2, seed=7, partition=2)
    assert not all(np.array_equal(p, q) for p, q in zip(first, other_round))
    assert not all(np.array_equal(p, q) for p, q in zip(first, [x.x for x in other_part.batches(3, 0, 5)]))
    starts = {int(s) for x in a.batches(3, 0, 50) for s in x.x[0]}
    assert len(starts) == int(np.ceil(0.2 * len(window_offsets(100, 9, 1))))   # the round's pool


def test_paragraph_lanes_reset_at_starts_and_never_score_across():
    src = Source("paragraphs", TOK, STARTS, B=2, T=10)
    b0 = src.batches(1, 0, 1)[0]
    xs = np.concatenate([b.x for b in src.batches(1, 0, src.steps_per_pass)])
    ys = np.concatenate([b.y for b in src.batches(1, 0, src.steps_per_pass)])
    rs = np.concatenate([b.reset for b in src.batches(1, 0, src.steps_per_pass)])
    assert b0.reset[0].all()
    for lane in range(2):
        for t in np.nonzero(rs[:, lane])[0]:
            assert xs[t, lane] in STARTS                        # a reset sits on a paragraph start
        scored = ys[:, lane] >= 0
        assert np.all(ys[scored, lane] == xs[scored, lane] + 1)  # within one paragraph
        ends = set((np.append(STARTS[1:], 100) - 1).tolist())
        assert not any(xs[t, lane] in ends for t in np.nonzero(scored)[0])
    assert (ys >= 0).sum() == 100 - 4                            # every in-paragraph successor once


def test_sampled_paragraphs_and_too_short():
    a = Source("sampled_paragraphs", TOK, STARTS, B=2, T=10, fraction=0.5, seed=1)
    assert np.array_equal(a.batches(2, 0, 1)[0].x, a.batches(2, 0, 1)[0].x)
    with pytest.raises(TooShort):
        Source("windows", TOK[:5], np.array([0]), B=2, T=9)
    with pytest.raises(TooShort):
        Source("streams", TOK[:15], np.array([0]), B=2, T=9)


def leaf(w, v, pid):
    return Aggregate.contribution(w, {"p": np.full(3, v, np.float32)}, {pid: {"s": pid}},
                                  tokens=int(w), loss_sum=float(w), steps=1, compute_s=float(pid))


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
        assert a.stats["tokens"] == 26 and a.stats["compute_s"] == 3.0 and sorted(a.local) == [0, 1, 2, 3]


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
    entry = ("https://example.invalid/toy.txt", hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(download.CORPORA, "toy", {"toy.txt": entry})
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "toy.txt").write_bytes(data)
    dest = tmp_path / "data"
    assert download.fetch("toy", str(dest), str(mirror), log=lambda s: None) == [str(dest / "toy.txt")]
    assert (dest / "toy.txt").read_bytes() == data
    (mirror / "toy.txt").write_bytes(b"tampered\n")
    (dest / "toy.txt").unlink()
    with pytest.raises(download.DownloadError, match="checksum mismatch"):
        download.fetch("toy", str(dest), str(mirror), log=lambda s: None)
    assert list(dest.iterdir()) == []                     # nothing half-written is left
    with pytest.raises(download.DownloadError, match="unknown corpus"):
        download.fetch("nope", str(dest))


def test_shared_corpora_verify(tmp_path):
    import os
    shared = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
    if not os.path.isdir(shared):
        pytest.skip("../shared/data is not beside the checkout")
    paths = download.fetch("tinyshakespeare", str(tmp_path), shared, log=lambda s: None)
    train, valid = open(paths[1]).read(), open(paths[2]).read()
    assert train + valid == open(paths[0]).read() and train.endswith("\n\n") and 0.85 < len(train) / 1115394 < 0.9
