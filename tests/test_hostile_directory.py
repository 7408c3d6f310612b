"""The directory's Redis under load and in trouble (issue 15, item 11), against a private redis-server.

Before: 200 concurrent lookups opened 200 connections (the pool's limit of 64 was bypassed by the
request path's own connections), and a 2 s stall of Redis made every request open a fresh one
(43 more). What Redis sees now: at most ``max_connections`` connections from one replica however
many requests wait, and while Redis fails, kvgate stops calling it: after a few failures the
directory's circuit opens (``kvgate_directory_circuit_open`` 1, calls fail open at once with
``DirectoryUnavailable``), one probe is sent after a backoff, and the first success closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import prometheus_client
import pytest
import redis

from directory_client import DirectoryUnavailable, NodeInfo, Tier, open_directory
from directory_client.breaker import CircuitBreaker
from directory_client.redis_base import check_server_version

KEYS = list(range(1, 65))


def connections(url: str) -> tuple[int, int]:
    """(clients connected now, connections ever accepted), as the server counts them."""
    with redis.Redis.from_url(url) as c:
        clients, stats = c.info("clients"), c.info("stats")
    return clients["connected_clients"] - 1, stats["total_connections_received"]


def gauge(name: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name)


async def test_a_burst_of_lookups_never_opens_more_than_the_pool(private_redis) -> None:
    d = open_directory(private_redis.url, key_prefix="storm", max_connections=16, op_timeout_s=2.0)
    try:
        await d.register_node(NodeInfo("n1", "10.0.0.1:8000"))
        await d.record_stored("n1", KEYS, Tier.GPU)
        views = await asyncio.gather(*(d.lookup(KEYS) for _ in range(200)))
        assert all(v.nodes[0].cached_blocks == len(KEYS) for v in views)
        open_now, _ = connections(private_redis.url)
        assert open_now <= 16 + 1, f"{open_now} connections for a pool of 16"  # + the client's own
    finally:
        await d.aclose()


async def test_while_redis_stalls_the_circuit_opens_and_no_connection_storm_follows(private_redis) -> None:
    d = open_directory(private_redis.url, key_prefix="stall", max_connections=16, op_timeout_s=0.1)
    await d.register_node(NodeInfo("n1", "10.0.0.1:8000"))
    await d.lookup(KEYS)
    _, accepted_before = connections(private_redis.url)
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    failures, fast = 0, 0
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # ~10 requests a 50 ms, as a loaded gateway would
            results = await asyncio.gather(*(d.lookup(KEYS) for _ in range(10)), return_exceptions=True)
            assert all(isinstance(r, DirectoryUnavailable) for r in results)
            failures += len(results)
            fast += sum("circuit open" in str(r) for r in results)
            await asyncio.sleep(0.05)
        assert gauge("kvgate_directory_circuit_open") == 1.0
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    assert fast >= failures * 0.8, f"only {fast} of {failures} failed fast"
    # the backoff ends, one probe finds Redis well again, and lookups are answered
    deadline = time.monotonic() + 15
    while True:
        try:
            view = await d.lookup(KEYS)
            break
        except DirectoryUnavailable:
            assert time.monotonic() < deadline, "the circuit never closed"
            await asyncio.sleep(0.1)
    assert view.nodes and gauge("kvgate_directory_circuit_open") == 0.0
    _, accepted_after = connections(private_redis.url)
    assert accepted_after - accepted_before <= 16 + 4, f"{accepted_after - accepted_before} connections opened"
    await d.aclose()


def test_the_breaker_backs_off_exponentially_and_lets_one_probe_through() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=3, base_s=0.5, max_s=2.0, clock=lambda: now[0])
    for _ in range(3):
        assert b.allow()
        b.failure()
    assert not b.allow()  # open for 0.5 s
    now[0] += 0.5
    assert b.allow() and not b.allow()  # one probe at a time
    b.failure()  # the probe failed: open again, for twice as long
    now[0] += 0.9
    assert not b.allow()
    now[0] += 0.1
    assert b.allow()
    b.success()
    assert b.allow() and b.allow()  # closed


def test_redis_older_than_7_is_refused_with_a_clear_error() -> None:
    check_server_version({"redis_version": "7.0.15"})
    with pytest.raises(Exception, match="Redis >= 7"):
        check_server_version({"redis_version": "6.2.14"})


async def test_one_stalled_cluster_shard_does_not_fail_the_lookup_within_its_budget() -> None:
    """Issue 15, item 14: on Redis Cluster a lookup asks every shard at once, and one stalled
    shard failed the whole lookup (the request failed open). What a request gets now: the nodes on
    the healthy shards, within ``shard_timeout_s``; the stalled shard's nodes are left out
    (``kvgate_directory_shard_failures_total``) and the lookup fails only if every shard does."""
    from redis.crc import key_slot

    from directory_client.redis_base import NodeKeys
    from tests.redis_servers import redis_cluster
    from tests.test_directory_outage import slots_of

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="shards", op_timeout_s=1.0, live_cache_s=0.0, shard_timeout_s=0.05)
        try:
            owners = {s.port: slots_of(s.port) for s in servers}
            nodes: dict[int, str] = {}  # one node per shard
            for i in range(200):
                slot = key_slot(NodeKeys("shards", f"n{i}").meta.encode())
                port = next(p for p, slots in owners.items() if slot in slots)
                nodes.setdefault(port, f"n{i}")
            registry_port = next(p for p, slots in owners.items() if key_slot(b"{shards}:registry") in slots)
            deadline = time.monotonic() + 15
            for node_id in nodes.values():
                while True:  # a new cluster may still say "cluster down" for a moment
                    try:
                        await d.register_node(NodeInfo(node_id, f"10.0.0.{len(node_id)}:8000"))
                        await d.record_stored(node_id, KEYS, Tier.GPU)
                        break
                    except DirectoryUnavailable:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.2)
            stalled = next(s for s in servers if s.port != registry_port)
            before = gauge("kvgate_directory_shard_failures_total") or 0.0
            os.kill(stalled.proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                view = await asyncio.wait_for(d.lookup(KEYS), 0.5)  # a request's lookup budget
                took = time.monotonic() - started
            finally:
                os.kill(stalled.proc.pid, signal.SIGCONT)
            assert {nv.node.node_id for nv in view.nodes} == {n for p, n in nodes.items() if p != stalled.port}
            assert all(nv.cached_blocks == len(KEYS) for nv in view.nodes)
            assert took < 0.3
            assert gauge("kvgate_directory_shard_failures_total") >= before + 1
        finally:
            await d.aclose()


async def test_a_dead_cluster_shard_holding_the_registry_costs_no_lookup_its_budget() -> None:
    """One primary of a Redis Cluster dies, the one holding the node registry. Before: every
    lookup once the cached node list aged (1 s) asked the dead shard again inside the request's
    25 ms budget, and each registration (the static fleet's keeper, every tick) threw the cached
    list away, so lookups failed until the shard came back and the circuit breaker opened for the
    whole directory. What a request gets now: the nodes on the live shards (all of them unless one
    is late on a busy machine), never a failure; the dead shard is tried again in the background,
    not on the request path."""
    from tests.redis_servers import redis_cluster

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="dead", op_timeout_s=0.5, shard_timeout_s=0.02, index_stride=1, heartbeat_ttl_s=600)
        try:
            nodes, registry_port = _shard_nodes("dead", servers, per_shard=2)
            await _register(d, [n for ns in nodes.values() for n in ns])
            await d.lookup(KEYS)  # the node list is known
            live = {n for p, ns in nodes.items() if p != registry_port for n in ns}
            next(s for s in servers if s.port == registry_port).kill()

            answered, complete, failed = 0, 0, []
            started = time.monotonic()
            while time.monotonic() - started < 3.0:
                try:
                    view = await asyncio.wait_for(d.lookup(KEYS), 0.025)  # a request's lookup budget
                    seen = {nv.node.node_id for nv in view.nodes}
                    assert seen <= live  # the dead shard's nodes are left out, nothing invented
                    answered += 1
                    complete += seen == live  # a live shard late under the 20 ms budget (a busy machine) drops its part
                except (DirectoryUnavailable, asyncio.TimeoutError) as e:
                    failed.append(repr(e))
                with contextlib.suppress(DirectoryUnavailable):
                    await d.register_node(NodeInfo(sorted(live)[0], "10.0.0.1:8000"))  # the keeper's tick
                await asyncio.sleep(0.05)
            assert answered >= 30, failed[:5]
            assert complete >= 0.8 * answered, (complete, answered)
            assert len(failed) <= 2, failed  # the lookup that found the shard dead, and one late on a busy machine
            assert not d.breaker.is_open
            assert gauge("kvgate_directory_shards_down") == 1  # what an operator sees: one shard out, circuit closed

            next(s for s in servers if s.port == registry_port).start()  # back, empty: its nodes register again
            back = nodes[registry_port][0]
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(DirectoryUnavailable):
                    await d.register_node(NodeInfo(back, "10.0.0.1:8000"))
                    view = await d.lookup(KEYS)
                    if back in {nv.node.node_id for nv in view.nodes}:
                        break
                assert time.monotonic() < deadline, "the shard never came back into lookups"
                await asyncio.sleep(0.2)
            assert gauge("kvgate_directory_shards_down") == 0
        finally:
            await d.aclose()


@contextlib.asynccontextmanager
async def _one_shard_dead(prefix: str):
    """A directory on a fresh Redis Cluster, one node registered on a primary that is then killed
    and one on the registry's (live) primary: (directory, node on the dead shard, node on a live one)."""
    from tests.redis_servers import redis_cluster

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix=prefix, op_timeout_s=0.3, index_stride=1, heartbeat_ttl_s=600)
        try:
            nodes, registry_port = _shard_nodes(prefix, servers)
            dead = next(s for s in servers if s.port != registry_port)
            on_dead, on_live = nodes[dead.port][0], nodes[registry_port][0]
            await _register(d, [on_dead, on_live])
            dead.kill()
            yield d, on_dead, on_live
        finally:
            await d.aclose()


def _shard_nodes(prefix: str, servers, per_shard: int = 1) -> tuple[dict[int, list[str]], int]:
    """Node ids whose keys live on each primary (by port), and the port holding the registry."""
    from redis.crc import key_slot

    from directory_client.redis_base import NodeKeys
    from tests.test_directory_outage import slots_of

    owners = {s.port: slots_of(s.port) for s in servers}
    nodes: dict[int, list[str]] = {p: [] for p in owners}
    for i in range(1000):
        slot = key_slot(NodeKeys(prefix, f"n{i}").meta.encode())
        port = next(p for p, slots in owners.items() if slot in slots)
        if len(nodes[port]) < per_shard:
            nodes[port].append(f"n{i}")
    registry = next(p for p, slots in owners.items() if key_slot(f"{{{prefix}}}:registry".encode()) in slots)
    return nodes, registry


async def _register(d, node_ids) -> None:
    deadline = time.monotonic() + 15
    for node_id in node_ids:
        while True:  # a new cluster may still say "cluster down" for a moment
            try:
                await d.register_node(NodeInfo(node_id, "10.0.0.1:8000"))
                await d.record_stored(node_id, KEYS, Tier.GPU)
                break
            except DirectoryUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)


async def test_a_call_refused_for_a_dead_shard_does_not_wedge_the_circuit() -> None:
    """A burst of calls reaches a shard that just died, and the directory's circuit opens. After
    the backoff one probe is let through; when that probe is a call on the dead shard's keys it is
    refused at once (the shard is known down) without an answer either way. Before: the breaker
    counted that neither as a success nor a failure, so its probe never ended and the circuit
    refused every call, on every shard, until the process restarted. Now the next call probes."""
    async with _one_shard_dead("wedge") as (d, on_dead, on_live):
        await asyncio.gather(*(d.heartbeat(on_dead) for _ in range(d.breaker.threshold)), return_exceptions=True)
        assert d.breaker.is_open
        await asyncio.sleep(d.breaker.retry_in_s + 0.05)
        with pytest.raises(DirectoryUnavailable, match="ShardDown"):
            await d.heartbeat(on_dead)  # the probe, refused before it is sent
        deadline = time.monotonic() + 10
        while True:
            try:
                await d.heartbeat(on_live)
                break
            except DirectoryUnavailable as e:
                assert time.monotonic() < deadline, f"the circuit never let a call through again: {e}"
                await asyncio.sleep(0.1)
        assert not d.breaker.is_open


async def test_a_session_on_a_dead_cluster_shard_costs_its_hint_not_every_lookup() -> None:
    """A shard holding no node but some sessions' keys dies. A lookup with such a session reads the
    session beside the fan-out. Before: that read went to the dead primary on every lookup, which
    made the cluster client drop every shard's connections (the live shards' answers were lost
    too) and counted against the circuit breaker: lookups failed until the circuit opened for the
    whole directory. Now the read fails once, the shard is probed apart, and later lookups answer
    without the session's hint."""
    from redis.crc import key_slot

    from tests.redis_servers import redis_cluster
    from tests.test_directory_outage import slots_of

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="sess", op_timeout_s=0.5, shard_timeout_s=0.02, index_stride=1, heartbeat_ttl_s=600)
        try:
            nodes, registry_port = _shard_nodes("sess", servers)
            dead = next(s for s in servers if s.port != registry_port)
            live = {n for p, ns in nodes.items() if p != dead.port for n in ns}
            await _register(d, sorted(live))
            dead_slots = slots_of(dead.port)
            session = next(f"s{i}" for i in range(1000) if key_slot(d._session_key(f"s{i}").encode()) in dead_slots)
            await d.record_session(session, sorted(live)[0], 60)
            assert (await d.lookup(KEYS, session)).session_node == sorted(live)[0]
            dead.kill()

            answered, failed = 0, []
            started = time.monotonic()
            while time.monotonic() - started < 3.0:
                try:
                    view = await asyncio.wait_for(d.lookup(KEYS, session), 0.025)  # a request's lookup budget
                    assert {nv.node.node_id for nv in view.nodes} <= live  # (a busy machine: a live shard late once)
                    answered += 1
                except (DirectoryUnavailable, asyncio.TimeoutError) as e:
                    failed.append(repr(e))
                with contextlib.suppress(DirectoryUnavailable):
                    await d.record_session(session, sorted(live)[0], 60)  # the request's answer records it
                await asyncio.sleep(0.05)
            assert answered >= 30, failed[:5]  # before: none
            assert len(failed) <= 4, failed  # the lookup that found the shard dead (and a busy machine's odd one)
            assert not d.breaker.is_open
        finally:
            await d.aclose()


async def test_a_shard_slow_once_takes_releases_again_at_once() -> None:
    """One lookup finds a shard slower than its budget (a fork, a long script): the shard is left
    out of lookups for a second. Before: every call on its keys was refused for that second too,
    so the releases of requests ending then were lost and their nodes looked busy until the
    reservations' own end (up to max_request_s). Now the shard is probed at once: calls on its keys
    go again as soon as it answers, and only lookups keep leaving it out for the second."""
    from directory_client.redis_cluster import SHARD_RETRY_S
    from tests.redis_servers import redis_cluster

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="once", op_timeout_s=1.0, shard_timeout_s=0.05, index_stride=1, heartbeat_ttl_s=600)
        try:
            nodes, registry_port = _shard_nodes("once", servers)
            slow = next(s for s in servers if s.port != registry_port)
            node_id = nodes[slow.port][0]
            await _register(d, [n for ns in nodes.values() for n in ns])
            reservation = await d.reserve(node_id, 100)
            os.kill(slow.proc.pid, signal.SIGSTOP)
            try:
                view = await d.lookup(KEYS)
            finally:
                os.kill(slow.proc.pid, signal.SIGCONT)
            assert node_id not in {nv.node.node_id for nv in view.nodes}
            await asyncio.sleep(0.2)
            await d.release(reservation)  # the request ended: its load is given back
            assert node_id not in {nv.node.node_id for nv in (await d.lookup(KEYS)).nodes}  # lookups: still left out
            await asyncio.sleep(SHARD_RETRY_S)
            view = await d.lookup(KEYS)
            assert {nv.node.node_id: nv.load.inflight for nv in view.nodes}[node_id] == 0
        finally:
            await d.aclose()


async def test_a_stalled_cluster_shard_holding_the_registry_costs_no_lookup_its_budget() -> None:
    """The registry's shard stalls (SIGSTOP: no answer, no reset) and holds no node, so only the
    registry read meets the stall. Before: once the cached node list aged (1 s), every lookup read
    the registry again under the op timeout, far beyond the request's budget, so each one timed
    out and nothing marked the shard down. Now the registry is
    read within ``shard_timeout_s``, and while its shard is down the last known list is used."""
    from tests.redis_servers import redis_cluster

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="stallreg", op_timeout_s=0.5, shard_timeout_s=0.02, index_stride=1, heartbeat_ttl_s=600)
        try:
            nodes, registry_port = _shard_nodes("stallreg", servers)
            live = {n for p, ns in nodes.items() if p != registry_port for n in ns}
            await _register(d, sorted(live))  # none on the registry's shard: only the registry read meets the stall
            await d.lookup(KEYS)  # the node list is known
            stalled = next(s for s in servers if s.port == registry_port)
            os.kill(stalled.proc.pid, signal.SIGSTOP)
            try:
                answered, failed = 0, []
                started = time.monotonic()
                while time.monotonic() - started < 3.0:
                    try:
                        view = await asyncio.wait_for(d.lookup(KEYS), 0.025)  # a request's lookup budget
                        assert {nv.node.node_id for nv in view.nodes} <= live  # (a busy machine: a live shard late once)
                        answered += 1
                    except (DirectoryUnavailable, asyncio.TimeoutError) as e:
                        failed.append(repr(e))
                    await asyncio.sleep(0.05)
            finally:
                os.kill(stalled.proc.pid, signal.SIGCONT)
            assert answered >= 30, failed[:5]
            assert len(failed) <= 2, failed  # the lookups that found the shard stalled
        finally:
            await d.aclose()


async def test_a_dead_shard_failed_over_to_its_replica_takes_calls_again() -> None:
    """A primary dies and its replica takes its slots over. Before: calls on the shard's keys were
    refused (known down) without being sent, so nothing made the cluster client read the new slot
    map, and the probe kept pinging the dead primary: the node's heartbeats, reserves, releases and
    lookups were refused for good. Now the probe reads the slot map again while its node does not
    answer, and a primary that left the map ends the wait."""
    import redis as sync_redis
    from redis.crc import key_slot

    from directory_client.redis_base import NodeKeys
    from tests.redis_servers import redis_cluster

    with redis_cluster(replicas=1) as (url, servers):
        d = open_directory(url, key_prefix="failover", op_timeout_s=0.3, shard_timeout_s=0.05, index_stride=1, heartbeat_ttl_s=600)
        try:
            with sync_redis.Redis(port=servers[0].port) as c:
                rows = c.execute_command("CLUSTER", "SLOTS")
            slot = key_slot(NodeKeys("failover", "n0").meta.encode())
            row = next(r for r in rows if int(r[0]) <= slot <= int(r[1]))
            primary = next(s for s in servers if s.port == int(row[2][1]))
            replica = next(s for s in servers if s.port == int(row[3][1]))
            await _register(d, ["n0"])
            primary.kill()
            with pytest.raises(DirectoryUnavailable):
                await d.heartbeat("n0")  # finds the primary dead
            with sync_redis.Redis(port=replica.port) as c:
                c.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")  # as the cluster's own vote would
            deadline = time.monotonic() + 10
            while True:
                try:
                    await d.heartbeat("n0")
                    break
                except DirectoryUnavailable as e:
                    assert time.monotonic() < deadline, f"calls on the failed-over shard never went again: {e}"
                    await asyncio.sleep(0.2)
            assert [nv.node.node_id for nv in (await d.lookup(KEYS)).nodes] == ["n0"]
        finally:
            await d.aclose()


async def test_a_reserve_refused_for_a_down_shard_is_not_given_back_for_minutes() -> None:
    """A reserve on a node whose shard is known down is refused before it is sent. Before, it was
    taken for a reserve whose answer was lost, and released in the background until its end (up to
    ``max_request_s``): a task retrying twice a second for each refused request."""
    from tests.redis_servers import redis_cluster

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="notsent", op_timeout_s=0.3, index_stride=1, heartbeat_ttl_s=600)
        try:
            nodes, registry_port = _shard_nodes("notsent", servers)
            dead = next(s for s in servers if s.port != registry_port)
            node_id = nodes[dead.port][0]
            await _register(d, [node_id])
            dead.kill()
            with pytest.raises(DirectoryUnavailable):
                await d.heartbeat(node_id)  # finds the shard dead
            with pytest.raises(DirectoryUnavailable, match="ShardDown"):
                await d.reserve(node_id, 10)
            assert not d._lost
        finally:
            await d.aclose()


async def test_plain_calls_on_a_dead_shard_are_refused_once_it_is_known_down() -> None:
    """The calls that are not scripts (a node's writer lease, its hot prefixes, the draining set)
    went to a dead primary every time. Before: each such call reached the dead shard again (the
    cluster client then drops and rebuilds every shard's connections), and none of them marked the
    shard down. What the caller sees now: the first call fails open and marks the shard down, the
    next are refused at once ("ShardDown") until the background probe finds it answering, and calls
    on live shards go on."""
    async with _one_shard_dead("plain") as (d, on_dead, on_live):
        with pytest.raises(DirectoryUnavailable) as first:
            await d.writer(on_dead)
        assert "ShardDown" not in str(first.value)  # this one was sent, and found the shard dead
        assert gauge("kvgate_directory_shards_down") == 1
        for call in (lambda: d.writer(on_dead), lambda: d.hot_prefixes(on_dead, 4), lambda: d.clear_node(on_dead)):
            with pytest.raises(DirectoryUnavailable, match="ShardDown"):
                await call()
        assert await d.writer(on_live) is None  # the live shards answer
        assert await d.draining() == frozenset()
        assert not d.breaker.is_open


@pytest.mark.parametrize("seen_down_first", [False, True])
async def test_static_nodes_stay_alive_while_the_registry_shard_is_down(seen_down_first: bool) -> None:
    """The registry's shard dies; the static fleet's keeper goes on registering its healthy nodes
    (one pipeline per node: its meta on the node's shard, its registry entry on the dead one).
    Before: a pipeline's failure never marked its shard down, so each registration reached the
    dead primary and counted against the circuit breaker, which opened for the whole directory;
    and once a lookup had marked the shard down, the whole pipeline was refused, so no node's
    heartbeat deadline moved and after the heartbeat TTL every node on the live shards vanished
    from lookups (each request failed open). Now each shard's part is sent, or refused, alone."""
    from tests.redis_servers import redis_cluster

    ttl_s = 1.0
    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="keep", op_timeout_s=0.3, index_stride=1, heartbeat_ttl_s=ttl_s, live_cache_s=0.0)
        try:
            nodes, registry_port = _shard_nodes("keep", servers)
            live = sorted(n for p, ns in nodes.items() if p != registry_port for n in ns)
            await _register(d, live)
            await d.lookup(KEYS)  # the node list is known
            next(s for s in servers if s.port == registry_port).kill()
            if seen_down_first:
                await d.lookup(KEYS)  # its registry read finds the shard dead
            started = time.monotonic()
            while time.monotonic() - started < 3 * ttl_s:
                for node_id in live:  # the keeper's tick
                    with contextlib.suppress(DirectoryUnavailable):
                        await d.register_node(NodeInfo(node_id, "10.0.0.1:8000"))
                await asyncio.sleep(ttl_s / 3)
            view = await d.lookup(KEYS)
            assert sorted(nv.node.node_id for nv in view.nodes) == live
        finally:
            await d.aclose()


async def test_a_shard_failing_while_the_directory_closes_starts_no_probe() -> None:
    """A call in flight when the gateway shuts down fails on its shard after ``aclose`` began:
    marking the shard down then must not start a probe that nobody would ever stop."""
    from tests.redis_servers import redis_cluster

    with redis_cluster() as (url, servers):
        d = open_directory(url, key_prefix="closing", op_timeout_s=0.5)
        await d.register_node(NodeInfo("n1", "10.0.0.1:8000"))
        await d.aclose()
        d._mark_down(f"127.0.0.1:{servers[0].port}")
        assert not d._shards_down
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("directory-shard-probe-")]
