"""Properties every decision must keep, on random fleets (hypothesis)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.policy import POLICY_NAMES, TtftEstimator, make_policy
from gateway.policy.kvgate import added_work
from gateway.profile import PROFILE_DIR, load_profile, shipped_profiles
from gateway.types import RoutingRequest

PROFILES = [load_profile(str(PROFILE_DIR / f"{name}.yaml")) for name in shipped_profiles()]
BS = 16


@st.composite
def requests(draw) -> RoutingRequest:
    blocks = draw(st.integers(0, 600))
    return RoutingRequest("m", blocks * BS + draw(st.integers(0, BS - 1)), blocks, BS)


@st.composite
def views(draw, total_blocks: int, max_nodes: int = 12) -> DirectoryView:
    n = draw(st.integers(1, max_nodes))
    out = []
    for i in range(n):
        cached = draw(st.integers(0, total_blocks))
        # Some nodes share an address (a misregistered node): fallbacks must still be distinct.
        host = draw(st.integers(1, n + 2))
        info = NodeInfo(
            f"n{i:02d}",
            f"10.0.0.{host}:8000",
            draw(st.sampled_from(["", f"10.0.0.{host}:9100"])),
        )
        load = NodeLoad(draw(st.integers(0, 300)), draw(st.integers(0, 200_000)))
        tier = draw(st.sampled_from(list(Tier))) if cached else Tier.GPU
        out.append(NodeView(info, cached, tier, load))
    return DirectoryView(tuple(out))


@st.composite
def scenarios(draw):
    req = draw(requests())
    return req, draw(views(req.total_blocks)), draw(st.sampled_from(PROFILES))


policy_names = st.sampled_from(POLICY_NAMES)
options = st.fixed_dictionaries({"fallbacks": st.integers(0, 4)})


@settings(max_examples=150, deadline=None)
@given(scenarios(), policy_names, options)
def test_chosen_node_is_in_the_view_and_fallbacks_are_distinct_others(scenario, name, opts):
    req, view, profile = scenario
    d = make_policy(name, **opts).decide(req, view, profile, now=0.0)
    assert d.node in [nv.node for nv in view.nodes]
    assert d.node.address not in d.fallbacks
    assert len(set(d.fallbacks)) == len(d.fallbacks)
    others = {nv.node.address for nv in view.nodes} - {d.node.address}
    assert set(d.fallbacks) <= others
    assert len(d.fallbacks) == min(opts["fallbacks"], len(others))
    assert [c.node_id for c in d.candidates] == [nv.node.node_id for nv in view.nodes]
    assert 0 <= d.expected_cached_tokens <= req.prompt_tokens


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.sampled_from(["kvgate", "kvgate_nopull"]), st.sampled_from(["tcp", "rdma"]))
def test_kvgate_picks_a_minimal_cost(scenario, name, link):
    """Minimal over the first token's estimate plus the prefill it spends the fleet (work_value;
    kvgate_nopull prices no work)."""
    req, view, profile = scenario
    policy = make_policy(name, link=link)
    d = policy.decide(req, view, profile, now=0.0)
    work = added_work(view.nodes, list(d.candidates), policy.work_value) if policy.work_value > 0 else {}
    ranked = [c.total_s + work.get(i, 0.0) for i, c in enumerate(d.candidates)]
    at = next(i for i, c in enumerate(d.candidates) if c.node_id == d.node.node_id)
    assert ranked[at] <= min(ranked) + policy.tie_tolerance_s
    chosen = d.candidates[at]
    if d.pull is not None:
        source = next(nv for nv in view.nodes if nv.node.node_id == d.pull.source_node_id)
        assert name == "kvgate" and chosen.via_pull and d.outcome == "pull"
        assert source.node.transfer_endpoint == d.pull.source_endpoint != ""
        assert d.pull.blocks == source.cached_blocks == max(
            nv.cached_blocks for nv in view.nodes if nv.node.transfer_endpoint
        )
        assert d.pull.blocks - chosen.cached_blocks >= policy.min_pull_blocks
    else:
        assert not chosen.via_pull


@settings(max_examples=100, deadline=None)
@given(scenarios(), policy_names, st.floats(0, 1e6))
def test_decisions_are_deterministic(scenario, name, now):
    req, view, profile = scenario
    first = make_policy(name).decide(req, view, profile, now=now)
    again = make_policy(name).decide(req, view, profile, now=now)
    assert first == again
    if name != "round_robin":  # the only policy with state between calls
        policy = make_policy(name)
        assert policy.decide(req, view, profile, now=now) == policy.decide(req, view, profile, now=now + 1)


@settings(max_examples=200, deadline=None)
@given(
    requests(),
    st.sampled_from(PROFILES),
    st.sampled_from(list(Tier)),
    st.integers(0, 300),
    st.integers(0, 200_000),
    st.data(),
)
def test_more_cache_never_raises_a_nodes_own_cost(req, profile, tier, inflight, queued, data):
    fewer = data.draw(st.integers(0, req.total_blocks))
    more = data.draw(st.integers(fewer, req.total_blocks))
    est = TtftEstimator(profile, req)

    def own_cost(blocks: int) -> float:
        nv = NodeView(NodeInfo("n", "10.0.0.1:8000"), blocks, tier, NodeLoad(inflight, queued))
        return est.node_costs([nv])[0].total_s

    assert own_cost(more) <= own_cost(fewer) + 1e-12


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_nopull_candidate_cost_never_rises_with_cache(scenario):
    req, view, profile = scenario
    i = len(view.nodes) // 2
    grown = list(view.nodes)
    grown[i] = dataclasses.replace(grown[i], cached_blocks=req.total_blocks)
    policy = make_policy("kvgate_nopull")
    before = policy.decide(req, view, profile, now=0.0).candidates[i]
    after = policy.decide(req, DirectoryView(tuple(grown)), profile, now=0.0).candidates[i]
    if before.tier == after.tier:
        assert after.total_s <= before.total_s + 1e-12


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_prefix_only_picks_a_longest_prefix(scenario):
    req, view, profile = scenario
    d = make_policy("prefix_only").decide(req, view, profile, now=0.0)
    longest = max(nv.cached_blocks for nv in view.nodes)
    chosen = next(nv for nv in view.nodes if nv.node.node_id == d.node.node_id)
    assert chosen.cached_blocks == longest
    assert d.outcome == ("owner" if longest > 0 else "balanced")


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_least_request_picks_fewest_inflight(scenario):
    req, view, profile = scenario
    d = make_policy("least_request").decide(req, view, profile, now=0.0)
    chosen = next(nv for nv in view.nodes if nv.node.node_id == d.node.node_id)
    assert chosen.load.inflight == min(nv.load.inflight for nv in view.nodes)


@settings(max_examples=50, deadline=None)
@given(views(total_blocks=10), st.integers(1, 30))
def test_round_robin_visits_every_node_equally(view, rounds):
    profile = PROFILES[0]
    rr = make_policy("round_robin")
    req = RoutingRequest("m", 170, 10, BS)
    picks = [rr.decide(req, view, profile, now=0.0).node.node_id for _ in range(rounds * len(view.nodes))]
    assert all(picks.count(nv.node.node_id) == rounds for nv in view.nodes)
