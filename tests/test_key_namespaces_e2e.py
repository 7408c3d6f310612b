"""Salted prompts, both sides: a real simulated-engine process caches a tenant's salted prompt and
publishes it as vLLM 0.32 does (the salt in block 0's ``extra_keys``); a real bridge follows it;
the gateway's own routing core is asked about salted and unsalted twins of that prompt.

What a tenant sees: its salted prompt is found on the node that holds it (before the fix the
bridge keyed it as unsalted, so it never hit); what another tenant sees: an unsalted or differently
salted guess of that prompt finds nothing anywhere (before: it was routed to the owner with the
whole prompt cached, a cross-tenant prefix oracle).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from directory_client import open_directory
from gateway.core import RoutingCore, RoutingLimits
from gateway.policy import make_policy
from gateway.profile import load_profile
from tests.test_bridge_processes import MODEL, EngineProcess
from tokenizer import PromptTokenizer
from workers.bridge import KVEventBridge

TEXT = "The harbour authority's quarterly traffic report, section by section. " * 40


@pytest.fixture(scope="module")
def engine():
    e = EngineProcess("salt-e1", kv_blocks=400)
    try:
        e.wait_ready()
        yield e
    finally:
        e.stop()


def completion(salt: str | None) -> dict:
    body: dict = {"model": MODEL, "prompt": TEXT, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def send(engine: EngineProcess, body: dict) -> None:
    req = urllib.request.Request(
        engine.url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


async def cached_on(core: RoutingCore, node_id: str, body: dict) -> tuple[int, int]:
    """(blocks the gateway finds cached on ``node_id`` for ``body``, blocks in the prompt)."""
    result = await core.explain("/v1/completions", json.dumps(body).encode())
    assert result.kind == "routed" and result.decision is not None and result.request is not None
    found = {c.node_id: c.cached_blocks for c in result.decision.candidates}
    return found.get(node_id, 0), result.request.total_blocks


async def test_salted_prompts_hit_only_their_own_salt(engine: EngineProcess) -> None:
    directory = open_directory("memory://", heartbeat_ttl_s=5.0, index_stride=1)
    bridge = KVEventBridge(directory, [engine.spec()], model=MODEL, block_size=16, heartbeat_interval_s=0.3)
    core = RoutingCore(
        PromptTokenizer(), directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
        RoutingLimits(models=frozenset([MODEL])),
    )  # fmt: skip
    await bridge.start()
    try:
        deadline = time.monotonic() + 20
        while not bridge.stats(engine.node_id).registered:
            assert time.monotonic() < deadline, "node never registered"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(send, engine, completion("tenant-a"))
        while (await cached_on(core, engine.node_id, completion("tenant-a")))[0] == 0:
            assert time.monotonic() < deadline, "the salted prompt never reached the directory"
            await asyncio.sleep(0.05)
        hit, blocks = await cached_on(core, engine.node_id, completion("tenant-a"))
        assert blocks > 20 and hit == blocks  # the owner's own salt finds the whole prompt
        assert (await cached_on(core, engine.node_id, completion(None)))[0] == 0  # unsalted guess: nothing
        assert (await cached_on(core, engine.node_id, completion("tenant-b")))[0] == 0  # other salt: nothing
        # and the other way round: an unsalted prompt's blocks are not found by a salted twin
        await asyncio.to_thread(send, engine, completion(None))
        while (await cached_on(core, engine.node_id, completion(None)))[0] == 0:
            assert time.monotonic() < deadline, "the unsalted prompt never reached the directory"
            await asyncio.sleep(0.05)
        assert (await cached_on(core, engine.node_id, completion("tenant-b")))[0] == 0
        assert bridge.stats(engine.node_id).dropped_blocks == 0
    finally:
        await bridge.aclose()
        await directory.aclose()


async def test_lora_requests_are_keyed_as_the_bridge_keys_the_adapters_blocks() -> None:
    """The gateway knows adapters only by the body's ``model``; with ``lora_adapters`` (adapter ->
    base model) it keys them as (base, adapter, salt), which is what the bridge derives from the
    engine's ``lora_name`` (before: the gateway keyed on the adapter name as if it were a model,
    the bridge on base + ``lora_name``, so no LoRA prompt ever hit)."""
    from directory_client.types import NodeInfo, Tier
    from workers.bridge import NodeBlockMap
    from workers.kv_events import BlockStored

    tok = PromptTokenizer()
    ids = tok.tokenize_body("/v1/completions", {"model": "support-bot", "prompt": TEXT}).token_ids
    n = len(ids) // 16
    directory = open_directory("memory://", heartbeat_ttl_s=60.0, index_stride=1)
    await directory.register_node(NodeInfo("lora-node", "127.0.0.1:9", model=MODEL))
    blocks = NodeBlockMap(model=MODEL, block_size=16, max_blocks=10_000)
    blocks.apply(
        BlockStored(
            block_hashes=list(range(1, n + 1)), parent_block_hash=None, token_ids=[int(t) for t in ids[: n * 16]],
            block_size=16, lora_id=3, lora_name="support-bot", extra_keys=[["support-bot"]] * n,
        )
    )  # fmt: skip
    await directory.record_stored("lora-node", blocks.snapshot()[Tier.GPU])
    limits = RoutingLimits(models=frozenset([MODEL, "support-bot"]), lora_adapters={"support-bot": MODEL})
    core = RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), limits)
    hit, total = await cached_on(core, "lora-node", {"model": "support-bot", "prompt": TEXT, "max_tokens": 1})
    assert hit == total == n
    assert (await cached_on(core, "lora-node", {"model": MODEL, "prompt": TEXT, "max_tokens": 1}))[0] == 0  # base: no
    unmapped = RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), RoutingLimits())
    assert (await cached_on(unmapped, "lora-node", {"model": "support-bot", "prompt": TEXT, "max_tokens": 1}))[0] == 0
    await directory.aclose()
