"""The engine's cache event records → vLLM-format KV events on the wire (one batch per step).

The cache keeps its events as plain records (``kv_cache.BlocksStored`` ...) so the pure classes
carry no wire format; this adapter turns them into ``workers.kv_events`` structs and hands them to
its ``KVEventPublisher`` (ZMQ PUB with sequence numbers and a replay ROUTER).
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.kv_cache import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent
from workers.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventPublisher


def to_wire(records: Sequence[CacheEvent]) -> list[KVEvent]:
    """Records in order, as the structs vLLM publishes."""
    out: list[KVEvent] = []
    for r in records:
        if isinstance(r, BlocksStored):
            out.append(
                BlockStored(
                    block_hashes=list(r.block_hashes),
                    parent_block_hash=r.parent_block_hash,
                    token_ids=list(r.token_ids),
                    block_size=r.block_size,
                    medium=r.medium,
                    lora_name=r.lora_name,
                    extra_keys=None if r.extra_keys is None else [None if e is None else list(e) for e in r.extra_keys],
                )
            )
        elif isinstance(r, BlocksRemoved):
            out.append(BlockRemoved(block_hashes=list(r.block_hashes), medium=r.medium))
        elif isinstance(r, CacheCleared):
            out.append(AllBlocksCleared())
        else:
            raise TypeError(f"not a cache event record: {r!r}")
    return out


class EventPublisher:
    """Publishes each non-empty step's records as one ``EventBatch``; counts what it sent."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        connect: bool = False,
    ) -> None:
        self._pub = KVEventPublisher(
            endpoint, replay_endpoint=replay_endpoint, topic=topic, buffer_batches=buffer_batches, connect=connect
        )
        self.endpoint = self._pub.endpoint
        self.replay_endpoint = self._pub.replay_endpoint
        self.batches = 0
        self.events = 0

    def publish(self, records: Sequence[CacheEvent]) -> None:
        if not records:
            return
        self._pub.publish(to_wire(records))
        self.batches += 1
        self.events += len(records)

    def close(self) -> None:
        self._pub.close()
