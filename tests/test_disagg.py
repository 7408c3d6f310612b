"""Disaggregated prefill/decode in the decision round: roles, and whether a request is split.

Mostly pure pricing: the views are built by hand so each test states the fleet it is about; one
test routes through RoutingCore over the in-process directory to see what a split reserves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from directory_client import InProcessDirectory
from directory_client.redis_base import decode_node, encode_node
from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from directory_client.validate import check_node
from gateway.config import NodeConfig, PolicyConfig
from gateway.core import RoutingCore, RoutingLimits
from gateway.decision_round import decide_round
from gateway.policy import make_policy
from gateway.profile import load_profile
from gateway.types import RoutingRequest
from tokenizer import PromptTokenizer
from workers.engine.step_time import prefill_pairs, step_seconds

PROFILE = load_profile("llama-3.1-8b-h100")
BS = PROFILE.block_size


def node(i: int, role: str, *, cached: int = 0, inflight: int = 0, queued: int = 0) -> NodeView:
    info = NodeInfo(f"{role[0]}{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100", role=role)
    return NodeView(info, cached, Tier.GPU, NodeLoad(inflight, queued))


def request(prompt: int) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=prompt, total_blocks=prompt // BS, block_size=BS, affinity=7)


def warmed(policy, tail_s: float = 10.0):  # type: ignore[no-untyped-def]
    """``policy`` once it has seen enough first tokens to know their p99 (``tail_s``): until then no
    split may delay a first token."""
    if hasattr(policy, "first_token_tail"):
        for _ in range(128):
            policy.first_token_tail.observe(tail_s)
    return policy


def decide(nodes: list[NodeView], prompt: int, answer: int, policy: str = "kvgate", **options):
    return decide_round(warmed(make_policy(policy, **options)), request(prompt), DirectoryView(tuple(nodes)), PROFILE,
                        now=0.0, answer_tokens=answer)


def test_a_long_uncached_prompt_with_a_long_answer_on_a_busy_mixed_fleet_is_split() -> None:
    # two mixed nodes decoding 40 answers each, one idle prefill node, one decode node with 8; over
    # RDMA the prompt's KV crosses in 40 ms, so its first token comes within 10% of the aggregated one
    fleet = [node(1, "both", inflight=40, queued=2000), node(2, "both", inflight=40, queued=2000),
             node(3, "prefill"), node(4, "decode", inflight=8)]
    rnd = decide(fleet, 16_000, 1024, link="rdma")
    plan = rnd.decision.prefill
    assert plan is not None, rnd.decision.reason
    assert (plan.node_id, plan.address) == ("p3", "10.0.0.3:8000")
    assert rnd.decision.node is not None and rnd.decision.node.node_id == "d4"  # the destination decodes
    assert plan.prefill_tokens == 16_000 and rnd.prefill_tokens == 0  # the decode node computes nothing
    assert 0 < plan.ready_s < plan.first_token_s == rnd.ttft_s < rnd.service_s
    assert rnd.decision.reason.startswith("split p3->d4") and "runner-up aggregated" in rnd.decision.reason
    aggregated = decide(fleet, 16_000, 1024, link="rdma", disaggregate=False)  # kvgate told never to split
    assert aggregated.decision.prefill is None
    assert plan.first_token_s <= aggregated.ttft_s * 1.1 + 0.001


def test_a_split_that_would_delay_the_first_token_beyond_the_slack_is_not_made() -> None:
    # the same fleet over TCP: 16k tokens of KV take 0.67 s, nearly doubling the first token
    fleet = [node(1, "both", inflight=40, queued=2000), node(2, "both", inflight=40, queued=2000),
             node(3, "prefill"), node(4, "decode", inflight=8)]
    rnd = decide(fleet, 16_000, 1024, link="tcp")
    assert rnd.decision.prefill is None and "not split: no pair gives a first token within" in rnd.decision.reason
    # with no slack even RDMA's 40 ms is too much when nothing queues: the first token never comes later
    assert decide(fleet, 16_000, 1024, link="rdma", split_ttft_slack=0.0).decision.prefill is None


def test_a_split_that_gives_a_sooner_first_token_is_made_without_slack() -> None:
    # every decode node has a long prefill queue; the prefill node is idle
    fleet = [node(1, "prefill"), node(2, "decode", inflight=4, queued=40_000), node(3, "decode", inflight=4, queued=40_000)]
    rnd = decide(fleet, 8_000, 256, link="rdma", split_ttft_slack=0.0)
    plan = rnd.decision.prefill
    assert plan is not None and plan.node_id == "p1", rnd.decision.reason
    whole = decide(fleet, 8_000, 256, link="rdma", disaggregate=False)
    assert plan.first_token_s < whole.ttft_s


def test_a_short_prompt_moves_only_for_a_sooner_first_token() -> None:
    # its prefill stalls nobody; a less busy decode node alone is no reason to pay a transfer
    fleet = [node(1, "prefill"), node(2, "decode", inflight=60), node(3, "decode", inflight=2)]
    rnd = decide(fleet, 200, 1500, link="rdma")
    assert rnd.decision.prefill is None, rnd.decision.reason


def test_a_short_split_prompt_is_done_when_the_prefill_nodes_step_is() -> None:
    # 131 tokens are one step on the prefill node, and a step reads every weight however few tokens
    # it computes: the plan's readiness (and so when the ledger takes the KV as landed) is the
    # engine's step, not the FLOPs of 131 tokens (3.7 ms sooner)
    fleet = [node(1, "prefill"), node(2, "decode", inflight=4, queued=40_000), node(3, "decode", inflight=4, queued=40_000)]
    plan = decide(fleet, 131, 256, link="rdma", split_ttft_slack=0.0).decision.prefill
    assert plan is not None
    step = step_seconds(PROFILE, prefill_tokens=131, prefill_pairs=prefill_pairs(131, 0), decode_seqs=0, decode_context_tokens=0)
    assert plan.ready_s == pytest.approx(step)
    assert plan.ready_s > PROFILE.prefill_seconds(131) + 0.003


def test_a_splits_first_token_waits_for_steps_that_read_the_answers_running_on_its_decode_node() -> None:
    # the same split, once with 32k tokens of landed splits answering on both decode nodes: the step
    # in progress (half of one, on average) and the one computing the prompt's last token read them
    fleet = [node(1, "prefill"), node(2, "decode", inflight=4, queued=40_000), node(3, "decode", inflight=4, queued=40_000)]
    plain = decide(fleet, 8_000, 256, link="rdma", split_ttft_slack=0.0).decision.prefill
    policy = warmed(make_policy("kvgate", link="rdma", split_ttft_slack=0.0))
    for d in ("d2", "d3"):
        policy.pending_arrivals.add(d, at=-1.0, blocks=2_000, until=10.0)
    answering = decide_round(policy, request(8_000), DirectoryView(tuple(fleet)), PROFILE, now=0.0, answer_tokens=256)
    assert plain is not None and answering.decision.prefill is not None, answering.decision.reason
    read = 1.5 * PROFILE.decode_step_per_context_token_s * 2_000 * BS
    assert answering.decision.prefill.first_token_s == pytest.approx(plain.first_token_s + read)
    assert answering.decision.prefill.ready_s == plain.ready_s  # the prefill node's side is unchanged


def test_the_decode_node_pays_for_the_memory_the_transferred_kv_takes() -> None:
    # two equally idle decode nodes, one with its memory full: the prompt's KV evicts others' blocks there
    def decoder(i: int, held: int) -> NodeView:
        info = NodeInfo(f"d{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100", role="decode", capacity_blocks=4000)
        return NodeView(info, 0, Tier.GPU, NodeLoad(30, 0), held)

    busy_both = NodeView(NodeInfo("b9", "10.0.0.9:8000", "", role="both"), 0, Tier.GPU, NodeLoad(40, 0))
    for full, free in ((2, 3), (3, 2)):
        fleet = [node(1, "prefill"), decoder(full, 4000), decoder(free, 0), busy_both]
        rnd = decide(fleet, 16_000, 1024, link="rdma")
        assert rnd.decision.prefill is not None, rnd.decision.reason
        assert rnd.decision.node is not None and rnd.decision.node.node_id == f"d{free}", rnd.decision.reason


def test_a_mostly_cached_prompt_on_a_decode_node_is_not_split() -> None:
    prompt = 16_000
    fleet = [node(1, "prefill"), node(2, "decode", cached=prompt // BS - 4, inflight=8), node(3, "decode", inflight=8)]
    rnd = decide(fleet, prompt, 1024)
    assert rnd.decision.prefill is None
    assert rnd.decision.node is not None and rnd.decision.node.node_id == "d2"
    assert "not split: no pair gives a first token within" in rnd.decision.reason  # 4 blocks to prefill here


@pytest.mark.parametrize("decoding", [0, 30])
def test_a_short_prompt_is_not_worth_a_transfer(decoding: int) -> None:
    # its prefill hides in a decode step's weight reads: it stalls none of the running decodes
    rnd = decide([node(1, "prefill"), node(2, "decode", inflight=decoding)], 200, 256)
    assert rnd.decision.prefill is None and rnd.decision.node is not None and rnd.decision.node.node_id == "d2"


@pytest.mark.parametrize("policy", ["kvgate", "round_robin", "least_request", "prefix_only"])
def test_a_prefill_node_is_never_the_destination_of_a_long_answer(policy: str) -> None:
    # the prefill node holds the whole prompt and is idle; the decode node is saturated
    prompt = 4096
    fleet = [node(1, "prefill", cached=prompt // BS), node(2, "decode", inflight=300, queued=50_000)]
    for _ in range(4):
        rnd = decide(fleet, prompt, 65, policy)
        assert rnd.decision.node is not None and rnd.decision.node.node_id == "d2"


@pytest.mark.parametrize("policy", ["round_robin", "least_request", "prefix_only"])
def test_balancing_policies_never_send_a_whole_request_to_a_prefill_node(policy: str) -> None:
    fleet = [node(1, "prefill"), node(2, "decode", inflight=300, queued=50_000)]
    for _ in range(4):
        assert decide(fleet, 4096, 8, policy).decision.node.node_id == "d2"


def test_a_long_prompt_asking_a_short_answer_is_served_whole_on_an_idle_prefill_node() -> None:
    # a document to summarise in 64 tokens: a split would add its KV's transfer to its first token,
    # served whole on a decode node its prefill chunks would carry the 20 answers decoding there
    fleet = [node(1, "prefill"), node(2, "decode", inflight=20), node(3, "decode", inflight=20)]
    rnd = decide(fleet, 23_000, 64, link="rdma")
    assert rnd.decision.prefill is None and rnd.decision.node.node_id == "p1", rnd.decision.reason
    assert rnd.prefill_tokens == 23_000  # the prefill node computes it, and its reservation says so
    # n answers count in full: 2 x 64 tokens is not a short answer
    two = decide_round(warmed(make_policy("kvgate", link="rdma")), request(23_000), DirectoryView(tuple(fleet)), PROFILE,
                       now=0.0, answer_tokens=64, answers=2)  # fmt: skip
    assert two.decision.node.role == "decode"
    # 0: prefill nodes never serve a request whole (SGLang's prefill mode), nor does kvgate told never to split
    for options in ({"prefill_serves_whole_tokens": 0}, {"disaggregate": False}):
        assert decide(fleet, 23_000, 64, link="rdma", **options).decision.node.role == "decode"
    with pytest.raises(ValueError, match="prefill_serves_whole_tokens"):
        make_policy("kvgate", prefill_serves_whole_tokens=-1)


def test_a_prefill_node_answering_a_short_request_is_spared_a_long_prefill() -> None:
    # p1 is sooner than p2 (p2 has 500 tokens queued), but p1 is decoding a document's 64-token
    # answer for the next 0.5 s: a 23k-token prefill there would pace that answer by its chunks
    fleet = [node(1, "prefill", inflight=1), node(2, "prefill", queued=500),
             node(3, "decode", inflight=20), node(4, "decode", inflight=20)]

    def policy(answering: bool):  # type: ignore[no-untyped-def]
        pol = warmed(make_policy("kvgate", link="rdma"))
        if answering:
            pol.answering.add("p1", 0.0, 0.5, 20_000, 64)
        return pol

    def rnd(pol, answer: int):  # type: ignore[no-untyped-def]
        return decide_round(pol, request(23_000), DirectoryView(tuple(fleet)), PROFILE, now=0.0, answer_tokens=answer)

    assert rnd(policy(False), 64).decision.node.node_id == "p1"  # served whole where it comes soonest
    whole = rnd(policy(True), 64).decision
    assert whole.node.node_id == "p2" and whole.prefill is None, whole.reason
    # a split's prefill (a long answer) is placed by the same charge
    assert rnd(policy(False), 1024).decision.prefill.node_id == "p1"
    split = rnd(policy(True), 1024).decision
    assert split.prefill is not None and split.prefill.node_id == "p2", split.reason


def test_a_fleet_of_prefill_nodes_only_has_no_destination() -> None:
    assert decide([node(1, "prefill")], 4096, 65).decision.node is None


def test_balancing_policies_never_split() -> None:
    fleet = [node(1, "both", inflight=40, queued=2000), node(3, "prefill"), node(4, "decode", inflight=8)]
    for policy in ("round_robin", "least_request", "prefix_only"):
        assert decide(fleet, 16_000, 1024, policy).decision.prefill is None


def test_an_aggregated_fleet_is_routed_as_before() -> None:
    # the same busy fleet with every node `both`: kvgate's own decision, unchanged
    fleet = [node(1, "both", inflight=40, queued=2000), node(2, "both"), node(3, "both", inflight=8)]
    rnd = decide(fleet, 16_000, 1024)
    policy_alone = make_policy("kvgate").decide(request(16_000), DirectoryView(tuple(fleet)), PROFILE, now=0.0)
    assert rnd.decision == policy_alone and rnd.decision.prefill is None


def test_roles_are_checked_and_carried_by_the_directory_record() -> None:
    info = NodeInfo("p1", "10.0.0.1:8000", role="prefill")
    assert decode_node(encode_node(info)) == info
    assert decode_node(b'{"node_id":"x","address":"10.0.0.2:8000"}').role == "both"  # records written before roles
    with pytest.raises(ValueError, match="role 'encode'"):
        check_node(NodeInfo("e", "10.0.0.3:8000", role="encode"))  # type: ignore[arg-type]
    assert NodeConfig(node_id="d1", address="10.0.0.4:8000", role="decode").role == "decode"
    assert NodeConfig(node_id="b1", address="10.0.0.5:8000").role == "both"
    with pytest.raises(ValidationError):
        NodeConfig(node_id="e1", address="10.0.0.6:8000", role="encode")


def test_the_documented_flags_parse() -> None:
    """docs/disaggregated.md: the vLLM connector config is JSON vLLM reads, the fleet is valid config."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "disaggregated.md").read_text()
    (config,) = re.findall(r"--kv-transfer-config '([^']+)'", doc)
    assert json.loads(config) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    fleet_yaml = re.search(r"```yaml\n(fleet:.*?)```", doc, re.S)
    assert fleet_yaml is not None
    roles = [NodeConfig(**n).role for n in yaml.safe_load(fleet_yaml.group(1))["fleet"]]
    assert roles == ["prefill", "decode", "decode", "both"]
    sglang_yaml = re.search(r"```yaml\n(policy:.*?)```", doc, re.S)  # SGLang's decode mode
    assert sglang_yaml is not None
    policy = PolicyConfig(**yaml.safe_load(sglang_yaml.group(1))["policy"]).build()
    assert policy.decode_serves_whole is False and policy.disaggregate


async def test_a_split_request_loads_its_prefill_node_until_the_estimated_end_of_its_prefill() -> None:
    """Through RoutingCore: the decode node holds the request, the prefill node its prompt; the
    prefill node's load ends by itself at the estimate (nobody sees that prefill's answer)."""
    now = [0.0]
    directory = InProcessDirectory(index_stride=1, heartbeat_ttl_s=10_000.0, clock=lambda: now[0])
    for info in (NodeInfo("p1", "127.0.0.1:9001", role="prefill"), NodeInfo("d1", "127.0.0.1:9002", role="decode")):
        await directory.register_node(info)
    busy = [await directory.reserve("d1", 0) for _ in range(24)]  # d1 decodes 24 answers
    core = RoutingCore(PromptTokenizer(), directory, warmed(make_policy("kvgate", link="rdma")), PROFILE,
                       RoutingLimits(models=frozenset(["m"])))
    text = "The quarterly report on harbour traffic. " * 1500
    result = await core.route("/v1/completions", json.dumps({"model": "m", "prompt": text, "max_tokens": 2048}).encode())
    assert result.kind == "routed" and result.decision is not None
    plan = result.decision.prefill
    assert plan is not None, result.decision.reason
    assert dict(result.headers)["x-prefiller-host-port"] == "127.0.0.1:9001"
    assert dict(result.headers)["x-gateway-destination-endpoint"] == "127.0.0.1:9002"
    loads = await directory.loads()
    assert loads["p1"].inflight == 1 and loads["p1"].prefill_tokens == plan.prefill_tokens > 10_000
    assert loads["d1"].inflight == 25 and loads["d1"].prefill_tokens == 0  # the decode node computes no prompt
    now[0] = plan.ready_s + 0.001
    assert (await directory.loads()).get("p1", NodeLoad()) == NodeLoad()  # gone by itself
    await core.release(result)
    for r in busy:
        await directory.release(r)
    assert (await directory.loads()).get("d1", NodeLoad()) == NodeLoad()


def test_a_split_never_puts_a_first_token_beyond_the_recent_p99() -> None:
    fleet = [node(1, "both", inflight=40, queued=2000), node(2, "both", inflight=40, queued=2000),
             node(3, "prefill"), node(4, "decode", inflight=8)]
    policy = make_policy("kvgate", link="rdma")
    for _ in range(128):  # recent first tokens all came in 0.5 s; this prompt's takes longer either way
        policy.first_token_tail.observe(0.5)
    assert policy.first_token_tail.p99_s == pytest.approx(0.5)
    view = DirectoryView(tuple(fleet))
    rnd = decide_round(policy, request(16_000), view, PROFILE, now=0.0, answer_tokens=1024)
    assert rnd.decision.prefill is None, rnd.decision.reason  # splitting would lengthen the tail by the transfer
    fresh = decide_round(make_policy("kvgate", link="rdma"), request(16_000), view, PROFILE, now=0.0, answer_tokens=1024)
    assert fresh.decision.prefill is None, fresh.decision.reason  # no tail known yet: no first token is delayed
    high = decide_round(warmed(make_policy("kvgate", link="rdma")), request(16_000), view, PROFILE, now=0.0,
                        answer_tokens=1024)
    assert high.decision.prefill is not None, high.decision.reason  # a tail far above: the slack alone bounds it


def test_a_split_stays_under_the_lower_bound_of_the_recent_p99_not_the_sample_p99() -> None:
    fleet = [node(1, "both", inflight=40, queued=2000), node(2, "both", inflight=40, queued=2000),
             node(3, "prefill"), node(4, "decode", inflight=8)]
    view = DirectoryView(tuple(fleet))
    free = decide_round(warmed(make_policy("kvgate", link="rdma")), request(16_000), view, PROFILE, now=0.0,
                        answer_tokens=1024)
    assert free.decision.prefill is not None, free.decision.reason
    split_first_token = free.decision.prefill.first_token_s
    # 13 of the last 1024 first tokens (1.3%) came 10 ms after this split's would: the sample's p99 is
    # above it, but 1024 samples cannot tell a 1.3% tail from a 0.8% one (a p99 is 10 +- 3 ranks from
    # the top); a split landing there would be among the slowest 1% that serving whole keeps out of it
    policy = make_policy("kvgate", link="rdma")
    for i in range(1024):
        policy.first_token_tail.observe(split_first_token + 0.01 if i < 13 else 0.1)
    assert policy.first_token_tail.p99_s < split_first_token
    rnd = decide_round(policy, request(16_000), view, PROFILE, now=0.0, answer_tokens=1024)
    assert rnd.decision.prefill is None, rnd.decision.reason


def test_decode_nodes_that_cannot_serve_whole_get_only_split_requests() -> None:
    """SGLang's decode-mode servers cannot compute a prompt by themselves (``decode_serves_whole:
    false``): a short prompt that would never pay a split is split all the same, over TCP, with a
    cold first-token tail, rather than reach a decode node whole."""
    fleet = [node(1, "prefill"), node(2, "prefill", inflight=3, queued=4000), node(3, "decode"), node(4, "decode", inflight=9)]
    whole = decide_round(make_policy("kvgate"), request(256), DirectoryView(tuple(fleet)), PROFILE, now=0.0, answer_tokens=128)
    assert whole.decision.prefill is None and whole.decision.node.role == "decode"  # vLLM's decode nodes serve it whole
    rnd = decide_round(make_policy("kvgate", decode_serves_whole=False, prefill_serves_whole_tokens=0), request(256),
                       DirectoryView(tuple(fleet)), PROFILE, now=0.0, answer_tokens=64)  # fmt: skip
    plan = rnd.decision.prefill
    assert plan is not None and plan.node_id == "p1" and rnd.decision.node.node_id == "d3", rnd.decision.reason
    assert rnd.decision.reason.startswith("split p1->d3 (decode nodes serve only split requests)")
    assert rnd.ttft_s == plan.first_token_s > 0 and rnd.prefill_tokens == 0


def test_with_a_node_that_serves_whole_only_it_or_a_split_is_chosen() -> None:
    fleet = [node(1, "both"), node(2, "prefill", inflight=30, queued=9000), node(3, "decode")]
    for prompt in (64, 2_000, 16_000):
        rnd = decide(fleet, prompt, 256, link="rdma", decode_serves_whole=False)
        assert rnd.decision.node.node_id == "b1" or rnd.decision.prefill is not None, rnd.decision.reason


def test_no_prefill_node_live_leaves_the_request_to_the_fallback_route() -> None:
    """Decode nodes alone cannot serve it: no destination (Envoy's fallback balances), and why."""
    rnd = decide([node(3, "decode"), node(4, "decode")], 2_000, 64, decode_serves_whole=False)
    assert rnd.decision.node is None and rnd.decision.outcome == "no_nodes"
    assert "no (prefill, decode) pair is live" in rnd.decision.reason


def test_decode_serves_whole_false_needs_disaggregation() -> None:
    with pytest.raises(ValueError, match="needs disaggregate: true"):
        make_policy("kvgate", decode_serves_whole=False, disaggregate=False)
