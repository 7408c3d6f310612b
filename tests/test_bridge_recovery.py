"""Recovery: after each fault the directory again holds exactly what the engine holds, within
seconds, and nothing true is wiped on the way. Real simulated-engine processes, real ``kvgate
bridge`` processes or in-process bridges, a real Redis under a private key prefix; each engine's
``GET /debug/blocks`` is the ground truth. Every test prints the recovery time it measured.

Faults: the bridge killed and restarted (a restart of ``kvgate serve`` or ``kvgate bridge``), a
second replica's bridge starting beside a running one, the engine restarted, the event socket
dropped and back. Before: a starting bridge cleared the node first (a second replica's bridge
took ``e1`` from 32 blocks to 0 while the engine held them), and a killed-then-restarted one found
nothing to replay (current vLLM's 4-frame replay answers were refused), leaving 0 blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio
import zmq
import zmq.asyncio

from directory_client import open_directory
from directory_client.types import Directory
from tests.conftest import REPO, free_port
from tests.test_bridge_processes import BS, MODEL, Client, EngineProcess, mirrored, node_holds, prompt_keys
from workers.bridge import KVEventBridge

TTL_S = 1.5
INTERVAL_S = TTL_S / 3


class Engine(EngineProcess):
    """A simulated engine that can be killed and started again on the same ports."""

    def __init__(self, node_id: str, *, replay_buffer: int = 10_000) -> None:
        self.node_id = node_id
        self.port, self.events, self.replay = free_port(), f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.replay_buffer = replay_buffer
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "workers.engine", "--port", str(self.port), "--model", MODEL,
                "--time-scale", "0", "--kv-blocks", "400", "--node-id", self.node_id,
                "--events-endpoint", self.events, "--replay-endpoint", self.replay,
                "--replay-buffer", str(self.replay_buffer),
            ],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip


class BridgeProcess:
    """``kvgate bridge`` following one engine (events possibly through a relay)."""

    def __init__(self, engine: Engine, redis_url: str, key_prefix: str, events: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "gateway.cli", "bridge", "--directory", redis_url, "--key-prefix", key_prefix,
                "--index-stride", "1", "--model", MODEL, "--heartbeat-ttl", str(TTL_S), "--log-level", "WARNING",
                "--engine", f"node_id={engine.node_id},address=127.0.0.1:{engine.port},"
                f"events={events or engine.events},replay={engine.replay}",
            ],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    async with aiohttp.ClientSession() as session:
        yield Client(session)


@pytest.fixture
async def directory(redis_url: str, key_prefix: str) -> AsyncIterator[Directory]:
    d = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=TTL_S, index_stride=1)
    yield d
    await d.aclose()


@pytest.fixture
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    e = Engine(f"rec-{request.node.name[5:25].replace('_', '-')}", replay_buffer=getattr(request, "param", 10_000))
    try:
        await asyncio.to_thread(e.wait_ready)
        yield e
    finally:
        e.stop()


def chats(start: int, n: int = 4) -> list[list[int]]:
    return [[start + c * 1000 + i for i in range(6 * BS)] for c in range(n)]


async def traffic(client: Client, engine: Engine, prompts: list[list[int]]) -> set[int]:
    for p in prompts:
        await client.complete(engine, p)
    return {k for p in prompts for k in prompt_keys(p)}


async def watch_floor(redis_url: str, key_prefix: str, node_id: str, keys: set[int], stop: asyncio.Event) -> int:
    """The fewest of ``keys`` recorded for the node while watching, read straight from its Redis
    hash (whether or not the node is live at that instant: what a replica wipes is what counts)."""
    client = redis.asyncio.from_url(redis_url)
    blocks = f"{key_prefix}:{{{node_id}}}:blocks"
    fields = [k.to_bytes(8, "big") for k in keys]
    floor = len(keys)
    try:
        while not stop.is_set():
            floor = min(floor, sum(v is not None for v in await client.hmget(blocks, fields)))
            await asyncio.sleep(0.01)
    finally:
        await client.aclose()
    return floor


async def is_live(directory: Directory, node_id: str) -> bool:
    return any(n.node_id == node_id for n in await directory.live_nodes())


async def until_live(directory: Directory, node_id: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await is_live(directory, node_id):
        assert time.monotonic() < deadline, f"{node_id} never registered"
        await asyncio.sleep(0.05)


async def test_a_killed_and_restarted_bridge_rebuilds_the_node(
    engine: Engine, directory: Directory, client: Client, redis_url: str, key_prefix: str
) -> None:
    first = BridgeProcess(engine, redis_url, key_prefix)
    second = None
    try:
        universe = await traffic(client, engine, chats(100))
        await mirrored(directory, client, engine, universe, timeout=20)
        first.kill()  # kill -9: no final flush, its lease and registration lapse on their own
        more = await traffic(client, engine, chats(20_000, 2))  # the engine goes on meanwhile
        t0 = time.monotonic()
        second = BridgeProcess(engine, redis_url, key_prefix)
        took = await mirrored(directory, client, engine, universe | more, timeout=15)
        took = time.monotonic() - t0
        print(f"\nbridge killed and restarted: directory equal to the engine {took:.2f} s after the restart "
              f"(lease {2 * INTERVAL_S:.1f} s, TTL {TTL_S} s)")  # fmt: skip
        assert took < 2 * TTL_S + 2.0
    finally:
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.parametrize("engine", [4], indirect=True)
async def test_a_restarted_bridge_whose_history_is_gone_keeps_what_the_directory_knows(
    engine: Engine, directory: Directory, client: Client, redis_url: str, key_prefix: str
) -> None:
    """The engine kept only its last 4 batches: a restarted bridge cannot rebuild the older blocks,
    so it must not clear them (they are still cached) — it adds what it can replay."""
    first = BridgeProcess(engine, redis_url, key_prefix)
    second = None
    try:
        await until_live(directory, engine.node_id)
        old = await traffic(client, engine, chats(300, 6))
        await mirrored(directory, client, engine, old, timeout=20)
        first.kill()
        new = await traffic(client, engine, chats(40_000, 2))
        t0 = time.monotonic()
        second = BridgeProcess(engine, redis_url, key_prefix)
        took = await mirrored(directory, client, engine, old | new, timeout=15)
        print(f"\nbridge restarted past the engine's replay buffer: directory equal {time.monotonic() - t0:.2f} s later, "
              f"old entries kept")  # fmt: skip
        assert took < 2 * TTL_S + 2.0
    finally:
        first.kill()
        if second is not None:
            second.kill()


async def test_a_second_replica_never_wipes_the_node_and_takes_over_when_the_first_leaves(
    engine: Engine, directory: Directory, client: Client, redis_url: str, key_prefix: str
) -> None:
    first = BridgeProcess(engine, redis_url, key_prefix)
    second_dir = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=TTL_S, index_stride=1)
    second = KVEventBridge(second_dir, [engine.spec()], model=MODEL, block_size=BS, heartbeat_interval_s=INTERVAL_S)
    try:
        universe = await traffic(client, engine, chats(500))
        await mirrored(directory, client, engine, universe, timeout=20)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_floor(redis_url, key_prefix, engine.node_id, universe, stop))
        await second.start()
        deadline = time.monotonic() + 3 * TTL_S
        while second.stats(engine.node_id).next_seq is None or time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        floor = await watcher
        assert floor == len(universe), f"the second replica wiped {len(universe) - floor} of {len(universe)} entries"
        s = second.stats(engine.node_id)
        assert not s.writer and s.tracked_keys == len(await client.engine_keys(engine))  # follows, writes nothing
        # the first replica goes away: the second takes the node over and keeps it in step
        first.kill()
        t0 = time.monotonic()
        more = await traffic(client, engine, chats(60_000, 2))
        while not second.stats(engine.node_id).writer:
            assert time.monotonic() - t0 < 3 * TTL_S, "the follower never took over"
            await asyncio.sleep(0.02)
        took = await mirrored(directory, client, engine, universe | more, timeout=10)
        took = time.monotonic() - t0
        print(f"\nsecond replica: never below {floor}/{len(universe)} entries while starting; took over and "
              f"equal to the engine {took:.2f} s after the first was killed")  # fmt: skip
    finally:
        first.kill()
        await second.aclose(deregister=False)
        await second_dir.aclose()


async def test_an_engine_restart_is_mirrored(engine: Engine, directory: Directory, client: Client) -> None:
    async with KVEventBridge(
        directory, [engine.spec()], model=MODEL, block_size=BS, heartbeat_interval_s=INTERVAL_S
    ) as bridge:
        before = await traffic(client, engine, chats(700))
        await mirrored(directory, client, engine, before, timeout=20)
        os.kill(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait()
        engine.start()
        await asyncio.to_thread(engine.wait_ready)
        t0 = time.monotonic()
        after = await traffic(client, engine, chats(80_000, 2))
        took = await mirrored(directory, client, engine, before | after, timeout=15)
        took = time.monotonic() - t0
        print(f"\nengine restarted: old entries gone, new ones in, {took:.2f} s after it was ready")
        assert not any([await node_holds(directory, engine.node_id, k) for k in before - after])
        assert bridge.stats(engine.node_id).writer


async def test_a_bridge_whose_lease_lapsed_rewrites_what_a_gateway_cleared(
    engine: Engine, directory: Directory, client: Client, redis_url: str, key_prefix: str
) -> None:
    """The bridge stalled past its lease; a gateway's keeper saw no writer and cleared the node.
    Taking the lease again, the bridge must rewrite the node, not go on as if it were intact."""
    async with KVEventBridge(
        directory, [engine.spec()], model=MODEL, block_size=BS, heartbeat_interval_s=INTERVAL_S
    ) as bridge:
        held = await traffic(client, engine, chats(900))
        await mirrored(directory, client, engine, held, timeout=20)
        async with redis.asyncio.Redis.from_url(redis_url) as r:  # the stall, as Redis saw it
            await r.delete(f"{key_prefix}:{{{engine.node_id}}}:writer")
        assert await directory.clear_if_unwritten(engine.node_id)
        assert not any([await node_holds(directory, engine.node_id, k) for k in held])
        t0 = time.monotonic()
        await mirrored(directory, client, engine, held, timeout=10)
        print(f"\nlapsed lease taken again, node rewritten in {time.monotonic() - t0:.2f} s")
        assert bridge.stats(engine.node_id).writer


class Relay:
    """A real ZMQ hop carrying the engine's events; closing it drops the bridge's socket."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._task: asyncio.Task[None] | None = None
        self.open()

    @property
    def is_open(self) -> bool:
        return self._task is not None

    def open(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.upstream)
        pub = self._ctx.socket(zmq.PUB)
        pub.bind(self.endpoint)
        self._task = asyncio.create_task(self._run(sub, pub))

    async def _run(self, sub: zmq.asyncio.Socket, pub: zmq.asyncio.Socket) -> None:
        while True:
            await pub.send_multipart(await sub.recv_multipart())

    async def close(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self._ctx.destroy(linger=0)


async def test_a_dropped_event_socket_is_mirrored_after_it_comes_back(
    engine: Engine, directory: Directory, client: Client
) -> None:
    relay = Relay(engine.events)
    spec = engine.spec(events=relay.endpoint)
    try:
        async with KVEventBridge(directory, [spec], model=MODEL, block_size=BS, heartbeat_interval_s=INTERVAL_S) as bridge:
            before: set[int] = set()
            while not before or not await is_live(directory, engine.node_id):
                before |= await traffic(client, engine, chats(900, 1))
                await asyncio.sleep(0.05)
            before |= await traffic(client, engine, chats(1900, 3))
            await mirrored(directory, client, engine, before, timeout=20)
            await relay.close()
            t_drop = time.monotonic()
            while await is_live(directory, engine.node_id):
                assert time.monotonic() - t_drop < 5, "node still live after its socket dropped"
                await asyncio.sleep(0.02)
            retired = time.monotonic() - t_drop
            during = await traffic(client, engine, chats(100_000, 2))  # events the bridge never sees live
            relay.open()
            t0 = time.monotonic()
            took = await mirrored(directory, client, engine, before | during, timeout=15)
            took = time.monotonic() - t0
            print(f"\nevent socket dropped: node retired after {retired:.2f} s; socket back: directory equal "
                  f"{took:.2f} s later")  # fmt: skip
            assert bridge.stats(engine.node_id).connected
    finally:
        await relay.close()
