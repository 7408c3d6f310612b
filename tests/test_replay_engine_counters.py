"""``kvgate loadtest replay --engine vllm``: per-node figures from the engines' own counters.

vLLM's answers name no node, so a replay against real engines reads each engine's ``/metrics``
before and after a policy's run. The exposition below is vLLM 0.32's shape (series per finish
reason and per engine, histograms' ``_sum``); the full run against real engines prints these
figures in its report (docs/real-vllm.md)."""

from __future__ import annotations

from loadtest.real_vllm.fleet import VLLM_COUNTERS, sample_sums
from loadtest.replay import _counter_deltas

VLLM_METRICS = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 9.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 4000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 3000.0
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 4.5
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 12.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 12.0
# HELP vllm:request_decode_time_seconds Histogram of time spent in DECODE phase for request.
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} 7.5
vllm:request_decode_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 12.0
vllm:request_decode_time_seconds_count{engine="0",model_name="tiny"} 12.0
"""


def test_vllm_counters_are_read_per_sample_name_over_label_sets() -> None:
    sums = sample_sums(VLLM_METRICS, VLLM_COUNTERS.values())
    got = {k: sums[name] for k, name in VLLM_COUNTERS.items()}
    assert got == {"requests": 12.0, "hit_tokens": 3000.0, "query_tokens": 4000.0, "prefill_s": 4.5, "decode_s": 7.5}


def test_a_policy_run_gets_each_nodes_growth_and_hit_rate() -> None:
    before = {"n1": {"requests": 2.0, "hit_tokens": 0.0, "query_tokens": 1000.0, "prefill_s": 1.0, "decode_s": 1.0}}
    after = {"n1": {"requests": 12.0, "hit_tokens": 3000.0, "query_tokens": 4000.0, "prefill_s": 4.5, "decode_s": 7.5},
             "n2": {"requests": 5.0, "hit_tokens": 0.0, "query_tokens": 0.0, "prefill_s": 1.0, "decode_s": 2.0}}  # fmt: skip
    d = _counter_deltas(before, after)
    assert d["n1"] == {"requests": 10.0, "hit_tokens": 3000.0, "query_tokens": 3000.0, "prefill_s": 3.5, "decode_s": 6.5,
                       "hit_rate": 1.0}  # fmt: skip
    assert d["n2"]["requests"] == 5.0 and d["n2"]["hit_rate"] == 0.0  # a node that looked nothing up
