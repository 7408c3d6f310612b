"""The shipped per-role Redis users (helm/kvgate/files/redis-acl.conf) on a real redis-server.

Before: every kvgate process used one Redis user that could write everything, so a compromised
bridge could fake or erase any node's load and reservations, and a compromised gateway could
write block entries (claim that a node holds any prompt). With the shipped users, each role does
everything it does in production, and what it must not do is refused by Redis itself: the
caller gets ``DirectoryUnavailable`` (NOPERM underneath; the request path fails open), Redis
records the refusal in ``ACL LOG``, and the keys are left exactly as they were.
"""

from __future__ import annotations

import asyncio
import re

import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from directory_client import open_directory
from directory_client.types import DirectoryUnavailable, NodeInfo, Reservation, Tier, WriterLease
from gateway.config import load_config
from tests.conftest import free_port
from tests.redis_servers import RedisProcess
from tests.support.engines import healthy_engine

ACL_FILE = Path(__file__).resolve().parents[1] / "helm/kvgate/files/redis-acl.conf"
PASSWORDS = {
    "kvgate-bridge": "bridge-password-1234",
    "kvgate-gateway": "gateway-password-1234",
    "kvgate-gateway-events": "events-password-1234",
}
KEYS = list(range(1, 33))
NODE = NodeInfo("e1", "10.0.0.1:8000", model="m")


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisProcess]:
    """A redis-server loading the shipped users, the default user off, and an admin for checking;
    the roles' passwords set the way the file says (``ACL SETUSER <user> >password``)."""
    with tempfile.TemporaryDirectory(prefix="kvgate-redis-acl-") as tmp:
        server = RedisProcess(
            free_port(), Path(tmp), "--include", str(ACL_FILE),
            "--user", "admin", "on", ">admin-password-1234", "~*", "&*", "+@all", "--user", "default", "off",
        ).start()  # fmt: skip
        try:
            with admin(server) as r:
                for user, password in PASSWORDS.items():
                    r.execute_command("ACL", "SETUSER", user, f">{password}")
            yield server
        finally:
            server.kill()


def admin(server: RedisProcess) -> redis.Redis:
    return redis.Redis(port=server.port, username="admin", password="admin-password-1234")


@pytest.fixture
async def as_role(acl_redis: RedisProcess) -> AsyncIterator:
    """``as_role(user)``: a directory client of that role, username and password outside the URL
    (kvgate's ``directory.username`` / ``KVGATE_DIRECTORY__PASSWORD``). Each refused call gets a
    fresh client: five refusals in a row would open a client's circuit."""
    opened = []
    with admin(acl_redis) as r:
        r.flushdb()
        r.execute_command("ACL", "LOG", "RESET")

    def make(user: str):
        d = open_directory(
            f"redis://127.0.0.1:{acl_redis.port}/0", username=user, password=PASSWORDS[user], index_stride=1, op_timeout_s=2
        )
        opened.append(d)
        return d

    yield make
    for d in opened:
        await d.aclose()


def snapshot(server: RedisProcess) -> dict[bytes, object]:
    with admin(server) as r:
        out: dict[bytes, object] = {}
        for key in r.keys("*"):
            kind = r.type(key)
            out[key] = r.hgetall(key) if kind == b"hash" else r.zrange(key, 0, -1, withscores=True) if kind == b"zset" else r.get(key)
        return out


def refusals(server: RedisProcess) -> list[tuple[str, str]]:
    """(user, object) of every refusal Redis logged."""
    with admin(server) as r:
        return [(e["username"], e["object"]) for e in r.acl_log()]


async def refused(call, server: RedisProcess) -> None:
    """``call`` fails with DirectoryUnavailable and changes no key."""
    before = snapshot(server)
    with pytest.raises(DirectoryUnavailable) as err:
        await call
    assert "NoPermission" in str(err.value) or "ResponseError" in str(err.value)
    assert snapshot(server) == before


async def test_a_bridge_does_its_job_and_cannot_touch_load_or_reservations(as_role, acl_redis: RedisProcess) -> None:
    bridge = as_role("kvgate-bridge")
    await bridge.register_node(NODE)
    assert await bridge.claim_writer("e1", "bridge-a", 10.0) == WriterLease.TAKEN
    await bridge.record_stored("e1", KEYS)
    await bridge.record_removed("e1", KEYS[24:])
    await bridge.heartbeat("e1")
    await bridge.replace_node("e1", {Tier.GPU: KEYS[:24], Tier.CPU: KEYS[:8]})
    assert await bridge.live_nodes() == [NODE]
    gateway = as_role("kvgate-gateway")
    assert (await gateway.lookup(KEYS)).nodes[0].cached_blocks == 24  # what the bridge wrote is routed on

    reservation = await gateway.reserve("e1", 100)
    await refused(as_role("kvgate-bridge").reserve("e1", 100), acl_redis)  # fake load on a node
    await refused(as_role("kvgate-bridge").release(reservation), acl_redis)  # erase another's reservation
    assert ("kvgate-bridge", "kvgate:{e1}:load") in refusals(acl_redis)
    async with aioredis.Redis(port=acl_redis.port, username="kvgate-bridge", password=PASSWORDS["kvgate-bridge"]) as raw:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.hset("kvgate:{e1}:load", "r", 0)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.set("kvgate:session:s1", "e1")  # steer a session
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.set("elsewhere", "x")  # anything outside the prefix
    assert (await gateway.loads())["e1"].inflight == 1

    await bridge.retire_node("e1")
    await bridge.clear_node("e1")
    await bridge.deregister_node("e1")  # deleting the node's keys, load included, is allowed
    await bridge.release_writer("e1", "bridge-a")
    assert snapshot(acl_redis).keys() <= {b"{kvgate}:registry", b"{kvgate}:config"}


async def test_a_gateway_routes_and_reserves_and_cannot_write_block_entries(as_role, acl_redis: RedisProcess) -> None:
    bridge = as_role("kvgate-bridge")
    await bridge.register_node(NODE)
    await bridge.record_stored("e1", KEYS[:8])
    gateway = as_role("kvgate-gateway")
    other = NodeInfo("s1", "10.0.0.2:8000", model="m")
    await gateway.register_node(other)  # the static fleet's nodes
    await gateway.heartbeat("s1")
    view = await gateway.lookup(KEYS)
    assert {n.node.node_id: n.cached_blocks for n in view.nodes} == {"e1": 8, "s1": 0}
    reservation = await gateway.reserve("e1", 64, first_token_s=1.0)
    assert (await gateway.loads())["e1"].inflight == 1
    await gateway.release(reservation)
    lost = Reservation("e1", 1, 64, "lost-1|64")  # a reserve whose answer was lost, not run yet
    gateway._release_lost(lost, 5.0)
    while gateway._lost:
        await asyncio.sleep(0.01)
    with admin(acl_redis) as r:
        assert r.zscore("kvgate:{e1}:resv", b"x:lost-1|64") is not None  # what stops it if it lands
    await gateway.record_session("sess-1", "e1", 30.0)
    assert await gateway.session_node("sess-1") == "e1"

    await refused(as_role("kvgate-gateway").record_stored("e1", KEYS), acl_redis)  # claim e1 holds any prompt
    await refused(as_role("kvgate-gateway").record_stored("s1", KEYS), acl_redis)
    await refused(as_role("kvgate-gateway").record_removed("e1", KEYS[:8]), acl_redis)  # hide e1's blocks
    await refused(as_role("kvgate-gateway").claim_writer("e1", "gw", 10.0), acl_redis)  # take the bridge's lease
    assert ("kvgate-gateway", "kvgate:{e1}:blocks") in refusals(acl_redis)
    async with aioredis.Redis(port=acl_redis.port, username="kvgate-gateway", password=PASSWORDS["kvgate-gateway"]) as raw:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.hset("kvgate:{e1}:blocks", "x", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.eval("return redis.call('HSET', KEYS[1], 'x', '1')", 1, "kvgate:{e1}:blocks")  # no EVAL at all
    assert (await gateway.lookup(KEYS)).nodes[0].cached_blocks == 8

    await gateway.deregister_node("s1")


async def test_a_gateway_following_events_does_both_jobs_and_nothing_outside_the_prefix(
    as_role, acl_redis: RedisProcess
) -> None:
    both = as_role("kvgate-gateway-events")
    await both.register_node(NODE)
    assert await both.claim_writer("e1", "gw-1", 10.0) == WriterLease.TAKEN
    await both.record_stored("e1", KEYS[:8])
    reservation = await both.reserve("e1", 10)
    assert (await both.lookup(KEYS)).nodes[0].cached_blocks == 8
    await both.release(reservation)
    async with aioredis.Redis(port=acl_redis.port, username="kvgate-gateway-events", password=PASSWORDS["kvgate-gateway-events"]) as raw:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.set("elsewhere", "x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.eval("return 1", 0)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.flushall()
    await both.deregister_node("e1")


def test_kvgate_takes_the_directory_user_and_password_from_the_environment(monkeypatch) -> None:
    """``kvgate serve``: KVGATE_DIRECTORY__USERNAME / __PASSWORD (from a Secret in the chart); the
    password never shows in the configuration's dump."""
    monkeypatch.setenv("KVGATE_DIRECTORY__URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("KVGATE_DIRECTORY__USERNAME", "kvgate-gateway")
    monkeypatch.setenv("KVGATE_DIRECTORY__PASSWORD", "gateway-password-1234")
    cfg = load_config()
    assert cfg.directory.username == "kvgate-gateway"
    assert cfg.directory.password.get_secret_value() == "gateway-password-1234"
    assert "gateway-password-1234" not in cfg.model_dump_json()
    with pytest.raises(ValueError, match="carries credentials"):
        open_directory("redis://u:p@127.0.0.1:6379/0", username="kvgate-gateway", password="x")


async def test_a_gateway_keeping_a_static_fleet_clears_a_node_whose_bridge_lease_lapsed(
    as_role, acl_redis: RedisProcess
) -> None:
    """The static-fleet keeper runs as ``kvgate-gateway``: it reads the writer lease and, once it
    lapsed, clears the node's entries (``clear_if_unwritten``). Refused by Redis, the stale entries
    would keep drawing the node's old prompts after its bridge died."""
    bridge = as_role("kvgate-bridge")
    await bridge.register_node(NODE)
    assert await bridge.claim_writer("e1", "bridge-a", 10.0) == WriterLease.TAKEN
    await bridge.record_stored("e1", KEYS[:8])
    gateway = as_role("kvgate-gateway")
    assert await gateway.writer("e1") == "bridge-a"
    assert not await gateway.clear_if_unwritten("e1")  # held: nothing cleared
    assert (await gateway.lookup(KEYS)).nodes[0].cached_blocks == 8
    await bridge.release_writer("e1", "bridge-a")
    assert await gateway.writer("e1") is None
    assert await gateway.clear_if_unwritten("e1")
    assert (await gateway.lookup(KEYS)).nodes[0].cached_blocks == 0
    await refused(as_role("kvgate-gateway").claim_writer("e1", "gw", 10.0), acl_redis)  # still not a writer
    assert await bridge.claim_writer("e1", "bridge-b", 10.0) == WriterLease.TAKEN
    await refused(as_role("kvgate-gateway").release_writer("e1", "bridge-b"), acl_redis)  # nor drops a bridge's lease
    await refused(as_role("kvgate-gateway").claim_writer("e1", "bridge-b", 0.1), acl_redis)  # nor renews it as the holder
    async with aioredis.Redis(port=acl_redis.port, username="kvgate-gateway", password=PASSWORDS["kvgate-gateway"]) as raw:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.delete("kvgate:{e1}:writer")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await raw.pexpire("kvgate:{e1}:writer", 1)
    assert await gateway.writer("e1") == "bridge-b"
    await gateway.deregister_node("e1")


async def test_a_keeper_whose_clear_was_refused_tries_again_on_the_next_tick(as_role, acl_redis: RedisProcess) -> None:
    """The gateway is upgraded before Redis's users are (the old gateway rule: no clear). The
    keeper's clear is refused once; when the users are updated, the next tick must still clear
    the dead bridge's entries rather than have forgotten that the node was bridged."""
    from gateway.fleet import StaticFleetKeeper

    async with healthy_engine() as port:
        node = NodeInfo("e1", f"127.0.0.1:{port}", model="m")
        old_rule = "(~kvgate:{*}:meta ~kvgate:{*}:blocks ~kvgate:{*}:load ~kvgate:{*}:resv +evalsha +pexpire +del)"
        clear_rule = "(~kvgate:{*}:writer ~kvgate:{*}:blocks ~kvgate:{*}:meta +evalsha)"
        bridge, gateway = as_role("kvgate-bridge"), as_role("kvgate-gateway")
        keeper = StaticFleetKeeper(gateway, [node], interval_s=3600)
        try:
            with admin(acl_redis) as r:
                r.execute_command("ACL", "SETUSER", "kvgate-gateway", "clearselectors", old_rule)
            await bridge.register_node(node)
            assert await bridge.claim_writer("e1", "bridge-a", 0.3) == WriterLease.TAKEN
            await bridge.record_stored("e1", KEYS[:8])
            await keeper.start()  # sees the bridge's lease
            await asyncio.sleep(0.5)  # the bridge died: its lease lapsed
            for _ in range(8):  # the clear is refused, tick after tick
                await keeper.tick()
            assert (await gateway.lookup(KEYS)).nodes[0].cached_blocks == 8
            for _ in range(2 * gateway.breaker.threshold):
                await refused(gateway.clear_if_unwritten("e1"), acl_redis)
            assert not gateway.breaker.is_open  # a refusal is an answer: requests still reach Redis
            with admin(acl_redis) as r:
                r.execute_command("ACL", "SETUSER", "kvgate-gateway", clear_rule)
            await keeper.tick()
            assert (await gateway.lookup(KEYS)).nodes[0].cached_blocks == 0
        finally:
            with admin(acl_redis) as r:
                r.execute_command("ACL", "SETUSER", "kvgate-gateway", "clearselectors", old_rule, clear_rule)
            await keeper.aclose()


async def test_a_gateway_shares_a_splits_arrival_and_an_older_user_still_reserves(as_role, acl_redis: RedisProcess) -> None:
    """The shipped gateway user writes a split's arrival with its reservation. A user from before
    the arrivals key (the gateway upgraded first) still reserves and looks up; only the arrival is
    not recorded, and the reservation says so (the request path counts it, others do not see it)."""
    from directory_client.types import SplitArrival

    await as_role("kvgate-bridge").register_node(NODE)
    gateway = as_role("kvgate-gateway")
    r = await gateway.reserve("e1", 0, arrival=SplitArrival("g1-1", 0.2, 50, 5.0))
    assert r.arrival_recorded
    assert [a.arrival_id for a in (await gateway.lookup(KEYS)).nodes[0].arrivals] == ["g1-1"]
    gone = await gateway.reserve("e1", 0, arrival=SplitArrival("g1-0", 0.2, 50, 5.0))
    await gateway.release(gone)  # the shipped user removes a released split's arrival
    assert [a.arrival_id for a in (await gateway.lookup(KEYS)).nodes[0].arrivals] == ["g1-1"]
    old_rule = (
        "%R~kvgate:* %R~{kvgate}:* ~kvgate:{*}:meta ~kvgate:{*}:load ~kvgate:{*}:resv ~kvgate:session:* ~{kvgate}:* "
        "-@all +ping +info +script|load +evalsha +time +exists +get +set +del +hget +hmget +hlen +hexists +hset "
        "+hsetnx +hincrby +pexpire +pexpiretime +pexpireat +zadd +zrange +zrem +zremrangebyscore +zscore"
    )
    try:
        with admin(acl_redis) as adm:
            adm.execute_command("ACL", "SETUSER", "kvgate-gateway", "resetkeys", "nocommands", "clearselectors", *old_rule.split())
        older = as_role("kvgate-gateway")
        r2 = await older.reserve("e1", 0, arrival=SplitArrival("g2-1", 0.2, 50, 5.0))
        assert not r2.arrival_recorded
        view = await older.lookup(KEYS)
        assert view.nodes[0].load.inflight == 2  # both reserved
        assert [a.arrival_id for a in view.nodes[0].arrivals] == ["g1-1"]  # read, not written
        await older.release(r)  # its load is given back; the arrival it may not remove expires by itself
        view = await older.lookup(KEYS)
        assert view.nodes[0].load.inflight == 1 and [a.arrival_id for a in view.nodes[0].arrivals] == ["g1-1"]
        r3 = await older.reserve("e1", 0, context_tokens=9_000)  # the answers' context lives in the load key
        assert (await older.lookup(KEYS)).nodes[0].answering_tokens == 9_000
        await older.release(r3)
        assert (await older.lookup(KEYS)).nodes[0].answering_tokens == 0
    finally:
        with admin(acl_redis) as adm:  # the shipped rule back, for the tests after this one
            line = next(ln for ln in ACL_FILE.read_text().splitlines() if ln.startswith("user kvgate-gateway "))
            rules = re.findall(r"\([^)]*\)|\S+", line)[2:]  # a selector is one argument
            adm.execute_command("ACL", "SETUSER", "kvgate-gateway", "reset", *rules, f">{PASSWORDS['kvgate-gateway']}")
