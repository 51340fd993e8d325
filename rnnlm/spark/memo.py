"""A Python worker's memo of what tasks derive from their inputs alone (the model with its
buffers, a partition's batch source, the executors' view of the parameters): results never
depend on it, only start-up time does. Keys name their inputs exactly (:func:`digest`)."""
from __future__ import annotations

import hashlib

import numpy as np

SIZE = 8


class Memo:
    """A small cache of at most ``size`` entries; the least recently used leaves first (the model,
    which every task reads, stays while a worker's partitions and views come and go)."""

    def __init__(self, size: int = SIZE):
        self.size, self.entries = size, {}

    def get(self, key, build):
        """The value under ``key``, built by ``build()`` on first use."""
        if key in self.entries:
            value = self.entries.pop(key)          # re-inserted: now the most recently used
        else:
            value = build()
        self.put(key, value)
        return value

    def pop(self, key, default=None):
        return self.entries.pop(key, default)

    def put(self, key, value) -> None:
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = value

    def clear(self) -> None:
        self.entries.clear()


# The worker process's. Task closures must reach it as ``memo.MEMO`` (a module attribute): a
# closure that names it directly is pickled with a copy of it, so every task would start empty.
MEMO = Memo()


def digest(*arrays) -> str:
    """Names a partition's data exactly (a sample of it could collide); hashing is ~1 GB/s. Each
    array's dtype and shape go in before its bytes, so that where one array ends is part of the name."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape};".encode())
        h.update(a.data)
    return h.hexdigest()
