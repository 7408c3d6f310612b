"""Engine cache events → directory writes, by the production translation (the bridge's, minus ZMQ).

Each step's cache records become vLLM wire structs (``workers.engine.events.to_wire``, what the
engine publishes), are applied to the bridge's ``NodeBlockMap`` (engine hash → kvgate key, from
the token IDs the events carry) and its folded changes are written to the directory in the
bridge's order (clear, removals, stores). The only difference from a live fleet: writes happen at
the end of the step that caused them, with no flush interval and no network in between, so the
simulated directory is never stale.
"""

from __future__ import annotations

from collections.abc import Sequence

from directory_client.memory import InProcessDirectory
from directory_client.types import Tier
from loadtest.sim.sync import run_now
from tokenizer.keys import BlockKey
from workers.bridge import NodeBlockMap
from workers.engine.events import to_wire
from workers.engine.kv_cache import CacheEvent


class DirectoryFeed:
    """One node's event → directory path."""

    __slots__ = ("node_id", "directory", "blocks")

    def __init__(self, node_id: str, directory: InProcessDirectory, *, model: str, block_size: int) -> None:
        self.node_id = node_id
        self.directory = directory
        self.blocks = NodeBlockMap(model=model, block_size=block_size, max_blocks=1 << 40)

    def apply(self, records: Sequence[CacheEvent]) -> None:
        if not records:
            return
        for ev in to_wire(records):
            self.blocks.apply(ev)
        cleared, changes = self.blocks.take_changes()
        if not cleared and not changes:
            return
        removed: dict[Tier, list[BlockKey]] = {}
        stored: dict[Tier, list[BlockKey]] = {}
        for change in changes:
            for tier in change.removed:
                removed.setdefault(tier, []).append(change.key)
            for tier in change.stored:
                stored.setdefault(tier, []).append(change.key)
        d, node = self.directory, self.node_id
        if cleared:
            run_now(d.clear_node(node))
        for tier, keys in removed.items():
            run_now(d.record_removed(node, keys, tier))
        for tier, keys in stored.items():
            run_now(d.record_stored(node, keys, tier))
