"""Send one request and time it the way a user feels it: streaming, time to the first chunk.

The engine (real or simulated) sends nothing before the first token, so the first SSE chunk
marks the time to first token (TTFT). The usage chunk at the end carries ``prompt_tokens``,
``completion_tokens`` and ``prompt_tokens_details.cached_tokens``; ``x-kvgate-node`` names the
engine that answered and ``x-kvgate-cached-tokens`` repeats the hit when usage is missing (a
peer router may drop the usage chunk).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from loadtest.records import RequestRecord
from loadtest.workloads.base import RequestSpec, stream_fields
from workers.pd_sidecar import PREFILLED_BY_HEADER  # a split answer: prefilled on another node

NODE_HEADER = "x-kvgate-node"
CACHED_HEADER = "x-kvgate-cached-tokens"
ENGINE_TTFT_HEADER = "x-kvgate-engine-ttft-ms"  # simulated engines: arrival there → first token
INFLIGHT_HEADER = "x-kvgate-engine-inflight"  # simulated engines: requests held at arrival


def _delta_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def _engine_fields(rec: RequestRecord, headers) -> None:  # type: ignore[no-untyped-def]
    """The engine's own TTFT and load at arrival, when it says (a peer router may drop them)."""
    try:
        if (v := headers.get(ENGINE_TTFT_HEADER)) is not None:
            rec.engine_ttft_s = float(v) / 1000.0
        if (v := headers.get(INFLIGHT_HEADER)) is not None:
            rec.engine_inflight = int(v)
    except ValueError:
        pass  # a malformed debug header costs the split, not the request


async def send(
    session: aiohttp.ClientSession, base_url: str, spec: RequestSpec, *, sent_at: float, timeout_s: float
) -> RequestRecord:
    """Post ``spec`` with streaming on; never raises for a failed request (the record says why)."""
    rec = RequestRecord(spec, sent_at)
    body = {**spec.wire_body(), **stream_fields()}
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(base_url + spec.path, json=body) as resp:
                rec.status = resp.status
                rec.node = resp.headers.get(NODE_HEADER, "")
                rec.split = PREFILLED_BY_HEADER in resp.headers
                header_cached = resp.headers.get(CACHED_HEADER)
                _engine_fields(rec, resp.headers)
                if resp.status != 200:
                    text = await resp.text()
                    rec.error = f"HTTP {resp.status}: {text[:200]}"
                    return rec
                parts: list[str] = []
                usage = None
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - t0
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    parts.append(_delta_text(chunk))
                rec.e2e_s = time.perf_counter() - t0
                rec.reply = "".join(parts)
                if usage is not None:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens") or 0)
                elif header_cached is not None:
                    rec.cached_tokens = int(header_cached)
                if rec.ttft_s is None:
                    rec.error = "stream ended without a chunk"
    except asyncio.TimeoutError:
        rec.error = f"timeout after {timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec
