"""Decode runs (several engine steps as one simulator event) change nothing but the event count:
every request ends on the same node with the same hit, TTFT and end time as with one event per
engine step, on memory-bound workloads (evictions, full queues, pulls) and on the trace."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gateway.profile import load_profile
from loadtest.sim.simulator import SimConfig, Simulator
from loadtest.workloads.memory_bound import agentic_workload, memchat_workload
from loadtest.workloads.trace import load_trace, trace_workload
from tokenizer import PromptTokenizer
from workers.engine.kv_cache import PrefixCache
from workers.engine.sampling import ReplySampler
from workers.engine.scheduler import Scheduler, SimRequest

PROFILE = load_profile("llama-3.1-8b-h100").model_copy(update={"block_size": 512, "kv_capacity_blocks": 781})


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


def _records(workload, tok, policy: str, run_steps: int, capacity: int, pulls: str | None = None):
    cfg = SimConfig(policy=policy, nodes=6, profile=PROFILE, capacity_blocks=capacity, decode_run_steps=run_steps,
                    pull_link=pulls)
    sim = Simulator(workload, cfg, tok)
    res = sim.run()
    steps = sum(n.scheduler.counters.steps for n in sim.nodes)
    return {(r.session_id, r.turn): r for r in res.records}, steps, res.busy_s


@pytest.mark.parametrize(
    ("name", "policy", "capacity", "pulls"),
    [("memchat", "kvgate", 40, "rdma"), ("agentic", "least_request", 40, None), ("trace", "oracle_pool", 150, None),
     ("trace", "prefix_only", 150, None)],
)
def test_decode_runs_give_the_figures_of_one_event_per_step(tok, name: str, policy: str, capacity: int, pulls) -> None:
    workload = {
        "memchat": lambda: memchat_workload(conversations=30, rate_per_s=0.5, seed=2),
        "agentic": lambda: agentic_workload(agents=25, rate_per_s=2, seed=2),
        "trace": lambda: trace_workload(load_trace(limit=200), model="kvgate-sim"),
    }[name]()
    single, steps_single, busy_single = _records(workload, tok, policy, 1, capacity, pulls)
    runs, steps_runs, busy_runs = _records(workload, tok, policy, 1 << 20, capacity, pulls)
    assert single.keys() == runs.keys() and sum(r.ok for r in single.values()) > 100
    for key, a in single.items():
        b = runs[key]
        assert (b.status, b.node, b.cached_tokens, b.pulled_tokens, b.output_tokens) == (
            a.status, a.node, a.cached_tokens, a.pulled_tokens, a.output_tokens), key
        if a.ok:
            assert math.isclose(b.ttft_s, a.ttft_s, rel_tol=1e-9, abs_tol=1e-9), key
            assert math.isclose(b.e2e_s, a.e2e_s, rel_tol=1e-9, abs_tol=1e-9), key
    assert steps_runs == steps_single  # the engines ran the same steps
    assert busy_runs == pytest.approx(busy_single, rel=1e-9)


def test_a_lone_decode_runs_to_its_block_boundary_and_a_cut_ends_it_at_the_step_in_progress() -> None:
    cache = PrefixCache(100, 16)
    profile = load_profile("llama-3.1-8b-h100")
    s = Scheduler(profile, cache)
    prompt = np.arange(1000, 1040, dtype=np.uint32)  # 40 tokens: 2 full blocks + 8
    reply = ReplySampler(np.arange(2000, 2100)).reply(prompt, 50, ignore_eos=True)
    r = SimRequest.create("a", prompt, reply, block_size=16, root_hash=1, key_seed=2, arrival=0.0)
    s.add(r)
    now = 0.0
    step = s.schedule(now, max_steps=1000)
    assert step is not None and step.steps == 1  # the prefill
    now += step.duration_s
    s.complete(step, now)
    step = s.schedule(now, max_steps=1000)
    # 41 tokens have KV after the first decode step; the run stops where block 3 (tokens 32..47) fills
    assert step is not None and step.steps == 48 - 40 and step.decode_seqs == 1
    one = profile.decode_step_seconds(1, 41)
    assert step.run_s(1) == pytest.approx(one)
    assert step.duration_s == pytest.approx(sum(profile.decode_step_seconds(1, 41 + j) for j in range(8)))
    assert step.cut(now + 2.5 * one) and step.steps == 3  # steps 1-2 ended, the third is running
    assert not step.cut(now + 2.5 * one)
    s.complete(step, now + step.duration_s)
    assert r.generated == 1 + 3 and r.num_computed == 43 and len(r.held) == 2
