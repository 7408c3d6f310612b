"""The memory-aware kvgate on explicit scenarios: what a second copy of a prefix costs a full
fleet, when it is still worth making, and that nothing changes while memory is to spare."""

from __future__ import annotations

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.policy import make_policy
from gateway.policy.memory import MemoryPricing
from gateway.profile import HardwareProfile
from gateway.types import RoutingRequest
from tests.support.engines import sample_profile

BS = 16
CAPACITY = 4000  # blocks per node


@pytest.fixture(scope="module")
def profile() -> HardwareProfile:
    return sample_profile(CAPACITY)


def node(i: int, cached: int = 0, *, held: int = 0, inflight: int = 0, queued: int = 0,
         capacity: int = CAPACITY) -> NodeView:
    info = NodeInfo(f"n{i}", f"10.0.0.{i}:8000", "", capacity_blocks=capacity)
    return NodeView(info, cached, Tier.GPU, NodeLoad(inflight, queued), max(held, cached))


def view(*nodes: NodeView) -> DirectoryView:
    return DirectoryView(tuple(nodes))


def request(blocks: int = 512) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=blocks * BS + 8, total_blocks=blocks, block_size=BS)


def busy_owner(held: int) -> tuple[NodeView, NodeView]:
    """n1 holds the whole 8k-token prompt behind ~0.6 s of queued prefill; n2 is idle and holds nothing."""
    return node(1, 512, held=held, inflight=3, queued=11_000), node(2, 0, held=held)


def test_a_busy_owner_is_left_for_a_copy_while_memory_is_to_spare(profile) -> None:
    # the fleet's work priced off: these scenarios are about memory (half of a 2-node fleet busy
    # would otherwise keep the copy's prefill from being spent; tests/test_policy.py)
    d = make_policy("kvgate", work_value=0).decide(request(), view(*busy_owner(held=1000)), profile, now=0.0)
    assert d.node.node_id == "n2" and d.outcome == "recompute"
    assert all(c.memory_s == 0 and c.survival == 1 for c in d.candidates)
    assert "memory" not in d.reason  # nothing to price: the explanation is the plain one


def test_on_a_full_fleet_the_copy_costs_what_it_evicts_and_the_owner_keeps_the_prompt(profile) -> None:
    v = view(*busy_owner(held=CAPACITY))
    plain = make_policy("kvgate_nopull").decide(request(), v, profile, now=0.0)
    aware = make_policy("kvgate").decide(request(), v, profile, now=0.0)
    assert plain.node.node_id == "n2"  # the baseline copies the prefix to save the queue
    assert aware.node.node_id == "n1" and aware.outcome == "owner"
    by_node = {c.node_id: c for c in aware.candidates}
    # n2 would add all 512 blocks to a full node: 512 blocks of someone's prefix evicted, each
    # worth its prefill (16 tokens at 18k tokens/s); the owner adds none
    assert by_node["n2"].memory_s == pytest.approx(512 * BS / 18000)
    assert by_node["n1"].score < by_node["n2"].score
    assert "memory" in aware.reason and "hit survives" in aware.reason


def test_a_copy_is_still_made_when_the_owners_queue_costs_more_than_the_memory(profile) -> None:
    owner = node(1, 512, held=CAPACITY, inflight=20, queued=60_000)  # ~3.3 s of prefill queued
    d = make_policy("kvgate").decide(request(), view(owner, node(2, 0, held=CAPACITY)), profile, now=0.0)
    assert d.node.node_id == "n2"


def test_a_hit_behind_a_queue_that_overflows_memory_is_discounted_by_its_chance_to_survive(profile) -> None:
    pricing = MemoryPricing(profile, BS, 1.0)
    full = node(1, 512, held=CAPACITY, inflight=5, queued=16_000)  # the queue stores 1,000 new blocks
    survival, eviction_s = pricing.price(full, 512)
    assert survival == pytest.approx(1 - 1000 / CAPACITY)
    assert eviction_s == pytest.approx((512 - 384) * BS / 18000)  # 384 of 512 blocks expected to survive
    roomy = node(1, 512, held=2000, inflight=5, queued=16_000)
    assert pricing.price(roomy, 512) == (1.0, 0.0)  # the queue's blocks fit beside what is held
    unknown = node(1, 512, held=CAPACITY, inflight=5, queued=16_000, capacity=0)
    assert pricing.price(unknown, 600) == (1.0, 0.0)
    d = make_policy("kvgate").decide(request(), view(full), profile, now=0.0)
    c = d.candidates[0]
    assert c.survival == pytest.approx(0.75)
    plain = make_policy("kvgate_nopull").decide(request(), view(full), profile, now=0.0).candidates[0]
    assert plain.prefill_s < c.prefill_s < plain.prefill_s + 0.5  # expected, between hit and miss


def test_new_prompts_go_where_memory_is_free(profile) -> None:
    # n1 holds fewer blocks (plain tie-breaking would pick it) but has room for 100 of the 512
    tight, roomy = node(1, 0, held=3900), node(2, 0, held=5000, capacity=8000)
    plain = make_policy("kvgate_nopull").decide(request(), view(tight, roomy), profile, now=0.0)
    aware = make_policy("kvgate").decide(request(), view(tight, roomy), profile, now=0.0)
    assert plain.node.node_id == "n1" and aware.node.node_id == "n2"
    assert {c.node_id: c.memory_s for c in aware.candidates} == pytest.approx({"n1": 412 * BS / 18000, "n2": 0.0})


def test_memory_value_is_validated_and_kvgate_nopull_takes_none() -> None:
    for bad in (-1, "1", True, float("nan")):
        with pytest.raises(ValueError, match="memory_value"):
            make_policy("kvgate", memory_value=bad)
    with pytest.raises(ValueError, match="memory_value"):
        make_policy("kvgate_nopull", memory_value=1.0)
    assert make_policy("kvgate", memory_value=0).memory_value == 0.0


def test_an_owner_whose_memory_is_full_of_running_requests_gets_a_copy_made(profile) -> None:
    """Capacity 1,600 blocks holds three 512-block requests: a fourth waits in the engine's queue for
    one to finish, which no prefill figure shows. Crowding prices that wait, so the hot prompt is
    copied to an idle node; with room for the running ones the owner keeps it."""
    full = view(node(1, 512, held=1600, inflight=3, capacity=1600), node(2, 0, held=1600, capacity=1600))
    d = make_policy("kvgate", work_value=0).decide(request(), full, profile, now=0.0)  # crowding alone
    assert d.node.node_id == "n2"
    owner = next(c for c in d.candidates if c.node_id == "n1")
    assert owner.queue_s >= 1.0  # one saturation penalty: a request beyond what its memory holds
    roomy = view(node(1, 512, held=1600, inflight=2, capacity=1600), node(2, 0, held=1600, capacity=1600))
    assert make_policy("kvgate").decide(request(), roomy, profile, now=0.0).node.node_id == "n1"
    assert make_policy("kvgate_nopull").decide(request(), full, profile, now=0.0).node.node_id == "n1"  # baseline as it was
    pricing = MemoryPricing(profile, BS, 1.0)
    assert pricing.crowding_s(node(1, 0, inflight=5, capacity=0), 512, 1.0) == 0.0  # capacity unknown: not priced


def test_a_node_with_free_memory_for_the_prompt_is_not_crowded_however_many_it_runs(profile) -> None:
    """A decode node running many short answers: ``inflight`` requests the size of this prompt would
    fill it, but the blocks it holds (which include every running request's) leave room for the
    prompt, so nothing has to finish first. Room for the prompt only once the queued prefill has
    taken its share."""
    pricing = MemoryPricing(profile, BS, 1.0)
    assert pricing.crowding_s(node(1, 0, held=1088, inflight=5, capacity=1600), 512, 1.0) == 0.0  # 512 free
    assert pricing.crowding_s(node(1, 0, held=1089, inflight=5, capacity=1600), 512, 1.0) == 3.0  # 511 free: 3 beyond what fits
    assert pricing.crowding_s(node(1, 0, held=1000, inflight=5, queued=100 * BS, capacity=1600), 512, 1.0) == 3.0
    roomy = view(node(1, 0, held=600, inflight=20, capacity=1600), node(2, 0, held=1600, inflight=1, capacity=1600))
    d = make_policy("kvgate", work_value=0).decide(request(), roomy, profile, now=0.0)
    assert {c.node_id: c.queue_s for c in d.candidates}["n1"] < 1.0  # no saturation penalty
