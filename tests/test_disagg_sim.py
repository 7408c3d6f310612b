"""Disaggregated prefill/decode in the simulator (`kvgate loadtest simulate --roles P:D`): a split
request's prompt runs on a prefill node, its KV crosses the link, the decode node answers."""

from __future__ import annotations

import pytest

from gateway.profile import load_profile
from loadtest.records import RequestRecord
from loadtest.sim.simulator import SimConfig, Simulator
from loadtest.summary import summarize
from loadtest.workloads.base import RequestSpec
from loadtest.workloads.trace import load_trace, trace_workload

PROFILE = load_profile("llama-3.1-8b-h100")


def run(roles: tuple[int, int] | None, policy: str = "kvgate"):
    wl = trace_workload(load_trace(limit=150), model="sim-model", time_scale=0.05, max_output=256)
    # over RDMA: a transfer over TCP takes about as long as the prefill, so a split rarely pays
    sim = Simulator(wl, SimConfig(policy=policy, nodes=4, profile=PROFILE, roles=roles, pull_link="rdma"), None)
    return sim, sim.run()


def test_a_disaggregated_fleet_splits_some_requests_and_answers_every_long_answer_from_a_decode_node() -> None:
    sim, res = run((1, 3))
    s = summarize(res.records, wall_s=res.wall_s, busy_s=res.busy_s, nodes=[n.node_id for n in sim.nodes])
    assert s["ok"] == s["requests"] == 150
    assert 0 < s["split_frac"] < 1  # some prompts are worth a transfer, some are not
    on_prefill = [r for r in res.records if r.node == "n1"]  # n1 is the prefill node: short answers only, whole
    assert all(r.output_tokens <= 64 and not r.split for r in on_prefill)
    assert {r.node for r in res.records if r.output_tokens > 64} <= {"n2", "n3", "n4"}
    assert res.busy_s["n1"] > 0  # it computed the split prompts
    split = [r for r in res.records if r.split]
    assert all(r.ttft_s is not None and r.cached_tokens > 0 for r in split)  # the decode node used the KV as a hit
    assert sum(r.pulled_tokens > 0 for r in split) >= len(split) / 2  # received it (unless it held it already)
    assert s["tpot_p50_ms"] is not None and s["tpot_p99_ms"] >= s["tpot_p50_ms"]


def test_kvgate_told_never_to_split_serves_whole_on_the_decode_nodes() -> None:
    sim, res = run((1, 3), "kvgate_aggregated")
    assert len(res.records) == 150 and all(r.ok and not r.split for r in res.records)
    assert res.busy_s["n1"] == 0  # the prefill node is never a whole request's destination


def test_an_aggregated_fleet_never_splits() -> None:
    sim, res = run(None)
    assert not any(r.split for r in res.records)
    assert summarize(res.records, wall_s=res.wall_s)["split_frac"] == 0.0


def test_roles_must_fit_the_fleet() -> None:
    with pytest.raises(ValueError, match="add up to 4 nodes"):
        run((1, 2))
    with pytest.raises(ValueError, match="at least one of each"):
        run((0, 4))


def test_time_per_output_token_counts_the_tokens_after_the_first() -> None:
    spec = RequestSpec("s", 1, "/v1/completions", {"model": "m", "prompt": "hi"})
    rec = RequestRecord(spec, 0.0, ttft_s=0.5, e2e_s=2.5, status=200, output_tokens=5)
    assert rec.tpot_s == pytest.approx(0.5)
    rec.output_tokens = 1
    assert rec.tpot_s is None
