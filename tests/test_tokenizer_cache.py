"""The byte-bounded LRU behind the segment cache."""

from __future__ import annotations

import sys
import threading
import tracemalloc

import numpy as np
import pytest

from tokenizer.encoder import _frozen
from tokenizer.lru import ENTRY_OVERHEAD_BYTES, ByteBoundedLRU, entry_cost


def ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint32)


def test_cost_counts_overhead_tokens_and_kept_key_text() -> None:
    assert entry_cost("abc", ids(5)) == ENTRY_OVERHEAD_BYTES + 20  # ASCII keys are kept as digests
    assert entry_cost("日本", ids(1)) == ENTRY_OVERHEAD_BYTES + 4 + sys.getsizeof("日本")
    cache = ByteBoundedLRU(10_000)
    cache.put("日本", ids(3))
    cache.put("x", ids(0))
    assert cache.stats.bytes == 2 * ENTRY_OVERHEAD_BYTES + 12 + sys.getsizeof("日本")


@pytest.mark.parametrize("prefix", ["k", "é"])
def test_accounted_bytes_cover_what_the_entries_really_take(prefix: str) -> None:
    """Many one-token entries (the short-pieces attack): memory traced while filling the cache is
    at most what it accounts, so its bound holds in the process, not only on paper."""
    cache = ByteBoundedLRU(1 << 30)
    keys = [f"{prefix}{i:07d}" for i in range(50_000)]
    tracemalloc.start()
    try:
        cache.put_many((k, _frozen([i])) for i, k in enumerate(keys))
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    kept_keys = 0 if prefix.isascii() else sum(map(sys.getsizeof, keys))  # allocated before tracing
    assert traced + kept_keys <= cache.stats.bytes, (traced, cache.stats.bytes)
    assert cache.stats.bytes <= 1.3 * (traced + kept_keys)  # and not wildly more


def test_evicts_least_recently_used_to_stay_within_bound() -> None:
    cache = ByteBoundedLRU(3 * entry_cost("a", ids(10)))
    for key in "abc":
        cache.put(key, ids(10))
    assert cache.get("a") is not None  # a becomes most recent; b is now the oldest
    cache.put("d", ids(10))
    assert "b" not in cache and all(k in cache for k in "acd")
    assert cache.stats.bytes <= cache.stats.capacity_bytes
    assert cache.stats.entries == 3


def test_replacing_a_key_does_not_double_count() -> None:
    cache = ByteBoundedLRU(10_000)
    cache.put("k", ids(10))
    cache.put("k", ids(3))
    assert cache.stats.bytes == ENTRY_OVERHEAD_BYTES + 12 and len(cache) == 1
    assert cache.get("k").tolist() == [0, 1, 2]


def test_entry_larger_than_the_bound_is_not_stored_and_evicts_nothing() -> None:
    cache = ByteBoundedLRU(ENTRY_OVERHEAD_BYTES + 100)
    cache.put("small", ids(2))
    cache.put("huge", ids(100))
    assert "huge" not in cache and "small" in cache


def test_hit_and_miss_counters_and_tuple_unpacking() -> None:
    cache = ByteBoundedLRU(10_000)
    cache.put("a", ids(1))
    assert [x is None for x in cache.get_many(["a", "b", "a", "c"])] == [False, True, False, True]
    hits, misses, size = cache.stats
    assert (hits, misses, size) == (2, 2, ENTRY_OVERHEAD_BYTES + 4)
    cache.clear()
    assert cache.stats.bytes == 0 and len(cache) == 0 and cache.stats.hits == 2


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError):
        ByteBoundedLRU(-1)


def test_concurrent_use_keeps_accounting_exact() -> None:
    cache = ByteBoundedLRU(5_000)
    errors: list[BaseException] = []
    lookups = [0] * 4

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2_000):
                key = f"k{rng.integers(0, 200)}"
                if rng.random() < 0.5:
                    cache.put(key, ids(int(rng.integers(0, 30))))
                else:
                    cache.get_many([key, f"k{rng.integers(0, 200)}"])
                    lookups[seed] += 2
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = cache.stats
    assert stats.hits + stats.misses == sum(lookups)  # no lost updates under the lock
    assert stats.bytes <= 5_000
    with cache._lock:  # recompute from the entries themselves
        assert stats.bytes == sum(cost for _, cost in cache._data.values())


def test_long_ascii_and_non_ascii_keys_are_told_apart() -> None:
    """ASCII keys are held as digests, others as text: lookups must not care which."""
    cache = ByteBoundedLRU(1 << 20)
    doc = "paragraph " * 3000
    cache.put(doc, ids(3))
    cache.put(doc + "!", ids(4))
    cache.put("日本" + doc, ids(5))
    assert [len(x) for x in cache.get_many([doc, doc + "!", "日本" + doc])] == [3, 4, 5]
    assert cache.get(doc[:-1]) is None and doc in cache and "日本" not in cache
    assert cache.stats.bytes == sum(entry_cost(k, ids(n)) for k, n in ((doc, 3), (doc + "!", 4), ("日本" + doc, 5)))
