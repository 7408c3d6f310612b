"""The bridge against real simulated-engine processes and real Redis (under a private key prefix).

Three ``python -m workers.engine`` processes publish KV events (engine hashes are blake2b, not
kvgate keys, so the bridge's mapping is exercised for real); an in-process bridge follows them
into a Redis directory. Each worker's ``GET /debug/blocks`` is the ground truth. One engine's
event stream goes through a lossy link (a real ZMQ forwarder that can drop or corrupt one batch)
so gaps and malformed batches arrive exactly as they would from a flaky network or a buggy
producer; its replay socket is reached directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence

import aiohttp
import pytest
import zmq
import zmq.asyncio

from directory_client import open_directory
from directory_client.types import Directory
from tests.conftest import REPO, free_port
from tokenizer.keys import BlockKey, block_keys, namespace_seed
from workers.bridge import EngineSpec, KVEventBridge

MODEL = "bridge-e2e"
BS = 16
TTL_S = 2.0


class EngineProcess:
    """One ``python -m workers.engine`` with KV events and replay on free loopback ports."""

    def __init__(self, node_id: str, *, kv_blocks: int) -> None:
        self.node_id = node_id
        self.port = free_port()
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "workers.engine", "--port", str(self.port), "--model", MODEL,
                "--time-scale", "0", "--kv-blocks", str(kv_blocks), "--node-id", node_id,
                "--events-endpoint", self.events, "--replay-endpoint", self.replay,
            ],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.node_id} exited: {self.proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            time.sleep(0.05)
        raise RuntimeError(f"engine {self.node_id} not ready in {timeout} s")

    def spec(self, events: str | None = None) -> EngineSpec:
        return EngineSpec(
            node_id=self.node_id, address=f"127.0.0.1:{self.port}", events=events or self.events, replay=self.replay
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProcess]]:
    """Three workers; the second has a small cache so traffic evicts."""
    fleet = [EngineProcess(f"w{i}", kv_blocks=cap) for i, cap in enumerate((400, 40, 400))]
    try:
        for e in fleet:
            e.wait_ready()
        yield fleet
    finally:
        for e in fleet:
            e.stop()


class LossyLink:
    """A real ZMQ hop between an engine's PUB and the bridge that can drop or corrupt a batch."""

    def __init__(self, upstream: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._pub.bind(self.endpoint)
        self.forwarded = 0
        self.drop = 0
        self.corrupt = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            topic, seq, payload = await self._sub.recv_multipart()
            if self.drop:
                self.drop -= 1
                continue
            if self.corrupt:
                self.corrupt -= 1
                payload = b"\x93\xc1" + payload[2:]  # an array whose first element is an invalid byte
            await self._pub.send_multipart([topic, seq, payload])
            self.forwarded += 1

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._ctx.destroy(linger=0)


class Client:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def complete(self, engine: EngineProcess, prompt: Sequence[int], max_tokens: int = 4) -> dict:
        body = {"model": MODEL, "prompt": list(prompt), "max_tokens": max_tokens}
        async with self.session.post(engine.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def engine_keys(self, engine: EngineProcess) -> set[int]:
        async with self.session.get(engine.url + "/debug/blocks") as r:
            return {b["kvgate_key"] for b in (await r.json())["blocks"]}

    async def reset(self, engine: EngineProcess) -> None:
        async with self.session.post(engine.url + "/debug/reset") as r:
            assert r.status == 200, await r.text()


def prompt_keys(prompt: Sequence[int]) -> list[BlockKey]:
    return block_keys(prompt, block_size=BS, seed=namespace_seed(MODEL))


async def node_holds(directory: Directory, node_id: str, key: int) -> bool:
    view = await directory.lookup([BlockKey(key)])
    return any(n.node.node_id == node_id and n.cached_blocks == 1 for n in view.nodes)


async def mismatches(directory: Directory, client: Client, engine: EngineProcess, universe: set[int]) -> list[str]:
    """Keys on which the directory and the worker's own block list disagree."""
    truth = await client.engine_keys(engine)
    out = []
    for k in sorted(universe | truth):
        in_dir = await node_holds(directory, engine.node_id, k)
        if in_dir != (k in truth):
            out.append(f"{k}: directory={in_dir} worker={k in truth}")
    return out


async def mirrored(
    directory: Directory, client: Client, engine: EngineProcess, universe: set[int], timeout: float = 5.0
) -> float:
    """Wait until the directory holds exactly the worker's blocks; returns how long it took."""
    t0 = time.monotonic()
    while True:
        bad = await mismatches(directory, client, engine, universe)
        if not bad:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{engine.node_id}: directory differs from the worker on {len(bad)} keys: {bad[:5]}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    async with aiohttp.ClientSession() as session:
        yield Client(session)


@pytest.fixture
async def directory(redis_url: str, key_prefix: str):
    d = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=TTL_S, index_stride=1)
    yield d
    await d.aclose()


@pytest.fixture
async def fleet(engines: list[EngineProcess], directory: Directory, client: Client):
    """The bridge following the three workers, the third through a lossy link (joined)."""
    link = LossyLink(engines[2].events)
    bridge = KVEventBridge(
        directory,
        [engines[0].spec(), engines[1].spec(), engines[2].spec(events=link.endpoint)],
        model=MODEL,
        block_size=BS,
        heartbeat_interval_s=0.3,
        replay_timeout_s=2.0,
    )
    await bridge.start()
    try:
        warm = [50_000 + i for i in range(2 * BS)]
        while link.forwarded == 0:  # the link's subscription has joined once a batch goes through
            await client.complete(engines[2], warm)
            await client.reset(engines[2])
            await asyncio.sleep(0.05)
        for e in engines:
            await mirrored(directory, client, e, set(), timeout=10)
        yield bridge, link
    finally:
        await bridge.aclose()
        await link.aclose()


def conversation(seed: int, turns: int, shared: Sequence[int]) -> list[list[int]]:
    """Growing multi-turn prompts that all start with ``shared``."""
    prompts, history = [], list(shared)
    for t in range(turns):
        history = history + [1000 + (seed * 7919 + t * 104729 + i * 31) % 60_000 for i in range(40)]
        prompts.append(list(history))
    return prompts


async def test_directory_holds_exactly_each_workers_blocks_after_traffic(
    fleet: tuple[KVEventBridge, LossyLink], engines: list[EngineProcess], directory: Directory, client: Client
) -> None:
    bridge, _ = fleet
    shared = list(range(200, 200 + 3 * BS))  # a system prompt every worker ends up holding
    universe: set[int] = set()
    for conv in range(6):
        engine = engines[conv % 3]
        for prompt in conversation(conv, turns=3, shared=shared):
            await client.complete(engine, prompt)
            universe.update(prompt_keys(prompt))
    for e in engines:
        took = await mirrored(directory, client, e, universe)
        print(f"{e.node_id}: directory mirrored the worker {took * 1000:.0f} ms after the last request")
        truth = await client.engine_keys(e)
        assert bridge.stats(e.node_id).tracked_keys == len(truth)
        assert bridge.stats(e.node_id).dropped_blocks == 0
    # the shared prefix is on every worker, and a lookup sees it on each
    view = await directory.lookup(prompt_keys(shared))
    assert {n.node.node_id: n.cached_blocks for n in view.nodes} == {e.node_id: 3 for e in engines}


async def test_evicted_blocks_leave_the_directory_within_one_second(
    fleet: tuple[KVEventBridge, LossyLink], engines: list[EngineProcess], directory: Directory, client: Client
) -> None:
    small = engines[1]  # 40 blocks: every 10-block prompt after the 4th evicts
    universe: set[int] = set()
    worst = 0.0
    evicted_total = 0
    before = await client.engine_keys(small)
    for i in range(8):
        prompt = [3000 + i * 1000 + j for j in range(10 * BS)]
        await client.complete(small, prompt)
        universe.update(prompt_keys(prompt))
        after = await client.engine_keys(small)
        evicted = before - after
        evicted_total += len(evicted)
        took = await mirrored(directory, client, small, universe | evicted, timeout=3.0)
        for k in evicted:
            assert not await node_holds(directory, small.node_id, k)
        worst = max(worst, took)
        before = after
    print(f"evictions: {evicted_total} blocks; slowest directory catch-up {worst * 1000:.0f} ms")
    assert evicted_total >= 40
    assert worst < 1.0


async def test_forced_gap_is_repaired_through_replay(
    fleet: tuple[KVEventBridge, LossyLink], engines: list[EngineProcess], directory: Directory, client: Client
) -> None:
    bridge, link = fleet
    engine = engines[2]
    repaired = bridge.stats(engine.node_id).gaps_repaired
    a = [7000 + i for i in range(6 * BS)]
    b = a[: 3 * BS] + [9000 + i for i in range(3 * BS)]
    link.drop = 1
    await client.complete(engine, a)  # its batch is lost on the link
    await client.complete(engine, b)  # the next batch shows the gap; replay fills it
    await mirrored(directory, client, engine, set(prompt_keys(a)) | set(prompt_keys(b)))
    assert link.drop == 0
    s = bridge.stats(engine.node_id)
    assert s.gaps_repaired == repaired + 1 and s.gaps_unrecoverable == 0 and s.dropped_blocks == 0


async def test_malformed_batch_is_logged_and_skipped(
    fleet: tuple[KVEventBridge, LossyLink], engines: list[EngineProcess], directory: Directory, client: Client
) -> None:
    bridge, link = fleet
    engine = engines[2]
    malformed = bridge.stats(engine.node_id).malformed_batches
    x = [11_000 + i for i in range(4 * BS)]
    y = [13_000 + i for i in range(4 * BS)]
    link.corrupt = 1
    await client.complete(engine, x)  # its batch arrives garbled: skipped, its blocks unknown
    await client.complete(engine, y)  # the bridge goes on
    deadline = time.monotonic() + 5
    while not all([await node_holds(directory, engine.node_id, k) for k in prompt_keys(y)]):
        assert time.monotonic() < deadline, "blocks after the malformed batch never arrived"
        await asyncio.sleep(0.02)
    assert bridge.stats(engine.node_id).malformed_batches == malformed + 1
    truth = await client.engine_keys(engine)
    assert set(prompt_keys(x)) <= truth  # the worker holds x ...
    assert not any([await node_holds(directory, engine.node_id, k) for k in prompt_keys(x)])  # ... the batch was lost
    # a prefix-cache reset (AllBlocksCleared) brings the directory back in step
    await client.reset(engine)
    await client.complete(engine, y)
    await mirrored(directory, client, engine, set(prompt_keys(x)) | set(prompt_keys(y)))


async def test_killed_worker_stops_being_returned_within_the_ttl(directory: Directory, client: Client) -> None:
    engine = EngineProcess("doomed", kv_blocks=100)
    try:
        await asyncio.to_thread(engine.wait_ready)
        async with KVEventBridge(directory, [engine.spec()], model=MODEL, heartbeat_interval_s=0.3) as bridge:
            prompt = [400 + i for i in range(5 * BS)]
            await client.complete(engine, prompt)
            await mirrored(directory, client, engine, set(prompt_keys(prompt)), timeout=10)
            assert (await directory.lookup(prompt_keys(prompt))).best().node.node_id == "doomed"  # type: ignore[union-attr]
            os.kill(engine.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while any(n.node.node_id == "doomed" for n in (await directory.lookup(prompt_keys(prompt))).nodes):
                assert time.monotonic() - t0 < TTL_S + 1.0, "dead worker still returned"
                await asyncio.sleep(0.02)
            gone = time.monotonic() - t0
            print(f"kill -9 → entries gone after {gone:.2f} s (TTL {TTL_S} s)")
            assert gone <= TTL_S + 0.5  # slack: our own polling on a shared 2-core machine
            assert not bridge.stats("doomed").connected
    finally:
        engine.stop()
