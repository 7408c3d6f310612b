"""Routing policies on explicit scenarios: each test is one situation a fleet meets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.policy import POLICY_NAMES, TtftEstimator, make_policy, policy_options
from gateway.profile import HardwareProfile, load_profile
from gateway.types import PullPlan, RoutingRequest

BS = 16


@pytest.fixture(scope="module")
def profile() -> HardwareProfile:
    """A fixed profile (8B-class model on one H100), so these scenarios do not move when the
    shipped profiles are recalibrated. Over TCP its KV moves at ~42 µs/token against ~56 µs/token
    of prefill: a pull is worth it, but not by so much that the model's terms do not matter."""
    return HardwareProfile(
        name="test-8b", model="test", hardware="test",
        kv_bytes_per_token=131072, kv_capacity_blocks=30000, max_num_seqs=256,
        prefill_tokens_per_s=18000, prefill_attention_s_per_token2=2.0e-9, prefill_overhead_s=0.004,
        decode_step_base_s=0.0065, decode_step_per_seq_s=0.00004, decode_step_per_context_token_s=1.0e-8,
        links_gbps={"rdma": 400, "tcp": 25}, transfer_setup_s=0.002, cpu_tier_gbps=200,
    )  # fmt: skip


def test_shipped_profiles_work_too():
    shipped = load_profile("llama-3.1-8b-h100")
    v = view(node(1), node(2, 512, inflight=shipped.max_num_seqs, queued=200_000), node(3))
    d = make_policy("kvgate", link="rdma").decide(request(), v, shipped, now=0.0)
    assert d.outcome == "pull" and d.pull.source_node_id == "n2"


def node(
    i: int, cached: int = 0, *, inflight: int = 0, queued: int = 0, tier: Tier = Tier.GPU, pullable: bool = True
) -> NodeView:
    info = NodeInfo(f"n{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100" if pullable else "")
    return NodeView(info, cached, tier if cached else Tier.GPU, NodeLoad(inflight, queued))


def view(*nodes: NodeView) -> DirectoryView:
    return DirectoryView(tuple(sorted(nodes, key=lambda n: n.node.node_id)))


def request(blocks: int = 512, extra: int = 8) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=blocks * BS + extra, total_blocks=blocks, block_size=BS)


def saturated(profile: HardwareProfile) -> dict[str, int]:
    return {"inflight": profile.max_num_seqs, "queued": 200_000}


# --- kvgate ------------------------------------------------------------------------------------


def test_idle_owner_wins(profile):
    d = make_policy("kvgate").decide(request(), view(node(1), node(2, 480), node(3), node(4)), profile, now=0.0)
    assert (d.outcome, d.node.node_id, d.pull) == ("owner", "n2", None)
    assert d.expected_cached_tokens == 480 * BS
    assert d.reason.startswith("owner n2 holds 480/512 blocks")
    assert "best alternative" in d.reason


def test_saturated_owner_gets_a_second_copy_on_an_idle_node(profile):
    v = view(node(1), node(2, 512, **saturated(profile)), node(3))
    d = make_policy("kvgate", link="tcp").decide(request(), v, profile, now=0.0)
    assert d.outcome == "pull"
    assert d.node.node_id in ("n1", "n3")  # n1 and n3 tie exactly: the spread hash picks one
    assert d.pull == PullPlan(source_node_id="n2", source_endpoint="10.0.0.2:9100", blocks=512)
    host, port = d.pull.source_endpoint.rsplit(":", 1)  # ready for x-kv-cache-source-host-port
    assert host == "10.0.0.2" and port.isdigit()
    assert d.expected_cached_tokens == 512 * BS
    chosen = next(c for c in d.candidates if c.node_id == "n1")
    assert chosen.via_pull and chosen.transfer_s >= profile.transfer_seconds(512 * BS, "tcp")
    assert d.destination_header.split(",")[0] == "10.0.0.1:8000"

    # Once n1's copy is in place (its request decoding), the next request for that prefix finds
    # two owners and goes to the one with room: replicas follow demand.
    v2 = view(node(1, 512, inflight=1), node(2, 512, **saturated(profile)), node(3))
    d2 = make_policy("kvgate", link="tcp").decide(request(), v2, profile, now=1.0)
    assert (d2.outcome, d2.node.node_id, d2.pull) == ("owner", "n1", None)


def test_pull_source_is_the_longest_prefix_that_can_serve_transfers(profile):
    v = view(
        node(1),
        node(2, 512, pullable=False, **saturated(profile)),  # longest, but no transfer agent
        node(3, 300, **saturated(profile)),
    )
    d = make_policy("kvgate").decide(request(), v, profile, now=0.0)
    assert d.outcome == "pull" and d.node.node_id == "n1"
    assert d.pull == PullPlan("n3", "10.0.0.3:9100", 300)
    assert d.expected_cached_tokens == 300 * BS


def test_nopull_recomputes_when_the_owner_is_saturated(profile):
    v = view(node(1), node(2, 512, **saturated(profile)), node(3, 100))
    d = make_policy("kvgate_nopull").decide(request(), v, profile, now=0.0)
    assert (d.outcome, d.node.node_id, d.pull) == ("recompute", "n3", None)  # n3's 100 blocks beat nothing
    assert not any(c.via_pull for c in d.candidates)


def test_nopull_queues_at_the_owner_when_waiting_beats_recompute(profile):
    v = view(node(1), node(2, 512, inflight=3, queued=2000))
    d = make_policy("kvgate_nopull").decide(request(), v, profile, now=0.0)
    assert (d.outcome, d.node.node_id) == ("owner", "n2")
    owner = next(c for c in d.candidates if c.node_id == "n2")
    assert owner.queue_s > 0


def test_tiny_prefix_is_not_pulled(profile):
    v = view(node(1), node(2, 4, **saturated(profile)))
    d = make_policy("kvgate", min_pull_blocks=8).decide(request(), v, profile, now=0.0)
    assert (d.outcome, d.node.node_id, d.pull) == ("recompute", "n1", None)


def test_pull_that_costs_more_than_it_saves_is_declined(profile):
    # One block: a transfer's fixed setup alone exceeds prefilling 16 tokens.
    assert profile.transfer_seconds(BS, "tcp") > profile.prefill_seconds(BS) - profile.prefill_overhead_s
    v = view(node(1), node(2, 1, **saturated(profile)))
    d = make_policy("kvgate", min_pull_blocks=1).decide(request(), v, profile, now=0.0)
    assert d.pull is None and d.node.node_id == "n1"


def test_cpu_tier_hit_costs_its_load_time(profile):
    v = view(node(1, 300, tier=Tier.CPU), node(2, 300, tier=Tier.GPU))
    d = make_policy("kvgate").decide(request(), v, profile, now=0.0)
    assert d.node.node_id == "n2"
    cpu = next(c for c in d.candidates if c.node_id == "n1")
    gpu = next(c for c in d.candidates if c.node_id == "n2")
    assert cpu.transfer_s == pytest.approx(profile.cpu_tier_load_seconds(300 * BS))
    assert gpu.transfer_s == 0.0
    assert cpu.total_s > gpu.total_s


def test_a_node_without_a_transfer_agent_is_never_told_to_pull(profile):
    v = view(node(1, pullable=False), node(2, 512, **saturated(profile)), node(3))
    d = make_policy("kvgate", link="rdma").decide(request(), v, profile, now=0.0)
    n1 = next(c for c in d.candidates if c.node_id == "n1")
    n3 = next(c for c in d.candidates if c.node_id == "n3")
    assert not n1.via_pull and n3.via_pull
    assert d.node.node_id == "n3" and d.outcome == "pull"


def test_exact_ties_go_to_the_least_loaded_then_spread_by_prompt(profile):
    v = view(node(1, inflight=1), node(2), node(3))
    d = make_policy("kvgate").decide(request(), v, profile, now=0.0)
    assert d.node.node_id in ("n2", "n3")  # the busy n1 is never first
    assert d.fallbacks[-1] == "10.0.0.1:8000"


@pytest.mark.parametrize("policy", ["kvgate", "kvgate_nopull", "prefix_only", "least_request"])
def test_a_new_conversation_goes_to_the_idle_node_holding_the_least(profile, policy):
    nodes = [replace(node(i), total_blocks=blocks) for i, blocks in ((1, 900), (2, 40), (3, 500))]
    for a in range(20):
        d = make_policy(policy).decide(replace(request(), affinity=a), view(*nodes), profile, now=0.0)
        assert d.node.node_id == "n2"


@pytest.mark.parametrize("policy", ["kvgate", "kvgate_nopull", "prefix_only", "least_request"])
def test_ties_between_idle_nodes_spread_over_prompts_and_stick_per_prompt(profile, policy):
    """New conversations must not all land on the first idle node (the imbalance a node_id
    tie-break caused), and one prompt must keep landing on the same node."""
    v = view(*(node(i) for i in range(1, 9)))
    p = make_policy(policy)
    chosen = [p.decide(replace(request(), affinity=a), v, profile, now=0.0).node.node_id for a in range(400)]
    counts = {n: chosen.count(n) for n in set(chosen)}
    assert len(counts) == 8 and max(counts.values()) < 2 * 400 / 8
    again = [p.decide(replace(request(), affinity=a), v, profile, now=0.0).node.node_id for a in range(400)]
    assert again == chosen


def test_near_ties_within_tolerance_go_to_the_less_loaded(profile):
    # n1 holds one more block but has 8 tokens queued: cheaper by less than the 1 ms tolerance.
    v = view(node(1, 11, queued=8), node(2, 10))
    d = make_policy("kvgate").decide(request(), v, profile, now=0.0)
    c1, c2 = (next(c for c in d.candidates if c.node_id == n) for n in ("n1", "n2"))
    assert 0 < c2.total_s - c1.total_s < 0.001
    assert d.node.node_id == "n2"
    strict = make_policy("kvgate", tie_tolerance_s=0.0).decide(request(), v, profile, now=0.0)
    assert strict.node.node_id == "n1"


def test_fallbacks_skip_repeated_addresses(profile):
    twin = NodeView(NodeInfo("n9", "10.0.0.1:8000"), 0, Tier.GPU, NodeLoad())  # same address as n1
    v = DirectoryView((node(1), node(2, inflight=3), node(3, inflight=5), twin))
    d = make_policy("kvgate", fallbacks=2).decide(request(), v, profile, now=0.0)
    assert d.node.node_id == "n1"
    assert d.fallbacks == ("10.0.0.2:8000", "10.0.0.3:8000")


def test_queue_estimate_follows_the_documented_formula(profile):
    est = TtftEstimator(profile, request())
    assert est.queue_s(NodeLoad(0, 9000)) == pytest.approx(9000 / profile.prefill_tokens_per_s)
    busy = NodeLoad(10, 40_000)
    assert est.queue_s(busy) == pytest.approx(
        40_000 / profile.prefill_tokens_per_s + 1.5 * profile.decode_step_seconds(10, 40_000)
    )
    full = NodeLoad(profile.max_num_seqs + 2, 0)
    assert est.queue_s(full) == pytest.approx(
        1.5 * profile.decode_step_seconds(full.inflight, 0) + 3 * est.saturation_penalty_s
    )


def test_queued_prefill_counts_only_until_its_estimated_first_token(profile):
    """A prompt reserved 0.25 s ago with its first token due at 0.3 s is mostly prefilled: a
    node with it queued must not look 0.4 s away (its whole prefill) to the next turn of a
    conversation it holds. That sent replay's follow-up turns away from their cache."""
    est = TtftEstimator(profile, request())
    fresh, late = NodeLoad(1, 7400), NodeLoad(1, 7400, prefill_due_s=0.05)
    assert est.queue_s(fresh) == pytest.approx(7400 / profile.prefill_tokens_per_s + 1.5 * profile.decode_step_seconds(1, 7400))
    assert est.queue_s(late) == pytest.approx(0.05 + 1.5 * profile.decode_step_seconds(1, 7400))
    assert NodeLoad(0, 9000, prefill_due_s=0.1) == NodeLoad(0, 9000)  # a time, not part of the load's identity
    v = view(node(1), NodeView(node(2, 500).node, 500, Tier.GPU, late), node(3))
    for name in ("kvgate", "kvgate_nopull"):
        d = make_policy(name).decide(request(), v, profile, now=0.0)
        assert (d.outcome, d.node.node_id) == ("owner", "n2"), d.reason
        costs = {c.node_id: c for c in d.candidates}
        assert costs["n2"].queue_s == pytest.approx(est.queue_s(late))


def test_a_follow_up_leaves_its_busy_owner_only_if_the_fleet_can_spare_the_prefill(profile):
    """The owner of a conversation just took a fresh 7k-token prompt (0.39 s queued): recomputing
    the follow-up's 4k tokens on the one idle node gives a sooner first token, but spends a full
    prefill that, with most of the fleet busy, the next requests wait for. kvgate prices that
    work (``work_value``) and stays; without it (and kvgate_nopull, the baseline) it recomputes."""
    req = request(250)
    busy = {"inflight": 1, "pullable": False}  # no transfer agents (a pull would spend no prefill)
    v = view(node(1, **busy), node(2, 250, inflight=1, queued=7000, pullable=False), node(3, **busy), node(4, pullable=False))
    d = make_policy("kvgate").decide(req, v, profile, now=0.0)
    assert (d.outcome, d.node.node_id) == ("owner", "n2"), d.reason
    assert "fleet's work" in d.reason
    for free in (make_policy("kvgate", work_value=0), make_policy("kvgate_nopull")):
        d = free.decide(req, v, profile, now=0.0)
        assert (d.outcome, d.node.node_id) == ("recompute", "n4"), d.reason
    # an idle fleet spares the prefill: the sooner first token wins
    idle = view(*(node(i, pullable=False) for i in (1, 3, 4)), node(2, 250, inflight=1, queued=7000, pullable=False))
    assert make_policy("kvgate").decide(req, idle, profile, now=0.0).outcome == "recompute"
    with pytest.raises(ValueError, match="work_value"):
        make_policy("kvgate_nopull", work_value=1.0)


def test_estimator_rejects_a_link_the_profile_lacks(profile):
    with pytest.raises(ValueError, match="infiniband"):
        TtftEstimator(profile, request(), link="infiniband")


# --- the baselines -------------------------------------------------------------------------------


def test_round_robin_cycles_in_node_order(profile):
    rr = make_policy("round_robin")
    v = view(node(3), node(1, 100), node(2))
    picks = [rr.decide(request(), v, profile, now=float(t)) for t in range(7)]
    assert [d.node.node_id for d in picks] == ["n1", "n2", "n3", "n1", "n2", "n3", "n1"]
    assert picks[1].fallbacks == ("10.0.0.3:8000", "10.0.0.1:8000")
    assert {d.outcome for d in picks} == {"balanced"}


def test_least_request_prefers_fewest_inflight_then_queued_tokens(profile):
    v = view(node(1, 500, inflight=4), node(2, inflight=2, queued=900), node(3, inflight=2, queued=100))
    d = make_policy("least_request").decide(request(), v, profile, now=0.0)
    assert (d.outcome, d.node.node_id) == ("balanced", "n3")
    assert d.fallbacks == ("10.0.0.2:8000", "10.0.0.1:8000")


def test_prefix_only_ignores_the_queue(profile):
    v = view(node(1), node(2, 512, **saturated(profile)), node(3, 100))
    d = make_policy("prefix_only").decide(request(), v, profile, now=0.0)
    assert (d.outcome, d.node.node_id) == ("owner", "n2")
    cold = make_policy("prefix_only").decide(request(), view(node(1, inflight=2), node(2)), profile, now=0.0)
    assert (cold.outcome, cold.node.node_id) == ("balanced", "n2")


# --- every policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_explanation_lists_every_candidate(name, profile):
    v = view(node(1), node(2, 300, inflight=5, queued=3000), node(3, 20, tier=Tier.CPU), node(4, inflight=1))
    d = make_policy(name).decide(request(), v, profile, now=0.0)
    assert [c.node_id for c in d.candidates] == ["n1", "n2", "n3", "n4"]
    for c in d.candidates:
        assert c.total_s == pytest.approx(c.queue_s + c.transfer_s + c.prefill_s)
        assert c.total_s > 0
    assert d.node.node_id in d.reason
    assert d.policy == name


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_empty_view_means_no_nodes(name, profile):
    d = make_policy(name).decide(request(), DirectoryView(()), profile, now=0.0)
    assert (d.outcome, d.node, d.destination_header, d.fallbacks) == ("no_nodes", None, "", ())


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_single_node_has_no_fallbacks(name, profile):
    d = make_policy(name).decide(request(), view(node(5, 3)), profile, now=0.0)
    assert d.node.node_id == "n5" and d.fallbacks == ()


def test_registry_names_and_errors():
    assert POLICY_NAMES == ("kvgate", "kvgate_nopull", "prefix_only", "least_request", "round_robin")
    with pytest.raises(ValueError, match="unknown policy 'fastest'.*kvgate"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="'min_pull_block'"):
        make_policy("kvgate", min_pull_block=3)
    with pytest.raises(ValueError, match="allow_pull"):
        make_policy("kvgate_nopull", allow_pull=True)
    with pytest.raises(ValueError, match="link"):
        make_policy("kvgate", link="carrier-pigeon")
    with pytest.raises(ValueError, match="fallbacks"):
        make_policy("round_robin", fallbacks=-1)
    with pytest.raises(ValueError, match="min_pull_blocks"):
        make_policy("kvgate", min_pull_blocks=0)
    assert "allow_pull" not in policy_options("kvgate_nopull")
    assert set(policy_options("kvgate")) >= {"link", "allow_pull", "min_pull_blocks", "fallbacks"}
    assert make_policy("kvgate_nopull").name == "kvgate_nopull"
