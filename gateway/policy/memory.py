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
  On a node whose memory turns over faster than the fleet's mean the evicted blocks are younger,
  so more likely to be asked for again: the cost is scaled by the node's turnover relative to the
  mean (``gateway.policy.churn``, the policy's count of blocks it sent each node), so new prefixes
  go where the oldest blocks wait to be evicted, as one pooled memory would evict them;
- **survival**: a hit seen now is used only once the queue ahead has run, and that queue's own new
  blocks evict the least recently used ones first. The directory keeps no recency, so each held
  block is taken as equally likely to go: a prefix survives with probability
  ``1 - evicted_during_wait / held``. The node's expected prefill blends "hit" and "miss" by it.

- **crowding**: a node runs only as many requests as its memory holds. With ``inflight`` requests
  each as large as this one already filling its capacity, a new one waits in the engine's queue
  for a running one to finish, a time the gateway cannot see: priced like a full batch
  (``saturation_penalty_s`` per request beyond what fits), so a hot prefix gets a copy instead of a
  queue when its owner's memory is full.

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

    def price(self, nv: NodeView, prompt_blocks: int, turnover: float = 1.0) -> tuple[float, float]:
        """(survival of the node's cached prefix, eviction cost in seconds of adding the rest).

        ``turnover``: the node's memory turnover relative to the fleet's (``gateway.policy.churn``),
        which scales what an evicted block is worth.

        One pass per node: a decision prices every live node (hundreds), so this stays inline
        arithmetic. Capacity unknown: (1.0, 0.0), memory is not priced.
        """
        capacity = nv.node.capacity_blocks
        if capacity <= 0:
            return 1.0, 0.0
        free = capacity - nv.total_blocks - -(-nv.load.prefill_tokens // self.block_size)
        cached = nv.cached_blocks
        survival = 1.0
        if free < 0 and cached > 0:
            survival = max(0.0, 1.0 + free / max(nv.total_blocks, cached, 1))
        new_blocks = prompt_blocks - int(cached * survival)
        over = new_blocks - free if free > 0 else new_blocks
        return survival, (over * self.block_value_s * turnover if over > 0 else 0.0)

    def crowding_s(self, nv: NodeView, prompt_blocks: int, penalty_s: float) -> float:
        """Wait for a running request to finish when ``inflight`` requests of this size fill the node.

        Not when the node's free memory, after the prefill queued there, holds the prompt: the
        blocks running requests use are among those it holds, so they cannot fill it then. (A decode
        node of a disaggregated fleet runs many short answers; priced as if each were a 23k-token
        document, it looked 2-3 s away while two thirds of its memory was free.)
        """
        capacity, running = nv.node.capacity_blocks, nv.load.inflight
        if capacity <= 0 or running <= 0 or prompt_blocks <= 0:
            return 0.0
        if capacity - nv.total_blocks - -(-nv.load.prefill_tokens // self.block_size) >= prompt_blocks:
            return 0.0
        fits = max(capacity // prompt_blocks, 1)
        return penalty_s * (running - fits + 1) if running >= fits else 0.0
