"""A byte-bounded, thread-safe LRU map from text segments to their token IDs.

The bound is on memory, not entry count, because segments range from one word to a whole
32k-token document. An entry is accounted at what it really costs the process: its token array
(4 bytes a token), the text of a key that is kept, and a fixed ``ENTRY_OVERHEAD_BYTES`` for the
Python objects around them (array header, map slot, tuple, digest: ~360 bytes measured with
tracemalloc). Counting only text and tokens let prompts of many short pieces (each piece one
entry) grow the process 38× past the bound; with the overhead counted the entry count is bounded
too, by ``capacity_bytes / ENTRY_OVERHEAD_BYTES``. One lock
guards the map: the event loop and the tokenizer thread pool read and fill it at once, and every
operation under the lock is O(number of keys), never a tokenization.

An ASCII key is held as its 128-bit xxh3 digest, not as text: a prompt's pieces are new strings
every request, and hashing a 30k-character one the Python way costs ~7 µs where encoding and
xxh3 cost ~2 (the text is not kept, so it costs nothing). Other keys stay strings, accounted at
their ``sys.getsizeof``: for them Python's hash is the faster one.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

_digest = xxhash.xxh3_128_intdigest
ENTRY_OVERHEAD_BYTES = 384
"""Bytes one entry costs besides its token data and key text (measured with tracemalloc: 360 for a one-token entry; 112 array header, ~210
map slot + ordering node + tuple + 128-bit digest + the cost's int; rounded up)."""


def _slot(key: str) -> int | str:
    """What the map is keyed by (see the module docstring)."""
    return _digest(key.encode("ascii")) if key.isascii() else key


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since construction; ``bytes`` is the current accounted size."""

    hits: int
    misses: int
    bytes: int
    entries: int
    capacity_bytes: int

    def __iter__(self):  # lets callers write ``hits, misses, size = stats`` as the contract says
        return iter((self.hits, self.misses, self.bytes))


def entry_cost(key: str, value: np.ndarray) -> int:
    """Accounted bytes of one entry: its fixed overhead, its tokens, and its key if kept as text."""
    kept_key = 0 if key.isascii() else sys.getsizeof(key)
    return ENTRY_OVERHEAD_BYTES + 4 * len(value) + kept_key


class ByteBoundedLRU:
    """Least-recently-used eviction once the accounted bytes exceed ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self._capacity = capacity_bytes
        self._data: OrderedDict[int | str, tuple[np.ndarray, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[str]) -> list[np.ndarray | None]:
        """Look up several keys under one lock acquisition; hits become most recent."""
        out: list[np.ndarray | None] = []
        slots = [_slot(k) for k in keys]
        with self._lock:
            data = self._data
            hits = 0
            for key in slots:
                entry = data.get(key)
                if entry is None:
                    out.append(None)
                else:
                    data.move_to_end(key)
                    out.append(entry[0])
                    hits += 1
            self._hits += hits
            self._misses += len(keys) - hits
        return out

    def count_hits(self, n: int) -> None:
        """Count segments found elsewhere (kept with a chat's chunk) as hits: the metric is what
        was not tokenized again, wherever the IDs were kept."""
        with self._lock:
            self._hits += n

    def get(self, key: str) -> np.ndarray | None:
        return self.get_many((key,))[0]

    def put_many(self, items: Iterable[tuple[str, np.ndarray]]) -> None:
        """Insert entries (costs computed outside the lock), then evict the oldest to fit."""
        costed = [(_slot(k), v, entry_cost(k, v)) for k, v in items]
        with self._lock:
            data = self._data
            for key, value, cost in costed:
                if cost > self._capacity:
                    continue  # would evict everything and still not fit
                old = data.pop(key, None)
                if old is not None:
                    self._bytes -= old[1]
                data[key] = (value, cost)
                self._bytes += cost
            while self._bytes > self._capacity:
                _, (_, cost) = data.popitem(last=False)
                self._bytes -= cost

    def put(self, key: str, value: np.ndarray) -> None:
        self.put_many(((key, value),))

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: str) -> bool:
        slot = _slot(key)
        with self._lock:
            return slot in self._data

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._bytes, len(self._data), self._capacity)
