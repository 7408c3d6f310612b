"""Fewest in-flight requests wins: the classic load balancer, blind to the cache.

It is the baseline kvgate has to beat, and what Envoy's own fallback route does when kvgate is
down, so a load test run with it shows what cache affinity adds. Ties go to fewer queued prefill
tokens, then node_id.
"""

from __future__ import annotations

from directory_client.types import DirectoryView, NodeView
from gateway.policy.base import DEFAULT_FALLBACKS, check_fallbacks, describe, load_rank, no_nodes, ranked_fallbacks
from gateway.policy.cost_model import TtftEstimator
from gateway.profile import HardwareProfile
from gateway.types import Decision, RoutingRequest


class LeastRequestPolicy:
    """Pick the node with the fewest in-flight requests."""

    def __init__(self, *, name: str = "least_request", fallbacks: int = DEFAULT_FALLBACKS) -> None:
        self.name = name
        self.fallbacks = check_fallbacks(fallbacks)

    def decide(
        self, request: RoutingRequest, view: DirectoryView, profile: HardwareProfile, *, now: float
    ) -> Decision:
        nodes = view.nodes
        if not nodes:
            return no_nodes(self.name)
        def rank(nv: NodeView) -> tuple[int, int, int, int, str]:
            return load_rank(nv, request.affinity)

        i = min(range(len(nodes)), key=lambda j: rank(nodes[j]))
        chosen = nodes[i]
        est = TtftEstimator(profile, request)
        costs = tuple(est.node_costs(nodes))
        mine = costs[i]
        return Decision(
            policy=self.name,
            outcome="balanced",
            node=chosen.node,
            fallbacks=ranked_fallbacks(nodes, rank, chosen, self.fallbacks),
            expected_cached_tokens=est.cached_tokens(chosen.cached_blocks),
            candidates=costs,
            reason=(
                f"least loaded {chosen.node.node_id}: {chosen.load.inflight} in flight, "
                f"{chosen.load.prefill_tokens} queued tokens; est. {describe(mine)}"
            ),
        )
