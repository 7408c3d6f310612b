"""Every directory backend must behave the same: the in-process one, a real Redis and a real
3-primary Redis Cluster run the same tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from directory_client import (
    DirectoryConfigError,
    InProcessDirectory,
    NodeInfo,
    NodeLoad,
    Reservation,
    ReservationConflict,
    Tier,
    UnknownNode,
    WriterLease,
    open_directory,
)
from directory_client.sampling import KeySampler
from tokenizer.keys import BlockKey
from tests.redis_servers import purge_prefix
from tokenizer.keys import block_keys, namespace_seed

SEED = namespace_seed("test-model")


def chain(n: int, salt: int = 0) -> list[int]:
    """n chained block keys of a prompt whose tokens depend on ``salt``."""
    return list(block_keys([(i * 7 + salt) % 50_000 for i in range(n * 16)], block_size=16, seed=SEED))


def node(nid: str, port: int = 8000) -> NodeInfo:
    return NodeInfo(nid, f"127.0.0.1:{port}", transfer_endpoint=f"127.0.0.1:{port + 1000}", capacity_blocks=1000)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Backend:
    """Makes directories of one backend that share state, and lets time pass for them."""

    name: str
    url: str
    prefix: str
    clock: FakeClock = field(default_factory=FakeClock)
    opened: list[Any] = field(default_factory=list)
    _memory: dict[tuple, InProcessDirectory] = field(default_factory=dict)

    def make(self, **kw: Any) -> Any:
        """Exact answers (stride 1) unless a test asks for a stride."""
        kw.setdefault("index_stride", 1)
        if self.name == "memory":
            # one process = one directory: a "second client" is the same object
            key = tuple(sorted((k, v) for k, v in kw.items() if k != "op_timeout_s"))
            if key not in self._memory:
                self._memory[key] = open_directory("memory://", clock=self.clock, **kw)
            return self._memory[key]
        d = open_directory(self.url, key_prefix=self.prefix, **kw)
        self.opened.append(d)
        return d

    async def sleep(self, seconds: float) -> None:
        if self.name == "memory":
            self.clock.t += seconds
        else:
            await asyncio.sleep(seconds)


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend(request: pytest.FixtureRequest, key_prefix: str, redis_url: str) -> AsyncIterator[Backend]:
    url = {"memory": "memory://", "redis": redis_url}.get(request.param)
    if url is None:
        url = request.getfixturevalue("redis_cluster_url")
    b = Backend(request.param, url, key_prefix)
    try:
        yield b
    finally:
        for d in b.opened:
            await d.aclose()
        if b.name != "memory":
            purge_prefix(url, key_prefix)


def cached(view: Any) -> dict[str, int]:
    return {v.node.node_id: v.cached_blocks for v in view.nodes}


async def test_longest_prefix_per_live_node(backend: Backend) -> None:
    d = backend.make()
    keys = chain(12)
    for i, nid in enumerate(["c", "a", "b"]):
        await d.register_node(node(nid, 8000 + i))
    await d.record_stored("a", keys[:10])
    await d.record_stored("b", keys[:4])
    view = await d.lookup(keys)
    assert [v.node.node_id for v in view.nodes] == ["a", "b", "c"]
    assert cached(view) == {"a": 10, "b": 4, "c": 0}
    assert view.best() is not None and view.best().node == node("a", 8001)
    assert all(v.tier is Tier.GPU and v.load == NodeLoad() for v in view.nodes)
    # a prompt that diverges after block 2 shares only those blocks
    other = keys[:2] + chain(5, salt=99)
    assert cached(await d.lookup(other)) == {"a": 2, "b": 2, "c": 0}
    assert cached(await d.lookup([])) == {"a": 0, "b": 0, "c": 0}


async def test_a_lookup_naming_a_session_answers_its_node_too(backend: Backend) -> None:
    """The session's node comes back with the lookup itself, not from a second call after it."""
    d = backend.make()
    keys = chain(6)
    await d.register_node(node("a", 8000))
    await d.record_stored("a", keys[:3])
    assert (await d.lookup(keys, "s-1")).session_node == ""  # named but never recorded
    await d.record_session("s-1", "a", ttl_s=30)

    async def refused(session: str) -> str | None:
        raise AssertionError("lookup read the session with a second call")

    d.session_node = refused  # the lookup must not fall back to the separate read
    view = await d.lookup(keys, "s-1")
    assert view.session_node == "a" and cached(view) == {"a": 3}
    assert (await d.lookup(keys)).session_node == ""  # not asked: not read


async def test_no_nodes_gives_empty_view(backend: Backend) -> None:
    d = backend.make()
    await d.record_stored("orphan", chain(3))  # blocks of a node that never registered
    view = await d.lookup(chain(3))
    assert view.nodes == () and view.best() is None
    assert await d.live_nodes() == [] and await d.loads() == {}


async def test_tier_is_slowest_within_the_prefix(backend: Backend) -> None:
    d = backend.make()
    keys = chain(8)
    await d.register_node(node("a"))
    await d.record_stored("a", keys[:5], Tier.GPU)
    await d.record_stored("a", keys[5:8], Tier.CPU)
    view = await d.lookup(keys)
    assert (view.nodes[0].cached_blocks, view.nodes[0].tier) == (8, Tier.CPU)
    view = await d.lookup(keys[:5])
    assert (view.nodes[0].cached_blocks, view.nodes[0].tier) == (5, Tier.GPU)
    # a block offloaded to CPU and then evicted from GPU is still there, on CPU
    await d.record_stored("a", keys[:2], Tier.CPU)
    assert (await d.lookup(keys[:2])).nodes[0].tier is Tier.GPU  # GPU copy still the fastest
    await d.record_removed("a", keys[:2], Tier.GPU)
    view = await d.lookup(keys[:2])
    assert (view.nodes[0].cached_blocks, view.nodes[0].tier) == (2, Tier.CPU)
    await d.record_removed("a", keys[:1], Tier.CPU)
    assert cached(await d.lookup(keys)) == {"a": 0}
    await d.record_stored("a", keys[:1], Tier.STORAGE)
    view = await d.lookup(keys)
    assert (view.nodes[0].cached_blocks, view.nodes[0].tier) == (8, Tier.STORAGE)


async def test_stops_at_first_missing_block(backend: Backend) -> None:
    d = backend.make()
    keys = chain(40)
    await d.register_node(node("a"))
    await d.record_stored("a", keys[:17] + keys[18:])  # a hole at block 17, the rest held
    assert cached(await d.lookup(keys)) == {"a": 17}
    await d.record_stored("a", keys[17:18])
    assert cached(await d.lookup(keys)) == {"a": 40}
    await d.record_removed("a", keys[0:1])  # a hole at the very start: nothing usable
    assert cached(await d.lookup(keys)) == {"a": 0}


async def test_a_long_prefix_looked_up_again_reflects_every_change_since(backend: Backend) -> None:
    """A continuing chat's history is looked up turn after turn: the in-process directory then
    skips the chunks of keys it found held before, which must never hide a change."""
    d = backend.make()
    keys = chain(1100)
    longer = keys + chain(300, salt=7)
    await d.register_node(node("a"))
    await d.record_stored("a", keys)
    for _ in range(2):
        view = await d.lookup(longer)
        assert (view.nodes[0].cached_blocks, view.nodes[0].tier) == (1100, Tier.GPU)
    if backend.name == "memory":
        assert d._nodes["a"].runs  # the held chunks were remembered
    assert cached(await d.lookup(keys[:512] + chain(40, salt=3))) == {"a": 512}
    await d.record_removed("a", keys[600:601])
    assert cached(await d.lookup(longer)) == {"a": 600}
    await d.record_stored("a", keys[600:601])
    assert cached(await d.lookup(longer)) == {"a": 1100}
    await d.record_stored("a", keys[:300], Tier.CPU)  # offloaded, still in GPU memory too
    assert (await d.lookup(longer)).nodes[0].tier is Tier.GPU
    await d.record_removed("a", keys[100:101], Tier.GPU)  # now on CPU only
    view = await d.lookup(longer)
    assert (view.nodes[0].cached_blocks, view.nodes[0].tier) == (1100, Tier.CPU)
    await d.record_stored("a", keys[100:101], Tier.GPU)
    for _ in range(2):
        assert (await d.lookup(longer)).nodes[0].tier is Tier.GPU
    await d.replace_node("a", {Tier.GPU: keys[:700]})
    assert cached(await d.lookup(longer)) == {"a": 700}
    await d.clear_node("a")
    assert cached(await d.lookup(longer)) == {"a": 0}


async def test_writes_are_idempotent(backend: Backend) -> None:
    d = backend.make()
    keys = chain(6)
    await d.register_node(node("a"))
    await d.register_node(node("a"))
    for _ in range(3):
        await d.record_stored("a", keys[:4], Tier.CPU)
    await d.record_stored("a", keys[:4] + keys[:4], Tier.CPU)  # duplicates inside one batch
    view = await d.lookup(keys)
    assert (view.nodes[0].cached_blocks, view.nodes[0].tier) == (4, Tier.CPU)
    assert await d.live_nodes() == [node("a")]
    for _ in range(2):
        await d.record_removed("a", keys[2:4])
    assert cached(await d.lookup(keys)) == {"a": 2}


async def test_removal_and_clear_node(backend: Backend) -> None:
    d = backend.make()
    keys = chain(10)
    await d.register_node(node("a"))
    await d.register_node(node("b", 8001))
    await d.record_stored("a", keys)
    await d.record_stored("b", keys)
    await d.record_removed("a", keys[7:])  # leaves evicted first, as engines do
    assert cached(await d.lookup(keys)) == {"a": 7, "b": 10}
    await d.record_removed("a", chain(3, salt=5))  # removing blocks never stored is harmless
    await d.clear_node("b")
    assert cached(await d.lookup(keys)) == {"a": 7, "b": 0}
    assert {n.node_id for n in await d.live_nodes()} == {"a", "b"}  # cleared, still alive
    await d.record_stored("b", keys[:3])
    assert cached(await d.lookup(keys)) == {"a": 7, "b": 3}


async def test_dead_node_is_not_returned_and_comes_back_on_heartbeat(backend: Backend) -> None:
    d = backend.make(heartbeat_ttl_s=1.0)
    keys = chain(5)
    await d.register_node(node("a"))
    await d.register_node(node("b", 8001))
    await d.record_stored("a", keys)
    await d.record_stored("b", keys[:2])
    await backend.sleep(0.6)
    await d.heartbeat("b")
    await backend.sleep(0.6)  # a missed its heartbeat, b did not
    assert [n.node_id for n in await d.live_nodes()] == ["b"]
    assert cached(await d.lookup(keys)) == {"b": 2}
    assert set(await d.loads()) == {"b"}
    # a dead node's entries are kept for the retention: a late heartbeat brings it back whole
    await d.heartbeat("a")
    assert cached(await d.lookup(keys)) == {"a": 5, "b": 2}


async def test_heartbeat_of_unknown_node_asks_to_register(backend: Backend) -> None:
    d = backend.make()
    with pytest.raises(UnknownNode):
        await d.heartbeat("never-registered")
    await d.register_node(node("a"))
    await d.deregister_node("a")
    with pytest.raises(UnknownNode):
        await d.heartbeat("a")


async def test_deregister_forgets_node_and_blocks(backend: Backend) -> None:
    d = backend.make()
    keys = chain(4)
    await d.register_node(node("a"))
    await d.register_node(node("b", 8001))
    await d.record_stored("a", keys)
    r = await d.reserve("a", 100)
    await d.deregister_node("a")
    await d.deregister_node("a")  # twice is fine
    assert [n.node_id for n in await d.live_nodes()] == ["b"]
    assert cached(await d.lookup(keys)) == {"b": 0}
    await d.register_node(node("a"))
    view = await d.lookup(keys)
    assert cached(view) == {"a": 0, "b": 0}
    assert view.nodes[0].load == NodeLoad()
    await d.release(r)  # releasing a reservation of the old incarnation changes nothing
    assert (await d.loads())["a"] == NodeLoad()


async def test_reregister_updates_node_info(backend: Backend) -> None:
    d = backend.make()
    await d.register_node(node("a", 8000))
    await d.register_node(NodeInfo("a", "10.0.0.9:9000", model="m"))
    assert await d.live_nodes() == [NodeInfo("a", "10.0.0.9:9000", model="m")]
    assert (await d.lookup(chain(1))).nodes[0].node.address == "10.0.0.9:9000"


async def test_reserve_and_release_load(backend: Backend) -> None:
    d = backend.make()
    await d.register_node(node("a"))
    await d.register_node(node("b", 8001))
    r1 = await d.reserve("a", 1000)
    r2 = await d.reserve("a", 24)
    assert (r1.node_id, r1.requests, r1.prefill_tokens) == ("a", 1, 1000)
    assert r1.token != r2.token
    assert await d.loads() == {"a": NodeLoad(2, 1024), "b": NodeLoad()}
    assert {v.node.node_id: v.load for v in (await d.lookup(chain(2))).nodes} == {
        "a": NodeLoad(2, 1024),
        "b": NodeLoad(),
    }
    await d.release(r1)
    await d.release(r1)  # idempotent
    assert await d.loads() == {"a": NodeLoad(1, 24), "b": NodeLoad()}
    await d.release(r2)
    assert await d.loads() == {"a": NodeLoad(), "b": NodeLoad()}
    zero = await d.reserve("b", 0)  # a request whose prompt is fully cached still counts
    assert await d.loads() == {"a": NodeLoad(), "b": NodeLoad(1, 0)}
    await d.release(zero)
    assert await d.loads() == {"a": NodeLoad(), "b": NodeLoad()}


async def test_leaked_reservation_expires(backend: Backend) -> None:
    d = backend.make(max_request_s=1.0)
    await d.register_node(node("a"))
    await d.reserve("a", 500)  # never released: the replica that made it "died"
    await d.reserve("a", 0)
    await backend.sleep(0.5)
    kept = await d.reserve("a", 7)
    assert await d.loads() == {"a": NodeLoad(3, 507)}
    await backend.sleep(0.7)
    assert await d.loads() == {"a": NodeLoad(1, 7)}
    await d.release(kept)
    await backend.sleep(0.6)
    assert await d.loads() == {"a": NodeLoad()}


async def test_concurrent_reserves_from_two_clients_add_up(backend: Backend) -> None:
    # 100 reserves at once per client: the sums are under test, not the speed, so no 0.5 s bound
    one, two = backend.make(op_timeout_s=10.0), backend.make(op_timeout_s=10.0)
    await one.register_node(node("a"))
    await one.register_node(node("b", 8001))
    tasks = [c.reserve(nid, i) for i in range(1, 51) for c in (one, two) for nid in ("a", "b")]
    reservations = await asyncio.gather(*tasks)
    expected = NodeLoad(100, 2 * sum(range(1, 51)))
    assert await one.loads() == {"a": expected, "b": expected}
    assert await two.loads() == {"a": expected, "b": expected}
    half = len(reservations) // 2
    await asyncio.gather(*(one.release(r) for r in reservations[:half]))
    await asyncio.gather(*(two.release(r) for r in reservations))  # overlaps: idempotent
    assert await one.loads() == {"a": NodeLoad(), "b": NodeLoad()}


async def test_lookup_reports_how_many_blocks_each_node_holds_in_all(backend: Backend) -> None:
    d = backend.make()
    await d.register_node(node("a"))
    await d.register_node(node("b", 8001))
    await d.record_stored("a", [BlockKey(k) for k in range(1, 41)], Tier.GPU)
    await d.record_stored("b", [BlockKey(k) for k in range(100, 105)], Tier.GPU)
    view = await d.lookup([BlockKey(999)])  # a prompt neither holds: totals are still reported
    assert {n.node.node_id: (n.cached_blocks, n.total_blocks) for n in view.nodes} == {"a": (0, 40), "b": (0, 5)}


async def test_a_reservation_stops_counting_its_prefill_at_its_first_token_by_itself(backend: Backend) -> None:
    """No call settles it: every replica sees the prompt queued until the first token is due,
    then the request in flight without it, until it is released."""
    one, two = backend.make(op_timeout_s=2.0), backend.make(op_timeout_s=2.0)
    await one.register_node(node("a"))
    r = await one.reserve("a", 700, first_token_s=0.3)
    plain = await one.reserve("a", 50)  # no estimate: its prefill counts until it is released
    assert await two.loads() == {"a": NodeLoad(2, 750)}
    await backend.sleep(0.5)
    assert await two.loads() == {"a": NodeLoad(2, 50)}
    await one.release(r)  # its prefill is already gone: only the request leaves
    assert await two.loads() == {"a": NodeLoad(1, 50)}
    await one.release(r)  # twice changes nothing
    await one.release(plain)
    assert await two.loads() == {"a": NodeLoad()}


async def test_a_lookup_says_when_the_queued_prefill_is_due(backend: Backend) -> None:
    """The queued prefill counts whole until its first token, yet most of it is done by then:
    every view says how long until the last queued prompt's first token is due, so the cost
    model waits no longer than that on it."""
    one, two = backend.make(op_timeout_s=2.0), backend.make(op_timeout_s=2.0)
    await one.register_node(node("a"))
    await one.register_node(node("b", 8001))
    await one.reserve("a", 7000, first_token_s=1.0)
    await one.reserve("a", 50, first_token_s=0.3)
    await backend.sleep(0.4)
    loads = await two.loads()
    assert loads["a"] == NodeLoad(2, 7000)
    assert 0.2 <= loads["a"].prefill_due_s <= 0.6 + 0.0001
    view = await two.lookup([BlockKey(1)])
    due = {n.node.node_id: n.load.prefill_due_s for n in view.nodes}
    assert 0.2 <= due["a"] <= 0.6 + 0.0001
    assert view.nodes[1].load.prefill_tokens == 0  # nothing queued on b


async def test_a_reservation_held_for_an_estimate_ends_by_itself(backend: Backend) -> None:
    """What ext_authz relies on: no release call, yet the load leaves at the estimated end."""
    one, two = backend.make(op_timeout_s=2.0), backend.make(op_timeout_s=2.0)
    await one.register_node(node("a"))
    await one.reserve("a", 400, first_token_s=0.3, hold_s=0.6)
    await one.reserve("a", 100, first_token_s=5.0, hold_s=0.6)  # the prefill cannot outlast the hold
    kept = await one.reserve("a", 7)
    assert await two.loads() == {"a": NodeLoad(3, 507)}
    await backend.sleep(0.45)
    assert await two.loads() == {"a": NodeLoad(3, 107)}
    await backend.sleep(0.45)
    assert await two.loads() == {"a": NodeLoad(1, 7)}
    await one.release(kept)
    assert await two.loads() == {"a": NodeLoad()}


async def test_reservation_times_are_validated(backend: Backend) -> None:
    d = backend.make()
    await d.register_node(node("a"))
    for bad in ({"first_token_s": -1.0}, {"hold_s": float("nan")}, {"hold_s": float("inf")}):
        with pytest.raises(ValueError):
            await d.reserve("a", 10, **bad)
    assert await d.loads() == {"a": NodeLoad()}  # a refused reservation took nothing


async def test_compare_and_reserve_lets_only_one_of_two_racing_clients_take_an_idle_node(
    backend: Backend,
) -> None:
    """Two replicas that both saw node a idle: exactly one gets it, the other is told to decide
    again and nothing is counted for it — the herding the unconditional reserve allowed."""
    one, two = backend.make(), backend.make(op_timeout_s=2.0)
    await one.register_node(node("a"))
    results = await asyncio.gather(
        *(c.reserve("a", 100, if_inflight_at_most=0) for c in (one, two)), return_exceptions=True
    )
    taken = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, ReservationConflict)]
    assert (len(taken), len(refused)) == (1, 1)
    assert await two.loads() == {"a": NodeLoad(1, 100)}
    # the refused one takes it knowing the new load; unconditional reserves never conflict
    second = await two.reserve("a", 50, if_inflight_at_most=1)
    third = await one.reserve("a", 5)
    assert await one.loads() == {"a": NodeLoad(3, 155)}
    for r in (taken[0], second, third):
        await one.release(r)
    assert await two.loads() == {"a": NodeLoad()}


@pytest.mark.parametrize("stride", [4, 8])
async def test_stride_answers_in_engine_blocks(backend: Backend, stride: int) -> None:
    d = backend.make(index_stride=stride)
    keys = chain(200)
    sampled = [i for i, k in enumerate(keys) if k % stride == 0]
    assert 200 // stride // 3 < len(sampled) < 3 * 200 // stride  # the sample is ~1/stride
    await d.register_node(node("full"))
    await d.register_node(node("part", 8001))
    await d.record_stored("full", keys)  # callers pass every key
    held = 120
    await d.record_stored("part", keys[:held])
    view = cached(await d.lookup(keys))
    # full: last sampled position + 1; part: lower bound within one sampling gap of the truth
    assert view["full"] == sampled[-1] + 1
    expected_part = max(i for i in sampled if i < held) + 1
    assert view["part"] == expected_part <= held
    assert held - view["part"] < max(b - a for a, b in zip(sampled, sampled[1:]))
    # removing an unsampled key changes nothing; removing a sampled one cuts the prefix there
    unsampled = next(i for i in range(50, 100) if i not in sampled)
    await d.record_removed("full", [keys[unsampled]])
    assert cached(await d.lookup(keys))["full"] == sampled[-1] + 1
    cut = next(i for i in sampled if i >= 50)
    await d.record_removed("full", [keys[cut]])
    prev = max(i for i in sampled if i < cut)
    assert cached(await d.lookup(keys))["full"] == prev + 1
    assert KeySampler(stride).blocks_for(0, sampled) == 0
    # the gateway passes its keys as a uint64 array: the same answers
    as_array = np.array(keys, dtype=np.uint64)
    assert cached(await d.lookup(as_array)) == cached(await d.lookup(keys))
    assert KeySampler(stride).select_positions(as_array) == KeySampler(stride).select_positions(keys)


@pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)
async def test_stride_mismatch_between_clients_is_refused(backend: Backend) -> None:
    """Only shared backends have a second client that could disagree."""
    first = backend.make(index_stride=4)
    await first.register_node(node("a"))
    second = backend.make(index_stride=1)
    with pytest.raises(DirectoryConfigError):
        await second.lookup(chain(4))
    with pytest.raises(DirectoryConfigError):
        await second.record_stored("a", chain(4))


@pytest.mark.parametrize(
    "call",
    [
        lambda d: d.record_stored("a", [1, 2, -3]),
        lambda d: d.record_stored("a", [1, 2, 1 << 64]),
        lambda d: d.record_stored("a", [1, 2.5]),
        lambda d: d.record_stored("a", [1], tier=7),
        lambda d: d.record_removed("a", ["x"]),
        lambda d: d.record_stored("a{x}", [1]),
        lambda d: d.record_stored("", [1]),
        lambda d: d.register_node(NodeInfo("a", "")),
        lambda d: d.register_node(NodeInfo("a", "1.2.3.4:5", capacity_blocks=-1)),
        lambda d: d.reserve("a", -5),
        lambda d: d.reserve("a", 1.5),
        lambda d: d.heartbeat(""),
    ],
)
async def test_bad_input_is_refused_and_writes_nothing(backend: Backend, call: Callable[[Any], Any]) -> None:
    d = backend.make()
    await d.register_node(node("a"))
    with pytest.raises(ValueError):
        await call(d)
    view = await d.lookup([1, 2])
    assert cached(view) == {"a": 0}
    assert await d.loads() == {"a": NodeLoad()}
    assert await d.live_nodes() == [node("a")]


async def test_factory_picks_backend_from_url_and_rejects_unknown() -> None:
    from directory_client import RedisClusterDirectory, RedisDirectory
    from directory_client.redis_cluster import parse_cluster_url
    from directory_client.sampling import DEFAULT_INDEX_STRIDE

    assert isinstance(open_directory("memory://"), InProcessDirectory)
    assert open_directory("memory://").index_stride == DEFAULT_INDEX_STRIDE
    single = open_directory("redis://127.0.0.1:1/0")
    cluster = open_directory("redis+cluster://127.0.0.1:1,127.0.0.1:2", index_stride=2)
    assert isinstance(single, RedisDirectory) and single.index_stride == DEFAULT_INDEX_STRIDE
    assert isinstance(cluster, RedisClusterDirectory) and cluster.index_stride == 2
    await single.aclose()
    await cluster.aclose()
    assert parse_cluster_url("redis+cluster://:s%40cret@h1:7001,h2:7002") == (
        [("h1", 7001), ("h2", 7002)],
        {"password": "s@cret"},
    )
    for bad in ("http://x", "redis+cluster://h1"):
        with pytest.raises(ValueError):
            open_directory(bad)
    with pytest.raises(ValueError):
        open_directory("memory://", index_stride=0)
    with pytest.raises(ValueError):
        open_directory("redis://127.0.0.1:1/0", key_prefix="a{b}")


async def test_one_writer_per_node_through_a_lease(backend: Backend) -> None:
    """Several gateway replicas follow one engine; only the lease holder writes its entries."""
    a, b = backend.make(), backend.make()
    assert await a.claim_writer("n1", "replica-a", 0.6) == WriterLease.TAKEN
    assert await a.claim_writer("n1", "replica-a", 0.6) == WriterLease.RENEWED
    assert await b.claim_writer("n1", "replica-b", 0.6) == WriterLease.HELD_BY_OTHER
    assert await b.writer("n1") == "replica-a"
    assert await b.claim_writer("n2", "replica-b", 0.6)  # leases are per node
    await backend.sleep(1.0)  # the holder stopped renewing: the lease lapses, another takes it
    assert await b.writer("n1") is None
    assert await b.claim_writer("n1", "replica-b", 0.6) == WriterLease.TAKEN
    assert not await a.claim_writer("n1", "replica-a", 0.6)
    await a.release_writer("n1", "replica-a")  # not the holder: nothing happens
    assert not await a.claim_writer("n1", "replica-a", 0.6)
    await b.release_writer("n1", "replica-b")
    assert await a.claim_writer("n1", "replica-a", 0.6)


async def test_entries_are_cleared_only_when_no_bridge_holds_the_lease(backend: Backend) -> None:
    """A gateway clears a node whose bridge died (nothing keeps its entries true); a node whose
    bridge holds the lease keeps them, whoever asks."""
    d, keys = backend.make(heartbeat_ttl_s=600), chain(6)
    await d.register_node(node("a"))
    await d.record_stored("a", keys)
    assert await d.claim_writer("a", "bridge-1", 0.6)
    assert not await d.clear_if_unwritten("a")
    assert (await d.lookup(keys)).nodes[0].cached_blocks == 6
    await backend.sleep(1.0)  # the bridge stopped renewing
    assert await d.clear_if_unwritten("a")
    view = await d.lookup(keys)
    assert [(v.node.node_id, v.cached_blocks) for v in view.nodes] == [("a", 0)]  # still routable, by load
    await d.record_stored("a", keys)  # written again by other means (no bridge holds the lease)
    assert not await d.clear_if_unwritten("a")  # cleared once: a second asker finds nothing to judge
    assert (await d.lookup(keys)).nodes[0].cached_blocks == 6


async def test_a_node_no_bridge_ever_wrote_is_not_cleared(backend: Backend) -> None:
    """Entries written without a lease (a fixture, a bridge of an older kvgate) are not judged; a
    bridge that claims the node before it is registered is still noted, and its lapse clears."""
    d, keys = backend.make(heartbeat_ttl_s=600), chain(6)
    await d.register_node(node("a"))
    await d.record_stored("a", keys)
    assert not await d.clear_if_unwritten("a")
    assert (await d.lookup(keys)).nodes[0].cached_blocks == 6
    assert await d.claim_writer("b", "bridge-1", 0.3) == WriterLease.TAKEN  # before "b" registers
    await d.register_node(node("b"))
    await d.record_stored("b", keys)
    await backend.sleep(0.6)
    assert await d.clear_if_unwritten("b")
    assert cached(await d.lookup(keys)) == {"a": 6, "b": 0}


async def test_a_forgotten_node_forgets_that_a_bridge_wrote_it(backend: Backend) -> None:
    """A node dead past the retention is forgotten whole, with the note that a bridge wrote it (in
    Redis the note lives in the node's meta, which expires with it). Before, the in-process
    directory kept the note for ever: entries written for the node again later without a lease (a
    fixture, a bridge of an older kvgate) were cleared there and kept on Redis."""
    d, keys = backend.make(heartbeat_ttl_s=0.2, dead_node_retention_s=0.3), chain(6)
    assert await d.claim_writer("a", "bridge-1", 0.2) == WriterLease.TAKEN
    await d.register_node(node("a"))
    await d.record_stored("a", keys)
    await backend.sleep(1.0)  # dead, its lease lapsed, and past the retention: forgotten
    await d.register_node(node("a"))
    await d.record_stored("a", keys)
    assert not await d.clear_if_unwritten("a")
    assert cached(await d.lookup(keys)) == {"a": 6}


async def test_replace_node_swaps_its_entries_and_retire_keeps_them(backend: Backend) -> None:
    d = backend.make()
    keys = chain(8)
    await d.register_node(node("a"))
    await d.record_stored("a", keys[:6], Tier.GPU)
    await d.replace_node("a", {Tier.GPU: keys[:3], Tier.CPU: keys[2:5]})
    view = await d.lookup(keys)
    assert cached(view) == {"a": 5} and view.nodes[0].tier is Tier.CPU  # blocks 3..5 on CPU only
    await d.replace_node("a", {})
    assert cached(await d.lookup(keys)) == {"a": 0}
    await d.record_stored("a", keys[:4])
    await d.retire_node("a")  # dead at once ...
    assert await d.live_nodes() == [] and (await d.lookup(keys)).nodes == ()
    await d.register_node(node("a"))  # ... and back whole
    assert cached(await d.lookup(keys)) == {"a": 4}
