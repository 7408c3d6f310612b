"""Scale-out warm-up (``gateway.policy.warmup``): a node that joins takes conversations with their
prefixes while it is young and below its share, never as a herd and within its link budget."""

from __future__ import annotations

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.policy import make_policy
from gateway.profile import HardwareProfile, load_profile
from gateway.types import RoutingRequest

BS = 16
PROFILE = load_profile("llama-3.1-8b-h100")


def node(i: int, cached: int = 0, *, inflight: int = 0, held: int = 4000) -> NodeView:
    info = NodeInfo(f"n{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100")
    return NodeView(info, cached, Tier.GPU, NodeLoad(inflight, 0), held)


def view(*nodes: NodeView) -> DirectoryView:
    return DirectoryView(tuple(sorted(nodes, key=lambda n: n.node.node_id)))


def request(blocks: int = 256, affinity: int = 7) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=blocks * BS + 8, total_blocks=blocks, block_size=BS, affinity=affinity)


def established(policy, profile: HardwareProfile = PROFILE) -> None:
    """The policy's first decisions: the nodes it sees now are the fleet it started with, and
    they have carried 30 requests (the yardstick of a share)."""
    for i in range(30):
        policy.decide(request(affinity=i), view(node(1), node(2)), profile, now=0.0)


def test_a_new_node_takes_a_conversation_with_its_prefix_while_young() -> None:
    p = make_policy("kvgate", link="rdma")
    established(p)
    fleet = view(node(1, 256), node(2), node(3, held=0))  # n3 joined after the start
    d = p.decide(request(), fleet, PROFILE, now=10.0)
    assert (d.node.node_id, d.outcome) == ("n3", "pull")
    assert d.pull is not None and d.pull.source_node_id == "n1" and d.pull.blocks == 256
    assert "warms new node n3" in d.reason
    owner = next(c for c in d.candidates if c.node_id == "n1")
    young = next(c for c in d.candidates if c.node_id == "n3")
    assert young.total_s > owner.total_s  # the credit ranks; the reported estimate stays the estimate


def test_without_warm_up_the_owner_keeps_it() -> None:
    p = make_policy("kvgate", link="rdma", warmup_s=0)
    established(p)
    d = p.decide(request(), view(node(1, 256), node(2), node(3, held=0)), PROFILE, now=10.0)
    assert (d.node.node_id, d.outcome) == ("n1", "owner")


def test_nodes_of_the_first_view_are_never_young() -> None:
    p = make_policy("kvgate", link="rdma")
    d = p.decide(request(), view(node(1, 256), node(2), node(3, held=0)), PROFILE, now=0.0)
    assert d.node.node_id == "n1"
    assert p.warmup.young() == {}


def test_no_herd_a_young_node_at_its_share_is_an_ordinary_node() -> None:
    p = make_policy("kvgate", link="rdma")
    established(p)
    busy = view(node(1, 256), node(2), node(3, inflight=1, held=0))  # above the mean in flight
    assert p.decide(request(), busy, PROFILE, now=10.0).node.node_id == "n1"
    for i in range(16):  # n3 serves its own conversations until it has carried its share of the traffic
        p.decide(request(affinity=i), view(node(1), node(2), node(3, 256, held=0)), PROFILE, now=11.0)
    fleet = view(node(1, 256), node(2), node(3, held=0))
    assert p.decide(request(), fleet, PROFILE, now=11.0).node.node_id == "n1"


def test_credited_pulls_stay_within_the_link_share_and_the_budget_refills() -> None:
    p = make_policy("kvgate", link="rdma", warmup_link_share=0.05)
    established(p)
    fleet = view(node(1, 256), node(2), node(3, held=0))
    per_pull = PROFILE.transfer_seconds(256 * BS, "rdma")
    allowed = int(0.05 // per_pull)
    assert allowed >= 1
    picks = [p.decide(request(affinity=i), fleet, PROFILE, now=10.0).node.node_id for i in range(allowed + 3)]
    assert picks.count("n3") == allowed  # the bucket holds one second of 5% of the link
    assert picks[allowed:] == ["n1"] * 3
    assert p.decide(request(), fleet, PROFILE, now=12.0).node.node_id == "n3"  # refilled two seconds later


def test_the_credit_fades_over_the_window_and_a_returning_node_is_young_again() -> None:
    p = make_policy("kvgate", link="rdma", warmup_s=60)
    established(p)
    fleet = view(node(1, 256), node(2), node(3, held=0))
    assert p.decide(request(), fleet, PROFILE, now=5.0).node.node_id == "n3"
    assert p.decide(request(), fleet, PROFILE, now=30.0).node.node_id == "n3"
    assert p.decide(request(), fleet, PROFILE, now=59.0).node.node_id == "n1"  # the credit has faded below the transfer
    assert p.decide(request(), fleet, PROFILE, now=70.0).node.node_id == "n1"  # past the window: established
    p.decide(request(), view(node(1, 256), node(2)), PROFILE, now=80.0)  # n3 leaves
    d = p.decide(request(), fleet, PROFILE, now=200.0)  # back after more than the rejoin gap: an empty cache
    assert d.node.node_id == "n3" and "n3" in p.warmup.young()


def test_over_a_link_as_slow_as_recompute_warm_up_never_pulls() -> None:
    p = make_policy("kvgate", link="tcp")  # 8B over 25 Gb/s: moving KV costs about what computing it does
    established(p)
    d = p.decide(request(), view(node(1, 256), node(2), node(3, held=0)), PROFILE, now=10.0)
    assert d.node.node_id == "n1" and d.outcome == "owner"


@pytest.mark.parametrize(
    ("option", "value"), [("warmup_s", -1.0), ("warmup_credit", -0.1), ("warmup_link_share", 0.0), ("warmup_link_share", 2.0)]
)
def test_bad_warm_up_options_are_refused_by_name(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        make_policy("kvgate", **{option: value})


def test_kvgate_nopull_takes_no_warm_up_option() -> None:
    with pytest.raises(ValueError, match="warmup_s"):
        make_policy("kvgate_nopull", warmup_s=60)


def test_a_fleet_idle_for_longer_than_the_rejoin_gap_has_no_new_node() -> None:
    """No decision for minutes says nothing about membership: the nodes present at the last
    decision and still present now never left, so none of them is young (nor gets credited pulls)."""
    p = make_policy("kvgate", link="rdma")
    established(p)
    fleet = view(node(1, 256), node(2, held=0))
    d = p.decide(request(), fleet, PROFILE, now=600.0)  # the first request after ten idle minutes
    assert p.warmup.young() == {}
    assert (d.node.node_id, d.outcome) == ("n1", "owner")
    p.decide(request(), view(node(1, 256), node(2), node(3, held=0)), PROFILE, now=900.0)  # a node joined meanwhile
    assert set(p.warmup.young()) == {"n3"}  # is new; the others are not
