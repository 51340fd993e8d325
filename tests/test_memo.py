"""The executors' memo (rnnlm/spark/memo.py): what it keeps, what it evicts, and the names of its keys."""
import numpy as np

from rnnlm.spark.memo import Memo, digest


def test_get_builds_once_and_the_least_recently_used_entry_leaves_first():
    built = []
    m = Memo(size=2)

    def build(v):
        return lambda: built.append(v) or v
    assert [m.get("a", build(1)), m.get("a", build(9)), m.get("b", build(2))] == [1, 1, 2]
    assert m.get("c", build(3)) == 3                 # full: "a", the least recently used, leaves
    assert list(m.entries) == ["b", "c"] and built == [1, 2, 3]
    assert m.get("b", build(8)) == 2                 # a hit makes "b" the most recent: "c" leaves next
    assert m.get("a", build(4)) == 4 and list(m.entries) == ["b", "a"] and built == [1, 2, 3, 4]
    assert m.pop("b") == 2 and m.pop("b", "gone") == "gone"
    m.clear()
    assert m.entries == {}


def test_a_digest_names_each_array_whole_not_the_concatenation_of_their_bytes():
    """A partition's source is memoised under digest(tokens, starts): two partitions whose bytes
    join the same way, or the same bytes in another dtype or shape, are different data."""
    tokens, starts = np.array([4, 5, 6, 7], np.int32), np.array([0, 2], np.int64)
    assert digest(tokens, starts) == digest(tokens.copy(), np.array([0, 2]))
    assert digest(tokens, starts) == digest(np.array([[4, 5, 6, 7]], np.int32)[0], starts)
    assert digest(np.arange(8, dtype=np.int32)[::2], starts) == digest(np.array([0, 2, 4, 6], np.int32), starts)
    others = [
        (np.array([4, 5, 6], np.int32), np.array([7], np.int32).view(np.int32), starts),   # the split moves
        (tokens.view(np.float32), starts),                                                 # same bytes, other dtype
        (tokens.reshape(2, 2), starts),                                                    # same bytes, other shape
        (tokens, starts[::-1].copy()),
    ]
    names = {digest(tokens, starts)} | {digest(*o) for o in others}
    assert len(names) == 1 + len(others)
    assert digest(np.array([4, 5], np.int32), np.array([6, 7], np.int32)) != \
        digest(np.array([4], np.int32), np.array([5, 6, 7], np.int32))
