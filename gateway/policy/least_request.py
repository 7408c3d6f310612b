"""Fewest in-flight requests wins: the classic load balancer, blind to the cache.

It is the baseline kvgate has to beat, and what Envoy's own fallback route does when kvgate is
down, so a load test run with it shows what cache affinity adds. Ties go to fewer queued prefill
tokens, then fewer blocks held, then the spread hash of (node, prompt) (``base.load_rank``).
"""

from __future__ import annotations

from directory_client.types import DirectoryView, NodeView
from gateway.policy.base import DEFAULT_FALLBACKS, check_fallbacks, load_rank
from gateway.policy.ranked import decide_by_rank
from gateway.profile import HardwareProfile
from gateway.types import Decision, Outcome, RoutingRequest


class LeastRequestPolicy:
    """Pick the node with the fewest in-flight requests."""

    def __init__(self, *, name: str = "least_request", fallbacks: int = DEFAULT_FALLBACKS) -> None:
        self.name = name
        self.fallbacks = check_fallbacks(fallbacks)

    def decide(
        self, request: RoutingRequest, view: DirectoryView, profile: HardwareProfile, *, now: float
    ) -> Decision:
        def explain(chosen: NodeView) -> tuple[Outcome, str]:
            load = chosen.load
            return "balanced", (
                f"least loaded {chosen.node.node_id}: {load.inflight} in flight, {load.prefill_tokens} queued tokens"
            )

        return decide_by_rank(
            self.name, request, view, profile,
            rank=lambda nv: load_rank(nv, request.affinity), fallbacks=self.fallbacks, explain=explain,
        )  # fmt: skip
