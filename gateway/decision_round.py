"""One decision round without the lookup: decide, estimate, and say what to reserve until when.

``RoutingCore`` (the request path) and the load-test simulator both call ``decide_round`` on the
view their directory lookup returned, so a simulated fleet is routed by exactly the rules a real
one is: the same request (prompt-hash affinity included), the same policy call, the same time
estimates, the same reservation (queued prefill released at the estimated first token). Pure: no
I/O, the time is passed in. In a fleet that declares roles, a prefill-only node is never the
policy's destination and a cost-model policy may split the request (``gateway.policy.disagg``).
A draining node (``gateway.drain``) is taken out of the view's candidates: it gets no new request,
but stays a pull source (``DirectoryView.pull_sources``) while it lives, so a conversation it holds
that the drain has not copied yet is pulled from it rather than recomputed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import xxhash

from directory_client.frozen import fast_frozen_init
from directory_client.types import DirectoryView, NodeLoad, SplitArrival
from gateway.policy.answering import Answer
from gateway.policy.arrivals import Arrival, PendingArrivals
from gateway.policy.disagg import aggregated_view, declares_roles, prefill_serves_whole, split_or_not
from gateway.policy.kvgate import KvgatePolicy
from gateway.policy.memory import MemoryPricing
from gateway.profile import HardwareProfile
from gateway.types import Decision, RoutingRequest

DEFAULT_ANSWER_TOKENS = 256  # answer length assumed when a request sets no max_tokens
MIN_HOLD_S = 0.005  # floor of every time estimate: a prefill never stops counting at once
MAX_ANSWER_TOKENS = 8192  # default ceiling of the answer budget a request's load is estimated with
MAX_HOLD_S = 300.0  # default cap of every estimate: a load held on an estimate ends by then at the latest
MAX_ANSWERS = 256  # answers one request counts as at most: a batch an engine runs at once (vLLM's max_num_seqs)


_INTEGER = re.compile(r"[+-]?[0-9]+")


class InvalidAnswerCount(ValueError):
    """The request's ``n`` is one the engine refuses (not an integer, below 1): the client gets
    the 400 the engine would answer, and no node is loaded with it."""


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class Round:
    """A decision and what its reservation on the chosen node must say."""

    decision: Decision
    seen_load: NodeLoad  # the chosen node's load as the view showed it (compare-and-reserve compares)
    prefill_tokens: int  # prompt tokens the chosen node computes: its queued prefill
    ttft_s: float  # from now until the estimated first token: the prefill stops counting then
    service_s: float  # from now until the estimated last token: the end, if it is never seen
    answers: int  # sequences it decodes side by side: what it counts in flight on the chosen node
    # a split: its KV's arrival on the decode node, recorded in the policy's ledger; the reservation
    # writes ``shared`` to the directory so that other replicas see it (``gateway.policy.arrivals``)
    arrival: Arrival | None = None
    shared: SplitArrival | None = None
    # served whole on a node of a disaggregated fleet: the answer in the policy's ledger; the
    # reservation counts its ``shared`` context for the other replicas (``gateway.policy.answering``)
    answer: Answer | None = None

    @property
    def context_tokens(self) -> int:
        """The context the reservation counts on the chosen node (0: none)."""
        return self.answer.shared if self.answer is not None else 0


def routing_request(
    model: str,
    token_ids: np.ndarray,
    keys: np.ndarray,
    *,
    block_size: int,
    seed: int,
    request_id: str = "",
    salted: bool = False,
    session: str = "",
    session_node: str = "",
    retention: str = "",
) -> RoutingRequest:
    """What the policy is asked about a tokenized prompt.

    Its affinity (the tie-breaker that spreads conversations and keeps one prompt on one node) is
    the last block key, or for a prompt shorter than a block a hash of its tokens in the namespace.
    """
    affinity = int(keys[-1]) if len(keys) else seed ^ xxhash.xxh3_64_intdigest(np.ascontiguousarray(token_ids).tobytes())
    return RoutingRequest(
        model=model, prompt_tokens=len(token_ids), total_blocks=len(keys), block_size=block_size,
        request_id=request_id, affinity=affinity, salted=salted, session=session, session_node=session_node,
        retention=retention,
    )


def answer_tokens(
    body: Any, prompt_tokens: int = 0, *, context_tokens: int | None = None, ceiling: int = MAX_ANSWER_TOKENS
) -> int:
    """The answer budget a request's load is estimated with: ``max_completion_tokens`` or
    ``max_tokens`` (else ``DEFAULT_ANSWER_TOKENS``), at most the context left after the prompt and
    at most ``ceiling``; at least 1.

    The budget is the client's to set, so it is never taken at face value: an engine stops at the
    context length, and the ceiling bounds it for everyone. Without the clamps twenty ext_authz
    requests asking for 10^12 tokens made a prefix owner look saturated for ten minutes.
    """
    budget = (body.get("max_completion_tokens") or body.get("max_tokens")) if isinstance(body, dict) else None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        budget = DEFAULT_ANSWER_TOKENS
    if context_tokens is not None:
        budget = min(budget, context_tokens - prompt_tokens)
    return max(1, min(budget, ceiling))


def _lax_int(value: Any) -> int | None:
    """``value`` as vLLM's request model reads an integer field (pydantic's lax mode, measured on
    vLLM 0.32: ``3``, ``"3"``, ``3.0`` and ``true`` are accepted, ``"x"`` and ``2.5`` refused)."""
    if isinstance(value, int):  # bool included: true is 1
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= 32 and _INTEGER.fullmatch(s := value.strip()):
        return int(s)
    return None


def answer_count(body: Any) -> int:
    """How many answers the engine generates for the request at once: ``n`` (OpenAI, vLLM,
    SGLang; 1 when unset or null). ``best_of`` is not counted: vLLM before V1 generated that many
    sequences, today's engines ignore the field (measured on vLLM 0.32: one choice, no extra work).
    Raises ``InvalidAnswerCount`` for an ``n`` the engine refuses with a 400 (not an integer,
    below 1); a large one is not refused here (the engine's ceiling is its own: 16384 in vLLM by
    default), its estimate is bounded by ``answer_budget``.
    """
    if not isinstance(body, dict):
        return 1
    raw = body.get("n")
    n = 1 if raw is None else _lax_int(raw)
    if n is None:
        raise InvalidAnswerCount(f"n must be an integer, got {type(raw).__name__} {str(raw)[:32]!r}")
    if n < 1:
        raise InvalidAnswerCount(f"n must be at least 1, got {n}.")
    return n


def answer_budget(
    body: Any, prompt_tokens: int = 0, *, context_tokens: int | None = None, ceiling: int = MAX_ANSWER_TOKENS
) -> tuple[int, int]:
    """(tokens per answer, answers) a request's load is estimated with: ``answer_tokens`` for each
    of its ``answer_count`` answers, which the engine decodes side by side.

    The ceiling bounds the whole budget, answers times tokens: the answers are counted first (a
    request asking for 100 answers occupies 100 places in the node's batch, at most
    ``MAX_ANSWERS``), and each is shortened to fit. Raises ``InvalidAnswerCount`` (a 400).
    """
    per_answer = answer_tokens(body, prompt_tokens, context_tokens=context_tokens, ceiling=ceiling)
    answers = min(answer_count(body), MAX_ANSWERS, ceiling)
    return max(1, min(per_answer, ceiling // answers)), answers


def blocked_s(arrivals: PendingArrivals | None, decision: Decision, view: DirectoryView, now: float, *, landed: bool = True) -> float:
    """How long the aggregated decision's prefill would delay splits arriving or answering on its node
    (``landed`` False: arriving only, whose first token it would delay)."""
    if not arrivals or decision.node is None:
        return 0.0
    i = next((i for i, nv in enumerate(view.nodes) if nv.node.node_id == decision.node.node_id), None)
    own = next((c for c in decision.candidates if c.node_id == decision.node.node_id), None)
    if i is None or own is None:
        return 0.0
    return arrivals.blocking_s((view.nodes[i],), (own,), now, landed=landed).get(0, 0.0)


def answering_tokens(policy: KvgatePolicy, view: DirectoryView, now: float, block_size: int) -> dict[str, int]:
    """Decode node id -> the KV the answers the replica knows run there read every step: the splits
    that landed there (``gateway.policy.arrivals``) and the answers it served whole there
    (``gateway.policy.answering``)."""
    policy.answering.expire(now)
    out: dict[str, int] = {}
    for nv in view.nodes:
        if nv.node.role != "prefill" and nv.load.inflight > 0:
            node_id = nv.node.node_id
            tokens = policy.pending_arrivals.landed_tokens(node_id, now, block_size) + policy.answering.context_tokens(node_id, now)
            if tokens:
                out[node_id] = tokens
    return out


def decide_round(
    policy: Any,  # gateway.policy.Policy
    request: RoutingRequest,
    view: DirectoryView,
    profile: HardwareProfile,
    *,
    now: float,
    answer_tokens: int,
    answers: int = 1,
    max_hold_s: float = MAX_HOLD_S,
    draining: frozenset[str] = frozenset(),
) -> Round:
    """The policy's decision on ``view`` and the reservation it implies.

    The time to first token is the policy's own estimate for the chosen node (queue + transfer +
    prefill); the service time adds the answer budget (``answer_tokens`` for each of ``answers``
    answers, ``answer_budget``) decoded at the node's batch size with this request's answers in
    it. With no node chosen every figure is zero. A split is recorded in the policy's ledger of KV
    arriving on decode nodes (``gateway.policy.arrivals``) until its estimated end; the other
    replicas' splits come in ``view`` (``NodeView.arrivals``) and join it first.
    Nodes in ``draining`` are not candidates unless no other node is live (a drain never turns
    traffic away); they stay pull sources for the policies that pull.
    """
    if draining and any(nv.node.node_id not in draining for nv in view.nodes):
        leaving = tuple(nv for nv in view.nodes if nv.node.node_id in draining)
        if leaving:
            kept = tuple(nv for nv in view.nodes if nv.node.node_id not in draining)
            view = replace(view, nodes=kept, pull_sources=leaving)
    if answers > 1:  # the extra answers' KV: memory the request adds on its node (RoutingRequest.answer_blocks)
        request = replace(request, answer_blocks=-(-(answers - 1) * answer_tokens // max(request.block_size, 1)))
    roles = declares_roles(view)
    arrivals = policy.pending_arrivals if roles and isinstance(policy, KvgatePolicy) else None
    if arrivals is not None:
        arrivals.expire(now)
        arrivals.share(view, now)  # the other replicas' splits, from the directory
        policy.answering.expire(now)
        policy.answering.share(view, now)  # ... and the contexts their answers read
        view = arrivals.with_pending_memory(view, now)  # KV about to land takes memory there already
    whole_on_decode = not isinstance(policy, KvgatePolicy) or policy.decode_serves_whole
    splits = roles and isinstance(policy, KvgatePolicy) and policy.disaggregate  # balancers never split
    # a short answer may be served whole on a prefill node, unless the engines serve only their role (SGLang)
    on_prefill = splits and whole_on_decode and prefill_serves_whole(answer_tokens, answers, policy.prefill_serves_whole_tokens)
    whole_view = aggregated_view(view, decode_serves_whole=whole_on_decode, prefill_serves_whole=on_prefill) if roles else view
    # the whole-request choice of a P/D fleet is its own (gateway.policy.whole); other policies know no such flag
    decision = policy.decide(request, whole_view, profile, now=now, **({"disaggregated": True} if splits else {}))
    if splits:
        tail = policy.first_token_tail
        aggregated_ttft = min((c.total_s for c in decision.candidates if decision.node and c.node_id == decision.node.node_id), default=None)
        decision = split_or_not(
            decision, request, view, profile,
            answer_tokens=answer_tokens, answers=answers, link=policy.link, tie_tolerance_s=policy.tie_tolerance_s,
            memory=MemoryPricing(profile, request.block_size, policy.memory_value) if policy.memory_value > 0 else None,
            ttft_slack=policy.split_ttft_slack, tail_s=tail.p99_s, blocked_s=blocked_s(arrivals, decision, view, now),
            delays_first_token=blocked_s(arrivals, decision, view, now, landed=False) > 0,
            decode_serves_whole=whole_on_decode, answering_tokens=answering_tokens(policy, view, now, request.block_size),
            answering=policy.answering, now=now,
        )  # fmt: skip
        if aggregated_ttft is not None:
            tail.observe(decision.prefill.first_token_s if decision.prefill else aggregated_ttft)
    node = decision.node
    if node is None:
        return Round(decision, NodeLoad(), 0, 0.0, 0.0, answers)
    load = next((nv.load for nv in view.nodes if nv.node.node_id == node.node_id), NodeLoad())
    own = [c.total_s for c in decision.candidates if c.node_id == node.node_id]
    if decision.prefill is not None:
        own = [decision.prefill.first_token_s]
    ttft_s = min(max(min(own, default=0.0), MIN_HOLD_S), max_hold_s)
    n = request.prompt_tokens
    decode_s = answer_tokens * profile.decode_step_seconds(load.inflight + answers, n)
    service_s = min(ttft_s + decode_s, max_hold_s)
    entry = answer = None
    if decision.prefill is not None and arrivals is not None:  # on its way: later decisions must not block it
        entry = arrivals.add(node.node_id, now + decision.prefill.kv_arrives_s, request.total_blocks, until=now + service_s)
    elif splits:  # served whole: its answer's KV is read by every step there (gateway.policy.answering)
        answer = policy.answering.add(
            node.node_id, now + ttft_s, now + service_s, n, answer_tokens, answers, keep=profile.max_num_seqs
        )
    shared = PendingArrivals.for_directory(entry, now) if entry is not None else None
    prefill = max(n - decision.expected_cached_tokens, 0)
    return Round(decision, load, prefill, ttft_s, service_s, answers, entry, shared, answer)


def end_round(policy: Any, rnd: Round) -> None:
    """The request of ``rnd`` is over (its response ended, or it is not made after all: explained
    only, or decided again): its split arrival and its answer leave the policy's ledgers, so no
    later decision prices them until their estimated end."""
    if rnd.arrival is not None:
        policy.pending_arrivals.discard(rnd.arrival)
    if rnd.answer is not None:
        policy.answering.discard(rnd.answer)
