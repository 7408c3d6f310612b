"""What every routing policy promises, and the small pieces they share.

A policy is pure: it reads the request, one directory view, the hardware profile and the time it
is given (``now``), and returns a ``Decision``. It does no I/O and never reads a clock, so the
load-test simulator can run the very same objects on a virtual clock. A policy may keep state
between calls (round-robin keeps its position); it must then be deterministic given the sequence
of calls.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import xxhash

from directory_client.types import DirectoryView, NodeView
from gateway.profile import HardwareProfile
from gateway.types import CandidateCost, Decision, RoutingRequest

DEFAULT_FALLBACKS = 2


@runtime_checkable
class Policy(Protocol):
    """Chooses the node for one request. ``name`` is what ``make_policy`` was called with."""

    name: str

    def decide(
        self, request: RoutingRequest, view: DirectoryView, profile: HardwareProfile, *, now: float
    ) -> Decision: ...


def no_nodes(policy: str) -> Decision:
    """Nothing live to route to: no header is set and Envoy's fallback route balances."""
    return Decision(policy=policy, outcome="no_nodes", node=None, reason="no live nodes in the directory view")


def check_fallbacks(fallbacks: int) -> int:
    """Validate the ``fallbacks`` option shared by every policy."""
    if isinstance(fallbacks, bool) or not isinstance(fallbacks, int) or fallbacks < 0:
        raise ValueError(f"fallbacks must be a non-negative integer, got {fallbacks!r}")
    return fallbacks


def spread(view: NodeView, affinity: int) -> int:
    """Rendezvous hash of (node, affinity): the last tie-breaker.

    Breaking ties by node_id would send every new conversation to the same idle node while the
    others sit empty (measured: 2.8× load imbalance over 8 nodes); a hash keyed by the prompt
    spreads them evenly and still sends one prompt to one node.
    """
    return xxhash.xxh3_64_intdigest(view.node.node_id.encode(), seed=affinity & 0xFFFFFFFFFFFFFFFF)


def load_rank(view: NodeView, affinity: int = 0) -> tuple[int, int, int, int, str]:
    """Order of 'less loaded': fewer in-flight requests, fewer queued tokens, fewer blocks held
    (a node holding fewer conversations' KV will be asked for fewer next turns), then the spread.

    Between turns every node is idle, so without the blocks term a new conversation's node is
    a coin toss, and 20 conversations over 8 nodes pile 4–5 on some: measured 2.0× busy-time
    imbalance in the demo.
    """
    return (view.load.inflight, view.load.prefill_tokens, view.total_blocks, spread(view, affinity), view.node.node_id)


def distinct_addresses(ordered: Iterable[NodeView], chosen: NodeView, count: int) -> tuple[str, ...]:
    """The first ``count`` addresses of ``ordered`` that are neither the chosen node nor repeats."""
    out: list[str] = []
    if count <= 0:
        return ()
    seen_ids = {chosen.node.node_id}
    seen_addrs = {chosen.node.address}
    for nv in ordered:
        if nv.node.node_id in seen_ids or nv.node.address in seen_addrs:
            continue
        seen_ids.add(nv.node.node_id)
        seen_addrs.add(nv.node.address)
        out.append(nv.node.address)
        if len(out) == count:
            break
    return tuple(out)


def ranked_fallbacks(
    views: Sequence[NodeView], key: Callable[[NodeView], Any], chosen: NodeView, count: int
) -> tuple[str, ...]:
    """Fallback addresses: the best ``count`` other nodes by ``key`` (smallest first).

    A partial selection (``heapq.nsmallest``) keeps this O(n) for the usual 2 fallbacks over
    hundreds of nodes; only when repeated addresses eat into it does it rank everything.
    """
    if count <= 0:
        return ()
    take = min(count + 1, len(views))
    while True:
        out = distinct_addresses(heapq.nsmallest(take, views, key=key), chosen, count)
        if len(out) == count or take >= len(views):
            return out
        take = len(views)


def describe(cost: CandidateCost) -> str:
    """'n3 0.412 s (queue 0.100, transfer 0.012, prefill 0.300)' — one candidate for a reason line;
    with memory priced: '..., prefill 0.300; memory 0.150, hit survives 80%)'."""
    line = (
        f"{cost.node_id} {cost.total_s:.3f} s (queue {cost.queue_s:.3f}, "
        f"transfer {cost.transfer_s:.3f}, prefill {cost.prefill_s:.3f}"
    )
    if cost.memory_s > 0 or cost.survival < 1:
        line += f"; memory {cost.memory_s:.3f}, hit survives {cost.survival:.0%}"
    return line + ")"
