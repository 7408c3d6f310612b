"""Values that cross the gateway's boundary: what a policy is asked and what it answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from directory_client.frozen import fast_frozen_init
from directory_client.types import NodeInfo, Tier

Outcome = Literal["owner", "pull", "recompute", "balanced", "no_nodes"]
"""owner: the node holding the longest prefix; pull: another node fetches it first;
recompute: a node with less (or nothing) cached is cheaper; balanced: a load/round-robin
policy chose without looking at the cache; no_nodes: nothing live, the caller fails open."""


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What the policy needs to know of one inference request (no text, no token IDs)."""

    model: str
    prompt_tokens: int
    total_blocks: int  # full blocks of the prompt (len(keys))
    block_size: int
    request_id: str = ""
    salted: bool = False  # carried a cache_salt: its block keys are its tenant's alone
    session: str = ""  # the conversation's key (gateway.sessions), "" when the client named none
    session_node: str = ""  # the node the session was last routed to, if recorded
    retention: str = ""  # the session's retention class: "" or "long" (gateway.sessions)
    affinity: int = 0
    """Spreads ties: equally good nodes are ordered by a hash of (node, affinity). The gateway
    passes the prompt's last block key, so distinct conversations spread over idle nodes while
    the same prompt always prefers the same one (and finds its own blocks there next turn)."""
    answer_blocks: int = 0
    """KV blocks the request's answers beyond the first take on its node (a request asking for n
    answers decodes n sequences side by side): memory it adds there besides its prompt's. The
    first answer's, like every request's, is not priced."""


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class PullPlan:
    """Tell the chosen node to fetch ``blocks`` leading blocks from ``source`` before prefill."""

    source_node_id: str
    source_endpoint: str  # transfer agent "ip:port" → x-kv-cache-source-host-port
    blocks: int  # how many leading blocks of the prompt to pull (the source's cached prefix)


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """A split request: ``address`` computes its prompt first and hands the KV to the destination
    (the decode node), which generates the answer (``gateway.policy.disagg``)."""

    node_id: str
    address: str  # "ip:port" of the prefill node's server → x-prefiller-host-port
    prefill_tokens: int  # prompt tokens the prefill node computes: its queued prefill
    ready_s: float  # from now until its prefill is done: its load ends then
    first_token_s: float  # from now until the decode node's first token (KV moved, queue waited)
    kv_arrives_s: float = 0.0  # from now until the prompt's KV has reached the decode node


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class CandidateCost:
    """One node's estimated time to first token, by part, as the policy saw it.

    ``memory_s`` is not part of the time to first token: it is what the request costs later
    requests by evicting their blocks here (``gateway.policy.memory``), and ``survival`` the
    chance this node's cached prefix is still there when the request is served (the prefill
    estimate already blends hit and miss by it). A memory-aware policy ranks by ``score``.
    """

    node_id: str
    address: str
    cached_blocks: int
    tier: Tier
    inflight: int
    queue_s: float
    transfer_s: float
    prefill_s: float
    total_s: float
    via_pull: bool = False
    memory_s: float = 0.0
    survival: float = 1.0

    @property
    def score(self) -> float:
        """Time to first token plus the memory this request takes from others."""
        return self.total_s + self.memory_s


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class Decision:
    """The answer: where to send the request, what to fall back to, and why."""

    policy: str
    outcome: Outcome
    node: NodeInfo | None
    fallbacks: tuple[str, ...] = ()  # further "ip:port" in order of preference
    pull: PullPlan | None = None
    prefill: PrefillPlan | None = None  # split: the prefill node; ``node`` is the decode node
    expected_cached_tokens: int = 0
    candidates: tuple[CandidateCost, ...] = ()
    reason: str = ""

    @property
    def destination_header(self) -> str:
        """Value of x-gateway-destination-endpoint: the chosen node only.

        The Gateway API Inference Extension allows ``ip:port,ip:port``, and kvgate's own bootstrap
        (override-host load balancing) would take a list, but the integrations that build an
        ORIGINAL_DST cluster (Envoy Gateway, Istio) parse the header as one address and answer
        503 to a list (measured on Envoy 1.40); so the fallbacks stay in the decision's
        explanation, and Envoy's retry goes to another node by itself.
        """
        return "" if self.node is None else self.node.address
