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
from loadtest.sim.sync import run_now
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
        writes = self.blocks.take_writes()
        if writes is not None:
            run_now(writes.apply(self.directory, self.node_id))
