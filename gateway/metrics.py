"""Prometheus metrics of the request path. One registry per process; names start with ``kvgate_``.

Fail-open is a first-class outcome here: an operator must be able to see that traffic is
flowing on plain balancing because kvgate or its directory is unhealthy.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

DECISIONS = Counter(
    "kvgate_decisions",
    "Routing decisions by policy and outcome (owner, pull, recompute, balanced, fail_open)",
    ["policy", "outcome"],
    registry=REGISTRY,
)
FAIL_OPEN = Counter(
    "kvgate_fail_open",
    "Requests passed to Envoy's fallback route without a destination, by reason",
    ["reason"],
    registry=REGISTRY,
)
REJECTED = Counter(
    "kvgate_rejected_requests",
    "Inference requests answered with an error by kvgate (never routed), by HTTP status",
    ["status"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter("kvgate_prompt_tokens", "Prompt tokens of routed requests", registry=REGISTRY)
CACHED_TOKENS = Counter(
    "kvgate_expected_cached_tokens",
    "Prompt tokens the chosen node was expected to hold (locally or by pull)",
    registry=REGISTRY,
)
DECISION_SECONDS = Histogram(
    "kvgate_decision_seconds",
    "Time from body received to decision, by stage (parse, tokenize, lookup, score, total)",
    ["stage"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)
DIRECTORY_ERRORS = Counter(
    "kvgate_directory_errors", "Directory calls that failed or timed out, by operation", ["op"], registry=REGISTRY
)
INFLIGHT = Gauge("kvgate_inflight_requests", "Requests routed by this replica and not yet finished", registry=REGISTRY)
EXT_PROC_STREAMS = Counter(
    "kvgate_ext_proc_streams", "ext_proc streams by how they ended (ok, error, cancelled)", ["end"], registry=REGISTRY
)
