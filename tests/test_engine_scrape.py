"""The engine-cache scraper: vLLM's prefix-cache counters per node, and what a bad node costs.

The happy path against real vLLM is in test_vllm_conformance.py (prediction = engine hits =
cached_tokens); here, the parsing of DP-ranked series and the failures an operator sees."""

from __future__ import annotations

from gateway import metrics
from gateway.engine_scrape import EngineCacheScraper, prefix_cache_counters
from tests.conftest import free_port
from tests.support.engines import engine_endpoint

VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 4096.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 1024.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 2048.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 32.0
"""


def test_counters_are_summed_over_data_parallel_ranks() -> None:
    assert prefix_cache_counters(VLLM_METRICS) == (2080.0, 5120.0)
    assert prefix_cache_counters("kvgate_engine_busy_seconds_total 3\n") is None  # not vLLM: nothing to compare


async def test_a_node_that_fails_is_counted_and_keeps_its_last_values() -> None:
    """The operator sees kvgate_engine_scrape_errors_total{node} rise; the last good figures stay."""
    down = free_port()
    errors = metrics.ENGINE_SCRAPE_ERRORS.labels("down")
    before = errors._value.get()
    scraper: EngineCacheScraper | None = None
    try:
        async with engine_endpoint("/metrics", VLLM_METRICS) as port:
            scraper = EngineCacheScraper([("good", f"127.0.0.1:{port}"), ("down", f"127.0.0.1:{down}")], interval_s=60)
            await scraper.start()
            for node_id, address in scraper.nodes:
                await scraper.scrape(node_id, address)
            assert metrics.CACHE_LOOP.engine["good"] == (2080.0, 5120.0)
            assert "down" not in metrics.CACHE_LOOP.engine
            assert errors._value.get() >= before + 1
        await scraper.scrape("good", f"127.0.0.1:{port}")  # the good node went away
        assert metrics.CACHE_LOOP.engine["good"] == (2080.0, 5120.0)  # its figures stay as last scraped
    finally:
        if scraper is not None:
            await scraper.aclose()
