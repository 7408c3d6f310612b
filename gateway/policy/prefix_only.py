"""Longest cached prefix wins, whatever the queue: cache affinity without a cost model.

This is what a prefix-aware router does when it only scores matches (and what kvgate degenerates
to when load is ignored). It shows, in a load test, why the queue term matters: a hot prefix
piles up on one node. Ties (including "nobody has anything") go to the less loaded node, then
by the spread hash of (node, prompt).
"""

from __future__ import annotations

from directory_client.types import DirectoryView, NodeView
from gateway.policy.base import DEFAULT_FALLBACKS, check_fallbacks, load_rank
from gateway.policy.ranked import decide_by_rank
from gateway.profile import HardwareProfile
from gateway.types import Decision, Outcome, RoutingRequest


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
        def explain(chosen: NodeView) -> tuple[Outcome, str]:
            if chosen.cached_blocks > 0:
                return "owner", (
                    f"longest prefix {chosen.node.node_id}: {chosen.cached_blocks}/{request.total_blocks} blocks"
                )
            return "balanced", f"no node holds a prefix; least loaded {chosen.node.node_id}"

        return decide_by_rank(
            self.name, request, view, profile,
            rank=lambda nv: _prefix_rank(nv, request.affinity), fallbacks=self.fallbacks, explain=explain,
        )  # fmt: skip
