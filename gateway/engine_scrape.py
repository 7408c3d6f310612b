"""What each engine says it delivered from its prefix cache, beside what kvgate predicted.

kvgate routes a request to a node expecting it to hold some prefix
(``kvgate_node_expected_cached_tokens_total{node}``, counted by the routing core). Whether it did
is the engine's to say: vLLM counts prompt tokens looked up and found in its prefix cache
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``). This scraper reads both
from each configured node's ``/metrics`` into ``metrics.CACHE_LOOP``, which exports them per node
beside kvgate's predictions (and ``/debug/nodes`` shows both), so one query compares prediction
and delivery (alert in ``docs/real-vllm.md``). A node whose keys silently differ from
kvgate's shows predictions with no matching hits.

The engine's counters include requests kvgate did not route (other gateways, the doctor); compare
rates over a window with mostly kvgate's traffic. A scrape that fails is counted
(``kvgate_engine_scrape_errors_total{node}``) and the last values are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway import metrics

log = logging.getLogger(__name__)

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
_WANTED = (HITS, QUERIES)


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """``(hits, queries)`` summed over the engine's series (DP ranks), or None if it exports neither."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _WANTED:
                found[s.name] = found.get(s.name, 0.0) + s.value
    if not found:
        return None
    return found.get(HITS, 0.0), found.get(QUERIES, 0.0)


class EngineCacheScraper:
    """Scrape ``http://<address>/metrics`` of every node every ``interval_s`` seconds."""

    def __init__(self, nodes: Sequence[tuple[str, str]], *, interval_s: float, timeout_s: float = 2.0) -> None:
        self.nodes = list(nodes)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self._task = asyncio.create_task(self._run(), name="engine-cache-scraper")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self.scrape(node_id, address) for node_id, address in self.nodes))
            await asyncio.sleep(self.interval_s)

    async def scrape(self, node_id: str, address: str) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"http://{address}/metrics") as resp:
                resp.raise_for_status()
                counters = prefix_cache_counters(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            metrics.ENGINE_SCRAPE_ERRORS.labels(node_id).inc()
            log.debug("scraping %s (%s) failed: %r", node_id, address, e)
            return
        if counters is None:  # not vLLM (or prefix caching off): nothing to compare
            return
        metrics.CACHE_LOOP.engine[node_id] = counters
