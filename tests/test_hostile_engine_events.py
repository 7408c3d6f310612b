"""KV events from a hostile or broken engine, through a real ZMQ socket into a real bridge and a
real Redis (unique key prefix): what the bridge keeps of fields the engine chooses.

Before: the bridge cached the key seed of every ``lora_name`` it saw (up to 1,024 names), keeping
each name as the cache's key, whatever its length: an engine announcing 48 blocks, each under its
own 4 MiB adapter name (within the 16 MiB batch limit), kept ~192 MiB of Python objects in the
bridge's process (``kvgate serve`` when bridged in-process), held until 1,024 more names came. No gateway
request can name such an adapter (model names past 1,024 characters are refused with 404), so
the blocks were useless too. Now: blocks under a ``lora_name`` longer than that are dropped and
counted (``kvgate_bridge_dropped_blocks_total{reason="lora_name"}``), nothing of the name kept.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from directory_client import open_directory
from tests.test_bridge import Engine, connected, eventually, held, keys_of, make_bridge, node_id, stored, tokens  # noqa: F401  (node_id: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def _eq(value, expected: int) -> bool:
    return await value == expected


async def test_huge_adapter_names_from_an_engine_are_not_kept(redis_url: str, key_prefix: str, node_id: str) -> None:
    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=5.0)
    eng = Engine(node_id, buffer_batches=1)  # the engine's own replay buffer must not hold them either
    good = tokens(7000, 2)
    try:
        async with make_bridge(directory, eng) as bridge:
            await connected(bridge, directory, node_id)
            gc.collect()
            tracemalloc.start()  # what Python objects keep (RSS would also count freed heap not returned)
            before = tracemalloc.get_traced_memory()[0]
            for i in range(48):
                name = f"adapter-{i}-" + "x" * (4 << 20)
                eng.pub.publish([stored([10_000 + i], tokens(100 * i, 1), lora_id=i + 1, lora_name=name)])
                del name
            eng.pub.publish([stored([1, 2], good)])
            await eventually(lambda: _eq(held(directory, node_id, keys_of(good)), 2), timeout=30, what="the good batch applied")
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            print(f"\nthe bridge keeps {grown / (1 << 20):.1f} MiB after 48 blocks under 4 MiB adapter names")
            stats = bridge.stats(node_id)
            assert grown < 48 << 20, f"the bridge keeps {grown >> 20} MiB of adapter names"
            assert stats.dropped_blocks == 48 and stats.tracked_blocks == 2
    finally:
        eng.pub.close()
        await directory.aclose()
