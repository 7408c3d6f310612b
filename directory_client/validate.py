"""Input checks shared by every backend, so bad input fails the same way everywhere and before
anything is written (a half-applied batch would be worse than a refused one)."""

from __future__ import annotations

import math

from directory_client.types import ROLES, NodeInfo, Reservation, SplitArrival, Tier

MAX_NODE_ID = 200
MAX_ARRIVAL_ID = 64


def check_node_id(node_id: str) -> str:
    """Node ids become part of Redis key names and hash tags: no braces, no empty ids."""
    if not isinstance(node_id, str) or not node_id:
        raise ValueError(f"node_id must be a non-empty string, got {node_id!r}")
    if len(node_id) > MAX_NODE_ID or "{" in node_id or "}" in node_id or not node_id.isprintable():
        raise ValueError(f"node_id {node_id!r} must be printable, without braces, at most {MAX_NODE_ID} chars")
    return node_id


def check_node(node: NodeInfo) -> NodeInfo:
    if not isinstance(node, NodeInfo):
        raise ValueError(f"expected NodeInfo, got {type(node).__name__}")
    check_node_id(node.node_id)
    if not node.address:
        raise ValueError(f"node {node.node_id!r} has no address")
    if node.capacity_blocks < 0:
        raise ValueError(f"node {node.node_id!r} has negative capacity_blocks")
    if node.role not in ROLES:
        raise ValueError(f"node {node.node_id!r} has role {node.role!r}; choose one of {', '.join(ROLES)}")
    return node


def check_tier(tier: Tier | None, *, optional: bool) -> None:
    if tier is None and optional:
        return
    if tier not in (Tier.GPU, Tier.CPU, Tier.STORAGE) or isinstance(tier, bool):
        raise ValueError(f"tier must be a Tier, got {tier!r}")


def check_prefill(prefill_tokens: int) -> int:
    if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) or prefill_tokens < 0:
        raise ValueError(f"prefill_tokens must be a non-negative integer, got {prefill_tokens!r}")
    return prefill_tokens


MAX_RESERVED_REQUESTS = 1024
"""Most requests one reservation may count (a request generating n answers counts n; an engine
batches a few hundred sequences at most, so more would only freeze a node's load)."""


def check_requests(requests: int) -> int:
    if isinstance(requests, bool) or not isinstance(requests, int) or not 1 <= requests <= MAX_RESERVED_REQUESTS:
        raise ValueError(f"requests must be an integer in [1, {MAX_RESERVED_REQUESTS}], got {requests!r}")
    return requests


MAX_CONTEXT_TOKENS = 1 << 31  # a reservation's context: far above any answer batch's KV


def check_context_tokens(tokens: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be an integer in [0, {MAX_CONTEXT_TOKENS}], got {tokens!r}")
    return tokens


def reservation_times(first_token_s: float | None, hold_s: float | None, max_request_s: float) -> tuple[float, float]:
    """(seconds until the prefill stops counting, seconds until the reservation ends by itself).

    The hold is capped at ``max_request_s`` and the prefill at the hold; None means "as long as
    allowed". Negative or non-finite times are a caller's bug.
    """
    for name, value in (("first_token_s", first_token_s), ("hold_s", hold_s)):
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    hold = max_request_s if hold_s is None else min(hold_s, max_request_s)
    return (hold if first_token_s is None else min(first_token_s, hold)), hold


def check_reservation(reservation: Reservation) -> Reservation:
    if not isinstance(reservation, Reservation):
        raise ValueError(f"expected Reservation, got {type(reservation).__name__}")
    check_node_id(reservation.node_id)
    aid = reservation.arrival_id
    if aid and (not isinstance(aid, str) or len(aid) > MAX_ARRIVAL_ID or "|" in aid or not aid.isprintable()):
        raise ValueError(f"arrival_id must be 1-{MAX_ARRIVAL_ID} printable chars without '|', got {aid!r}")
    return reservation


def check_durations(heartbeat_ttl_s: float, op_timeout_s: float, max_request_s: float, retention_s: float) -> None:
    for name, value in (
        ("heartbeat_ttl_s", heartbeat_ttl_s),
        ("op_timeout_s", op_timeout_s),
        ("max_request_s", max_request_s),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if not retention_s >= 0:
        raise ValueError(f"dead_node_retention_s must be >= 0, got {retention_s!r}")


def check_arrival(arrival: SplitArrival, max_request_s: float) -> SplitArrival:
    """A split arrival as the directory stores it: its end capped at ``max_request_s`` (an entry
    never outlives the longest reservation), its landing within [0, end]. The id becomes part of
    a Redis member string: printable, no ``|``."""
    if not isinstance(arrival, SplitArrival):
        raise ValueError(f"expected SplitArrival, got {type(arrival).__name__}")
    aid = arrival.arrival_id
    if not isinstance(aid, str) or not aid or len(aid) > MAX_ARRIVAL_ID or "|" in aid or not aid.isprintable():
        raise ValueError(f"arrival_id must be 1-{MAX_ARRIVAL_ID} printable chars without '|', got {aid!r}")
    blocks = arrival.blocks
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        raise ValueError(f"arrival blocks must be a non-negative integer, got {blocks!r}")
    for name, value in (("arrives_s", arrival.arrives_s), ("until_s", arrival.until_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"arrival {name} must be a finite number, got {value!r}")
    until = min(max(float(arrival.until_s), 0.0), max_request_s)
    return SplitArrival(aid, min(max(float(arrival.arrives_s), 0.0), until), blocks, until)
