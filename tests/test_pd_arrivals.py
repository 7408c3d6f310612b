"""Split requests on their way to a decode node (``gateway.policy.arrivals``): a later decision
prices the first tokens its prefill would delay there, and sees the KV memory about to land."""

from __future__ import annotations

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.decision_round import decide_round
from gateway.policy import make_policy
from gateway.policy.arrivals import PendingArrivals
from gateway.profile import load_profile
from gateway.types import RoutingRequest
from loadtest.sim.simulator import SimConfig, Simulator
from loadtest.workloads.mixed import mixed_workload

PROFILE = load_profile("llama-3.1-8b-h100")
BS = PROFILE.block_size


def node(i: int, role: str, *, inflight: int = 0, queued: int = 0, total_blocks: int = 0) -> NodeView:
    info = NodeInfo(f"{role[0]}{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100", role=role)
    return NodeView(info, 0, Tier.GPU, NodeLoad(inflight, queued), total_blocks)


def request(prompt: int) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=prompt, total_blocks=prompt // BS, block_size=BS, affinity=7)


def warmed(policy, tail_s: float = 10.0):  # type: ignore[no-untyped-def]
    for _ in range(128):
        policy.first_token_tail.observe(tail_s)
    return policy


def test_a_prefill_ending_after_an_arrival_delays_it_until_its_end() -> None:
    arrivals = PendingArrivals()
    arrivals.add("d2", at=0.5, blocks=100, until=0.9)
    fleet = (node(2, "decode"), node(3, "decode"))
    policy = make_policy("kvgate")
    costs = list(policy.decide(request(16_000), DirectoryView(fleet), PROFILE, now=0.0).candidates)
    end = costs[0].total_s
    assert end > 0.5
    assert arrivals.blocking_s(fleet, costs, 0.0) == {0: pytest.approx(end - 0.5)}  # d3 has nothing arriving
    short = list(policy.decide(request(1_000), DirectoryView(fleet), PROFILE, now=0.0).candidates)
    assert short[0].total_s < 0.5 and arrivals.blocking_s(fleet, short, 0.0) == {}  # done before the KV lands
    # later, the arrival is in: a prefill that starts after its answer is done delays nobody
    arrivals.expire(0.95)
    assert not arrivals and arrivals.blocking_s(fleet, costs, 0.95) == {}


def test_a_long_prompt_avoids_the_decode_node_a_split_is_arriving_on() -> None:
    # d2 is the less loaded of two idle-queued decode nodes: the tie goes to it, unless a split lands there
    fleet = [node(1, "prefill", inflight=1, queued=20_000), node(2, "decode", inflight=2), node(3, "decode", inflight=3)]
    view = DirectoryView(tuple(fleet))
    plain = decide_round(make_policy("kvgate", link="rdma"), request(16_000), view, PROFILE, now=0.0, answer_tokens=32)
    assert plain.decision.node is not None and plain.decision.node.node_id == "d2", plain.decision.reason
    policy = make_policy("kvgate", link="rdma")
    policy.pending_arrivals.add("d2", at=0.2, blocks=1000, until=0.6)
    rnd = decide_round(policy, request(16_000), view, PROFILE, now=0.0, answer_tokens=32)
    assert rnd.decision.node is not None and rnd.decision.node.node_id == "d3", rnd.decision.reason
    assert "not d2: its prefill would delay splits arriving or answering there" in rnd.decision.reason


def test_a_split_is_recorded_as_arriving_on_its_decode_node_and_its_kv_counts_there_until_it_lands() -> None:
    fleet = [node(1, "both", inflight=40, queued=2000), node(2, "both", inflight=40, queued=2000),
             node(3, "prefill"), node(4, "decode", inflight=8, total_blocks=5000)]
    policy = warmed(make_policy("kvgate", link="rdma"))
    rnd = decide_round(policy, request(16_000), DirectoryView(tuple(fleet)), PROFILE, now=100.0, answer_tokens=1024)
    plan = rnd.decision.prefill
    assert plan is not None, rnd.decision.reason
    (arrival,) = policy.pending_arrivals.arrivals("d4")
    assert plan.ready_s < plan.kv_arrives_s < plan.first_token_s
    assert arrival.at == pytest.approx(100.0 + plan.kv_arrives_s) and arrival.blocks == 16_000 // BS
    assert arrival.until > 100.0 + plan.first_token_s  # it then decodes its answer there
    seen = policy.pending_arrivals.with_pending_memory(DirectoryView(tuple(fleet)), 100.0)
    assert [nv.total_blocks for nv in seen.nodes] == [0, 0, 0, 5000 + 16_000 // BS]
    landed = policy.pending_arrivals.with_pending_memory(DirectoryView(tuple(fleet)), arrival.at + 0.001)
    assert landed.nodes[3].total_blocks == 5000  # its KV events report it from then on


def _split_lateness(monkeypatch: pytest.MonkeyPatch, *, ledger: bool) -> float:
    """Simulated mixed load on 2P+6D over RDMA: the worst (actual - estimated) first token of a split."""
    if not ledger:
        monkeypatch.setattr(PendingArrivals, "add", lambda self, *a, **k: None)
    wl = mixed_workload(sessions=160, seed=1)
    sim = Simulator(wl, SimConfig(policy="kvgate", nodes=8, profile=PROFILE, roles=(2, 6), pull_link="rdma",
                                  policy_options={"warmup_s": 0.0, "prefill_serves_whole_tokens": 0}), None)
    estimate: dict[tuple[str, int], float] = {}
    sim.on_round = lambda spec, rnd: estimate.__setitem__((spec.session_id, spec.turn), rnd.ttft_s)
    res = sim.run()
    split = [r for r in res.records if r.split and r.ttft_s is not None]
    assert split
    return max(r.ttft_s - estimate[(r.session_id, r.turn)] for r in split)  # type: ignore[operator]


def test_a_split_is_not_kept_waiting_by_a_long_prompt_routed_to_its_decode_node_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without the ledger, a document routed whole to the decode node while a split's KV crossed the
    # link took the step budgets when it landed: that split's first token came 0.6 s late (160 sessions,
    # seed 1; seeds 2-5: 0.4-1.2 s; seed 0 lost its instance once answers served whole were priced)
    with monkeypatch.context() as m:
        assert _split_lateness(m, ledger=False) > 0.3
    assert _split_lateness(monkeypatch, ledger=True) < 0.05


def test_the_kv_a_decode_node_is_about_to_receive_counts_against_its_memory() -> None:
    def decoder(i: int, held: int) -> NodeView:
        info = NodeInfo(f"d{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100", capacity_blocks=2000, role="decode")
        return NodeView(info, 0, Tier.GPU, NodeLoad(2, 0), held)

    view = DirectoryView((node(1, "prefill", inflight=1, queued=20_000), decoder(2, 500), decoder(3, 600)))
    plain = decide_round(make_policy("kvgate"), request(16_000), view, PROFILE, now=0.0, answer_tokens=32)
    assert plain.decision.node is not None and plain.decision.node.node_id == "d2"  # holds less: the tie is its
    policy = make_policy("kvgate")
    policy.pending_arrivals.add("d2", at=50.0, blocks=1000, until=60.0)  # lands long after this prefill: no wait
    rnd = decide_round(policy, request(16_000), view, PROFILE, now=0.0, answer_tokens=32)
    assert rnd.decision.node is not None and rnd.decision.node.node_id == "d3", rnd.decision.reason
    d2 = next(c for c in rnd.decision.candidates if c.node_id == "d2")
    assert d2.memory_s > 0  # 1000 blocks on the way leave 500 free for this prompt's 1000


def test_serving_whole_where_splits_are_arriving_lets_a_split_past_the_tail_guard() -> None:
    # both decode nodes expect a split's KV in 0.2 s; the recent first tokens all came in 0.5 s
    fleet = [node(1, "prefill"), node(2, "decode", inflight=24), node(3, "decode", inflight=24)]
    view = DirectoryView(tuple(fleet))
    guarded = warmed(make_policy("kvgate", link="rdma"), tail_s=0.5)
    plain = decide_round(guarded, request(16_000), view, PROFILE, now=0.0, answer_tokens=1024)
    assert plain.decision.prefill is None, plain.decision.reason  # a split would lengthen the tail by its transfer
    policy = warmed(make_policy("kvgate", link="rdma"), tail_s=0.5)
    for d in ("d2", "d3"):
        policy.pending_arrivals.add(d, at=0.2, blocks=1000, until=5.0)
    rnd = decide_round(policy, request(16_000), view, PROFILE, now=0.0, answer_tokens=1024)
    assert rnd.decision.prefill is not None, rnd.decision.reason  # serving whole would delay a first token too
    assert "runner-up aggregated" in rnd.decision.reason and "delays arriving splits" in rnd.decision.reason


def test_splits_that_have_landed_and_are_answering_do_not_let_a_split_past_the_tail_guard() -> None:
    # the same fleet, but the splits' KV landed 0.1 s ago: serving whole slows their tokens (priced),
    # it delays no first token, so the tail guard holds the split back (it would lengthen the p99)
    fleet = [node(1, "prefill"), node(2, "decode", inflight=24), node(3, "decode", inflight=24)]
    view = DirectoryView(tuple(fleet))
    policy = warmed(make_policy("kvgate", link="rdma"), tail_s=0.5)
    for d in ("d2", "d3"):
        policy.pending_arrivals.add(d, at=9.9, blocks=1000, until=15.0)
    rnd = decide_round(policy, request(16_000), view, PROFILE, now=10.0, answer_tokens=1024)
    assert rnd.decision.prefill is None, rnd.decision.reason
    assert "delays splits arriving or answering here" in rnd.decision.reason  # still paid in the ranking


def test_a_flood_of_splits_never_makes_each_decision_read_more_than_a_node_can_hold() -> None:
    """A client sends 100 requests a second asking 8,192 tokens each (then hangs up: estimates
    stand until their end, minutes later). Before: the replica's ledgers kept every split's
    arrival and every whole answer until its estimated end, and each decision read them all: after
    6,000 requests 3,000 arrivals were held on one node and ~600 answers on each, and a decision
    took 0.92 ms on average (0.46 now); the cost grows with the rate times the estimates, ~4 ms a
    decision once ~4,000 of each were held. Now a node keeps the 64 arrivals ending last (the
    directory's own rule) and at most its engine's ``max_num_seqs`` answers, all it decodes at once."""
    import time

    from directory_client.types import MAX_ARRIVALS_PER_NODE

    fleet = DirectoryView(tuple([node(1, "prefill"), node(2, "prefill")] + [node(i, "decode", inflight=4) for i in range(3, 9)]))
    policy = warmed(make_policy("kvgate", link="rdma"))
    now, t0 = 0.0, time.perf_counter()
    for k in range(6000):
        prompt = 16_000 if k % 2 else 2_000
        decide_round(policy, request(prompt), fleet, PROFILE, now=now, answer_tokens=8192)
        now += 0.01
    took = (time.perf_counter() - t0) / 6000
    arrivals = {nv.node.node_id: len(policy.pending_arrivals.arrivals(nv.node.node_id)) for nv in fleet.nodes}
    answers = {n: len(rows) for n, rows in policy.answering._by_node.items()}
    print(f"\n6,000 requests at 100/s: {took * 1e6:.0f} us a decision; arrivals held {arrivals}; answers held {answers}")
    assert sum(arrivals.values()) > 0 and max(arrivals.values()) <= MAX_ARRIVALS_PER_NODE
    assert sum(answers.values()) > 0 and max(answers.values()) <= PROFILE.max_num_seqs


def test_a_node_keeps_the_arrivals_ending_last_as_the_directory_does() -> None:
    from directory_client.types import MAX_ARRIVALS_PER_NODE

    arrivals = PendingArrivals()
    entries = [arrivals.add("d2", at=1.0, blocks=1, until=2.0 + (i * 37 % 100)) for i in range(100)]
    kept = arrivals.arrivals("d2")
    assert sorted(a.until for a in kept) == sorted(a.until for a in entries)[-MAX_ARRIVALS_PER_NODE:]
