"""What a request costs the fleet's KV memory, in seconds, so the cost model can weigh it.

When the working set outgrows the fleet's memory, every block a request adds to a full node
evicts a block of somebody else's prefix, which a later request then prefills again. Sending a
request away from the node that holds its prefix (to recompute there, or to pull a copy) adds the
prefix a second time: cheaper for this request when the owner is queued, dearer for the fleet.
Two terms price that, from what the directory knows of each node (``NodeView``): its capacity
(``NodeInfo.capacity_blocks``, registered by the bridge), the blocks it holds (``total_blocks``,
from the engine's KV events) and the prefill queued on it (``load.prefill_tokens``):

- **eviction**: the blocks this request adds beyond the node's free memory — after the prefill
  already queued there has taken its share — each worth ``block_value_s`` (the prefill of one
  block, times ``memory_value``: the chance an evicted block would have been used again);
- **survival**: a hit seen now is used only once the queue ahead has run, and that queue's own new
  blocks evict the least recently used ones first. The directory keeps no recency, so each held
  block is taken as equally likely to go: a prefix survives with probability
  ``1 - evicted_during_wait / held``. The node's expected prefill blends "hit" and "miss" by it.

A node whose capacity is unknown (0) or that has room for everything queued is priced exactly as
without this module: memory is free until it binds.
"""

from __future__ import annotations

from directory_client.types import NodeView
from gateway.profile import HardwareProfile

DEFAULT_MEMORY_VALUE = 1.0


class MemoryPricing:
    """Eviction cost and hit survival on one node, for one request's block size."""

    __slots__ = ("block_value_s", "block_size")

    def __init__(self, profile: HardwareProfile, block_size: int, memory_value: float) -> None:
        self.block_size = block_size
        self.block_value_s = memory_value * block_size / profile.prefill_tokens_per_s

    def _room(self, nv: NodeView) -> tuple[int, int] | None:
        """(free blocks once the queued prefill is stored, blocks the queue evicts); None: unknown."""
        capacity = nv.node.capacity_blocks
        if capacity <= 0:
            return None
        queued = -(-nv.load.prefill_tokens // self.block_size)
        free = capacity - nv.total_blocks - queued
        return (free, 0) if free >= 0 else (0, -free)

    def survival(self, nv: NodeView) -> float:
        """Chance the node's cached prefix is still there when the queue ahead of it has run."""
        room = self._room(nv)
        if room is None or room[1] == 0 or nv.cached_blocks <= 0:
            return 1.0
        held = max(nv.total_blocks, nv.cached_blocks, 1)
        return max(0.0, 1.0 - room[1] / held)

    def eviction_s(self, nv: NodeView, new_blocks: int) -> float:
        """Future prefill this request's ``new_blocks`` cost by evicting others' blocks here."""
        room = self._room(nv)
        if room is None or new_blocks <= 0:
            return 0.0
        return max(new_blocks - room[0], 0) * self.block_value_s
