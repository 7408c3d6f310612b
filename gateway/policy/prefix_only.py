"""Longest cached prefix wins, whatever the queue: cache affinity without a cost model.

This is what a prefix-aware router does when it only scores matches (and what kvgate degenerates
to when load is ignored). It shows, in a load test, why the queue term matters: a hot prefix
piles up on one node. Ties (including "nobody has anything") go to the less loaded node, then
by the spread hash of (node, prompt).
"""

from __future__ import annotations

from directory_client.types import DirectoryView, NodeView
from gateway.policy.base import DEFAULT_FALLBACKS, check_fallbacks, describe, load_rank, no_nodes, ranked_fallbacks
from gateway.policy.cost_model import TtftEstimator
from gateway.profile import HardwareProfile
from gateway.types import Decision, RoutingRequest


def _prefix_rank(nv: NodeView, affinity: int) -> tuple[int, int, int, int, int, str]:
    return (-nv.cached_blocks, *load_rank(nv, affinity))


class PrefixOnlyPolicy:
    """Pick the node holding the most leading blocks of the prompt."""

    def __init__(self, *, name: str = "prefix_only", fallbacks: int = DEFAULT_FALLBACKS) -> None:
        self.name = name
        self.fallbacks = check_fallbacks(fallbacks)

    def decide(
        self, request: RoutingRequest, view: DirectoryView, profile: HardwareProfile, *, now: float
    ) -> Decision:
        nodes = view.nodes
        if not nodes:
            return no_nodes(self.name)
        def rank(nv: NodeView) -> tuple[int, int, int, int, int, str]:
            return _prefix_rank(nv, request.affinity)

        i = min(range(len(nodes)), key=lambda j: rank(nodes[j]))
        chosen = nodes[i]
        est = TtftEstimator(profile, request)
        costs = tuple(est.node_costs(nodes))
        mine = costs[i]
        hit = chosen.cached_blocks > 0
        head = (
            f"longest prefix {chosen.node.node_id}: {chosen.cached_blocks}/{request.total_blocks} blocks"
            if hit
            else f"no node holds a prefix; least loaded {chosen.node.node_id}"
        )
        return Decision(
            policy=self.name,
            outcome="owner" if hit else "balanced",
            node=chosen.node,
            fallbacks=ranked_fallbacks(nodes, rank, chosen, self.fallbacks),
            expected_cached_tokens=est.cached_tokens(chosen.cached_blocks),
            candidates=costs,
            reason=f"{head}; est. {describe(mine)}",
        )
