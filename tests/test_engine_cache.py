"""The simulated engine's paged prefix cache: capacity, references, prefix closure, LRU leaves first."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenizer.keys import block_keys
from workers.engine.kv_cache import (
    BlocksRemoved,
    BlocksStored,
    CacheBusy,
    CacheCleared,
    PrefixCache,
    engine_block_hashes,
    root_hash,
)

BS = 4
ROOT = root_hash()


def chain(tokens: list[int]) -> tuple[list[int], np.ndarray]:
    arr = np.asarray(tokens, dtype=np.uint32)
    return engine_block_hashes(arr, block_size=BS, parent=ROOT), arr


def admit(cache: PrefixCache, tokens: list[int], now: float) -> list[int] | None:
    """A request's life up to its prefill: pin the hit, reserve the rest, commit it."""
    hashes, arr = chain(tokens)
    hit = cache.match(hashes)
    need = len(hashes) - hit
    if not cache.can_reserve(need, pinning=hashes[:hit]):
        return None
    cache.pin(hashes[:hit], now)
    assert cache.reserve(need)
    keys = block_keys(arr, block_size=BS, seed=1)
    cache.commit(hashes[hit:], keys[hit:], hashes[hit - 1] if hit else None, arr[hit * BS :], hit, now)
    return hashes


def test_engine_hash_is_not_kvgate_key_but_chains_the_same_way() -> None:
    arr = np.arange(16, dtype=np.uint32)
    h = engine_block_hashes(arr, block_size=BS, parent=ROOT)
    assert len(h) == 4
    assert h[2:] == engine_block_hashes(arr, block_size=BS, parent=h[1], start_block=2)
    assert set(h).isdisjoint(block_keys(arr, block_size=BS, seed=ROOT))
    assert engine_block_hashes(arr, block_size=BS, parent=root_hash(cache_salt="x")) [0] != h[0]


def test_second_request_hits_and_shares_blocks() -> None:
    cache = PrefixCache(10, BS)
    a = admit(cache, list(range(12)), 1.0)
    assert a is not None and len(cache) == 3
    cache.unpin(a, 2.0)
    b_hashes, _ = chain(list(range(8)) + [99, 98, 97, 96])
    assert cache.match(b_hashes) == 2  # shared first two blocks, then a miss
    b = admit(cache, list(range(8)) + [99, 98, 97, 96], 3.0)
    assert b is not None and len(cache) == 4
    events = cache.drain_events()
    assert [type(e) for e in events] == [BlocksStored, BlocksStored]
    second = events[1]
    assert isinstance(second, BlocksStored)
    assert second.parent_block_hash == a[1] and second.token_ids == (99, 98, 97, 96)
    cache.check_invariants()


def test_lru_evicts_least_recent_leaf_first_and_keeps_prefix_closure() -> None:
    cache = PrefixCache(4, BS)
    old = admit(cache, list(range(8)), 1.0)  # blocks A0 <- A1
    assert old is not None
    cache.unpin(old, 1.0)
    new = admit(cache, [50 + i for i in range(8)], 2.0)  # blocks B0 <- B1
    assert new is not None
    cache.unpin(new, 2.0)
    cache.drain_events()
    assert cache.reserve(1)  # must evict: the LRU leaf is A1, not its parent A0, not B*
    assert old[1] not in cache and old[0] in cache and new[0] in cache and new[1] in cache
    assert cache.reserve(1)  # then A0, now a leaf
    assert old[0] not in cache
    removed = [e for e in cache.drain_events() if isinstance(e, BlocksRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [old[1], old[0]]
    cache.check_invariants()


def test_referenced_blocks_are_never_evicted() -> None:
    cache = PrefixCache(3, BS)
    held = admit(cache, list(range(12)), 1.0)
    assert held is not None
    assert not cache.reserve(1)  # every block is referenced: nothing can go
    assert cache.match(held) == 3
    cache.unpin(held, 2.0)
    assert cache.reserve(3) and len(cache) == 0


def test_clear_refuses_while_busy_then_records_clear() -> None:
    cache = PrefixCache(8, BS)
    held = admit(cache, list(range(8)), 1.0)
    assert held is not None
    with pytest.raises(CacheBusy):
        cache.clear()
    cache.unpin(held, 2.0)
    cache.drain_events()
    assert cache.clear() == 2 and len(cache) == 0
    assert cache.drain_events() == [CacheCleared()]


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixCache(0, BS)
    cache = PrefixCache(2, BS)
    with pytest.raises(ValueError):
        cache.release_private(1)


class CacheMachine(RuleBasedStateMachine):
    """Random request lives over a small alphabet (so prefixes are shared and evictions frequent)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(12, BS)
        self.live: list[list[int]] = []
        self.private = 0
        self.now = 0.0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=BS, max_size=6 * BS))
    def start_request(self, tokens: list[int]) -> None:
        self.now += 1
        before = set(h for req in self.live for h in req)
        hashes = admit(self.cache, tokens, self.now)
        if hashes is not None:
            self.live.append(hashes)
        for h in before:  # blocks in use survived whatever eviction the admission needed
            assert h in self.cache

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        self.now += 1
        i = data.draw(st.integers(0, len(self.live) - 1))
        self.cache.unpin(self.live.pop(i), self.now)

    @rule(n=st.integers(1, 4))
    def reserve_private(self, n: int) -> None:
        if self.cache.reserve(n):
            self.private += n

    @precondition(lambda self: self.private)
    @rule()
    def release_private(self) -> None:
        self.cache.release_private(self.private)
        self.private = 0

    @invariant()
    def structure_holds(self) -> None:
        self.cache.check_invariants()  # capacity, prefix closure, counts
        stats = self.cache.stats()
        assert stats.hashed_blocks + stats.private_blocks <= stats.capacity_blocks
        for req in self.live:
            assert self.cache.match(req) == len(req)  # referenced chains are whole


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
