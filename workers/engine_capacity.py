"""How large an engine's KV cache is, read from its own ``/metrics``.

kvgate prices memory (what a copy or a new prompt evicts) only for nodes whose capacity it knows.
Configuring it by hand per node is easy to forget and goes stale when an operator resizes the
cache, while both engines say it themselves:

- vLLM: ``vllm:cache_config_info``, an info gauge whose labels carry the cache config:
  ``kv_cache_size_tokens`` (newer releases) or ``num_gpu_blocks`` × ``block_size`` (the CPU build
  reports its KV space under ``num_gpu_blocks`` too). One of those blocks is vLLM's null block,
  never given to a request, so a block less holds KV. A data-parallel server exports one series per
  engine (``engine`` label); their caches add up.
- SGLang: ``sglang:max_total_num_tokens``, a gauge in tokens.

The bridge asks once a node's events begin (and again later while the answer is missing) when no
``capacity`` was configured; a configured capacity always wins.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

VLLM_CACHE_INFO = "vllm:cache_config_info"
SGLANG_MAX_TOKENS = "sglang:max_total_num_tokens"
MAX_METRICS_BYTES = 8 << 20  # vLLM's /metrics is ~100 KB; more is not an engine's page, and is not read
MAX_TOKENS = 1 << 40  # no engine's cache holds a trillion tokens: a larger figure is garbage, not a size


def _int_label(labels: dict[str, str], name: str) -> int | None:
    value = labels.get(name, "")
    try:
        number = int(float(value))
    except (ValueError, OverflowError):  # "None", "", "inf" or garbage: not reported
        return None
    return number if number > 0 else None


def kv_capacity_tokens(text: str) -> int | None:
    """Tokens the engine's KV cache holds, summed over its engines, or None if it does not say."""
    vllm_tokens = 0
    sglang_tokens = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == VLLM_CACHE_INFO:
                tokens = _int_label(sample.labels, "kv_cache_size_tokens")
                blocks, size = _int_label(sample.labels, "num_gpu_blocks"), _int_label(sample.labels, "block_size")
                if tokens is None:
                    tokens = blocks * size if blocks and size else None
                if tokens and size and tokens > size:
                    tokens -= size  # the null block
                vllm_tokens += tokens or 0
            elif sample.name == SGLANG_MAX_TOKENS and sample.value > 0:
                sglang_tokens += sample.value
    total = vllm_tokens or int(sglang_tokens)
    return total if 0 < total <= MAX_TOKENS else None


async def fetch_capacity_blocks(address: str, block_size: int, *, timeout_s: float = 2.0) -> int | None:
    """The engine at ``address`` (``host:port``)'s KV capacity in blocks of ``block_size`` tokens;
    None when it cannot be reached or does not say (logged at debug: the caller retries)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(f"http://{address}/metrics") as resp:
                resp.raise_for_status()
                body = await resp.content.read(MAX_METRICS_BYTES + 1)
        if len(body) > MAX_METRICS_BYTES:
            raise ValueError(f"/metrics is over {MAX_METRICS_BYTES} bytes")
        tokens = kv_capacity_tokens(body.decode("utf-8", errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        log.debug("reading the KV capacity of %s failed: %r", address, e)
        return None
    return tokens // block_size if tokens else None
