"""Split arrivals shared through the directory: a split one gateway replica routes is in every
replica's next lookup (``NodeView.arrivals``), written with its decode node's reservation, gone by
itself at its estimated end, at most ``MAX_ARRIVALS_PER_NODE`` per node. Every backend runs the
same tests (the in-process one, a real Redis, a real 3-primary Redis Cluster)."""

from __future__ import annotations

import math
import time

import pytest

from directory_client import ReservationConflict
from directory_client.types import MAX_ARRIVALS_PER_NODE, SplitArrival
from tests.test_directory_behaviour import Backend, backend, node  # noqa: F401 (the fixture)


def arrivals(view, nid: str) -> tuple[SplitArrival, ...]:  # type: ignore[no-untyped-def]
    return next(nv.arrivals for nv in view.nodes if nv.node.node_id == nid)


async def test_a_split_arrival_reserved_by_one_client_is_in_another_clients_lookup(backend: Backend) -> None:
    writer, reader = backend.make(), backend.make()
    for i, nid in enumerate(("d1", "d2")):
        await writer.register_node(node(nid, 8000 + i))
    await reader.lookup([])  # connected (a cluster client's first call also learns the slots)
    t0 = time.monotonic()
    r = await writer.reserve("d1", 0, first_token_s=0.5, arrival=SplitArrival("rA-1", 0.25, 120, 0.6))
    assert r.arrival_recorded
    view = await reader.lookup([])
    since = time.monotonic() - t0 + 0.001  # what passed between the write and this read, at most
    (seen,) = arrivals(view, "d1")
    assert seen.arrival_id == "rA-1" and seen.blocks == 120
    assert 0.25 - since <= seen.arrives_s <= 0.2501 and 0.6 - since <= seen.until_s <= 0.6001  # times from this lookup
    assert arrivals(view, "d2") == ()
    await backend.sleep(0.7)
    assert arrivals(await reader.lookup([]), "d1") == ()  # gone by itself: no replica has to remove it
    await writer.release(r)  # after its end: nothing left to remove, nothing else touched
    assert (await reader.lookup([])).nodes[0].load.inflight == 0


async def test_a_released_split_leaves_the_arrivals_at_once_and_only_it(backend: Backend) -> None:
    writer, reader = backend.make(), backend.make()
    await writer.register_node(node("d1"))
    r1 = await writer.reserve("d1", 0, arrival=SplitArrival("rA-1", 0.2, 120, 30.0))
    r2 = await writer.reserve("d1", 0, arrival=SplitArrival("rA-12", 0.2, 80, 30.0))  # its id starts like r1's
    assert r1.arrival_id == "rA-1" and r2.arrival_id == "rA-12"
    await writer.release(r1)  # the response ended: the split has answered, long before its estimate
    assert [a.arrival_id for a in arrivals(await reader.lookup([]), "d1")] == ["rA-12"]
    await writer.release(r1)  # idempotent
    await writer.release(r2)
    view = await reader.lookup([])
    assert arrivals(view, "d1") == () and view.nodes[0].load.inflight == 0


async def test_a_node_keeps_only_the_arrivals_that_end_last(backend: Backend) -> None:
    d = backend.make()
    await d.register_node(node("d1"))
    for i in range(MAX_ARRIVALS_PER_NODE + 6):
        await d.reserve("d1", 0, arrival=SplitArrival(f"r-{i}", 1.0, 10, 30.0 + i))
    kept = arrivals(await d.lookup([]), "d1")
    assert len(kept) == MAX_ARRIVALS_PER_NODE
    assert [a.arrival_id for a in kept] == [f"r-{i}" for i in range(6, MAX_ARRIVALS_PER_NODE + 6)]  # soonest end first


async def test_a_conflicting_reserve_records_no_arrival(backend: Backend) -> None:
    d = backend.make()
    await d.register_node(node("d1"))
    await d.reserve("d1", 0)
    with pytest.raises(ReservationConflict):
        await d.reserve("d1", 0, if_inflight_at_most=0, arrival=SplitArrival("lost", 0.1, 10, 5.0))
    assert arrivals(await d.lookup([]), "d1") == ()


@pytest.mark.parametrize(
    "bad",
    [
        SplitArrival("a|b", 0.1, 10, 5.0),  # the separator of the stored member
        SplitArrival("", 0.1, 10, 5.0),
        SplitArrival("x" * 65, 0.1, 10, 5.0),
        SplitArrival("ok", math.nan, 10, 5.0),
        SplitArrival("ok", 0.1, 10, math.inf),
        SplitArrival("ok", 0.1, -1, 5.0),
        SplitArrival("ok", 0.1, True, 5.0),  # type: ignore[arg-type]
    ],
)
async def test_a_malformed_arrival_is_refused_before_anything_is_reserved(backend: Backend, bad: SplitArrival) -> None:
    d = backend.make()
    await d.register_node(node("d1"))
    with pytest.raises(ValueError):
        await d.reserve("d1", 0, arrival=bad)
    view = await d.lookup([])
    assert view.nodes[0].load.inflight == 0 and arrivals(view, "d1") == ()


async def test_an_arrival_never_outlives_the_longest_reservation(backend: Backend) -> None:
    d = backend.make(max_request_s=0.5)
    await d.register_node(node("d1"))
    await d.reserve("d1", 0, arrival=SplitArrival("long", 0.1, 10, 10_000.0))  # a replica's wild estimate
    (seen,) = arrivals(await d.lookup([]), "d1")
    assert seen.until_s <= 0.5001
    await backend.sleep(0.6)
    assert arrivals(await d.lookup([]), "d1") == ()


# -- two gateway replicas over one directory -------------------------------------------------------

import json  # noqa: E402

from directory_client import NodeInfo, open_directory  # noqa: E402
from gateway import metrics  # noqa: E402
from gateway.core import RoutingCore, RoutingLimits  # noqa: E402
from gateway.policy import make_policy  # noqa: E402
from gateway.profile import load_profile  # noqa: E402
from tokenizer import PromptTokenizer  # noqa: E402

PROFILE = load_profile("llama-3.1-8b-h100")
DOC = "The quarterly report on harbour traffic, berth by berth. " * 1400  # ~16k tokens
LONGER = "A different report, longer still, on the same harbour. " * 2400  # its prefill ends after DOC's KV lands


def replica(directory):  # type: ignore[no-untyped-def]
    """A gateway replica: its own policy (its own ledger), the shared directory."""
    policy = make_policy("kvgate", link="rdma", prefill_serves_whole_tokens=0)  # the decode nodes' whole choice is the subject
    for _ in range(128):  # it has seen enough first tokens to know their p99
        policy.first_token_tail.observe(10.0)
    return RoutingCore(PromptTokenizer(), directory, policy, PROFILE, RoutingLimits(models=frozenset(["m"]), lookup_timeout_s=2.0))  # a loaded test machine


def body(prompt: str, answer: int) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": answer}).encode()


async def fleet(directory) -> None:  # type: ignore[no-untyped-def]
    """One prefill node, two decode nodes decoding 20 and 24 answers: a long prompt with a long
    answer is split, and its KV goes to d1 (the less busy)."""
    for info in (NodeInfo("p1", "127.0.0.1:9001", role="prefill"), NodeInfo("d1", "127.0.0.1:9002", role="decode"),
                 NodeInfo("d2", "127.0.0.1:9003", role="decode")):
        await directory.register_node(info)
    for nid, busy in (("d1", 20), ("d2", 24)):
        for _ in range(busy):
            await directory.reserve(nid, 0, hold_s=60.0)


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_a_split_routed_by_one_replica_steers_the_other_replicas_next_decision(
    where: str, key_prefix: str, redis_url: str, request: pytest.FixtureRequest
) -> None:
    url = redis_url if where == "redis" else request.getfixturevalue("redis_cluster_url")
    a_dir, b_dir = (open_directory(url, key_prefix=key_prefix, index_stride=1, op_timeout_s=2.0) for _ in range(2))
    try:
        await fleet(a_dir)
        a, b = replica(a_dir), replica(b_dir)
        before = (await b.explain("/v1/completions", body(LONGER, 16))).decision
        assert before is not None and before.node is not None and before.node.node_id == "d1", before.reason
        split = await a.route("/v1/completions", body(DOC, 2048))
        plan = split.decision.prefill if split.decision else None
        assert plan is not None and split.decision.node.node_id == "d1", split.decision.reason
        # replica b never saw that request: the directory tells it
        after = (await b.explain("/v1/completions", body(LONGER, 16))).decision
        assert after is not None and after.node is not None
        theirs = b.policy.pending_arrivals.arrivals("d1")
        assert len(theirs) == 1 and theirs[0].blocks == split.request.total_blocks
        assert after.node.node_id == "d2", after.reason  # its long prefill would hold up a's split on d1
        assert "splits arriving or answering there" in after.reason
        # a counts its own split once, though the directory shows it too
        await a.explain("/v1/completions", body("x " * 50, 8))
        assert len(a.policy.pending_arrivals.arrivals("d1")) == 1
        await a.release(split)
    finally:
        for d in (a_dir, b_dir):
            await d.aclose()


class DiesAfterLookup:
    """A real Redis directory whose server is killed right after the next lookup answers: the
    reservation that follows finds it down."""

    def __init__(self, directory, server) -> None:  # type: ignore[no-untyped-def]
        self._directory, self._server, self.armed = directory, server, False

    async def lookup(self, keys, session: str = ""):  # type: ignore[no-untyped-def]
        view = await (self._directory.lookup(keys, session) if session else self._directory.lookup(keys))
        if self.armed:
            self.armed = False
            self._server.kill()
        return view

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._directory, name)


async def test_with_the_directory_down_a_replica_still_steers_by_its_own_splits(private_redis) -> None:  # type: ignore[no-untyped-def]
    directory = open_directory(private_redis.url, key_prefix="kvgate", index_stride=1, op_timeout_s=0.5)
    try:
        await fleet(directory)
        dying = DiesAfterLookup(directory, private_redis)
        a = replica(dying)
        unshared = metrics.PD_ARRIVALS_UNSHARED._value.get()
        dying.armed = True
        split = await a.route("/v1/completions", body(DOC, 2048))
        assert split.kind == "routed" and split.decision is not None and split.decision.prefill is not None
        assert split.reservation is None  # the directory went down before the reserve
        assert metrics.PD_ARRIVALS_UNSHARED._value.get() == unshared + 1  # the metric says the others cannot see it
        (mine,) = a.policy.pending_arrivals.arrivals("d1")
        assert mine.blocks == split.request.total_blocks
        # the directory comes back empty (a restarted Redis): the fleet registers again, no arrival in it
        private_redis.start()
        a.directory.breaker.success()
        await fleet(directory)
        await directory.reserve("p1", mine.blocks * PROFILE.block_size, first_token_s=2.0, hold_s=2.0)  # as it was
        after = (await a.explain("/v1/completions", body(LONGER, 16))).decision
        assert after is not None and after.node is not None and after.node.node_id == "d2", after.reason
        assert "splits arriving or answering there" in after.reason
    finally:
        await directory.aclose()



async def test_an_explained_split_arrives_nowhere() -> None:
    """``/debug/explain`` runs the decision without routing: its split must not sit in the ledger
    (before, each explain of a long document kept later prompts off that decode node)."""
    from directory_client import InProcessDirectory

    directory = InProcessDirectory(index_stride=1, heartbeat_ttl_s=10_000.0)
    await fleet(directory)
    gw = replica(directory)
    explained = await gw.explain("/v1/completions", body(DOC, 2048))
    assert explained.decision is not None and explained.decision.prefill is not None, explained.decision.reason
    assert not gw.policy.pending_arrivals
    routed = await gw.route("/v1/completions", body(DOC, 2048))
    assert routed.decision is not None and routed.decision.prefill is not None
    assert len(gw.policy.pending_arrivals.arrivals(routed.decision.node.node_id)) == 1
    view = await directory.lookup([])
    assert {nv.node.node_id: len(nv.arrivals) for nv in view.nodes} == {"d1": 1, "d2": 0, "p1": 0}  # shared too
    await gw.release(routed)
