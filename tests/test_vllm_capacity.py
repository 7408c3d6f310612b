"""A real vLLM engine sized in blocks, and the capacity kvgate registers for it.

One ``vllm serve`` (CPU build) started with ``--num-gpu-blocks-override 64`` — what
``kvgate loadtest replay --engine vllm --kv-blocks 64`` runs — so memory binds after 64 blocks of
32 tokens. What the operator sees: no capacity configured for the node, and the directory holds
the size vLLM says it allocated in its start-up log, so kvgate prices memory for it.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from directory_client import open_directory
from loadtest.local_fleet import FleetOptions
from loadtest.real_vllm.fleet import BLOCK_SIZE, VllmFleet, VllmOptions
from tests.test_vllm_recovery import complete
from workers.bridge import EngineSpec, KVEventBridge

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "tiny"
BLOCKS = 64


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    options = VllmOptions(kv_blocks=BLOCKS)
    with VllmFleet(FleetOptions(nodes=1, model=MODEL), tmp_path_factory.mktemp("vllm-capacity"), options) as f:
        yield f


def logged_cache_tokens(log: Path) -> int:
    match = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    assert match, "vLLM logged no KV cache size"
    return int(match.group(1).replace(",", ""))


def test_vllm_allocates_the_blocks_asked_for_and_evicts_past_them(fleet: VllmFleet) -> None:
    url = fleet.workers[0].url
    assert logged_cache_tokens(fleet.engines[fleet.workers[0].node_id].log_path) == BLOCKS * BLOCK_SIZE
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 100_000) for _ in range(30 * BLOCK_SIZE)] for _ in range(3)]  # 90 blocks > 64
    for ids in prompts:
        complete(url, ids)
    assert complete(url, prompts[-1])["usage"]["prompt_tokens_details"]["cached_tokens"] >= 29 * BLOCK_SIZE  # held
    assert complete(url, prompts[0])["usage"]["prompt_tokens_details"]["cached_tokens"] < 30 * BLOCK_SIZE  # evicted


async def test_the_node_is_registered_with_the_kv_capacity_vllm_allocated(fleet: VllmFleet) -> None:
    w = fleet.workers[0]
    directory = open_directory("memory://", heartbeat_ttl_s=3.0, index_stride=1)
    spec = EngineSpec(node_id=w.node_id, address=w.address, events=f"tcp://127.0.0.1:{w.events_port}")  # no capacity
    try:
        async with KVEventBridge(directory, [spec], model=MODEL, block_size=BLOCK_SIZE, heartbeat_interval_s=0.2):
            deadline = time.monotonic() + 30
            capacity = 0
            while capacity == 0:
                assert time.monotonic() < deadline, "the node never registered with a capacity"
                await asyncio.sleep(0.05)
                capacity = next((n.capacity_blocks for n in await directory.live_nodes() if n.node_id == w.node_id), 0)
    finally:
        await directory.aclose()
    assert capacity == logged_cache_tokens(fleet.engines[w.node_id].log_path) // BLOCK_SIZE == BLOCKS
