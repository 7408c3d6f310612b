"""Disaggregated prefill/decode: whether to split a request over two nodes, and over which pair.

A fleet declares roles (``NodeInfo.role``): ``prefill`` nodes compute prompts and hand their KV
to a ``decode`` node, ``both`` nodes do either. The policy's aggregated decision (one node serves
the whole request) is priced against the cheapest (prefill, decode) pair on one scale, the time
the request costs from now until its last token, plus the time its prefill stalls the decodes
already running where it is computed, plus the KV memory it takes::

    aggregated(n)  = ttft(n) + memory(n) + decode(n) + stall(n, prefill on n)
    split(p, d)    = first_token(p, d) + decode(d) + memory(p) + memory(d) + stall(p, prefill on p)
    first_token    = max(queue(p) + prefill(p) + transfer(prompt), queued prefill on d)
                     + the step running on d + the prompt's last token, computed on d

(prefill(p) is at least one step's pass over the weights, ``weights_pass_s``; the steps on d
read the KV of the answers the replica knows to run there, ``answering_tokens``.)

    decode(n)      = answer budget × decode_step_seconds(running(n) + 1, prompt)
    stall(n, s)    = running decodes on n × (s - prefill overhead - one decode step's base time)
                     (0 on a prefill-only node: nothing decodes there)

``ttft(n)`` is the policy's own estimate (queue + transfer + prefill of what n lacks); the prefill
on ``p`` counts ``p``'s own cache; the whole prompt's KV crosses the configured link and lands in
``d``'s memory (``memory`` prices the blocks each node must evict, ``gateway.policy.memory``). The
stall term is why splitting pays at all: a long prefill computed on a node that is decoding 60
answers delays each of them by its length (the time-per-output-token spikes aggregated fleets
show), while on a prefill node it delays nobody.

The time to first token bounds which pairs may compete (measured: pricing the stall alone split
so eagerly that TTFT p99 doubled on two prefill nodes):

- a split sparing the decodes a stall may make the first token ``ttft_slack`` (10%) later than
  aggregated serving, enough for an RDMA transfer, never for a TCP one of a long prompt (its KV
  takes about as long to move as to compute);
- it may never put the first token beyond ``tail_s``, a lower bound of the recent p99 of first
  tokens (``FirstTokenTail``), unless aggregated serving is already beyond it, or delays a split
  still arriving there (a first token either way): a split costs at least its transfer, and the
  slowest first tokens are the p99;
- a prefill that stalls nobody (a short prompt rides in a decode step whose time is spent reading
  the weights anyway) is split only for an earlier first token.

Once split, the request is on its way to the decode node: the replica records it
(``gateway.policy.arrivals``) so that no later decision starts a long prefill there meanwhile without
paying for the wait it causes. An aggregated decision that would cause one pays it here too, and
then the tail guard does not hold a split back (serving whole already delays a first token). One
that only slows splits already answering there pays it as well, but the guard holds: their first
tokens are out, and a split of one of the longest prompts would join the slowest first tokens
(simulate, mixed, 4P+4D, RDMA, seeds 0–11: TTFT p99 against 8 aggregated nodes +9.9 → +7.1 ms on
average, time per token unchanged).

The node serving a request whole is chosen knowing the roles (``gateway.policy.whole``): it is
charged what the decodes running there add to each chunk of its prefill, and a request whose first
token is near the recent p99 goes where that first token comes soonest, never waiting for a node the
ranking prefers for others' sake (answering splits, memory). Before, the longest documents were
ranked onto decode nodes with a prefill queued, a split then looked sooner, and its transfer put it
among the slowest first tokens (simulate, mixed, RDMA, against 8 aggregated nodes, TTFT p99 / TPOT
p99, mean of seeds 0–11: 4P+4D +7.1 → +3.6 ms / −2.5 → −3.5 ms; seeds 12–23: +7.1 → +3.7 ms /
−3.4 → −3.7 ms; 2P+6D within the noise, +1.5 → +2.0 and +1.4 → +0.6 ms / −6.8 → −6.9 and −7.3 →
−7.9 ms). Pricing the stall itself in the whole-request choice (the node with fewer decodes, under
the split's first-token guard) did not help: +7.0 ms / −2.4 ms at 4P+4D.

The best pair is among the few soonest or cheapest of each side (a node cannot pair with itself),
so the search stays linear in the fleet. A split must beat the aggregated decision by more than
the tie tolerance. Splitting is considered only in a fleet that declared roles (some node is not
``both``): an aggregated fleet is routed exactly as before.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from directory_client.types import DirectoryView, NodeView
from gateway.policy.answering import AnsweringContexts
from gateway.policy.cost_model import TtftEstimator
from gateway.policy.memory import MemoryPricing
from gateway.profile import HardwareProfile
from gateway.types import Decision, PrefillPlan, RoutingRequest

DEFAULT_TTFT_SLACK = 0.1  # a split sparing running decodes a long prefill may delay the first token by 10%


class FirstTokenTail:
    """A bound on the 99th percentile of the first-token estimates of recent decisions (``window``
    of them), from below.

    A split delays a first token by the transfer at least; the fleet's TTFT p99 is made of its
    slowest first tokens (the longest prompts), so a split whose first token would land beyond the
    recent p99 is not made: the tail stays where aggregated serving puts it. Until ``warmup``
    estimates are seen the tail is unknown and taken as 0: no split may delay a first token then
    (measured: the first split documents of a run, before the guard knew the tail, were among
    the slowest first tokens).

    The p99 of a sample is uncertain: it is the 1%·n-th slowest of n, give or take
    sqrt(n·0.01·0.99) ranks. A split placed just under the sample's p99 lands above the true one
    about half the time, and the p99 only ever moves up when it does (the split is a first token
    in the slowest 1% that serving whole would not have put there). So the guard is the one-sided
    95% lower bound of the p99: the value ``z`` (1.645) standard errors further down the ranks.
    Measured (simulate, mixed, 2P+6D, RDMA, seeds 0–11): one or two split documents per
    run were among the ten slowest first tokens; with the bound, TTFT p99 against 8 aggregated
    nodes went from +8.7 ms to +2.3 ms on average (worst +26.1 to +12.8).
    """

    __slots__ = ("_ring", "_count", "_p99", "warmup", "every", "z")

    def __init__(self, window: int = 1024, *, warmup: int = 64, every: int = 32, z: float = 1.645) -> None:
        self._ring = np.zeros(window)
        self._count = 0
        self._p99 = 0.0  # no tail known yet: no split may delay a first token
        self.warmup = warmup
        self.every = every
        self.z = z  # standard errors below the sample's p99: 1.645 is a one-sided 95% bound

    def observe(self, first_token_s: float) -> None:
        self._ring[self._count % len(self._ring)] = first_token_s
        self._count += 1
        if self._count >= self.warmup and self._count % self.every == 0:
            seen = self._ring[: min(self._count, len(self._ring))]
            n = len(seen)
            from_top = 0.01 * n + self.z * (0.01 * 0.99 * n) ** 0.5  # ranks above the bound
            self._p99 = float(np.quantile(seen, max(0.0, 1.0 - from_top / n)))

    @property
    def p99_s(self) -> float:
        """The bound a split's first token must stay under (the class docstring)."""
        return self._p99


def chunk_overhead_s(profile: HardwareProfile, tokens: int) -> float:
    """The step overhead of a prefill's chunks after the first: an engine computes a long prompt
    in step budgets (``max_num_batched_tokens``) and pays each step's fixed cost. The cost model's
    prefill counts it once, which put split first tokens 8 ms (a 24k-token prompt, three chunks)
    later than estimated, right at the tail the guard keeps them under."""
    chunks = -(-max(tokens, 1) // profile.max_num_batched_tokens)
    return profile.prefill_overhead_s * (chunks - 1)


def weights_pass_s(profile: HardwareProfile, tokens: int) -> float:
    """What a prompt of ``tokens`` computed in one step adds to its prefill estimate: the step
    reads every weight whatever it computes (``decode_step_base_s``), and the cost model's linear
    term charges only the tokens' FLOPs. A 131-token split prompt was estimated done 3.7 ms before
    it was, so the ledger took its KV as landed while it was still on its way, and a document
    routed whole to the same decode node held its first token 774 ms (simulate, mixed, 4P+4D,
    RDMA, seed 1: the TTFT p99's request)."""
    if tokens >= profile.max_num_batched_tokens:
        return 0.0
    return max(profile.decode_step_base_s - max(tokens, 1) / profile.prefill_tokens_per_s, 0.0)


def prefill_serves_whole(answer_tokens: int, answers: int, limit: int) -> bool:
    """Whether a request whose answers are ``answers`` × ``answer_tokens`` tokens may be served
    whole on a prefill node: at most ``limit`` tokens in all (0: never).

    The slowest first tokens of a fleet with prefill/decode roles are its longest prompts, and
    those that ask a short answer (a summary, an extraction) cannot pay a split: 23k tokens of KV
    take 60 ms over RDMA. Served whole on a decode node, each of their prefill chunks carries every
    answer decoding there, and a decode node runs the answers of the whole fleet: at 4P+4D, the
    ten slowest documents of each run had 7.7 decodes in their chunks against 3.6 on 8 aggregated
    nodes, and their first tokens came 2.7 ms later (simulate, mixed, RDMA, seeds 0-11: TTFT p99
    +3.2 ms mean, worse on 10 of 12 seeds). A prefill node decodes nothing: the document's first
    token comes with its prefill, and its few answer tokens ride in the steps of the prompts the
    node computes next (one token each, a batch of one). A long answer would make the prefill node
    a decode node, its tokens paced by those prompts' chunks: hence the bound. An engine must be
    able to serve a request by itself for this (vLLM's NIXL prefill instances are; SGLang's
    prefill-mode servers are not: 0, and ``decode_serves_whole: false`` implies it)."""
    return limit > 0 and answer_tokens * answers <= limit


def declares_roles(view: DirectoryView) -> bool:
    """True for a disaggregated fleet: some live node is not ``both``."""
    return any(nv.node.role != "both" for nv in view.nodes)


def aggregated_view(
    view: DirectoryView, *, decode_serves_whole: bool = True, prefill_serves_whole: bool = False
) -> DirectoryView:
    """The nodes that may serve a whole request: a prefill node only when ``prefill_serves_whole``
    (a short answer, ``prefill_serves_whole``), a decode node unless its engine cannot compute a
    prompt by itself (``decode_serves_whole`` False: SGLang's decode mode)."""
    kept = tuple(
        nv for nv in view.nodes
        if nv.node.role == "both" or (nv.node.role == "decode" and decode_serves_whole)
        or (nv.node.role == "prefill" and prefill_serves_whole)
    )
    return view if len(kept) == len(view.nodes) else replace(view, nodes=kept)


def split_or_not(
    decision: Decision,
    request: RoutingRequest,
    view: DirectoryView,
    profile: HardwareProfile,
    *,
    answer_tokens: int,
    link: str,
    answers: int = 1,
    tie_tolerance_s: float = 0.001,
    memory: MemoryPricing | None = None,
    ttft_slack: float = DEFAULT_TTFT_SLACK,
    tail_s: float = float("inf"),
    blocked_s: float = 0.0,
    decode_serves_whole: bool = True,
    delays_first_token: bool | None = None,
    answering_tokens: Mapping[str, int] | None = None,
    answering: AnsweringContexts | None = None,
    now: float = 0.0,
) -> Decision:
    """``decision`` as it is, or split over the cheapest (prefill, decode) pair of ``view``.

    A pair qualifies only if its first token comes no later than ``(1 + ttft_slack)`` times the
    aggregated estimate (plus the tie tolerance), nor later than ``tail_s`` (the recent p99 of
    first tokens, ``FirstTokenTail``) unless aggregated serving is already beyond it, or delays
    a split arriving on its node (``delays_first_token``; by default whenever ``blocked_s`` > 0).
    Aggregated serving pays ``blocked_s``, the delay its prefill causes the splits arriving or
    answering on its node (``gateway.policy.arrivals``). With ``memory``, each side also pays for the
    blocks it adds: the prefill node keeps the prompt's KV, the decode node receives all of it.
    The returned decision names the decode node as its destination and the prefill node in
    ``prefill``; its reason says which won and gives the runner-up's figures. With
    ``decode_serves_whole`` False and no node chosen (no ``both`` node live), the request is split
    over the cheapest pair (``forced_split``). ``answering_tokens``: node id -> the KV the answers
    known to run there read every step (the replica's ledgers): the decode node's steps read it
    while the split waits for one and computes its last token in the next. ``answering``: the
    answers served whole (the replica's ledger, read at ``now``): a prefill node's short ones are
    stalled by a split's prefill computed there.
    """
    chosen = decision.node
    if not declares_roles(view) or (chosen is None and decode_serves_whole):
        return decision
    pairs = _Pairs(request, view, profile, answer_tokens=answer_tokens, answers=answers, link=link, memory=memory,
                   answering_tokens=answering_tokens, answering=answering, now=now)
    if chosen is None:
        return forced_split(decision, pairs, view, link)
    agg_nv = next((nv for nv in view.nodes if nv.node.node_id == chosen.node_id), None)
    own = next((c for c in decision.candidates if c.node_id == chosen.node_id), None)
    if agg_nv is None or own is None:
        return decision
    transfer = pairs.transfer
    stall = pairs.stall_s(agg_nv, own.prefill_s)
    if agg_nv.node.role == "prefill" and answering:  # a short answer served whole there: others answering wait
        stall += answering.stalled_s(chosen.node_id, now + own.total_s - own.prefill_s, now + own.total_s)
    aggregated = own.score + pairs.decode_s(agg_nv) + stall + blocked_s
    # Splitting spares the decodes only a prefill that would stall them; any other split must
    # give a sooner first token (else it only moves the answer to a less busy decode node).
    stalls = stall > 0
    latest_first_token = own.total_s * (1.0 + ttft_slack) + tie_tolerance_s if stalls else own.total_s
    if delays_first_token is None:
        delays_first_token = blocked_s > 0
    if not delays_first_token:  # a split never lengthens the tail (unless serving whole delays an arrival)
        latest_first_token = min(latest_first_token, max(tail_s, own.total_s))
    best = _best_pair(pairs.prefill_side, pairs.decode_side, transfer, pairs.last_token, latest_first_token)
    if best is None:
        return replace(decision, reason=f"{decision.reason}; not split: no pair gives a first token within"
                                        f" {latest_first_token * 1e3:.1f}ms")
    p, d, first_token = best
    split = first_token + p.extra + d.extra
    p_nv, d_nv = view.nodes[p.index], view.nodes[d.index]
    split_line = (
        f"split {p_nv.node.node_id}->{d_nv.node.node_id} {split * 1e3:.1f}ms, first token {first_token * 1e3:.1f}ms"
        f" (prefill done {p.wait * 1e3:.1f}ms, transfer {transfer * 1e3:.1f}ms over {link}, decode node free"
        f" {d.wait * 1e3:.1f}ms; then {d.extra * 1e3:.1f}ms decoding)"
    )
    agg_line = f"aggregated {chosen.node_id} {aggregated * 1e3:.1f}ms, first token {own.total_s * 1e3:.1f}ms" + (
        f", delays arriving splits {blocked_s * 1e3:.1f}ms" if blocked_s > 0 else "")
    if split >= aggregated - tie_tolerance_s:
        return replace(decision, reason=f"{decision.reason}; not split: {agg_line} vs runner-up {split_line}")
    return _split(decision, pairs, view, p, d, first_token, f"{split_line}; runner-up {agg_line}")


def forced_split(decision: Decision, pairs: _Pairs, view: DirectoryView, link: str) -> Decision:
    """No node may serve the request whole (decode nodes that cannot compute a prompt, and no
    ``both`` node live): the cheapest pair, whatever its first token; ``decision`` as it is when
    no pair is live (the caller fails open)."""
    best = _best_pair(pairs.prefill_side, pairs.decode_side, pairs.transfer, pairs.last_token, float("inf"))
    if best is None:
        return replace(decision, reason=f"{decision.reason}; no (prefill, decode) pair is live")
    p, d, first_token = best
    p_id, d_id = view.nodes[p.index].node.node_id, view.nodes[d.index].node.node_id
    reason = (
        f"split {p_id}->{d_id} (decode nodes serve only split requests): first token {first_token * 1e3:.1f}ms"
        f" (prefill done {p.wait * 1e3:.1f}ms, transfer {pairs.transfer * 1e3:.1f}ms over {link})"
    )
    return _split(replace(decision, outcome="recompute"), pairs, view, p, d, first_token, reason)


def _split(decision: Decision, pairs: _Pairs, view: DirectoryView, p: _Side, d: _Side, first_token: float, reason: str) -> Decision:
    p_nv, d_nv = view.nodes[p.index], view.nodes[d.index]
    plan = PrefillPlan(p_nv.node.node_id, p_nv.node.address, p.tokens, p.wait, first_token, p.wait + pairs.transfer)
    return replace(
        decision,
        node=d_nv.node,
        fallbacks=(),
        pull=None,
        prefill=plan,
        expected_cached_tokens=pairs.prompt_tokens,  # the decode node receives the whole prompt's KV
        reason=reason,
    )


class _Pairs:
    """Both sides of every (prefill, decode) pair of a view, priced for one request: the prefill
    side's readiness and extra costs (stall, memory), the decode side's wait and decoding."""

    def __init__(
        self, request: RoutingRequest, view: DirectoryView, profile: HardwareProfile, *,
        answer_tokens: int, link: str, memory: MemoryPricing | None, answers: int = 1,
        answering_tokens: Mapping[str, int] | None = None, answering: AnsweringContexts | None = None, now: float = 0.0,
    ) -> None:
        est = TtftEstimator(profile, request, link=link)
        n = self.prompt_tokens = request.prompt_tokens
        self._answer_tokens, self._answers, self._step = answer_tokens, answers, profile.decode_step_seconds
        self._hidden_s = profile.prefill_overhead_s + profile.decode_step_base_s

        def memory_s(nv: NodeView) -> float:
            return memory.price(nv, request.total_blocks + request.answer_blocks)[1] if memory is not None else 0.0

        self.prefill_side: list[_Side] = []
        self.decode_side: list[_Side] = []
        for i, nv in enumerate(view.nodes):
            role = nv.node.role
            if role != "decode":
                cached = est.cached_tokens(nv.cached_blocks)
                new = max(n - cached, 1)
                prefill = est.prefill_s(cached) + est.stage_s(cached, nv.tier) + chunk_overhead_s(profile, new)
                prefill += weights_pass_s(profile, new)
                ready = est.queue_s(nv.load) + prefill
                stall = self.stall_s(nv, prefill)
                if role == "prefill" and answering:  # the short answers served whole there wait for it
                    stall += answering.stalled_s(nv.node.node_id, now + ready - prefill, now + ready)
                self.prefill_side.append(_Side(ready, stall + memory_s(nv), i, max(n - cached, 1)))
            if role != "prefill":
                busy = est.queue_s(replace(nv.load, prefill_tokens=0))  # the batch's own step: waited on arrival
                drain = est.queue_s(nv.load) - busy  # the prefill queued there: it runs while ours is computed
                if answering_tokens and nv.load.inflight > 0:  # half the step in progress and ours read the answers' KV
                    busy += 1.5 * profile.decode_step_per_context_token_s * answering_tokens.get(nv.node.node_id, 0)
                self.decode_side.append(_Side(drain, self.decode_s(nv) + memory_s(nv), i, busy=busy))
        self.transfer = est.transfer_s(n)
        self.last_token = est.prefill_s(n)  # the decode node computes the prompt's last token itself

    def decode_s(self, nv: NodeView) -> float:
        return self._answer_tokens * self._step(nv.load.inflight + self._answers, self.prompt_tokens)  # its answers side by side

    def stall_s(self, nv: NodeView, prefill: float) -> float:
        if nv.node.role == "prefill" or prefill <= self._hidden_s:
            return 0.0
        return nv.load.inflight * (prefill - self._hidden_s)


class _Side(NamedTuple):
    """One node's half of a pair: when it is ready (prefill side: its prefill done; decode side:
    the prefill queued there has run), what else it costs (stall, memory, decoding), its index in
    the view, and the tokens it computes (prefill side)."""

    wait: float
    extra: float
    index: int
    tokens: int = 0
    busy: float = 0.0  # decode side: the wait for the step running when the KV arrives


_SHORTLIST = 3


def _best_pair(
    prefill: list[_Side], decode: list[_Side], transfer: float, last_token: float, latest: float
) -> tuple[_Side, _Side, float] | None:
    """The cheapest (prefill, decode) pair of distinct nodes whose first token comes by ``latest``,
    with that first token's time.

    The request joins the decode node's batch when both its KV has arrived (prefill done +
    ``transfer``) and the prefill queued there has run, the later of the two; its first token
    comes after the step running then and ``last_token`` (the one prompt token the decode node
    computes). The cheapest pair is
    among the few soonest or cheapest of each side, so a shortlist of both keeps this O(n).
    """
    def shortlist(side: list[_Side]) -> list[_Side]:
        soonest = heapq.nsmallest(_SHORTLIST, side, key=lambda s: s.wait + s.busy)
        cheapest = heapq.nsmallest(_SHORTLIST, side, key=lambda s: s.wait + s.busy + s.extra)
        return list({s.index: s for s in soonest + cheapest}.values())

    best: tuple[float, _Side, _Side, float] | None = None
    for p in shortlist(prefill):
        for d in shortlist(decode):
            if p.index == d.index:
                continue
            first_token = max(p.wait + transfer, d.wait) + d.busy + last_token
            cost = first_token + p.extra + d.extra
            if first_token <= latest and (best is None or cost < best[0]):
                best = (cost, p, d, first_token)
    return None if best is None else (best[1], best[2], best[3])
