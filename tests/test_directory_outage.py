"""A directory that is down surfaces as one typed error, promptly, from every method — and the
client recovers by itself when the server comes back. Uses private redis-servers we may kill."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.crc import key_slot

from directory_client import DirectoryUnavailable, NodeInfo, NodeLoad, Reservation, Tier, open_directory
from tests.conftest import free_port
from directory_client.scripts import scripts
from tests.redis_servers import RedisProcess, redis_cluster
from tests.support.holding_proxy import HoldingProxy

OP_TIMEOUT_S = 0.3
# "never hangs": generous against a loaded 2-core machine, far below a hang
BOUND_S = 3.0

KEYS = [11, 22, 33, 44]


def slots_of(port: int) -> set[int]:
    """Hash slots served by the cluster primary on ``port``."""
    import redis

    with redis.Redis(port=port) as c:
        rows = c.execute_command("CLUSTER", "SLOTS")
    ranges = [(int(row[0]), int(row[1])) for row in rows if int(row[2][1]) == port]
    return {s for lo, hi in ranges for s in range(lo, hi + 1)}


def every_method(d: Any) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    return [
        ("register_node", lambda: d.register_node(NodeInfo("n1", "127.0.0.1:1"))),
        ("heartbeat", lambda: d.heartbeat("n1")),
        ("live_nodes", lambda: d.live_nodes()),
        ("record_stored", lambda: d.record_stored("n1", KEYS, Tier.CPU)),
        ("record_removed", lambda: d.record_removed("n1", KEYS[2:])),
        ("clear_node", lambda: d.clear_node("n1")),
        ("lookup", lambda: d.lookup(KEYS)),
        ("reserve", lambda: d.reserve("n1", 10)),
        ("release", lambda: d.release(Reservation("n1", 1, 10, "x|10"))),
        ("loads", lambda: d.loads()),
        ("deregister_node", lambda: d.deregister_node("n1")),
    ]


async def assert_all_unavailable(d: Any) -> None:
    for name, call in every_method(d):
        started = time.monotonic()
        with pytest.raises(DirectoryUnavailable):
            await call()
        assert time.monotonic() - started < BOUND_S, f"{name} took too long to fail"


async def cancel_midway(call: Awaitable[Any]) -> None:
    """Cancel ``call`` while it waits on the server: it raises CancelledError, not an outage."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def prime(d: Any) -> None:
    await d.register_node(NodeInfo("n1", "127.0.0.1:1"))
    await d.record_stored("n1", KEYS)
    assert (await d.lookup(KEYS)).nodes[0].cached_blocks == 4


async def test_killed_redis_raises_unavailable_everywhere_then_recovers(private_redis: RedisProcess) -> None:
    d = open_directory(private_redis.url, key_prefix="outage", op_timeout_s=OP_TIMEOUT_S, index_stride=1)
    try:
        await prime(d)
        private_redis.kill()
        await assert_all_unavailable(d)
        private_redis.start()  # same port, empty (no persistence), no scripts loaded
        assert d.breaker.is_open  # the failures opened the circuit: calls are refused at once ...
        deadline = time.monotonic() + 10
        while True:  # ... until a probe after the backoff finds the server back
            try:
                await prime(d)
                break
            except DirectoryUnavailable:
                assert time.monotonic() < deadline, "the client never recovered"
                await asyncio.sleep(0.05)
        assert not d.breaker.is_open
        r = await d.reserve("n1", 5)
        assert await d.loads() == {"n1": NodeLoad(1, 5)}
        await d.release(r)
    finally:
        await d.aclose()


async def test_a_connection_that_died_idle_is_replaced_without_failing_the_call(private_redis: RedisProcess) -> None:
    """The request path's scripts keep connections between calls: after a server restart the
    first call finds its connection dead, and must still succeed (no fail-open for it)."""
    d = open_directory(private_redis.url, key_prefix="idle", op_timeout_s=OP_TIMEOUT_S, index_stride=1)
    try:
        await prime(d)  # leaves a connection idle
        private_redis.kill()
        private_redis.start()  # empty, scripts unknown: the call also reloads its script
        r = await d.reserve("n1", 5)
        await d.release(r)
    finally:
        await d.aclose()


async def test_stalled_server_times_out_and_leaves_no_half_read_connection(private_redis: RedisProcess) -> None:
    """SIGSTOP makes the server accept nothing and answer nothing: every op must give up after the
    op timeout. After SIGCONT the server answers the abandoned requests too; a connection that
    went back to the pool half-read would hand those stale replies to later calls."""
    d = open_directory(private_redis.url, key_prefix="stall", op_timeout_s=OP_TIMEOUT_S, index_stride=1)
    other = [101, 202]
    try:
        await prime(d)
        await d.register_node(NodeInfo("n2", "127.0.0.1:2"))
        await d.record_stored("n2", other)
        assert private_redis.proc is not None
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            for call in (lambda: d.lookup(KEYS), lambda: d.loads(), lambda: d.live_nodes(), lambda: d.reserve("n1", 3)):
                started = time.monotonic()
                with pytest.raises(DirectoryUnavailable):
                    await call()
                assert time.monotonic() - started < BOUND_S
            # cancellation (Envoy dropping the stream) propagates as itself, not as an outage
            await cancel_midway(d.lookup(other))
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        for _ in range(5):
            by_node = {v.node.node_id: v.cached_blocks for v in (await d.lookup(KEYS)).nodes}
            assert by_node == {"n1": 4, "n2": 0}
            by_node = {v.node.node_id: v.cached_blocks for v in (await d.lookup(other)).nodes}
            assert by_node == {"n1": 0, "n2": 2}
            assert [n.node_id for n in await d.live_nodes()] == ["n1", "n2"]
        # the reserve that timed out may or may not have landed; either way it is one at most
        assert (await d.loads())["n1"].inflight in (0, 1)
    finally:
        await d.aclose()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_nothing_listening_raises_unavailable(scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{free_port()}" + ("/0" if scheme == "redis" else "")
    d = open_directory(url, key_prefix="nobody", op_timeout_s=OP_TIMEOUT_S, index_stride=1)
    try:
        await assert_all_unavailable(d)
    finally:
        await d.aclose()


async def test_cluster_outage_raises_unavailable() -> None:
    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="outage", op_timeout_s=OP_TIMEOUT_S, index_stride=1)
        try:
            await prime(d)
            dead_slots = slots_of(servers[0].port)
            on_dead = next(f"x{i}" for i in range(1000) if key_slot(f"outage:{{x{i}}}:blocks".encode()) in dead_slots)
            on_live = next(f"x{i}" for i in range(1000) if key_slot(f"outage:{{x{i}}}:blocks".encode()) not in dead_slots)
            servers[0].kill()  # one shard gone
            with pytest.raises(DirectoryUnavailable):
                await d.record_stored(on_dead, KEYS)
            await d.record_stored(on_live, KEYS)  # the other shards still serve their nodes
            for s in servers[1:]:
                s.kill()
            await assert_all_unavailable(d)
        finally:
            await d.aclose()


async def test_a_reserve_whose_answer_is_lost_is_given_back(private_redis: RedisProcess) -> None:
    """A reserve sent to a stalled server times out, but the server runs it when it wakes: the
    client must give that reservation back, or the node looks busy until the reservation's own
    end (up to ``max_request_s``) and the router sends its work elsewhere."""
    d = open_directory(private_redis.url, key_prefix="lost", op_timeout_s=OP_TIMEOUT_S, index_stride=1, heartbeat_ttl_s=600)
    try:
        await prime(d)
        assert private_redis.proc is not None
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DirectoryUnavailable):
                await d.reserve("n1", 300)
            await cancel_midway(d.reserve("n1", 40))  # Envoy dropped the stream meanwhile
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 3 * BOUND_S
        while time.monotonic() < deadline:
            try:
                if (await d.loads())["n1"] == NodeLoad():
                    break
            except DirectoryUnavailable:  # the circuit is open for a moment after the stall
                pass
            await asyncio.sleep(0.1)
        assert (await d.loads())["n1"] == NodeLoad()
    finally:
        await d.aclose()


async def test_a_lost_reserve_that_lands_after_its_release_is_still_given_back(private_redis: RedisProcess) -> None:
    """The reserve's packets are late; the background release of the lost answer, on a fresh
    connection, reaches the server first and finds nothing to give back. When the reserve lands
    it must not take the node's load (no one holds its token any more): else the node looks busy
    until the reservation's end (``max_request_s``, 10 minutes by default)."""
    proxy = await HoldingProxy(private_redis.port, scripts()["reserve"].sha.encode()).start()
    d = open_directory(
        f"redis://127.0.0.1:{proxy.port}/0", key_prefix="late", op_timeout_s=OP_TIMEOUT_S, index_stride=1, heartbeat_ttl_s=600
    )
    try:
        await prime(d)
        proxy.armed = True
        with pytest.raises(DirectoryUnavailable):
            await d.reserve("n1", 300, first_token_s=1.0, hold_s=2.0)
        assert proxy.held, "the reserve was not held back"
        deadline = time.monotonic() + BOUND_S
        while d._lost and time.monotonic() < deadline:  # the background release answered
            await asyncio.sleep(0.05)
        await proxy.deliver()  # the late reserve runs now
        await asyncio.sleep(0.3)
        assert (await d.loads())["n1"] == NodeLoad()
        # what marked the release falls due with the reservation's end and takes nothing away
        held = await d.reserve("n1", 50, first_token_s=30.0)
        await asyncio.sleep(2.0)
        assert (await d.loads())["n1"] == NodeLoad(1, 50)
        await d.release(held)
        assert (await d.loads())["n1"] == NodeLoad()
    finally:
        await d.aclose()
        await proxy.aclose()


async def test_a_burst_of_reserves_lost_in_a_stall_is_all_given_back_and_closing_ends_the_retries(
    private_redis: RedisProcess,
) -> None:
    """Hundreds of requests reserve while the server is stalled (before the circuit opens, every
    one is sent): each lost answer gets one background release, and when the server wakes all of
    them are given back; a client closed meanwhile leaves no retry running."""
    d = open_directory(private_redis.url, key_prefix="burst", op_timeout_s=OP_TIMEOUT_S, index_stride=1, heartbeat_ttl_s=600)
    closed = open_directory(private_redis.url, key_prefix="burst2", op_timeout_s=OP_TIMEOUT_S, index_stride=1, heartbeat_ttl_s=600)
    try:
        await prime(d)
        await prime(closed)
        assert private_redis.proc is not None
        os.kill(private_redis.proc.pid, signal.SIGSTOP)
        try:
            results = await asyncio.gather(*(d.reserve("n1", 10) for _ in range(300)), return_exceptions=True)
            assert all(isinstance(r, DirectoryUnavailable) for r in results)
            assert 0 < len(d._lost) <= 300
            with pytest.raises(DirectoryUnavailable):
                await closed.reserve("n1", 10)
            assert len(closed._lost) == 1
            lost = set(closed._lost)
            await closed.aclose()
            await asyncio.sleep(0)
            assert all(t.done() for t in lost)
        finally:
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5 * BOUND_S
        while (d._lost or (await loads_or_none(d)) != NodeLoad()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not d._lost
        assert (await d.loads())["n1"] == NodeLoad()
    finally:
        await d.aclose()


async def loads_or_none(d: Any) -> NodeLoad | None:
    try:
        return (await d.loads())["n1"]
    except DirectoryUnavailable:
        return None
