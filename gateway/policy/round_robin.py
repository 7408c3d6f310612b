"""Each request to the next live node in turn: the cache-blind baseline of the headline experiment.

The position is the only state; it advances once per decision over whatever nodes the view holds
(in the view's stable node_id order), so the sequence of choices is deterministic for a given
sequence of views. One instance per gateway replica: replicas do not share the position, as in
any round-robin balancer.
"""

from __future__ import annotations

from directory_client.types import DirectoryView
from gateway.policy.base import DEFAULT_FALLBACKS, check_fallbacks, describe, distinct_addresses, no_nodes
from gateway.policy.cost_model import TtftEstimator
from gateway.profile import HardwareProfile
from gateway.types import Decision, RoutingRequest


class RoundRobinPolicy:
    """Cycle over the live nodes; fallbacks are the nodes that come next in the cycle."""

    def __init__(self, *, name: str = "round_robin", fallbacks: int = DEFAULT_FALLBACKS, start: int = 0) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be a non-negative integer, got {start!r}")
        self.name = name
        self.fallbacks = check_fallbacks(fallbacks)
        self._next = start

    def decide(
        self, request: RoutingRequest, view: DirectoryView, profile: HardwareProfile, *, now: float
    ) -> Decision:
        nodes = view.nodes
        if not nodes:
            return no_nodes(self.name)
        i = self._next % len(nodes)
        self._next = i + 1
        chosen = nodes[i]
        est = TtftEstimator(profile, request)
        costs = tuple(est.node_costs(nodes))
        return Decision(
            policy=self.name,
            outcome="balanced",
            node=chosen.node,
            fallbacks=distinct_addresses(nodes[i + 1 :] + nodes[:i], chosen, self.fallbacks),
            expected_cached_tokens=est.cached_tokens(chosen.cached_blocks),
            candidates=costs,
            reason=f"round robin: {chosen.node.node_id} is {i + 1}/{len(nodes)}; est. {describe(costs[i])}",
        )
