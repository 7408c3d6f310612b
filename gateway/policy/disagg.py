"""Disaggregated prefill/decode: whether to split a request over two nodes, and over which pair.

A fleet declares roles (``NodeInfo.role``): ``prefill`` nodes compute prompts and hand their KV
to a ``decode`` node, ``both`` nodes do either. The policy's aggregated decision (one node serves
the whole request) is priced against the cheapest (prefill, decode) pair on one scale, the time
the request costs from now until its last token plus the time its prefill stalls the decodes
already running where it is computed::

    aggregated(n)  = ttft(n) + decode(n) + stall(n, prefill on n)
    split(p, d)    = queue(p) + prefill(p) + transfer(prompt) + queue(d) + decode(d) + stall(p, prefill on p)

    decode(n)      = answer budget × decode_step_seconds(running(n) + 1, prompt)
    stall(n, s)    = running decodes on n × (s - prefill overhead - one decode step's base time)
                     (0 on a prefill-only node: nothing decodes there)

``ttft(n)`` is the policy's own estimate (queue + transfer + prefill of what n lacks); the prefill
on ``p`` counts ``p``'s own cache; the whole prompt's KV crosses the configured link. The stall
term is why splitting pays at all: a long prefill computed on a node that is decoding 60 answers
delays each of them by its length (the time-per-output-token spikes aggregated fleets show),
while on a prefill node it delays nobody. A short prefill rides in a decode step whose time is
spent reading the weights anyway (the step's base time): it stalls nobody, so a short prompt is
never split to spare the decodes. A prompt mostly cached on a decode node has little to
prefill there, so the transfer of the whole prompt is not worth it and the request stays whole.

The cost separates into a prefill part and a decode part, so the best pair is found in one pass
(the best two of each side, as a node cannot pair with itself). A split must beat the aggregated
decision by more than the tie tolerance. Splitting is considered only in a fleet that declared
roles (some node is not ``both``): an aggregated fleet is routed exactly as before.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from directory_client.types import DirectoryView, NodeView
from gateway.policy.cost_model import TtftEstimator
from gateway.profile import HardwareProfile
from gateway.types import Decision, PrefillPlan, RoutingRequest


def declares_roles(view: DirectoryView) -> bool:
    """True for a disaggregated fleet: some live node is not ``both``."""
    return any(nv.node.role != "both" for nv in view.nodes)


def aggregated_view(view: DirectoryView) -> DirectoryView:
    """The nodes that may serve a whole request: a prefill-only node never does."""
    kept = tuple(nv for nv in view.nodes if nv.node.role != "prefill")
    return view if len(kept) == len(view.nodes) else replace(view, nodes=kept)


def split_or_not(
    decision: Decision,
    request: RoutingRequest,
    view: DirectoryView,
    profile: HardwareProfile,
    *,
    answer_tokens: int,
    link: str,
    tie_tolerance_s: float = 0.001,
) -> Decision:
    """``decision`` as it is, or split over the cheapest (prefill, decode) pair of ``view``.

    The returned decision names the decode node as its destination and the prefill node in
    ``prefill``; its reason says which won and gives the runner-up's figures.
    """
    chosen = decision.node
    if chosen is None or not declares_roles(view):
        return decision
    est = TtftEstimator(profile, request, link=link)
    n = request.prompt_tokens
    step = profile.decode_step_seconds

    def decode_s(nv: NodeView) -> float:
        return answer_tokens * step(nv.load.inflight + 1, n)

    hidden_s = profile.prefill_overhead_s + profile.decode_step_base_s

    def stall_s(nv: NodeView, prefill: float) -> float:
        if nv.node.role == "prefill" or prefill <= hidden_s:
            return 0.0
        return nv.load.inflight * (prefill - hidden_s)

    by_id = {nv.node.node_id: nv for nv in view.nodes}
    agg_nv = by_id.get(chosen.node_id)
    own = next((c for c in decision.candidates if c.node_id == chosen.node_id), None)
    if agg_nv is None or own is None:
        return decision
    aggregated = own.total_s + decode_s(agg_nv) + stall_s(agg_nv, own.prefill_s)

    prefill_side: list[tuple[float, int, float, int]] = []  # (cost, index, time to handoff, tokens computed)
    decode_side: list[tuple[float, int, float]] = []  # (cost, index, queue)
    for i, nv in enumerate(view.nodes):
        role = nv.node.role
        if role != "decode":
            cached = est.cached_tokens(nv.cached_blocks)
            prefill = est.prefill_s(cached) + est.stage_s(cached, nv.tier)
            ready = est.queue_s(nv.load) + prefill
            prefill_side.append((ready + stall_s(nv, prefill), i, ready, max(n - cached, 1)))
        if role != "prefill":
            decode_side.append((est.queue_s(nv.load) + decode_s(nv), i, est.queue_s(nv.load)))
    best_p = heapq.nsmallest(2, prefill_side)
    best_d = heapq.nsmallest(2, decode_side)
    pairs = [(p, d) for p in best_p for d in best_d if p[1] != d[1]]
    if not pairs:
        return decision
    transfer = est.transfer_s(n)
    p, d = min(pairs, key=lambda pd: pd[0][0] + pd[1][0])
    split = p[0] + transfer + d[0]
    p_nv, d_nv = view.nodes[p[1]], view.nodes[d[1]]
    split_line = (
        f"split {p_nv.node.node_id}->{d_nv.node.node_id} {split * 1e3:.1f}ms"
        f" (prefill side {p[0] * 1e3:.1f}ms, transfer {transfer * 1e3:.1f}ms over {link}, decode side {d[0] * 1e3:.1f}ms)"
    )
    agg_line = f"aggregated {chosen.node_id} {aggregated * 1e3:.1f}ms"
    if split >= aggregated - tie_tolerance_s:
        return replace(decision, reason=f"{decision.reason}; not split: {agg_line} vs runner-up {split_line}")
    plan = PrefillPlan(p_nv.node.node_id, p_nv.node.address, p[3], p[2], p[2] + transfer + d[2])
    return replace(
        decision,
        node=d_nv.node,
        fallbacks=(),
        pull=None,
        prefill=plan,
        expected_cached_tokens=n,  # the decode node receives the whole prompt's KV
        reason=f"{split_line}; runner-up {agg_line}",
    )
