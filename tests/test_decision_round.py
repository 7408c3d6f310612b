"""The simulator routes by the gateway's own decision round: every simulated request, asked of
a ``RoutingCore`` over the same directory at the same (virtual) time, gets the same decision,
the same estimates and the same reservation."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.core import RoutingCore, RoutingLimits
from gateway.decision_round import DEFAULT_ANSWER_TOKENS, Round, answer_tokens
from gateway.policy import make_policy
from gateway.profile import load_profile
from loadtest.sim.simulator import SimConfig, Simulator
from loadtest.workloads.base import RequestSpec
from loadtest.workloads.chat import chat_workload
from loadtest.workloads.trace import load_trace, trace_workload
from tokenizer import PromptTokenizer

PROFILE = load_profile("llama-3.1-8b-h100")


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


def _chat(tok: PromptTokenizer):
    return chat_workload(conversations=10, turns=4, count_tokens=lambda s: len(tok.encode_text(s, add_special_tokens=False)),
                         model="sim-model", rate_per_s=4.0, doc_tokens=(1000, 3000), think_s=(0.2, 0.6),
                         max_tokens=48, seed=5)


def _trace():
    return trace_workload(load_trace(limit=60), model="sim-model", time_scale=0.05, max_output=64)


@pytest.mark.parametrize("policy,pulls", [("kvgate", "rdma"), ("kvgate", None), ("prefix_only", None)])
@pytest.mark.parametrize("workload", ["chat", "trace"])
def test_every_simulated_decision_is_the_gateways(tok, policy: str, pulls: str | None, workload: str) -> None:
    wl = _chat(tok) if workload == "chat" else _trace()
    sim = Simulator(wl, SimConfig(policy=policy, nodes=4, profile=PROFILE, pull_link=pulls, view="directory"), tok)
    options = {"link": pulls} if pulls else {}
    # head_chars=0: the gateway's shortcut for long fresh text (decide on its head) is off, so
    # both sides decide on the whole prompt
    core = RoutingCore(tok, sim.directory, make_policy(policy, **options), PROFILE,
                       RoutingLimits(block_size=PROFILE.block_size, head_chars=0), clock=lambda: sim.now)
    seen: list[tuple[RequestSpec, Round]] = []

    def compare(spec: RequestSpec, rnd: Round) -> None:
        body = json.dumps(spec.wire_body()).encode()
        answer = asyncio.run(core.explain(spec.path, body))  # before the simulator reserves: the same view
        assert answer.kind == "routed", answer.reason
        assert answer.decision == rnd.decision  # node, pull, cached tokens, every candidate's cost, reason
        assert (answer.ttft_s, answer.service_s) == (rnd.ttft_s, rnd.service_s)
        assert answer.request is not None
        assert rnd.prefill_tokens == answer.request.prompt_tokens - answer.decision.expected_cached_tokens
        seen.append((spec, rnd))

    sim.on_round = compare
    res = sim.run()
    assert len(seen) == len(res.records) == wl.max_requests
    outcomes = {rnd.decision.outcome for _, rnd in seen}
    assert "owner" in outcomes  # the comparison covered cache hits, not only cold prompts
    if pulls:
        assert any(rnd.decision.pull is not None for _, rnd in seen) or "recompute" in outcomes


def test_the_simulator_stops_counting_queued_prefill_at_the_estimated_first_token(tok) -> None:
    """What each node's load shows a decision is exactly: one request per reservation not yet
    ended, and the prefill of those whose estimated first token is still to come."""
    wl = _trace()
    sim = Simulator(wl, SimConfig(policy="kvgate", nodes=2, profile=PROFILE), tok)
    settles: dict[str, float] = {}  # request id -> when its prefill stops counting
    prefill: dict[str, int] = {}
    released_early = 0

    def check(spec: RequestSpec, rnd: Round) -> None:
        nonlocal released_early
        view = asyncio.run(sim.directory.loads())
        for node in sim.nodes:
            on_node = [rid for rid, ctx in sim._pending.items() if ctx.node is node]
            counted = [rid for rid in on_node if settles[rid] > sim.now]
            released_early += len(on_node) - len(counted)
            assert view[node.node_id].inflight == len(on_node)
            assert view[node.node_id].prefill_tokens == sum(prefill[rid] for rid in counted)
        rid = f"{spec.session_id}/{spec.turn}"
        settles[rid], prefill[rid] = sim.now + rnd.ttft_s, rnd.prefill_tokens

    sim.on_round = check
    sim.run()
    assert released_early > 0  # some requests were still running past their first token
    loads = asyncio.run(sim.directory.loads())
    assert all(load.inflight == 0 and load.prefill_tokens == 0 for load in loads.values())


def test_answer_budget_is_read_like_the_engine_reads_it() -> None:
    assert answer_tokens({"max_tokens": 40}) == 40
    assert answer_tokens({"max_completion_tokens": 12, "max_tokens": 40}) == 12
    for bad in ({}, {"max_tokens": True}, {"max_tokens": -3}, {"max_tokens": "9"}, []):
        assert answer_tokens(bad) == DEFAULT_ANSWER_TOKENS
