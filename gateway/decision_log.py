"""The last N decisions and a per-second outline of recent traffic, for ``/debug`` and the dashboard.

Recording is on the request path, so it keeps references, not copies: the ``RouteResult`` (its
``Decision`` is frozen and already holds every candidate's cost and the reason) goes into a
bounded deque, and one small per-second bucket is bumped. Turning results into JSON happens only
when someone reads them. Memory is bounded by ``size`` results (each a few hundred bytes plus one
``CandidateCost`` per live node) and ``window_s`` buckets.

The outline counts what kvgate *expected*: ``cached_tokens`` is the prefix the chosen node was
expected to hold (locally or by pull), so ``cached / prompt`` is the hit rate the policy aimed
for, not what the engines later reported in ``usage.prompt_tokens_details``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from directory_client.types import Tier
from gateway.prediction import predict

if TYPE_CHECKING:
    from gateway.core import RouteResult

OUTCOMES = ("owner", "pull", "recompute", "balanced", "fail_open")


@dataclass(slots=True)
class _Entry:
    ts: float
    request_id: str
    path: str
    result: RouteResult


class _Second:
    """Counts of one wall-clock second."""

    __slots__ = ("t", "counts", "prompt_tokens", "cached_tokens")

    def __init__(self, t: int) -> None:
        self.t = t
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def as_dict(self) -> dict[str, Any]:
        return {"t": self.t, **self.counts, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}


class DecisionLog:
    """Bounded memory of routed and failed-open requests (rejections are only counted in metrics)."""

    def __init__(self, size: int = 256, *, window_s: int = 300, clock: Callable[[], float] = time.time) -> None:
        if size < 1 or window_s < 1:
            raise ValueError("size and window_s must be positive")
        self._entries: deque[_Entry] = deque(maxlen=size)
        self._seconds: deque[_Second] = deque(maxlen=window_s)
        self._clock = clock
        self.recorded = 0  # since start; lets a reader tell "nothing new" from "log wrapped"

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, path: str, request_id: str, result: RouteResult) -> None:
        now = self._clock()
        self._entries.append(_Entry(now, request_id, path, result))
        self.recorded += 1
        sec = int(now)
        seconds = self._seconds
        if not seconds or seconds[-1].t != sec:
            seconds.append(_Second(sec))
        bucket = seconds[-1]
        d = result.decision
        if result.kind == "routed" and d is not None and result.request is not None:
            bucket.counts[d.outcome] = bucket.counts.get(d.outcome, 0) + 1
            bucket.prompt_tokens += result.request.prompt_tokens
            bucket.cached_tokens += d.expected_cached_tokens
        else:
            bucket.counts["fail_open"] += 1

    def recent(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Newest first, as JSON-ready dicts (see ``describe``)."""
        entries = list(self._entries)
        entries.reverse()
        if limit is not None:
            entries = entries[: max(limit, 0)]
        return [
            {"ts": e.ts, "request_id": e.request_id, "path": e.path, **describe(e.result)} for e in entries
        ]

    def timeline(self) -> list[dict[str, Any]]:
        """Per-second counts, oldest first; seconds without traffic are absent."""
        return [s.as_dict() for s in self._seconds]


def describe(result: RouteResult) -> dict[str, Any]:
    """An operator's view of one answer: what was chosen, every candidate's cost, and why."""
    out: dict[str, Any] = {"kind": result.kind}
    req = result.request
    if req is not None:
        out.update(model=req.model, prompt_tokens=req.prompt_tokens, prompt_blocks=req.total_blocks,
                   block_size=req.block_size)  # fmt: skip
    if result.kind == "rejected":
        out.update(outcome="rejected", status=result.status, reason=result.reason)
        return out
    d = result.decision
    out["timings_ms"] = {k: round(v * 1000, 4) for k, v in result.timings.items()}
    if result.kind == "fail_open":
        out.update(outcome="fail_open", fail_open_reason=result.reason)
    if d is None:
        out.setdefault("reason", result.reason)
        return out
    chosen_id = d.node.node_id if d.node is not None else None
    block_size = req.block_size if req is not None else 0
    candidates = sorted(d.candidates, key=lambda c: (c.total_s, c.node_id))
    prediction = predict(result)  # what the prediction headers say, when they are on
    best = max(d.candidates, key=lambda c: c.cached_blocks, default=None)
    out.update(
        policy=d.policy,
        outcome=out.get("outcome", d.outcome),
        chosen=None if d.node is None else {"node_id": d.node.node_id, "address": d.node.address},
        fallbacks=list(d.fallbacks),
        pull=None if d.pull is None else {
            "source_node_id": d.pull.source_node_id, "source_endpoint": d.pull.source_endpoint, "blocks": d.pull.blocks,
        },
        expected_cached_tokens=d.expected_cached_tokens,
        estimated_ttft_ms=prediction.estimated_ttft_ms if prediction is not None else None,
        best_cached=None if best is None or best.cached_blocks == 0 else {
            "node_id": best.node_id, "blocks": best.cached_blocks, "tokens": best.cached_blocks * block_size,
        },
        reason=d.reason if result.kind == "routed" else f"{result.reason}: {d.reason}",
        candidates=[
            {
                "node_id": c.node_id,
                "address": c.address,
                "chosen": c.node_id == chosen_id,
                "cached_blocks": c.cached_blocks,
                "cached_tokens": c.cached_blocks * block_size,
                "tier": Tier(c.tier).name,
                "inflight": c.inflight,
                "via_pull": c.via_pull,
                "queue_s": c.queue_s,
                "transfer_s": c.transfer_s,
                "prefill_s": c.prefill_s,
                "total_s": c.total_s,
                "memory_s": c.memory_s,
                "survival": c.survival,
            }
            for c in candidates
        ],
    )  # fmt: skip
    if result.headers:
        out["headers"] = dict(result.headers)
    return out
