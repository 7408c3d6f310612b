"""Prometheus metrics of the request path. One registry per process; names start with ``kvgate_``.

Fail-open is a first-class outcome here: an operator must be able to see that traffic is
flowing on plain balancing because kvgate or its directory is unhealthy.

Two kinds of metric live here. Counters and histograms the request path updates itself (cheap:
label children the hot path uses are bound once, below, so a count is one lock and an add; the
request path's histograms are ``LoopHistograms``, observed lock-free from the event loop). And
state that already exists elsewhere — the tokenizer cache's counters, each node's load and cached
blocks — which is read only when ``/metrics`` is scraped, by the collectors at the
bottom: a request never pays for it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

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


@cache
def decisions(policy: str, outcome: str) -> Counter:
    """The bound ``DECISIONS`` child (``labels`` costs a lock and a dict lookup per call)."""
    return DECISIONS.labels(policy, outcome)


PROMPT_TOKENS = Counter("kvgate_prompt_tokens", "Prompt tokens of routed requests", registry=REGISTRY)
CACHED_TOKENS = Counter(
    "kvgate_expected_cached_tokens",
    "Prompt tokens the chosen node was expected to hold (locally or by pull)",
    registry=REGISTRY,
)
class NodeCacheLoop(Collector):
    """Per node, what kvgate predicted beside what the engine says it delivered (the closed loop).

    ``count`` is called on the request path (plain additions on the event loop's thread: cheaper
    than a labelled prometheus Counter's lock); ``engine`` is set by ``gateway.engine_scrape``
    from the engine's own counters. Exported as counters, so ``rate()`` applies; ``view`` is what
    ``/debug/nodes`` shows.
    """

    def __init__(self) -> None:
        self.routed: dict[str, list[int]] = {}  # node → [prompt tokens routed, tokens expected cached]
        self.engine: dict[str, tuple[float, float]] = {}  # node → (hit tokens, query tokens), as scraped
        # node → [responses read, tokens kvgate expected cached on them, cached_tokens they reported]
        self.observed: dict[str, list[int]] = {}

    def count(self, node_id: str, prompt_tokens: int, expected_cached: int) -> None:
        r = self.routed.get(node_id)
        if r is None:
            r = self.routed[node_id] = [0, 0]
        r[0] += prompt_tokens
        r[1] += expected_cached

    def observe(self, node_id: str, expected_cached: int, delivered_cached: int) -> None:
        """One answer whose ``usage.prompt_tokens_details.cached_tokens`` kvgate read (ext_proc)."""
        o = self.observed.get(node_id)
        if o is None:
            o = self.observed[node_id] = [0, 0, 0]
        o[0] += 1
        o[1] += expected_cached
        o[2] += delivered_cached

    def view(self, node_id: str) -> dict[str, float] | None:
        routed, engine, observed = self.routed.get(node_id), self.engine.get(node_id), self.observed.get(node_id)
        if routed is None and engine is None and observed is None:
            return None
        out: dict[str, float] = {}
        if routed is not None:
            out.update(routed_prompt_tokens=routed[0], expected_cached_tokens=routed[1])
        if engine is not None:
            out.update(engine_hit_tokens=engine[0], engine_query_tokens=engine[1])
        if observed is not None:
            out.update(observed_responses=observed[0], observed_expected_cached_tokens=observed[1],
                       observed_cached_tokens=observed[2])  # fmt: skip
        return out

    def collect(self) -> list[Metric]:
        families = {
            name: CounterMetricFamily(name, help_text, labels=["node"])
            for name, help_text in (
                ("kvgate_node_prompt_tokens", "Prompt tokens routed to each node"),
                ("kvgate_node_expected_cached_tokens",
                 "Prompt tokens the chosen node was expected to hold, per node (compare with kvgate_engine_prefix_cache_hit_tokens)"),
                ("kvgate_engine_prefix_cache_hit_tokens",
                 "The node's own count of prompt tokens served from its prefix cache (vLLM vllm:prefix_cache_hits_total)"),
                ("kvgate_engine_prefix_cache_query_tokens",
                 "The node's own count of prompt tokens looked up in its prefix cache (vLLM vllm:prefix_cache_queries_total)"),
                ("kvgate_node_observed_responses",
                 "Answers of the node whose usage.prompt_tokens_details.cached_tokens kvgate read (a sample, ext_proc)"),
                ("kvgate_node_observed_expected_cached_tokens",
                 "Prompt tokens kvgate expected the node to serve from cache, over the answers it read"),
                ("kvgate_node_observed_cached_tokens",
                 "cached_tokens the node reported in those answers (compare with kvgate_node_observed_expected_cached_tokens)"),
            )
        }
        for node, (prompt, expected) in sorted(self.routed.items()):
            families["kvgate_node_prompt_tokens"].add_metric([node], prompt)
            families["kvgate_node_expected_cached_tokens"].add_metric([node], expected)
        for node, (hits, queries) in sorted(self.engine.items()):
            families["kvgate_engine_prefix_cache_hit_tokens"].add_metric([node], hits)
            families["kvgate_engine_prefix_cache_query_tokens"].add_metric([node], queries)
        for node, (answers, expected, delivered) in sorted(self.observed.items()):
            families["kvgate_node_observed_responses"].add_metric([node], answers)
            families["kvgate_node_observed_expected_cached_tokens"].add_metric([node], expected)
            families["kvgate_node_observed_cached_tokens"].add_metric([node], delivered)
        return list(families.values())


CACHE_LOOP = NodeCacheLoop()
REGISTRY.register(CACHE_LOOP)
USAGE_UNREAD = Counter(
    "kvgate_usage_unread",
    "Sampled answers whose body ended without usage.prompt_tokens_details.cached_tokens (streams without "
    "stream_options.include_usage, errors, engines without --enable-prompt-tokens-details)",
    registry=REGISTRY,
)
WRITER_LAPSES = Counter(
    "kvgate_node_writer_lapses",
    "Static nodes whose KV-event bridge stopped holding their writer lease; their entries were cleared",
    ["node"],
    registry=REGISTRY,
)
ENGINE_SCRAPE_ERRORS = Counter(
    "kvgate_engine_scrape_errors", "Failed scrapes of a node's /metrics (engine cache counters)", ["node"], registry=REGISTRY
)
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class LoopHistogram:
    """One histogram series that only the event loop's thread observes: no lock, no bucket walk.

    prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets in Python
    (~2 µs); the request path observes seven a request. Here it is a bisect and two additions;
    a scrape reads the counts as they are (``LoopHistograms`` exports them).
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # buckets are "<= bound"
        self.sum += value


class LoopHistograms(Collector):
    """A histogram family of ``LoopHistogram`` series, one per label values, exported when scraped."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: tuple[float, ...], registry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.buckets = buckets
        self._series: dict[tuple[str, ...], LoopHistogram] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogram:
        """The series of these label values (bind it once: the hot path keeps the returned object)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = LoopHistogram(self.buckets)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, series.bounds), "+Inf"), list(series.counts)):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(values), buckets, series.sum)
        yield family


DECISION_SECONDS = LoopHistograms(
    "kvgate_decision_seconds",
    "Time of a routed request's decision, by stage (parse, tokenize, lookup, score; total = their sum; "
    "reserve = the load reservation after it)",
    ["stage"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
STAGES = ("parse", "tokenize", "lookup", "score", "total", "reserve")
STAGE_SECONDS = {stage: DECISION_SECONDS.labels(stage) for stage in STAGES}
"""Bound series of ``DECISION_SECONDS`` by stage (the hot path indexes this dict)."""

DIRECTORY_LOOKUP_SECONDS = LoopHistograms(
    "kvgate_directory_lookup_seconds",
    "Directory lookups of the request path, successful or not (timeouts end at the lookup budget)",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
).labels()
DIRECTORY_ERRORS = Counter(
    "kvgate_directory_errors", "Directory calls that failed or timed out, by operation", ["op"], registry=REGISTRY
)
HOT_NOTES_SKIPPED = Counter(
    "kvgate_hot_prefix_notes_skipped",
    "Routed prompts not noted as a node's hot prefixes (its note budget per second was spent)",
    registry=REGISTRY,
)
HEAD_DECISIONS = Counter(
    "kvgate_head_decisions",
    "Long fresh prompts routed on their first blocks (no node held those), tokenized in full after answering",
    registry=REGISTRY,
)
BACKGROUND_TOKENIZE = Counter(
    "kvgate_background_tokenize",
    "Whole-prompt tokenizations after a head decision, by outcome: queued, dropped (queue full), "
    "done (cached for the next turn), failed",
    ["outcome"],
    registry=REGISTRY,
)
BACKGROUND_TOKENIZE_PENDING = Gauge(
    "kvgate_background_tokenize_pending", "Head-decided prompts waiting for or in background tokenization",
    registry=REGISTRY,
)
PD_ARRIVALS_UNSHARED = Counter(
    "kvgate_pd_arrivals_unshared",
    "Split requests whose KV arrival the directory did not record (down, slow, or its Redis user not "
    "allowed the arrivals key): this replica's decisions see it, other replicas' do not",
    registry=REGISTRY,
)
PD_ANSWERING_UNSHARED = Counter(
    "kvgate_pd_answering_unshared",
    "Requests served whole on a node of a disaggregated fleet whose context the directory did not count "
    "(down or slow): this replica's decisions price what their decodes read, other replicas' do not",
    registry=REGISTRY,
)
RESERVATION_CONFLICTS = Counter(
    "kvgate_reservation_conflicts",
    "Decisions taken again because another replica loaded the chosen node between lookup and reserve",
    registry=REGISTRY,
)
INFLIGHT = Gauge(
    "kvgate_inflight_requests",
    "Requests routed by this replica over ext_proc and not yet finished (ext_authz never sees a "
    "response end: its load shows in kvgate_node_inflight_requests until the estimated end)",
    registry=REGISTRY,
)
EXT_PROC_STREAMS = Counter(
    "kvgate_ext_proc_streams", "ext_proc streams by how they ended (ok, error, cancelled; silent: no message within 5 s)", ["end"], registry=REGISTRY
)


# --- read at scrape time -------------------------------------------------------------------------


class _CacheStats(Protocol):
    hits: int
    misses: int
    bytes: int
    entries: int
    capacity_bytes: int


class TokenizerCacheCollector(Collector):
    """The tokenizer's segment cache, read when scraped (``PromptTokenizer.cache_stats``).

    The hit ratio is exported ready-made because it is what an operator watches (a multi-turn
    workload should sit well above 0.9); the raw counters are there for ``rate()`` over a window.
    """

    def __init__(self, stats: Callable[[], _CacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield CounterMetricFamily("kvgate_tokenizer_cache_hits", "Tokenization cache hits (text segments)", s.hits)
        yield CounterMetricFamily("kvgate_tokenizer_cache_misses", "Tokenization cache misses (text segments)", s.misses)
        lookups = s.hits + s.misses
        yield GaugeMetricFamily(
            "kvgate_tokenizer_cache_hit_ratio",
            "Tokenization cache hits / lookups since start (0 before the first lookup)",
            s.hits / lookups if lookups else 0.0,
        )
        yield GaugeMetricFamily("kvgate_tokenizer_cache_bytes", "Bytes held by the tokenization cache", s.bytes)
        yield GaugeMetricFamily("kvgate_tokenizer_cache_entries", "Entries in the tokenization cache", s.entries)
        yield GaugeMetricFamily(
            "kvgate_tokenizer_cache_capacity_bytes", "Byte budget of the tokenization cache", s.capacity_bytes
        )


class _NodeRow(Protocol):
    node_id: str
    live: bool
    inflight: int
    prefill_tokens: int
    cached_blocks: int | None


class FleetCollector(Collector):
    """Per-node load and cached blocks from the last fleet snapshot (``FleetMonitor``).

    The admin server refreshes the snapshot before it renders ``/metrics``, so a scrape sees the
    directory as of that scrape; nothing is polled between scrapes.
    """

    def __init__(self, rows: Callable[[], Sequence[_NodeRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        rows = list(self._rows())
        live = GaugeMetricFamily("kvgate_node_live", "1 if the node is live in the directory, else 0", labels=["node"])
        inflight = GaugeMetricFamily(
            "kvgate_node_inflight_requests", "In-flight requests on the node, as every replica sees them", labels=["node"]
        )
        queued = GaugeMetricFamily(
            "kvgate_node_queued_prefill_tokens", "Prefill tokens reserved on the node and not yet released", labels=["node"]
        )
        cached = GaugeMetricFamily(
            "kvgate_node_cached_blocks", "KV blocks the directory holds for the node (where known)", labels=["node"]
        )
        for r in rows:
            live.add_metric([r.node_id], 1.0 if r.live else 0.0)
            if r.live:
                inflight.add_metric([r.node_id], r.inflight)
                queued.add_metric([r.node_id], r.prefill_tokens)
            if r.cached_blocks is not None:
                cached.add_metric([r.node_id], r.cached_blocks)
        yield GaugeMetricFamily("kvgate_live_nodes", "Nodes live in the directory", sum(1 for r in rows if r.live))
        yield from (live, inflight, queued, cached)


def exposition(registries: Iterable[CollectorRegistry]) -> bytes:
    """The text exposition of several registries, one after another (their names do not overlap)."""
    from prometheus_client import generate_latest

    return b"".join(generate_latest(r) for r in registries)

CLOSED_CONNECTIONS = Counter(
    "kvgate_closed_connections",
    "Connections kvgate closed on a port before their client proved to be Envoy's or an operator's: "
    "no request head in time (head_timeout, answered 408), or too many such were open (evicted, the oldest)",
    ["port", "reason"],
    registry=REGISTRY,
)
