"""The bridge against the exact wire shapes engines publish, one per case docs/kv-events.md gives flags for.

vLLM's payloads are encoded by vLLM 0.32 itself: its own ``KVEventBatch`` / ``BlockStored`` /
``BlockRemoved`` classes and msgpack encoder, run in the real-vLLM venv (``make vllm``), so a
field vLLM adds, renames or reorders shows here. SGLang's are its ``array_like`` tagged structs
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]``, batches
``[ts, events]`` without a rank, as ``sglang/srt/disaggregation/kv_events.py`` encodes them),
built as raw msgpack. Each payload goes through a real ZMQ publisher into a running
``KVEventBridge``; the test then asks the directory for the keys the gateway computes for the
same prompt (``tokenizer.keys.request_seed``, the request path's rule): equal keys are found,
and a case kvgate cannot key degrades the node with a reason an operator can act on.
"""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY

from directory_client import open_directory
from directory_client.types import Directory, Tier
from loadtest.real_vllm.install import DEFAULT_VENV
from tests.conftest import free_port
from tests.test_bridge import eventually
from tokenizer.keys import block_keys, request_seed
from workers.bridge import EngineSpec, KVEventBridge
from workers.kv_events import KVEventPublisher

MODEL = "shapes-model"
BS = 16
TOKENS = [1000 + i for i in range(3 * BS)]  # three full blocks
HASHES = [bytes([i]) * 32 for i in (1, 2, 3)]  # vLLM's default hashes are 32-byte digests

# vLLM 0.32's own classes encode each case (events given as class name + keyword arguments)
ENCODE_WITH_VLLM = r"""
import base64, json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
CLASSES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
def arg(value):
    if isinstance(value, dict) and "hex" in value:
        return bytes.fromhex(value["hex"])
    if isinstance(value, list):
        return [arg(v) for v in value]
    return value
def event(spec):
    kw = {k: arg(v) for k, v in spec["kw"].items()}
    if kw.get("extra_keys") is not None:
        kw["extra_keys"] = [None if e is None else tuple(e) for e in kw["extra_keys"]]
    return CLASSES[spec["type"]](**kw)
out = {}
encoder = msgspec.msgpack.Encoder()
for name, batches in json.load(sys.stdin).items():
    out[name] = [base64.b64encode(encoder.encode(KVEventBatch(ts=1.0, events=[event(e) for e in b["events"]],
                                                              data_parallel_rank=b.get("rank")))).decode() for b in batches]
json.dump(out, sys.stdout)
"""


def _h(b: bytes) -> dict[str, str]:
    return {"hex": b.hex()}


def stored(**kw: Any) -> dict[str, Any]:
    base = {"block_hashes": [_h(h) for h in HASHES], "parent_block_hash": None, "token_ids": TOKENS, "block_size": BS,
            "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    return {"type": "BlockStored", "kw": {**base, **kw}}


def removed(hashes: Sequence[bytes], **kw: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "kw": {"block_hashes": [_h(h) for h in hashes], "medium": "GPU", **kw}}


VLLM_CASES: dict[str, list[dict[str, Any]]] = {
    # today's full-attention store, with every newer field vLLM 0.32 publishes
    "plain": [{"events": [stored(extra_keys=None, group_idx=0, kv_cache_spec_kind="full_attention",
                                 locality="LOCAL", ownership=None, session_id="s-1")]}],  # fmt: skip
    # cache_salt: block 0's extra_keys carries it (untagged)
    "salted": [{"events": [stored(extra_keys=[["tenant-a"], None, None])]}],
    # --lora-modules ad1=...: every block names the adapter; block 0 also the salt
    "lora": [{"events": [stored(lora_id=1, lora_name="ad1", extra_keys=[["ad1"], ["ad1"], ["ad1"]])]}],
    "lora_salted": [{"events": [stored(lora_id=1, lora_name="ad1", extra_keys=[["ad1", "tenant-a"], ["ad1"], ["ad1"]])]}],
    # MLA (FlashMLA forces 64): one block of 64 tokens
    "mla": [{"events": [stored(block_hashes=[_h(HASHES[0])], token_ids=TOKENS[:48] + TOKENS[:16], block_size=64)]}],
    # hybrid: a full-attention group and a sliding-window group hash the same tokens; the window
    # then evicts block 0 from its group only, later the full group evicts it too
    "hybrid": [
        {"events": [stored(group_idx=0, kv_cache_spec_kind="full_attention"),
                    stored(block_hashes=[_h(h[::-1] + b"w") for h in HASHES], group_idx=1,
                           kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32)]},
        {"events": [removed([HASHES[0][::-1] + b"w"], group_idx=1)]},
        {"events": [removed([HASHES[0]], group_idx=0)]},
    ],  # fmt: skip
    # data parallel: each rank publishes on endpoint port + rank, its batches tagged with the rank
    "dp_rank1": [{"rank": 1, "events": [stored()]}],
    # CPU offload: a copy with token IDs, then placeholders (no tokens, block_size 0) for a known
    # and an unknown hash, then the GPU original evicted
    "offload": [
        {"events": [stored()]},
        {"events": [stored(block_hashes=[_h(HASHES[0])], token_ids=TOKENS[:BS], medium="CPU")]},
        {"events": [stored(block_hashes=[_h(HASHES[1]), _h(b"\x09" * 32)], token_ids=[], block_size=0, medium="CPU",
                           parent_block_hash=None, locality="LOCAL")]},
        {"events": [removed(HASHES[:2])]},
    ],  # fmt: skip
}


@pytest.fixture(scope="module")
def vllm_payloads() -> dict[str, list[bytes]]:
    python = DEFAULT_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"real vLLM is not installed in {DEFAULT_VENV} (make vllm, or KVGATE_VLLM_VENV)")
    out = subprocess.run([str(python), "-c", ENCODE_WITH_VLLM], input=json.dumps(VLLM_CASES), capture_output=True,
                         text=True, timeout=600, env={"PATH": "/usr/bin:/bin", "VLLM_TARGET_DEVICE": "cpu"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return {name: [base64.b64decode(p) for p in payloads] for name, payloads in json.loads(out.stdout).items()}


def sglang_batch(events: list[list[Any]]) -> bytes:
    """SGLang's wire form: ``[ts, [[tag, *fields], ...]]`` (array_like, tagged, no rank)."""
    return msgspec.msgpack.encode([1.0, events])


@pytest.fixture
async def directory() -> AsyncIterator[Directory]:
    d = open_directory("memory://", heartbeat_ttl_s=2.0, index_stride=1)
    yield d
    await d.aclose()


@asynccontextmanager
async def following(directory: Directory, *nodes: str) -> AsyncIterator[tuple[KVEventBridge, dict[str, KVEventPublisher]]]:
    pubs = {n: KVEventPublisher(f"tcp://127.0.0.1:{free_port()}") for n in nodes}
    specs = [EngineSpec(node_id=n, address=f"127.0.0.1:{free_port()}", events=p.endpoint) for n, p in pubs.items()]
    bridge = KVEventBridge(directory, specs, model=MODEL, block_size=BS, heartbeat_interval_s=0.2)
    await bridge.start()
    try:
        for n in nodes:
            await eventually(lambda n=n: _live(directory, n), what=f"{n} registered")
            await eventually(lambda n=n: _true(bridge.stats(n).connected), what=f"{n} connected")
        yield bridge, pubs
    finally:
        await bridge.aclose()
        for p in pubs.values():
            p.close()


async def _true(value: bool) -> bool:
    return value


async def _live(directory: Directory, node: str) -> bool:
    return any(n.node_id == node for n in await directory.live_nodes())


async def send(bridge: KVEventBridge, pub: KVEventPublisher, node: str, payloads: Sequence[bytes]) -> None:
    before = bridge.stats(node).batches + bridge.stats(node).malformed_batches
    for p in payloads:
        pub.publish_raw(p)
    await eventually(lambda: _true(bridge.stats(node).batches + bridge.stats(node).malformed_batches == before + len(payloads)),
                     what="batches applied")  # fmt: skip
    assert bridge.stats(node).malformed_batches == 0 and bridge.stats(node).rejected_events == 0


async def held(directory: Directory, node: str, keys: Sequence[int]) -> tuple[int, Tier | None]:
    """(blocks of ``keys`` the node holds, the slowest tier among them) once the bridge has flushed."""
    view = await directory.lookup(list(keys))
    nv = next((n for n in view.nodes if n.node.node_id == node), None)
    return (0, None) if nv is None else (nv.cached_blocks, nv.tier if nv.cached_blocks else None)


def gateway_keys(model: str = MODEL, *, salt: str | None = None, adapters: dict[str, str] | None = None, tokens=TOKENS) -> list[int]:
    return block_keys(tokens, block_size=BS, seed=request_seed(model, cache_salt=salt, adapters=adapters))


async def holds(directory: Directory, node: str, keys: Sequence[int], blocks: int, tier: Tier | None = Tier.GPU) -> None:
    async def check() -> bool:
        return await held(directory, node, keys) == (blocks, tier if blocks else None)

    await eventually(check, what=f"{node} holds {blocks} of the keys")


pytestmark_vllm = pytest.mark.vllm


@pytestmark_vllm
async def test_vllm_plain_blocks_with_newer_fields_key_like_the_gateway(directory: Directory, vllm_payloads) -> None:
    async with following(directory, "v-plain") as (bridge, pubs):
        await send(bridge, pubs["v-plain"], "v-plain", vllm_payloads["plain"])
        await holds(directory, "v-plain", gateway_keys(), 3)
        assert bridge.stats("v-plain").engine_block_size == BS and not bridge.stats("v-plain").degraded


@pytestmark_vllm
async def test_vllm_cache_salt_and_lora_key_like_the_gateway_and_nothing_else(directory: Directory, vllm_payloads) -> None:
    adapters = {"ad1": MODEL}
    cases = {"salted": dict(salt="tenant-a"), "lora": dict(model="ad1", adapters=adapters),
             "lora_salted": dict(model="ad1", salt="tenant-a", adapters=adapters)}  # fmt: skip
    nodes = [f"v-{c.replace('_', '-')}" for c in cases]
    async with following(directory, *nodes) as (bridge, pubs):
        for node, (case, how) in zip(nodes, cases.items()):
            await send(bridge, pubs[node], node, vllm_payloads[case])
            await holds(directory, node, gateway_keys(**how), 3)
            others = [dict(), dict(salt="tenant-b"), dict(model="ad1", adapters=adapters), dict(salt="tenant-a")]
            for other in (o for o in others if o != how):  # no other namespace finds a block
                assert await held(directory, node, gateway_keys(**other)) == (0, None), (case, other)


@pytestmark_vllm
async def test_vllm_mla_block_size_degrades_the_node_naming_both_sizes(directory: Directory, vllm_payloads) -> None:
    async with following(directory, "v-mla") as (bridge, pubs):
        await send(bridge, pubs["v-mla"], "v-mla", vllm_payloads["mla"])
        await eventually(lambda: _true(bool(bridge.stats("v-mla").degraded)), what="degraded")
        assert bridge.stats("v-mla").degraded == "block_size: engine block size 64, configured 16"
        assert REGISTRY.get_sample_value("kvgate_bridge_node_degraded", {"node": "v-mla", "reason": "block_size"}) == 1
        assert await held(directory, "v-mla", gateway_keys()) == (0, None)


@pytestmark_vllm
async def test_vllm_hybrid_groups_keep_a_block_until_every_group_evicts_it(directory: Directory, vllm_payloads) -> None:
    first, window_evicts, full_evicts = vllm_payloads["hybrid"]
    async with following(directory, "v-hybrid") as (bridge, pubs):
        pub = pubs["v-hybrid"]
        await send(bridge, pub, "v-hybrid", [first])
        await holds(directory, "v-hybrid", gateway_keys(), 3)
        await send(bridge, pub, "v-hybrid", [window_evicts])  # the full-attention group still holds block 0
        await holds(directory, "v-hybrid", gateway_keys(), 3)
        await send(bridge, pub, "v-hybrid", [full_evicts])  # now nobody does: the prefix is gone
        await holds(directory, "v-hybrid", gateway_keys(), 0)


@pytestmark_vllm
async def test_vllm_data_parallel_ranks_are_nodes_of_their_own(directory: Directory, vllm_payloads) -> None:
    """Rank 1's batches (tagged ``data_parallel_rank: 1``, on port + 1) land on rank 1's node only."""
    async with following(directory, "v-dp0", "v-dp1") as (bridge, pubs):
        await send(bridge, pubs["v-dp1"], "v-dp1", vllm_payloads["dp_rank1"])
        await holds(directory, "v-dp1", gateway_keys(), 3)
        assert await held(directory, "v-dp0", gateway_keys()) == (0, None)


@pytestmark_vllm
async def test_vllm_cpu_offload_copies_keep_blocks_found_after_gpu_eviction(directory: Directory, vllm_payloads) -> None:
    gpu, copy_with_tokens, placeholders, evicted = vllm_payloads["offload"]
    node = "v-offload"
    async with following(directory, node) as (bridge, pubs):
        await send(bridge, pubs[node], node, [gpu, copy_with_tokens, placeholders])
        await holds(directory, node, gateway_keys(), 3)
        dropped = REGISTRY.get_sample_value("kvgate_bridge_dropped_blocks_total", {"node": node, "reason": "no_tokens"})
        assert dropped == 1  # the placeholder for a hash never seen on the GPU cannot be keyed
        await send(bridge, pubs[node], node, [evicted])  # blocks 0 and 1 leave the GPU; their CPU copies stay
        await holds(directory, node, gateway_keys(), 3, Tier.CPU)  # the whole prefix, its slowest part on CPU


async def test_sglang_page_size_equal_to_kvgate_block_size_keys_like_the_gateway(directory: Directory) -> None:
    hashes = [11, 12, 13]
    store = ["BlockStored", hashes, None, TOKENS, BS, None]
    async with following(directory, "sg-16") as (bridge, pubs):
        await send(bridge, pubs["sg-16"], "sg-16", [sglang_batch([store])])
        await holds(directory, "sg-16", gateway_keys(), 3)
        await send(bridge, pubs["sg-16"], "sg-16", [sglang_batch([["BlockRemoved", hashes[1:]]])])
        await holds(directory, "sg-16", gateway_keys(), 1)


async def test_sglang_default_page_size_of_one_degrades_the_node(directory: Directory) -> None:
    """SGLang's default ``--page-size 1`` publishes one token per block: nothing can be keyed in
    blocks of 16, and the node says so instead of silently never hitting."""
    pages = [["BlockStored", [100 + i], None if i == 0 else 99 + i, [t], 1, None] for i, t in enumerate(TOKENS[:4])]
    async with following(directory, "sg-1") as (bridge, pubs):
        await send(bridge, pubs["sg-1"], "sg-1", [sglang_batch(pages)])
        await eventually(lambda: _true(bool(bridge.stats("sg-1").degraded)), what="degraded")
        assert bridge.stats("sg-1").degraded == "block_size: engine block size 1, configured 16"
