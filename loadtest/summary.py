"""Per-policy figures from request records, one function for replay and simulate.

Definitions:
- ``hit_rate`` = cached prompt tokens ÷ prompt tokens over successful requests (``_local``: found
  on the serving node, ``_pulled``: fetched from another node first);
- ``redundant_prefill_frac`` = prefill of tokens an earlier request had already sent ÷ all prefill
  (``accounting.py``);
- TTFT percentiles over successful requests, overall and per turn (1-based);
- ``throughput_tok_s`` = output tokens ÷ wall time of the run, ``requests_per_s`` likewise;
- ``imbalance`` = max ÷ mean over nodes of busy time (modelled GPU seconds; request counts when
  busy time is not known), 1.0 = perfectly even;
- ``hit_rate_of_oracle_pool`` = hit rate ÷ the ``oracle_pool`` ceiling's hit rate in the same run
  (simulate, when that ceiling ran);
- ``request_table``: every successful request as one row of ``REQUEST_COLUMNS`` (what
  ``kvgate profile fit`` prices a profile from).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from loadtest.records import RequestRecord

PCTS = (50, 90, 99)
REQUEST_COLUMNS = ("prompt_tokens", "cached_tokens", "output_tokens", "ttft_ms", "e2e_ms")


def _pcts_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PCTS}
    arr = np.asarray(values) * 1000.0
    return {f"p{p}": float(np.percentile(arr, p)) for p in PCTS}


def imbalance(per_node: Mapping[str, float]) -> float | None:
    """max/mean of a per-node quantity (None without nodes or without any work)."""
    vals = list(per_node.values())
    if not vals or sum(vals) <= 0:
        return None
    return max(vals) / (sum(vals) / len(vals))


def summarize(
    records: Sequence[RequestRecord],
    *,
    wall_s: float,
    busy_s: Mapping[str, float] | None = None,
    nodes: Sequence[str] = (),
    decision_ms: Mapping[str, float | None] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON-ready figures of one policy's run (schema in loadtest/README.md)."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    pulled = sum(r.pulled_tokens for r in ok)
    prefilled = sum(max(r.prompt_tokens - r.cached_tokens, 0) for r in ok)
    redundant = sum(max(r.seen_tokens - r.cached_tokens, 0) for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    overall = _pcts_ms(ttfts)
    tpot = _pcts_ms([t for t in (r.tpot_s for r in ok) if t is not None])

    by_turn: dict[int, list[float]] = defaultdict(list)
    turn_tokens: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # prompt, cached
    for r in ok:
        if r.ttft_s is not None:
            by_turn[r.turn].append(r.ttft_s)
        turn_tokens[r.turn][0] += r.prompt_tokens
        turn_tokens[r.turn][1] += r.cached_tokens
    turn_stats = {
        str(t): {
            "requests": len(v), **{f"ttft_{k}_ms": x for k, x in _pcts_ms(v).items()},
            "hit_rate": turn_tokens[t][1] / turn_tokens[t][0] if turn_tokens[t][0] else 0.0,
        }
        for t, v in sorted(by_turn.items())
    }

    counts = Counter(r.node for r in ok if r.node)
    for n in nodes:
        counts.setdefault(n, 0)
    busy = dict(busy_s) if busy_s else {}
    basis = "busy_seconds" if busy and sum(busy.values()) > 0 else "requests"
    imb = imbalance(busy) if basis == "busy_seconds" else imbalance({k: float(v) for k, v in counts.items()})
    wall = max(wall_s, 1e-9)
    errors = [r.error or f"HTTP {r.status}" for r in records if not r.ok]
    out: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "hit_rate_local": (cached - pulled) / prompt if prompt else 0.0,
        "hit_rate_pulled": pulled / prompt if prompt else 0.0,
        "redundant_prefill_frac": redundant / prefilled if prefilled else 0.0,
        "ttft_p50_ms": overall["p50"],
        "ttft_p90_ms": overall["p90"],
        "ttft_p99_ms": overall["p99"],
        "ttft_by_turn": turn_stats,
        "tpot_p50_ms": tpot["p50"],
        "tpot_p99_ms": tpot["p99"],
        "split_frac": sum(r.split for r in ok) / len(ok) if ok else 0.0,
        "output_tokens": sum(r.output_tokens for r in ok),
        "throughput_tok_s": sum(r.output_tokens for r in ok) / wall,
        "requests_per_s": len(ok) / wall,
        "wall_s": wall_s,
        "imbalance": imb,
        "imbalance_basis": basis,
        "per_node_requests": dict(sorted(counts.items())),
        "per_node_busy_s": dict(sorted(busy.items())),
        # how busy the fleet was: mean busy seconds per node over the run's wall time (None unknown)
        "busy_frac": sum(busy.values()) / len(busy) / wall if basis == "busy_seconds" else None,
        **_path_split(ok),
        "decision_p50_ms": (decision_ms or {}).get("p50"),
        "decision_p99_ms": (decision_ms or {}).get("p99"),
        "request_table": request_table(ok),
    }
    if extra:
        out.update(extra)
    return out


def _path_split(ok: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Per request, TTFT at the client minus the engine's own (where the engine said): p50/p99 of
    what the path in front of the engines (client, proxies, routing decision) adds."""
    path = [r.ttft_s - r.engine_ttft_s for r in ok if r.ttft_s is not None and r.engine_ttft_s is not None]
    engine = [r.engine_ttft_s for r in ok if r.engine_ttft_s is not None]
    p, e = _pcts_ms(path), _pcts_ms(engine)
    return {"path_ttft_p50_ms": p["p50"], "path_ttft_p99_ms": p["p99"],
            "engine_ttft_p50_ms": e["p50"], "engine_ttft_p99_ms": e["p99"]}


def request_table(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """Successful requests with a first token, one compact row each (times in ms, 0.01 ms steps)."""
    rows = [
        [r.prompt_tokens, r.cached_tokens, r.output_tokens, round(r.ttft_s * 1000, 2), round(r.e2e_s * 1000, 2)]
        for r in ok if r.ttft_s is not None and r.e2e_s is not None
    ]
    return {"columns": list(REQUEST_COLUMNS), "rows": rows}


def add_pool_share(policies: Mapping[str, dict[str, Any]], ceiling: str = "oracle_pool") -> None:
    """Give every policy its hit rate as a fraction of the ``ceiling``'s (nothing without it)."""
    pool = policies.get(ceiling)
    if pool is None or not pool["hit_rate"]:
        return
    for s in policies.values():
        s["hit_rate_of_oracle_pool"] = s["hit_rate"] / pool["hit_rate"]


def ttft_samples_ms(records: Sequence[RequestRecord]) -> list[float]:
    """Every successful request's TTFT in ms (for CDF plots)."""
    return [r.ttft_s * 1000.0 for r in records if r.ok and r.ttft_s is not None]
