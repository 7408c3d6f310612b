"""Small stand-ins shared by tests: an engine's health (or any plain) endpoint on a real port, and the hardware
profile the policy tests price with."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from aiohttp import web

from gateway.profile import HardwareProfile
from tests.conftest import free_port


@asynccontextmanager
async def engine_endpoint(path: str, text: str) -> AsyncIterator[int]:
    """An engine's ``GET path`` answering 200 with ``text`` on a free port (the port is yielded)."""

    async def answer(_: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


def healthy_engine() -> AbstractAsyncContextManager[int]:
    """An engine's ``GET /health`` answering 200 on a free port (the port is yielded)."""
    return engine_endpoint("/health", "ok")


def sample_profile(capacity_blocks: int) -> HardwareProfile:
    """An 8B-model-like profile with ``capacity_blocks`` of KV memory per node."""
    return HardwareProfile(
        name="test-8b", model="test", hardware="test",
        kv_bytes_per_token=131072, kv_capacity_blocks=capacity_blocks, max_num_seqs=256,
        prefill_tokens_per_s=18000, prefill_attention_s_per_token2=2.0e-9, prefill_overhead_s=0.004,
        decode_step_base_s=0.0065, decode_step_per_seq_s=0.00004, decode_step_per_context_token_s=1.0e-8,
        links_gbps={"rdma": 400, "tcp": 25}, transfer_setup_s=0.002, cpu_tier_gbps=200,
    )  # fmt: skip
