"""Elastic fleets: the directory's hot-prefix records and draining marks (in-process and real
Redis), the drain's planning code, decisions that leave draining nodes out, and scale events in
the simulator (which runs that same code)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import numpy as np
import pytest

from directory_client import InProcessDirectory, open_directory
from directory_client.types import DirectoryView, HotPrefix, NodeInfo, NodeLoad, NodeView, Tier
from gateway.decision_round import decide_round, routing_request
from gateway.drain import distinct_prefixes, plan_copy
from gateway.elastic import HotBudget, hot_tokens
from gateway.policy import make_policy
from gateway.profile import load_profile
from loadtest.elastic_figures import elastic_figures
from loadtest.sim.elastic import parse_scale, split_variant
from loadtest.sim.simulator import SimConfig, Simulator
from loadtest.workloads.memory_bound import agentic_workload
from tests.redis_servers import purge_prefix
from tokenizer.keys import block_keys

PROFILE = load_profile("llama-3.1-8b-h100")


def tokens(*ids: int) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


@pytest.fixture(params=["memory", "redis", "cluster"])
def directory(request, redis_url):
    if request.param == "memory":
        yield InProcessDirectory()
        return
    url = request.getfixturevalue("redis_cluster_url") if request.param == "cluster" else redis_url
    prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"
    yield url, prefix  # each test opens its own client inside its event loop
    purge_prefix(url, prefix)


def opened(directory):
    """The directory under test, opened in the running event loop (the Redis ones are async clients)."""
    if isinstance(directory, InProcessDirectory):
        return directory
    url, prefix = directory
    return open_directory(url, key_prefix=prefix, op_timeout_s=2.0)


def test_a_node_keeps_its_most_recent_prompts_newest_first(directory) -> None:
    async def go():
        directory_ = opened(directory)
        try:
            return await records(directory_)
        finally:
            await directory_.aclose()

    async def records(directory):
        for i in range(5):
            await directory.record_hot("n1", "m", tokens(1, 2, i), keep=3, ttl_s=60)
            await asyncio.sleep(0.01)  # Redis scores by wall time: keep the order unambiguous
        await directory.record_hot("n1", "m", tokens(1, 2, 2), keep=3, ttl_s=60)  # served again: newest
        return await directory.hot_prefixes("n1", 10), await directory.hot_prefixes("n2", 10)

    hot, other = asyncio.run(go())
    assert [np.frombuffer(h.tokens, "<u4")[-1] for h in hot] == [2, 4, 3]  # 0 and 1 fell out; 2 came back
    assert all(h.model == "m" and h.token_count == 3 for h in hot)
    assert other == []


def test_draining_marks_expire_and_can_be_taken_back(directory) -> None:
    async def go():
        directory_ = opened(directory)
        try:
            return await marks(directory_)
        finally:
            await directory_.aclose()

    async def marks(directory):
        await directory.set_draining("n1", 60)
        await directory.set_draining("n2", 0.2)
        both = await directory.draining()
        await asyncio.sleep(0.3)
        after = await directory.draining()
        await directory.set_draining("n1", 0)
        return both, after, await directory.draining()

    both, after, undone = asyncio.run(go())
    assert both == {"n1", "n2"} and after == {"n1"} and undone == frozenset()


def test_bad_hot_records_are_refused_and_stored_nothing() -> None:
    d = InProcessDirectory()
    for model, toks, keep, ttl in (("", tokens(1), 3, 1), ("m", b"\x01\x02\x03", 3, 1), ("m", tokens(1), 0, 1),
                                   ("m", tokens(1), 3, 0)):  # fmt: skip
        with pytest.raises(ValueError):
            asyncio.run(d.record_hot("n1", model, toks, keep=keep, ttl_s=ttl))
    assert asyncio.run(d.hot_prefixes("n1", 10)) == []


def test_a_drain_copies_a_conversation_once_not_every_turn() -> None:
    turn1, turn2, other = HotPrefix("m", tokens(1, 2), 1.0), HotPrefix("m", tokens(1, 2, 3, 4), 2.0), HotPrefix("m", tokens(9), 1.5)
    elsewhere = HotPrefix("other-model", tokens(1, 2), 3.0)
    assert distinct_prefixes([turn1, other, turn2, elsewhere]) == [elsewhere, turn2, other]


def test_salted_and_sub_block_prompts_are_never_recorded() -> None:
    ids = np.arange(40, dtype=np.uint32)
    req = routing_request("m", ids, np.asarray(block_keys(ids, block_size=16, seed=1), dtype=np.uint64), block_size=16, seed=1)
    assert np.frombuffer(hot_tokens(req, ids), "<u4").tolist() == list(range(32))  # full blocks only
    short = ids[:10]
    assert hot_tokens(routing_request("m", short, np.asarray([], np.uint64), block_size=16, seed=1), short) is None
    assert hot_tokens(replace(req, salted=True), ids) is None


def node(i: int, cached: int = 0, inflight: int = 0) -> NodeView:
    return NodeView(NodeInfo(f"n{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100"), cached, Tier.GPU, NodeLoad(inflight, 0), 100)


def test_a_draining_node_gets_no_new_request_unless_it_is_the_only_one() -> None:
    ids = np.arange(64 * 16, dtype=np.uint32)
    keys = np.asarray(block_keys(ids, block_size=16, seed=1), dtype=np.uint64)
    req = routing_request("m", ids, keys, block_size=16, seed=1)
    policy = make_policy("kvgate", link="rdma")
    view = DirectoryView((node(1, 64), node(2), node(3)))
    assert decide_round(policy, req, view, PROFILE, now=0.0, answer_tokens=8).decision.node.node_id == "n1"
    rnd = decide_round(policy, req, view, PROFILE, now=0.0, answer_tokens=8, draining=frozenset({"n1"}))
    assert rnd.decision.node.node_id in ("n2", "n3")
    # its blocks live until it stops: the new node pulls them rather than recompute the prompt
    assert rnd.decision.pull is not None and rnd.decision.pull.source_node_id == "n1" and rnd.decision.pull.blocks == 64
    assert rnd.decision.expected_cached_tokens == 64 * 16 and rnd.prefill_tokens == 0
    nopull = decide_round(make_policy("kvgate_nopull"), req, view, PROFILE, now=0.0, answer_tokens=8, draining=frozenset({"n1"}))
    assert nopull.decision.node.node_id in ("n2", "n3") and nopull.decision.pull is None  # a policy that never pulls
    for name in ("prefix_only", "round_robin", "least_request"):  # the balancers never send it anything
        assert all(decide_round(make_policy(name), req, view, PROFILE, now=float(t), answer_tokens=8,
                                draining=frozenset({"n1"})).decision.node.node_id != "n1" for t in range(6))  # fmt: skip
    alone = DirectoryView((node(1, 64),))
    assert decide_round(policy, req, alone, PROFILE, now=0.0, answer_tokens=8, draining=frozenset({"n1"})).decision.node.node_id == "n1"


def test_a_copy_goes_where_the_prompt_would_be_served_next() -> None:
    ids = np.arange(64 * 16, dtype=np.uint32)
    keys = np.asarray(block_keys(ids, block_size=16, seed=1), dtype=np.uint64)
    prefix = HotPrefix("m", ids.astype("<u4").tobytes(), 1.0)
    view = DirectoryView((node(1, 64), node(2, 0, inflight=3), node(3)))
    plan = plan_copy(make_policy("kvgate", link="rdma"), PROFILE, prefix, keys, view, source_id="n1",
                     draining=frozenset(), seed=1, now=0.0, link="rdma", block_size=16)  # fmt: skip
    assert plan is not None and plan.target.node_id == "n3" and plan.blocks == 64  # the idle one
    assert plan.transfer_s == pytest.approx(PROFILE.transfer_seconds(64 * 16, "rdma"))
    holder = DirectoryView((node(1, 64), node(2, 64)))
    assert plan_copy(make_policy("kvgate"), PROFILE, prefix, keys, holder, source_id="n1", draining=frozenset(),
                     seed=1, now=0.0, link="rdma", block_size=16) is None  # n2 already holds it  # fmt: skip
    gone = DirectoryView((node(1, 0), node(3)))
    assert plan_copy(make_policy("kvgate"), PROFILE, prefix, keys, gone, source_id="n1", draining=frozenset(),
                     seed=1, now=0.0, link="rdma", block_size=16) is None  # evicted meanwhile  # fmt: skip


@pytest.mark.parametrize("text", ["300", "300:4", "x:+4", "300:+0", "300:+4,,600:-4"])
def test_bad_scale_events_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="SECONDS:"):
        parse_scale(text)


def test_scale_events_and_policy_variants_parse() -> None:
    assert [(e.at_s, e.delta) for e in parse_scale("600:-4, 300:+4")] == [(300.0, 4), (600.0, -4)]
    assert split_variant("kvgate+drain+nowarm") == ("kvgate", True, False)
    assert split_variant("round_robin") == ("round_robin", False, True)
    with pytest.raises(ValueError, match="unknown variant"):
        split_variant("kvgate+fast")


def _run(drain: bool):
    wl = agentic_workload(agents=60, rate_per_s=0.5, steps=(8, 12), model="sim-model", seed=2)
    cfg = SimConfig(policy="kvgate", nodes=4, profile=PROFILE, pull_link="rdma", duration_s=160,
                    scale=tuple(parse_scale("30:+2,130:-2")), drain=drain)  # fmt: skip
    sim = Simulator(wl, cfg, None)
    res = sim.run()
    return sim, res, elastic_figures(res.records, sim.elastic.members, sim.elastic.copies)


@pytest.mark.parametrize("drain", [False, True])
def test_simulated_nodes_join_and_leave_on_the_virtual_clock(drain: bool) -> None:
    sim, res, fig = _run(drain)
    removed = fig["scale_in_events"][0]["nodes"]
    assert sorted(removed) == ["n5", "n6"] and sorted(n.node_id for n in sim.nodes) == ["n1", "n2", "n3", "n4"]
    assert any(r.node in ("n5", "n6") for r in res.records)  # the new nodes served
    assert not any(r.node in removed and r.sent_at >= 130 for r in res.records)  # and nothing after they left
    assert [row["live_nodes"] for row in fig["timeline"]][:3] == [4, 6, 4]  # nodes in the fleet for the whole minute
    assert fig["scale_in_loss"] == fig["scale_in_events"][0]["loss"]  # one removal: its loss is the mean
    tokens_ = sum(r.prompt_tokens for r in res.records if r.ok and r.sent_at < 60)
    assert fig["timeline"][0]["hit_rate"] == sum(r.cached_tokens for r in res.records if r.ok and r.sent_at < 60) / tokens_
    if drain:
        assert fig["drain_copies"]["done"] >= 1 and fig["drain_copies"]["blocks"] > 0
        # the two leave together: copies that first went to the other leaving node were made again
        assert fig["drain_copies"]["retargeted"] >= 1 and fig["drain_copies"]["done"] == fig["drain_copies"]["planned"]
        assert fig["scale_in_loss_reuse"] is not None
    else:
        assert fig["drain_copies"]["planned"] == 0


def test_hot_prefix_notes_are_sampled_per_node_within_their_byte_budget() -> None:
    """A node serving long prompts back to back gets some noted, not all: at most the budget per
    second reaches the directory; another node's budget is its own, and the budget refills."""
    budget = HotBudget(bytes_per_s=1000)
    assert [budget.allow("n1", 400, now=0.0) for _ in range(4)] == [True, True, False, False]
    assert budget.allow("n2", 400, now=0.0)  # another node: its own budget
    assert budget.allow("n1", 400, now=0.5)  # half a second refills 500 bytes
    assert not budget.allow("n1", 2000, now=100.0)  # never more than one second's worth at once
