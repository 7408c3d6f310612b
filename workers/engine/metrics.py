"""``/metrics`` with vLLM's metric names, so dashboards and scrapers made for vLLM work unchanged.

Gauges and counters are read from the scheduler at scrape time (a custom collector: nothing is
updated per step); latency histograms are observed when a request ends. Each engine has its own
registry, so several engines can live in one process (tests, the demo).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.engine.scheduler import Scheduler

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _SchedulerCollector(Collector):
    def __init__(self, scheduler: Scheduler, model: str) -> None:
        self._s = scheduler
        self._model = model

    def collect(self) -> Iterator[Metric]:
        s, labels, lv = self._s, ["model_name"], [self._model]
        stats = s.cache.stats()
        c = s.counters

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lv, value)
            return m

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(s.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(s.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.usage)
        yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (pre-V1 name). 1 means 100 percent.", stats.usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", c.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", c.prefix_hits)
        yield counter("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries (older name), in tokens.", c.prefix_queries)
        yield counter("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits (older name), in tokens.", c.prefix_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", c.preemptions)
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=["model_name", "finished_reason"]
        )
        for reason, n in sorted(c.finished.items()):
            success.add_metric([self._model, reason], n)
        yield success
        info = GaugeMetricFamily(  # as vLLM exports it (an info gauge): how a bridge learns the cache's size
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine", "kv_cache_size_tokens", "num_gpu_blocks"],
        )
        size = s.cache.block_size
        info.add_metric([str(size), "True", "0", str(stats.capacity_blocks * size), str(stats.capacity_blocks)], 1.0)
        yield info
        blocks = GaugeMetricFamily("kvgate_engine_kv_blocks", "KV blocks by state.", labels=["model_name", "state"])
        blocks.add_metric([self._model, "capacity"], stats.capacity_blocks)
        blocks.add_metric([self._model, "cached"], stats.hashed_blocks)
        blocks.add_metric([self._model, "referenced"], stats.referenced_blocks)
        blocks.add_metric([self._model, "private"], stats.private_blocks)
        yield blocks
        yield counter("kvgate_engine_busy_seconds", "Modelled hardware time spent in engine steps.", c.busy_s)


class EngineMetrics:
    """The engine's registry: scheduler state at scrape time plus request latency histograms."""

    def __init__(self, scheduler: Scheduler, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(scheduler, model))
        self._model = model
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (wall clock, scaled by --time-scale).",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds (wall clock).",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.closed_connections = Counter(  # the HTTP port's guard (``kvgate worker``)
            "kvgate_engine_closed_connections",
            "Connections closed before a request arrived whole, by why (head_timeout: 408; evicted: past 256 waiting)",
            ["reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
