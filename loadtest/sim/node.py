"""One simulated node: the engine's own ``PrefixCache`` and ``Scheduler``, stepped on a virtual clock.

The same classes ``kvgate worker`` runs (``workers.engine``), built the way its ``Engine`` builds
them; only the driver differs: instead of sleeping through each step, the simulator schedules the
step's end as an event. ``insert_prefix`` puts leading blocks of a request into the cache before
it is admitted — what a KV pull does (and what the oracle's infinite shared cache does for free).
"""

from __future__ import annotations

from dataclasses import dataclass

from directory_client.types import NodeInfo
from gateway.profile import HardwareProfile
from workers.engine.kv_cache import CacheEvent, PrefixCache
from workers.engine.scheduler import ScheduledStep, Scheduler, SimRequest


@dataclass(slots=True)
class SimNode:
    info: NodeInfo
    cache: PrefixCache
    scheduler: Scheduler
    step: ScheduledStep | None = None  # the step running now (None: idle)
    step_seq: int = 0  # queue sequence number of its end event (an older one is stale)

    @classmethod
    def build(cls, info: NodeInfo, profile: HardwareProfile, capacity_blocks: int) -> SimNode:
        cache = PrefixCache(capacity_blocks, profile.block_size)
        return cls(info, cache, Scheduler(profile, cache))

    @property
    def node_id(self) -> str:
        return self.info.node_id

    def cached_blocks(self, r: SimRequest, upto: int) -> int:
        return self.cache.match(r.hashes[:upto])

    def insert_prefix(self, r: SimRequest, upto: int, now: float) -> tuple[int, list[CacheEvent]]:
        """Cache the first ``upto`` blocks of ``r`` here; returns (blocks added, cache events).

        Adds nothing when they do not fit (the request then computes them itself).
        """
        cache, bs = self.cache, self.cache.block_size
        hashes = r.hashes[:upto]
        have = cache.match(hashes)
        need = len(hashes) - have
        if need <= 0 or not cache.can_reserve(need, pinning=hashes[:have]):
            return 0, []
        cache.pin(hashes[:have], now)
        cache.reserve(need)
        cache.commit(
            hashes[have:], r.keys[have : len(hashes)], hashes[have - 1] if have else None,
            r.tokens[have * bs : len(hashes) * bs], have, now,
        )
        cache.unpin(hashes, now)
        return need, cache.drain_events()
