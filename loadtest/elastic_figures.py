"""Per-minute figures of a run with scale events, and what each event cost.

- ``timeline``: per virtual minute (by arrival), requests, prompt and cached tokens, hit rate
  (cached ÷ prompt tokens), TTFT p99, live nodes (in the fleet the whole minute) and their requests;
- ``scale_in_loss``: hit rate of the ``window_s`` (5 minutes) before a removal minus that of the
  ``window_s`` after, averaged over removals (positive: the removal lost hits);
  ``scale_in_loss_reuse`` is the same over reusable tokens (cached ÷ the prompt tokens an earlier
  request had already sent): the share of fresh text in a window drifts with the workload (new
  conversations start, old ones end), which moves the hit rate whatever the fleet does; this one
  moves only when a cache that could have hit did not;
- ``scale_out``: per addition, the hit rate before and after, and ``catch_up_s``: from the event to
  the end of the first minute in which the new nodes served at least ``CATCH_UP_SHARE`` of the
  fleet's mean requests per node (None: never within the run).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from loadtest.records import RequestRecord
from loadtest.sim.elastic import Membership

MINUTE_S = 60.0
WINDOW_S = 300.0
CATCH_UP_SHARE = 0.9


def _hit_rate(records: Sequence[RequestRecord]) -> float | None:
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompt if prompt else None


def _live(members: Membership, node: str, start: float, end: float) -> bool:
    """Was the node in the fleet for the whole of [start, end)?"""
    return members.joined.get(node, float("inf")) <= start and members.left.get(node, float("inf")) >= end


def timeline(records: Sequence[RequestRecord], members: Membership, bin_s: float = MINUTE_S) -> list[dict[str, Any]]:
    ok = [r for r in records if r.ok]
    if not ok:
        return []
    bins: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in ok:
        bins[int(r.sent_at // bin_s)].append(r)
    out = []
    for m in range(max(bins) + 1):
        rs = bins.get(m, [])
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
        start, end = m * bin_s, (m + 1) * bin_s
        per_node = Counter(r.node for r in rs)
        live = sorted(n for n in members.joined if _live(members, n, start, end))
        out.append({
            "minute": m,
            "start_s": start,
            "requests": len(rs),
            "prompt_tokens": sum(r.prompt_tokens for r in rs),
            "cached_tokens": sum(r.cached_tokens for r in rs),
            "hit_rate": _hit_rate(rs),
            "ttft_p99_ms": float(np.percentile(np.asarray(ttfts) * 1000, 99)) if ttfts else None,
            "live_nodes": len(live),
            "per_node_requests": {n: per_node.get(n, 0) for n in live},
        })  # fmt: skip
    return out


def _window_hit_rate(records: Sequence[RequestRecord], start: float, end: float) -> float | None:
    return _hit_rate([r for r in records if r.ok and start <= r.sent_at < end])


def _window_reuse_rate(records: Sequence[RequestRecord], start: float, end: float) -> float | None:
    """Cached ÷ reusable tokens (what an earlier request had sent) of the requests sent in the window."""
    rs = [r for r in records if r.ok and start <= r.sent_at < end]
    seen = sum(r.seen_tokens for r in rs)
    return sum(min(r.cached_tokens, r.seen_tokens) for r in rs) / seen if seen else None


def scale_in_loss(records: Sequence[RequestRecord], members: Membership, window_s: float = WINDOW_S) -> dict[str, Any]:
    """Hit rate lost around each removal; ``mean`` averages the removals that had traffic on both sides."""
    events = []
    for t in sorted(members.removed_at):
        before = _window_hit_rate(records, t - window_s, t)
        after = _window_hit_rate(records, t, t + window_s)
        reuse_before, reuse_after = _window_reuse_rate(records, t - window_s, t), _window_reuse_rate(records, t, t + window_s)
        events.append({"at_s": t, "nodes": members.removed_at[t], "hit_rate_before": before, "hit_rate_after": after,
                       "loss": None if before is None or after is None else before - after,
                       "reuse_before": reuse_before, "reuse_after": reuse_after,
                       "reuse_loss": None if reuse_before is None or reuse_after is None else reuse_before - reuse_after})  # fmt: skip
    losses = [e["loss"] for e in events if e["loss"] is not None]
    reuse = [e["reuse_loss"] for e in events if e["reuse_loss"] is not None]
    return {"mean": sum(losses) / len(losses) if losses else None, "events": events,
            "reuse_mean": sum(reuse) / len(reuse) if reuse else None}  # fmt: skip


def scale_out(
    records: Sequence[RequestRecord], members: Membership, tl: Sequence[Mapping[str, Any]], window_s: float = WINDOW_S
) -> list[dict[str, Any]]:
    out = []
    for t in sorted(members.added_at):
        added = set(members.added_at[t])
        catch_up = None
        for row in tl:
            if row["start_s"] < t:
                continue
            counts = row["per_node_requests"]
            new = [counts[n] for n in added if n in counts]
            if not new or not counts:
                continue
            fleet_mean = sum(counts.values()) / len(counts)
            if fleet_mean > 0 and sum(new) / len(new) >= CATCH_UP_SHARE * fleet_mean:
                catch_up = row["start_s"] + MINUTE_S - t
                break
        out.append({
            "at_s": t, "nodes": sorted(added), "catch_up_s": catch_up,
            "hit_rate_before": _window_hit_rate(records, t - window_s, t),
            "hit_rate_after": _window_hit_rate(records, t, t + window_s),
        })  # fmt: skip
    return out


def elastic_figures(records: Sequence[RequestRecord], members: Membership, copies: Mapping[str, int]) -> dict[str, Any]:
    """The JSON a policy's summary gets in a run with ``--scale``."""
    tl = timeline(records, members)
    loss = scale_in_loss(records, members)
    return {
        "timeline": tl,
        "scale_in_loss": loss["mean"],
        "scale_in_loss_reuse": loss["reuse_mean"],
        "scale_in_events": loss["events"],
        "scale_out_events": scale_out(records, members, tl),
        "drain_copies": dict(copies),
    }
