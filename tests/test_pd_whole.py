"""The whole-request choice of a fleet with prefill/decode roles (``gateway.policy.whole``): the
decodes running on a node slow a prefill there, and a request near the recent TTFT p99 is served
where its first token comes soonest."""

from __future__ import annotations

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.decision_round import decide_round
from gateway.policy import make_policy
from gateway.policy.whole import interference_s
from gateway.profile import load_profile
from gateway.types import RoutingRequest

PROFILE = load_profile("llama-3.1-8b-h100")
BS = PROFILE.block_size


def node(i: int, role: str, *, inflight: int = 0, queued: int = 0) -> NodeView:
    info = NodeInfo(f"{role[0]}{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100", role=role)
    return NodeView(info, 0, Tier.GPU, NodeLoad(inflight, queued))


def request(prompt: int) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=prompt, total_blocks=prompt // BS, block_size=BS, affinity=7)


def warmed(policy, tail_s: float):  # type: ignore[no-untyped-def]
    for _ in range(128):
        policy.first_token_tail.observe(tail_s)
    return policy


def test_interference_is_one_token_of_each_running_decode_and_its_kv_read_per_chunk() -> None:
    per_decode = 1 / PROFILE.prefill_tokens_per_s + PROFILE.decode_step_per_seq_s
    assert interference_s(PROFILE, 10, 0, 8_000) == pytest.approx(10 * per_decode)  # one chunk
    assert interference_s(PROFILE, 10, 30_000, 16_385) == pytest.approx(  # three chunks of 8,192
        3 * (10 * per_decode + 30_000 * PROFILE.decode_step_per_context_token_s))
    assert interference_s(PROFILE, 0, 30_000, 16_000) == 0.0  # nothing decodes there


def test_a_long_prompt_goes_to_the_decode_node_whose_running_decodes_slow_its_chunks_least() -> None:
    # d2 is 2.4 ms sooner by the queue estimate (d3 has 100 tokens queued), but it decodes 40
    # answers: each of the prompt's two chunks carries them, 5.0 ms against d3's 1.2 ms
    # (no prefill node live: the request is served whole)
    fleet = (node(2, "decode", inflight=40), node(3, "decode", inflight=10, queued=100))
    policy = warmed(make_policy("kvgate", link="rdma"), tail_s=10.0)
    rnd = decide_round(policy, request(16_000), DirectoryView(fleet), PROFILE, now=0.0, answer_tokens=32)
    assert rnd.decision.prefill is None and rnd.decision.node is not None, rnd.decision.reason
    d2, d3 = rnd.decision.candidates
    assert d2.total_s < d3.total_s - 0.002  # what an aggregated fleet ranks by
    assert rnd.decision.node.node_id == "d3", rnd.decision.reason
    # the same loads on `both` nodes: an aggregated fleet is routed as before
    both = tuple(node(i, "both", inflight=n, queued=q) for i, n, q in ((2, 40, 0), (3, 10, 100)))
    agg = decide_round(warmed(make_policy("kvgate", link="rdma"), tail_s=10.0), request(16_000), DirectoryView(both),
                       PROFILE, now=0.0, answer_tokens=32)
    assert agg.decision.node is not None and agg.decision.node.node_id == "b2", agg.decision.reason


def test_a_prompt_at_the_tail_is_served_whole_where_its_first_token_comes_soonest() -> None:
    # a split answering on d2 makes its ranking avoid d2 for a 23k-token prompt (their steps would be
    # shared), so it ranked d3, where a queued prefill puts the first token 0.3 s later; a split via
    # p1 then looked sooner and paid its KV transfer (60 ms), landing among the slowest first tokens.
    # The recent p99 is 1 s: this prompt's first token is at the tail whatever is chosen, so it goes
    # where it comes soonest, whole.
    fleet = (node(1, "prefill"), node(2, "decode", inflight=2), node(3, "decode", inflight=2, queued=8_000))
    policy = warmed(make_policy("kvgate", link="rdma", prefill_serves_whole_tokens=0), tail_s=1.0)
    policy.pending_arrivals.add("d2", at=99.9, blocks=1_000, until=105.0)  # landed, still answering
    rnd = decide_round(policy, request(23_000), DirectoryView(fleet), PROFILE, now=100.0, answer_tokens=32)
    d2, d3 = rnd.decision.candidates[0], rnd.decision.candidates[1]
    assert d2.total_s < d3.total_s - 0.2
    assert rnd.decision.prefill is None, rnd.decision.reason
    assert rnd.decision.node is not None and rnd.decision.node.node_id == "d2", rnd.decision.reason
    assert rnd.ttft_s == pytest.approx(d2.total_s)
    assert "served where it comes soonest, not d3" in rnd.decision.reason
    # a request whose first token is well under the tail is ranked as before: serving whole, it avoids d2
    short = decide_round(policy, request(8_000), DirectoryView(fleet), PROFILE, now=100.0, answer_tokens=32)
    assert "aggregated d3" in short.decision.reason and "soonest" not in short.decision.reason


def test_the_tail_rule_never_delays_a_split_still_arriving() -> None:
    # d2 is sooner for this prompt, but a split's KV lands there in 0.2 s: serving whole there would
    # hold that split's first token back until the end of this prefill, so d2 does not win on speed
    fleet = (node(1, "prefill"), node(2, "decode", inflight=2), node(3, "decode", inflight=2, queued=4_000))
    policy = warmed(make_policy("kvgate", link="rdma", prefill_serves_whole_tokens=0), tail_s=1.0)
    policy.pending_arrivals.add("d2", at=100.2, blocks=1_000, until=105.0)
    rnd = decide_round(policy, request(23_000), DirectoryView(fleet), PROFILE, now=100.0, answer_tokens=32)
    assert "aggregated d3" in rnd.decision.reason, rnd.decision.reason  # serving whole, d3 (here a split beat it)
    assert "served where it comes soonest" not in rnd.decision.reason
