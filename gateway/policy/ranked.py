"""One mechanism for the policies that pick the node ranked first by a key (``least_request``,
``prefix_only``): the policy supplies the key and the words of its reason; the choice, the
fallbacks and the priced candidate list are built here the same way for both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from directory_client.types import DirectoryView, NodeView
from gateway.policy.base import describe, no_nodes, ranked_fallbacks
from gateway.policy.cost_model import TtftEstimator
from gateway.profile import HardwareProfile
from gateway.types import Decision, Outcome, RoutingRequest


def decide_by_rank(
    name: str,
    request: RoutingRequest,
    view: DirectoryView,
    profile: HardwareProfile,
    *,
    rank: Callable[[NodeView], Any],
    fallbacks: int,
    explain: Callable[[NodeView], tuple[Outcome, str]],
) -> Decision:
    """The node with the smallest ``rank`` wins; ``explain(chosen)`` gives (outcome, reason head)."""
    nodes = view.nodes
    if not nodes:
        return no_nodes(name)
    i = min(range(len(nodes)), key=lambda j: rank(nodes[j]))
    chosen = nodes[i]
    est = TtftEstimator(profile, request)
    costs = tuple(est.node_costs(nodes))
    outcome, head = explain(chosen)
    return Decision(
        policy=name,
        outcome=outcome,
        node=chosen.node,
        fallbacks=ranked_fallbacks(nodes, rank, chosen, fallbacks),
        expected_cached_tokens=est.cached_tokens(chosen.cached_blocks),
        candidates=costs,
        reason=f"{head}; est. {describe(costs[i])}",
    )
