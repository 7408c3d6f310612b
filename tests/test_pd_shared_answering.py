"""The contexts of answers served whole, shared through the directory (``gateway.policy.answering``):
a reservation counts what its decodes read on its node (``reserve(context_tokens=...)``), every
lookup returns the node's sum (``NodeView.answering_tokens``) until the reservation is released or
ends, and another gateway replica prices it. Every backend runs the same tests (the in-process
one, a real Redis, a real 3-primary Redis Cluster); the replicas run on real Redis and Cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from directory_client import NodeInfo, open_directory
from gateway import metrics
from gateway.core import RoutingCore, RoutingLimits
from gateway.policy import make_policy
from gateway.profile import load_profile
from tests.test_directory_behaviour import Backend, backend, node  # noqa: F401 (the fixture)
from tests.test_pd_shared_arrivals import DiesAfterLookup
from tokenizer import PromptTokenizer


def answering(view, nid: str) -> int:  # type: ignore[no-untyped-def]
    return next(nv.answering_tokens for nv in view.nodes if nv.node.node_id == nid)


async def test_a_reserved_context_is_in_every_clients_lookup_until_released(backend: Backend) -> None:
    writer, reader = backend.make(), backend.make()
    for i, nid in enumerate(("d1", "d2")):
        await writer.register_node(node(nid, 8000 + i))
    r1 = await writer.reserve("d1", 500, context_tokens=20_000)
    r2 = await writer.reserve("d1", 0, context_tokens=3_000, requests=4, first_token_s=0.1)
    await writer.reserve("d1", 0)  # a reservation that says nothing of its context
    view = await reader.lookup([])
    assert answering(view, "d1") == 23_000 and answering(view, "d2") == 0
    assert view.nodes[0].load.inflight == 6 and view.nodes[0].load.prefill_tokens == 500  # counts unchanged
    await writer.release(r1)
    assert answering(await reader.lookup([]), "d1") == 3_000
    await writer.release(r1)  # idempotent: nothing given back twice
    await writer.release(r2)
    view = await reader.lookup([])
    assert answering(view, "d1") == 0 and view.nodes[0].load.inflight == 1


async def test_a_context_ends_with_its_reservation_by_itself(backend: Backend) -> None:
    d = backend.make()
    await d.register_node(node("d1"))
    await d.reserve("d1", 0, context_tokens=8_000, hold_s=0.3)
    await d.reserve("d1", 0, context_tokens=1_000, hold_s=30.0)
    assert answering(await d.lookup([]), "d1") == 9_000
    await backend.sleep(0.5)
    assert answering(await d.lookup([]), "d1") == 1_000


@pytest.mark.parametrize("bad", [-1, True, 1.5, 1 << 40])
async def test_a_malformed_context_is_refused_before_anything_is_reserved(backend: Backend, bad: object) -> None:
    d = backend.make()
    await d.register_node(node("d1"))
    with pytest.raises(ValueError):
        await d.reserve("d1", 0, context_tokens=bad)  # type: ignore[arg-type]
    view = await d.lookup([])
    assert view.nodes[0].load.inflight == 0 and answering(view, "d1") == 0


# -- two gateway replicas over one directory -------------------------------------------------------

PROFILE = load_profile("llama-3.1-8b-h100")
DOC = "The quarterly report on harbour traffic, berth by berth. " * 1400  # ~16k tokens


def replica(directory):  # type: ignore[no-untyped-def]
    """A gateway replica: its own policy (its own ledgers), the shared directory."""
    policy = make_policy("kvgate", link="rdma")
    for _ in range(128):  # it has seen enough first tokens to know their p99
        policy.first_token_tail.observe(10.0)
    limits = RoutingLimits(models=frozenset(["m"]), lookup_timeout_s=2.0)  # a loaded test machine
    return RoutingCore(PromptTokenizer(), directory, policy, PROFILE, limits)


def body(prompt: str, answer: int, n: int = 1) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": answer, "n": n}).encode()


class Unshared:
    """A directory whose lookups say nothing of the answers' contexts: sharing disabled."""

    def __init__(self, directory) -> None:  # type: ignore[no-untyped-def]
        self._directory = directory

    async def lookup(self, keys, session: str = ""):  # type: ignore[no-untyped-def]
        view = await self._directory.lookup(keys, session)
        nodes = tuple(dataclasses.replace(nv, answering_tokens=0) for nv in view.nodes)
        return dataclasses.replace(view, nodes=nodes)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._directory, name)


async def decode_fleet(directory) -> None:  # type: ignore[no-untyped-def]
    """Two decode nodes and no prefill node: every request is served whole."""
    for info in (NodeInfo("d1", "127.0.0.1:9002", role="decode"), NodeInfo("d2", "127.0.0.1:9003", role="decode")):
        await directory.register_node(info)


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_answers_one_replica_served_whole_steer_the_other_replicas_long_prompt(
    where: str, key_prefix: str, redis_url: str, request: pytest.FixtureRequest
) -> None:
    url = redis_url if where == "redis" else request.getfixturevalue("redis_cluster_url")
    a_dir, b_dir = (open_directory(url, key_prefix=key_prefix, index_stride=1, op_timeout_s=2.0) for _ in range(2))
    try:
        await decode_fleet(a_dir)
        a, b, blind = replica(a_dir), replica(b_dir), replica(Unshared(b_dir))
        # replica a serves four answers of a document whole: they read ~4 x 16k tokens a step
        routed = await a.route("/v1/completions", body(DOC, 512, n=4))
        assert routed.kind == "routed" and routed.decision is not None and routed.decision.prefill is None
        busy = routed.decision.node.node_id
        idle = "d2" if busy == "d1" else "d1"
        shared = routed.round.context_tokens
        assert shared == 4 * (routed.request.prompt_tokens + 256)
        for _ in range(5):  # the other node runs one more plain request: the fewer in flight is busy's
            await a_dir.reserve(idle, 0, hold_s=60.0)
        await asyncio.sleep(routed.ttft_s + 0.05)  # a's prompt is estimated computed: no queue left on busy
        # a replica that does not see the contexts sends the next document where fewer run
        unaware = (await blind.explain("/v1/completions", body(DOC, 16))).decision
        assert unaware is not None and unaware.node is not None and unaware.node.node_id == busy, unaware.reason
        # replica b never saw a's request: the directory tells it what its answers read
        after = (await b.explain("/v1/completions", body(DOC, 16))).decision
        assert after is not None and after.node is not None and after.node.node_id == idle, after.reason
        assert b.policy.answering.context_tokens(busy, 0.0) == shared
        # a counts its own answers once, though the directory counts them too
        await a.explain("/v1/completions", body("x " * 50, 8))
        entry = routed.round.answer
        assert a.policy.answering.context_tokens(busy, entry.start + 1e-6) == pytest.approx(4 * routed.request.prompt_tokens, abs=4)
        # the response ended: a's ledger and the directory forget it, and b prices it no more
        await a.release(routed)
        assert a.policy.answering.context_tokens(busy, entry.start + 1e-6) == 0
        assert answering(await b_dir.lookup([]), busy) == 0
        await b.explain("/v1/completions", body(DOC, 16))
        assert b.policy.answering.context_tokens(busy, 0.0) == 0
    finally:
        for d in (a_dir, b_dir):
            await d.aclose()


async def test_with_the_directory_down_a_replica_still_prices_its_own_answers(private_redis) -> None:  # type: ignore[no-untyped-def]
    directory = open_directory(private_redis.url, key_prefix="kvgate", index_stride=1, op_timeout_s=0.5)
    try:
        await decode_fleet(directory)
        dying = DiesAfterLookup(directory, private_redis)
        a = replica(dying)
        unshared = metrics.PD_ANSWERING_UNSHARED._value.get()
        dying.armed = True
        routed = await a.route("/v1/completions", body(DOC, 512))
        assert routed.kind == "routed" and routed.reservation is None  # the directory went down before the reserve
        assert metrics.PD_ANSWERING_UNSHARED._value.get() == unshared + 1  # the others cannot see it
        entry = routed.round.answer
        # the directory comes back empty (a restarted Redis): a's own answer is still priced, once
        private_redis.start()
        a.directory.breaker.success()
        await decode_fleet(directory)
        await a.explain("/v1/completions", body("x " * 50, 8))
        node_id = routed.decision.node.node_id
        assert a.policy.answering.context_tokens(node_id, entry.start + 1e-6) == pytest.approx(routed.request.prompt_tokens, abs=1)
    finally:
        await directory.aclose()


async def test_a_released_split_and_answer_leave_the_ledgers_and_the_directory() -> None:
    """A request's end takes its split arrival or its answer out of the replica's ledgers and of
    the directory: no later decision prices them until their estimated ends."""
    from directory_client.memory import InProcessDirectory
    from tests.test_pd_shared_arrivals import DOC as SPLIT_DOC
    from tests.test_pd_shared_arrivals import fleet

    directory = InProcessDirectory()
    await fleet(directory)
    a = replica(directory)
    split = await a.route("/v1/completions", body(SPLIT_DOC, 2048))
    assert split.decision is not None and split.decision.prefill is not None, split.decision.reason
    whole = await a.route("/v1/completions", body("a short question " * 20, 64))
    assert whole.decision is not None and whole.decision.prefill is None, whole.decision.reason
    d = split.decision.node.node_id
    w = whole.decision.node.node_id
    assert a.policy.pending_arrivals.arrivals(d) and a.policy.answering.context_tokens(w, whole.round.answer.start + 1e-6) > 0
    view = await directory.lookup([])
    assert answering(view, w) == whole.round.context_tokens > 0
    assert [x.arrival_id for x in next(nv.arrivals for nv in view.nodes if nv.node.node_id == d)] == [split.round.arrival.arrival_id]
    await a.release(split)
    await a.release(whole)
    assert not a.policy.pending_arrivals.arrivals(d)
    assert a.policy.answering.context_tokens(w, whole.round.answer.start + 1e-6) == 0
    view = await directory.lookup([])
    assert answering(view, w) == 0 and all(nv.arrivals == () for nv in view.nodes)


def test_a_simulated_fleet_serves_n_answers_and_its_ledgers_empty_as_requests_end() -> None:
    """The simulator runs the request's end as the gateway does: when every request has answered,
    no split arrival and no answer is left in the policy's ledgers (before, they stayed until
    their estimated ends). Requests asking n answers are decoded and counted n times."""
    from loadtest.sim.simulator import SimConfig, Simulator
    from loadtest.sim.sync import run_now
    from loadtest.workloads.mixed import mixed_workload

    wl = mixed_workload(sessions=60, seed=2, multi_share=0.3)
    sim = Simulator(wl, SimConfig(policy="kvgate", nodes=4, profile=PROFILE, roles=(1, 3), pull_link="rdma",
                                  policy_options={"warmup_s": 0.0, "prefill_serves_whole_tokens": 0}), None)
    res = sim.run()
    assert res.records and all(r.ok for r in res.records)
    many = [r for r in res.records if r.answers > 1]
    assert many and all(r.output_tokens == r.answers * r.spec.body["max_tokens"] for r in many)
    assert any(r.split for r in res.records)
    policy = sim.policy
    assert not policy.answering and not any(policy.pending_arrivals.arrivals(n.node_id) for n in sim.nodes)
    assert all(load.inflight == 0 for load in run_now(sim.directory.loads()).values())
