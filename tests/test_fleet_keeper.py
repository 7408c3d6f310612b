"""The static-fleet keeper against a real /health endpoint and the shared Redis: a node whose
KV-event bridge runs elsewhere keeps its entries while that bridge holds the writer lease, and
loses them (but not its traffic) when the bridge dies — the entries would otherwise claim blocks
the engine has long evicted."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from directory_client import NodeInfo, WriterLease, open_directory
from gateway.fleet import StaticFleetKeeper
from gateway.metrics import REGISTRY
from tests.redis_servers import purge_prefix
from tests.support.engines import healthy_engine
from tokenizer.keys import block_keys, namespace_seed

REDIS = "redis://127.0.0.1:6379/0"
LEASE_S = 0.5
KEYS = list(block_keys(list(range(96)), block_size=16, seed=namespace_seed("m")))


@pytest.fixture
async def engine():
    """A healthy engine's /health on a free port."""
    async with healthy_engine() as port:
        yield NodeInfo("s1", f"127.0.0.1:{port}", model="m")


@pytest.fixture
async def directory():
    prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"
    d = open_directory(REDIS, key_prefix=prefix, index_stride=1, heartbeat_ttl_s=600, op_timeout_s=2.0)
    yield d
    await d.aclose()
    purge_prefix(REDIS, prefix)


def cached(view) -> dict[str, int]:
    return {v.node.node_id: v.cached_blocks for v in view.nodes}


async def test_a_dead_bridges_entries_are_cleared_and_the_node_stays_routable(engine, directory) -> None:
    keeper = StaticFleetKeeper(directory, [engine], interval_s=3600)
    await keeper.start()
    lapses = REGISTRY.get_sample_value("kvgate_node_writer_lapses_total", {"node": "s1"}) or 0.0
    try:
        assert await directory.claim_writer("s1", "bridge-1", LEASE_S) == WriterLease.TAKEN  # its bridge, elsewhere
        await directory.record_stored("s1", KEYS)
        await keeper.tick()
        assert cached(await directory.lookup(KEYS)) == {"s1": 6}  # the bridge is alive: entries kept

        await asyncio.sleep(LEASE_S + 0.3)  # the bridge died: nobody renews its lease
        await keeper.tick()
        assert cached(await directory.lookup(KEYS)) == {"s1": 0}  # live, routed by load alone
        assert REGISTRY.get_sample_value("kvgate_node_writer_lapses_total", {"node": "s1"}) == lapses + 1

        assert await directory.claim_writer("s1", "bridge-2", 30.0) == WriterLease.TAKEN  # restarted: rewrites
        await directory.record_stored("s1", KEYS)
        await keeper.tick()
        await keeper.tick()
        assert cached(await directory.lookup(KEYS)) == {"s1": 6}
    finally:
        await keeper.aclose()


async def test_a_keeper_started_after_the_bridge_died_clears_and_only_one_replica_counts_it(engine, directory) -> None:
    """Two gateway replicas start after the node's bridge died (a rolling restart, or the bridge
    died while no gateway ran): neither saw the lease held, yet the dead bridge's entries go, and
    the lapse is counted once, not once per replica."""
    await directory.register_node(engine)
    assert await directory.claim_writer("s1", "bridge-1", LEASE_S) == WriterLease.TAKEN
    await directory.record_stored("s1", KEYS)
    await asyncio.sleep(LEASE_S + 0.3)  # the bridge died before any keeper looked
    lapses = REGISTRY.get_sample_value("kvgate_node_writer_lapses_total", {"node": "s1"}) or 0.0
    first = StaticFleetKeeper(directory, [engine], interval_s=3600)
    second = StaticFleetKeeper(directory, [engine], interval_s=3600)
    try:
        await asyncio.gather(first.start(), second.start())
        assert cached(await directory.lookup(KEYS)) == {"s1": 0}  # live, routed by load alone
        await asyncio.gather(first.tick(), second.tick())
        assert REGISTRY.get_sample_value("kvgate_node_writer_lapses_total", {"node": "s1"}) == lapses + 1

        assert await directory.claim_writer("s1", "bridge-2", 30.0) == WriterLease.TAKEN  # a new bridge
        await directory.record_stored("s1", KEYS)
        await first.tick()
        await second.tick()
        assert cached(await directory.lookup(KEYS)) == {"s1": 6}  # its entries are kept
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_node_never_bridged_keeps_what_was_written_for_it(engine, directory) -> None:
    """No lease was ever seen (entries written by other means, e.g. a replay's fixture): the keeper
    does not judge them."""
    keeper = StaticFleetKeeper(directory, [engine], interval_s=3600)
    await keeper.start()
    try:
        await directory.record_stored("s1", KEYS[:3])
        await keeper.tick()
        await keeper.tick()
        assert cached(await directory.lookup(KEYS)) == {"s1": 3}
    finally:
        await keeper.aclose()
