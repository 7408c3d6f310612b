"""A node configured without a KV capacity gets the one its engine reports on ``/metrics``.

What the operator sees: ``capacity_blocks`` left at 0 in the fleet config, and the node still
registered with its engine's real cache size (so memory is priced for it); a capacity written in
the config always wins. The parser is fed vLLM 0.32's own line (captured from the CPU build) and
SGLang's gauge; the bridge is run against the simulated engine over real sockets. The real-vLLM
check lives in ``test_vllm_recovery.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestServer

from directory_client import open_directory
from directory_client.types import Directory
from gateway.profile import load_profile
from tests.conftest import free_port
from tests.support.engines import engine_endpoint
from tokenizer import PromptTokenizer
from workers.bridge import EngineSpec, KVEventBridge
from workers.engine.events import EventPublisher
from workers.engine.server import Engine, EngineConfig, create_app
from workers.engine_capacity import fetch_capacity_blocks, kv_capacity_tokens

MODEL = "sim-8b"

VLLM_032 = (  # vLLM 0.32 (CPU build, 1 GiB of KV space, block size 32), labels as it printed them
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
    'engine="0",gpu_memory_utilization="0.92",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="1048576",'
    'num_cpu_blocks="None",num_gpu_blocks="32768",num_gpu_blocks_override="None"} 1.0\n'
)


def test_vllm_says_its_cache_size_in_tokens_and_one_block_of_it_is_its_null_block() -> None:
    assert kv_capacity_tokens(VLLM_032) == 1_048_576 - 32


def test_older_vllm_without_a_token_count_is_read_by_blocks_times_block_size() -> None:
    text = VLLM_032.replace('kv_cache_size_tokens="1048576",', "")
    assert kv_capacity_tokens(text) == (32768 - 1) * 32


def test_a_data_parallel_server_adds_its_engines_caches() -> None:
    second = VLLM_032.splitlines()[-1].replace('engine="0"', 'engine="1"')
    assert kv_capacity_tokens(VLLM_032 + second + "\n") == 2 * (1_048_576 - 32)  # a null block each


def test_sglang_says_it_in_max_total_num_tokens() -> None:
    text = (
        "# HELP sglang:max_total_num_tokens Maximum total number of tokens\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
        'sglang:max_total_num_tokens{model_name="m"} 161721.0\n'
    )
    assert kv_capacity_tokens(text) == 161721


@pytest.mark.parametrize(
    "text",
    [
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n",  # says nothing of its cache
        VLLM_032.replace('kv_cache_size_tokens="1048576",', "").replace('num_gpu_blocks="32768"', 'num_gpu_blocks="None"'),
    ],
)
def test_an_engine_that_does_not_say_gives_no_capacity(text: str) -> None:
    assert kv_capacity_tokens(text) is None


async def test_an_unreachable_engine_gives_no_capacity_and_no_error() -> None:
    assert await fetch_capacity_blocks(f"127.0.0.1:{free_port()}", 16, timeout_s=0.5) is None


@pytest.mark.parametrize(
    "text",
    [
        VLLM_032 + "x" * (9 << 20),  # a page no engine serves: not read past 8 MiB
        VLLM_032.replace('kv_cache_size_tokens="1048576"', 'kv_cache_size_tokens="1e30"'),  # not a size
        VLLM_032.replace('kv_cache_size_tokens="1048576"', 'kv_cache_size_tokens="inf"').replace('"32768"', '"inf"'),
        "vllm:cache_config_info{kv_cache_size_tokens= garbage\n",  # not the exposition format
    ],
    ids=["huge-page", "absurd-size", "infinite", "malformed"],
)
async def test_a_hostile_metrics_page_gives_no_capacity_and_no_error(text: str) -> None:
    """What the operator sees: the node registered without a capacity (memory not priced), the
    bridge still running; never a capacity made of garbage."""
    async with engine_endpoint("/metrics", text) as port:
        assert await fetch_capacity_blocks(f"127.0.0.1:{port}", 16) is None


@pytest.fixture
async def directory() -> AsyncIterator[Directory]:
    d = open_directory("memory://", heartbeat_ttl_s=1.0, index_stride=1)
    yield d
    await d.aclose()


@pytest.fixture
async def sim_engine() -> AsyncIterator[tuple[str, Engine, EventPublisher]]:
    """A simulated engine with 300 blocks of KV cache, its HTTP server and its KV events on real ports."""
    events = EventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    profile = load_profile("llama-3.1-8b-h100")
    engine = Engine(EngineConfig(model=MODEL, profile=profile, node_id="n1", kv_blocks=300, time_scale=0.01), PromptTokenizer(), events)
    server = TestServer(create_app(engine), host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        yield f"127.0.0.1:{server.port}", engine, events
    finally:
        await server.close()
        events.close()


async def registered_capacity(directory: Directory, node_id: str, want: int, timeout_s: float = 10.0) -> int:
    """The capacity the node is registered with, once it is ``want`` (or whatever it is at the timeout)."""
    deadline = time.monotonic() + timeout_s
    seen = -1
    while time.monotonic() < deadline:
        seen = next((n.capacity_blocks for n in await directory.live_nodes() if n.node_id == node_id), -1)
        if seen == want:
            break
        await asyncio.sleep(0.05)
    return seen


@pytest.mark.parametrize("configured, expected", [(0, 299), (120, 120)], ids=["learned", "configured-wins"])
async def test_the_bridge_registers_the_capacity_the_engine_reports(
    directory: Directory, sim_engine: tuple[str, Engine, EventPublisher], configured: int, expected: int
) -> None:
    address, engine, events = sim_engine
    spec = EngineSpec(node_id="n1", address=address, events=events.endpoint, replay=events.replay_endpoint, capacity=configured)
    bridge = KVEventBridge(directory, [spec], model=MODEL, block_size=engine.config.profile.block_size, heartbeat_interval_s=0.1)
    await bridge.start()
    try:
        assert await registered_capacity(directory, "n1", expected) == expected
        await asyncio.sleep(0.3)  # a few heartbeats later it has not changed
        assert await registered_capacity(directory, "n1", expected, timeout_s=0.1) == expected
    finally:
        await bridge.aclose()
