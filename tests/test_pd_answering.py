"""The answers a disaggregated fleet's gateway served whole (``gateway.policy.answering``): their
contexts are read by every step on their node, so a long prompt is priced the interference."""

from __future__ import annotations

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.decision_round import decide_round
from gateway.policy import make_policy
from gateway.policy.answering import AnsweringContexts
from gateway.profile import load_profile
from tests.test_pd_arrivals import request, warmed

PROFILE = load_profile("llama-3.1-8b-h100")


def node(i: int, role: str, *, inflight: int = 0) -> NodeView:
    info = NodeInfo(f"{role[0]}{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100", role=role)
    return NodeView(info, 0, Tier.GPU, NodeLoad(inflight, 0))


def test_an_answer_reads_its_prompt_and_what_it_has_decoded_until_its_estimated_end() -> None:
    ledger = AnsweringContexts()
    ledger.add("d2", 10.0, 20.0, 8_000, 1_000)
    ledger.add("d2", 12.0, 13.0, 500, 100)
    ledger.add("d3", 10.0, 10.0, 9_999, 1)  # no span: nothing to record
    assert ledger.context_tokens("d2", 9.9) == 0  # not answering yet: its prefill is queued work
    assert ledger.context_tokens("d2", 15.0) == 8_500  # half way: 8,000 + 500
    assert ledger.context_tokens("d2", 12.5) == 8_250 + 550
    assert ledger.context_tokens("d3", 15.0) == 0
    ledger.expire(15.0)
    assert ledger.context_tokens("d2", 15.0) == 8_500
    ledger.expire(20.0)
    assert not ledger and ledger.context_tokens("d2", 19.0) == 0


def test_a_long_prompt_avoids_the_decode_node_whose_answers_read_the_most_kv() -> None:
    # two decode nodes, ten and eleven answers: the less loaded d2 wins the tie, unless the gateway
    # knows that five of d2's answers are documents reading 20k tokens a step (2 chunks x 5 x 20k
    # x 68.6 ns = 13.7 ms more for this prompt; no prefill node live: the request is served whole)
    fleet = DirectoryView((node(2, "decode", inflight=10), node(3, "decode", inflight=11)))
    plain = decide_round(warmed(make_policy("kvgate", link="rdma")), request(16_000), fleet, PROFILE, now=100.0,
                         answer_tokens=32)
    assert plain.decision.node is not None and plain.decision.node.node_id == "d2", plain.decision.reason
    policy = warmed(make_policy("kvgate", link="rdma"))
    for _ in range(5):
        policy.answering.add("d2", 99.0, 101.0, 20_000, 64)
    rnd = decide_round(policy, request(16_000), fleet, PROFILE, now=100.0, answer_tokens=32)
    assert rnd.decision.node is not None and rnd.decision.node.node_id == "d3", rnd.decision.reason


def test_decide_round_records_what_a_disaggregated_fleet_serves_whole_and_nothing_elsewhere() -> None:
    fleet = DirectoryView((node(1, "prefill", inflight=1), node(2, "decode", inflight=1), node(3, "decode", inflight=1)))
    policy = warmed(make_policy("kvgate", link="rdma"))
    rnd = decide_round(policy, request(2_000), fleet, PROFILE, now=0.0, answer_tokens=100)
    assert rnd.decision.prefill is None and rnd.decision.node is not None, rnd.decision.reason
    answering = rnd.decision.node.node_id
    assert policy.answering.context_tokens(answering, rnd.ttft_s - 1e-6) == 0
    assert policy.answering.context_tokens(answering, rnd.ttft_s + 1e-9) == pytest.approx(2_000, abs=1)
    assert policy.answering.context_tokens(answering, rnd.service_s - 1e-9) == pytest.approx(2_100, abs=1)
    # an aggregated fleet keeps no such ledger: it is routed exactly as before
    both = DirectoryView(tuple(node(i, "both", inflight=1) for i in (1, 2, 3)))
    agg = warmed(make_policy("kvgate", link="rdma"))
    decide_round(agg, request(2_000), both, PROFILE, now=0.0, answer_tokens=100)
    assert not agg.answering
