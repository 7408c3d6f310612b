"""Memory turnover: an eviction costs more on a node that writes faster than the fleet's mean, so
new prefixes go where the blocks waiting to be evicted are oldest."""

from __future__ import annotations

import math

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.policy import make_policy
from gateway.policy.churn import MAX_FACTOR, Churn
from gateway.profile import HardwareProfile
from gateway.types import RoutingRequest
from tests.support.engines import sample_profile

BS = 16
CAPACITY = 4000


@pytest.fixture(scope="module")
def profile() -> HardwareProfile:
    return sample_profile(CAPACITY)


def full(i: int, cached: int = 0, *, capacity: int = CAPACITY, inflight: int = 0) -> NodeView:
    return NodeView(NodeInfo(f"n{i}", f"10.0.0.{i}:8000", "", capacity_blocks=capacity), cached, Tier.GPU,
                    NodeLoad(inflight, 0), capacity)  # fmt: skip


def request(blocks: int, affinity: int = 0) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=blocks * BS + 8, total_blocks=blocks, block_size=BS, affinity=affinity)


def test_factors_are_turnover_over_the_mean_fading_with_the_window() -> None:
    churn = Churn(window_s=100.0)
    nodes = [full(1), full(2), full(3, capacity=2 * CAPACITY)]
    assert churn.factors(nodes, 0.0) is None  # nothing written: no opinion
    churn.wrote("n1", 300, 0.0)
    churn.wrote("n2", 100, 0.0)
    churn.wrote("n3", 200, 0.0)  # twice n2's blocks into twice its memory: the same turnover
    f = churn.factors(nodes, 0.0)
    assert f == pytest.approx([1.8, 0.6, 0.6])
    churn.wrote("n2", 200, 100.0)  # n1's writes faded by e^-1 meanwhile
    later = churn.factors(nodes, 100.0)
    r1, r2, r3 = 300 * math.exp(-1), 100 * math.exp(-1) + 200, 200 * math.exp(-1) / 2  # per CAPACITY
    mean = (r1 + r2 + r3) / 3
    assert later == pytest.approx([r1 / mean, r2 / mean, r3 / mean])


def test_factors_are_clamped_and_unknown_capacity_is_neutral() -> None:
    churn = Churn(window_s=60.0)
    churn.wrote("n1", 10_000, 0.0)
    f = churn.factors([full(1), full(2), full(3), full(4), full(5), full(6, capacity=0)], 0.0)
    assert f == [MAX_FACTOR] + [1 / MAX_FACTOR] * 4 + [1.0]  # 5× the mean, clamped; capacity unknown
    assert Churn(window_s=0.0).factors([full(1)], 0.0) is None  # off
    with pytest.raises(ValueError, match="churn_window_s"):
        Churn(window_s=-1.0)


def test_a_cold_prompt_goes_to_the_node_whose_memory_turns_over_slowest(profile) -> None:
    """Three full, idle nodes: the plain model ties them (least loaded, then a hash); with
    turnover priced, the node that was just sent the most new blocks is avoided, and the one sent
    the fewest takes the next cold prompt."""
    nodes = DirectoryView((full(1), full(2), full(3)))
    kv = make_policy("kvgate")
    kv.churn.wrote("n1", 2000, 0.0)
    kv.churn.wrote("n2", 50, 0.0)
    kv.churn.wrote("n3", 1000, 0.0)
    d = kv.decide(request(200, affinity=7), nodes, profile, now=1.0)
    assert d.node.node_id == "n2"
    mem = {c.node_id: c.memory_s for c in d.candidates}
    assert mem["n1"] > mem["n3"] > mem["n2"] > 0
    off = make_policy("kvgate", churn_window_s=0.0)
    off.churn.wrote("n2", 50, 0.0)  # ignored: turnover not priced
    d_off = off.decide(request(200, affinity=7), nodes, profile, now=1.0)
    assert len({c.memory_s for c in d_off.candidates}) == 1


def test_decisions_record_the_blocks_they_write(profile) -> None:
    kv = make_policy("kvgate")
    nodes = DirectoryView((full(1, cached=150), full(2)))
    d = kv.decide(request(200), nodes, profile, now=0.0)
    assert d.node.node_id == "n1"  # the owner: it writes the 50 blocks it lacks
    kv.churn.wrote("n2", 50, 0.0)
    assert kv.churn.factors(nodes.nodes, 0.0) == pytest.approx([1.0, 1.0])
    nopull = make_policy("kvgate_nopull")  # memory free: nothing to record
    nopull.decide(request(200), nodes, profile, now=0.0)
    assert nopull.churn.factors(nodes.nodes, 0.0) is None
    with pytest.raises(ValueError, match="churn_window_s"):
        make_policy("kvgate_nopull", churn_window_s=60.0)
