"""The ``oracle_pool`` ceiling: one LRU memory of the whole fleet's KV capacity, shared by all.

When memory binds, an infinite cache (``oracle``) is the wrong ceiling: no router can hit blocks
the fleet had no room to keep. What a router *can* aim at is the fleet's memory used as one pool
(what an RDMA-pooled KV memory across nodes would give): every block any node computed stays
until the pool, holding the fleet's total capacity, evicts it as least recently used. A request's
leading blocks found in the pool are hits, whichever node computed them.

Recency follows vLLM's free-block order: a request's blocks are touched last-to-first, so the
head of a prefix is its most recent block and is evicted after its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PooledMemory:
    """LRU set of engine block hashes, ``capacity_blocks`` at most."""

    __slots__ = ("capacity", "_lru")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def hit(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` held; those are touched (used by this request)."""
        lru = self._lru
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        for h in reversed(hashes[:n]):
            lru.move_to_end(h)
        return n

    def store(self, hashes: Sequence[int]) -> None:
        """Blocks computed somewhere in the fleet; the least recently used go when the pool is full."""
        lru = self._lru
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
