"""The default policy: send each request where its estimated time to first token is lowest.

For every live node the estimate is ``queue + prefill of what that node lacks``, and, when
another node holds a longer prefix and can serve transfers, also ``queue + transfer of the
missing blocks + prefill of the rest`` (``cost_model``). The smallest wins. Pulling is how a hot
prefix spreads: once its owner is saturated, a copy to an idle node is cheaper than the owner's
queue, and the next request finds two owners.

Memory is a cost too (``memory_value`` > 0, the default; ``gateway.policy.memory``): a node is
ranked by its estimated TTFT plus the future prefill of the blocks it would evict, with its own
hit discounted by the chance it survives the queue ahead. On a full fleet that keeps a prefix on
its owner unless the owner's queue costs more than a second copy takes from everyone else; with
memory to spare it changes nothing. An eviction costs more on a node whose memory turns over
faster than the fleet's (``gateway.policy.churn``, over ``churn_window_s``): new prefixes go where
the blocks waiting to be evicted are oldest. ``kvgate_nopull`` prices no memory (a baseline, as it was).

Decisions that differ by less than ``tie_tolerance_s`` (1 ms) are ties, broken towards the less
loaded node, then by a hash of (node, prompt) (``base.spread``): the model is not accurate to a millisecond, and spreading near-equal
work is what keeps queues short. For the same reason a node only pulls when the pull beats its
own recompute by more than the tolerance.

A request naming its conversation (``RoutingRequest.session_node``, see ``gateway.sessions``)
stays on the node that served the conversation last while that node's estimate is within
``session_slack`` (25%) of the cheapest: a rewritten history keeps its node, but a node that is
much cheaper (it holds the new prompt, or the session's node is queued) still wins.

A node that joined the fleet less than ``warmup_s`` ago gets a credit on its pull option while it
carries less than its share (``gateway.policy.warmup``): scale-out takes conversations to the new
node with their prefixes, bounded by a share of its link.

In a disaggregated fleet, a node where a split request's KV is about to land
(``gateway.policy.arrivals``) is charged the delay this request's prefill would cause it: the
engine's chunked prefill gives step budgets to running prompts first, so the split would wait for
a long prompt's last chunk.

A session that asked for long retention (``RoutingRequest.retention``) weighs more:
``session_slack_long`` (100%: up to twice the cheapest).
"""

from __future__ import annotations

import heapq

from directory_client.types import DirectoryView, NodeView
from gateway.policy.base import (
    DEFAULT_FALLBACKS,
    check_fallbacks,
    describe,
    distinct_addresses,
    load_rank,
    no_nodes,
)
from gateway.policy.answering import AnsweringContexts
from gateway.policy.arrivals import PendingArrivals
from gateway.policy.churn import DEFAULT_CHURN_WINDOW_S, Churn
from gateway.policy.cost_model import DEFAULT_SATURATION_PENALTY_S, TtftEstimator
from gateway.policy.disagg import DEFAULT_TTFT_SLACK, FirstTokenTail
from gateway.policy.memory import DEFAULT_MEMORY_VALUE, MemoryPricing
from gateway.policy.warmup import DEFAULT_WARMUP_CREDIT, DEFAULT_WARMUP_LINK_SHARE, DEFAULT_WARMUP_S, WarmUp
from gateway.policy.whole import interference_s, tail_first
from gateway.profile import HardwareProfile
from gateway.types import CandidateCost, Decision, Outcome, PullPlan, RoutingRequest

LINKS = ("rdma", "tcp")
DEFAULT_MIN_PULL_BLOCKS = 8  # 128 tokens at block size 16: a few ms of prefill, not worth a transfer
DEFAULT_TIE_TOLERANCE_S = 0.001
DEFAULT_SESSION_SLACK = 0.25
DEFAULT_SESSION_SLACK_LONG = 1.0
DEFAULT_WORK_VALUE = 1.0
DEFAULT_PREFILL_SERVES_WHOLE_TOKENS = 64  # answers this short may be served whole on a prefill node (gateway.policy.disagg)


class KvgatePolicy:
    """The cost model (``gateway/policy/README.md``); ``allow_pull=False`` gives ``kvgate_nopull``."""

    def __init__(
        self,
        *,
        name: str = "kvgate",
        link: str = "tcp",
        allow_pull: bool = True,
        min_pull_blocks: int = DEFAULT_MIN_PULL_BLOCKS,
        fallbacks: int = DEFAULT_FALLBACKS,
        saturation_penalty_s: float = DEFAULT_SATURATION_PENALTY_S,
        tie_tolerance_s: float = DEFAULT_TIE_TOLERANCE_S,
        memory_value: float = DEFAULT_MEMORY_VALUE,
        session_slack: float = DEFAULT_SESSION_SLACK,
        warmup_s: float = DEFAULT_WARMUP_S,
        warmup_credit: float = DEFAULT_WARMUP_CREDIT,
        warmup_link_share: float = DEFAULT_WARMUP_LINK_SHARE,
        disaggregate: bool = True,
        decode_serves_whole: bool = True,
        split_ttft_slack: float = DEFAULT_TTFT_SLACK,
        session_slack_long: float = DEFAULT_SESSION_SLACK_LONG,
        churn_window_s: float = DEFAULT_CHURN_WINDOW_S,
        work_value: float = DEFAULT_WORK_VALUE,
        prefill_serves_whole_tokens: int = DEFAULT_PREFILL_SERVES_WHOLE_TOKENS,
    ) -> None:
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        if isinstance(min_pull_blocks, bool) or not isinstance(min_pull_blocks, int) or min_pull_blocks < 1:
            raise ValueError(f"min_pull_blocks must be an integer >= 1, got {min_pull_blocks!r}")
        if not saturation_penalty_s >= 0:
            raise ValueError(f"saturation_penalty_s must be >= 0, got {saturation_penalty_s!r}")
        if not tie_tolerance_s >= 0:
            raise ValueError(f"tie_tolerance_s must be >= 0, got {tie_tolerance_s!r}")
        if isinstance(memory_value, bool) or not isinstance(memory_value, int | float) or not memory_value >= 0:
            raise ValueError(f"memory_value must be a number >= 0 (0: memory is free), got {memory_value!r}")
        if isinstance(work_value, bool) or not isinstance(work_value, int | float) or not work_value >= 0:
            raise ValueError(f"work_value must be a number >= 0 (0: the fleet's work is free), got {work_value!r}")
        if isinstance(prefill_serves_whole_tokens, bool) or not isinstance(prefill_serves_whole_tokens, int) or prefill_serves_whole_tokens < 0:
            raise ValueError(f"prefill_serves_whole_tokens must be an integer >= 0 (0: never), got {prefill_serves_whole_tokens!r}")
        if not session_slack >= 0:
            raise ValueError(f"session_slack must be >= 0, got {session_slack!r}")
        if not split_ttft_slack >= 0:
            raise ValueError(f"split_ttft_slack must be >= 0, got {split_ttft_slack!r}")
        if not decode_serves_whole and not disaggregate:
            raise ValueError("decode_serves_whole: false needs disaggregate: true (decode nodes then serve only split requests)")
        if not session_slack_long >= session_slack:
            raise ValueError(f"session_slack_long must be >= session_slack ({session_slack}), got {session_slack_long!r}")
        self.name = name
        self.link = link
        self.allow_pull = bool(allow_pull)
        self.min_pull_blocks = min_pull_blocks
        self.fallbacks = check_fallbacks(fallbacks)
        self.saturation_penalty_s = float(saturation_penalty_s)
        self.tie_tolerance_s = float(tie_tolerance_s)
        self.memory_value = float(memory_value)
        self.session_slack = float(session_slack)
        self.warmup = WarmUp(warmup_s, warmup_credit, warmup_link_share)  # scale-out: new nodes are warmed
        self.disaggregate = bool(disaggregate)  # may split a request over a (prefill, decode) pair (gateway.policy.disagg)
        self.decode_serves_whole = bool(decode_serves_whole)  # False: SGLang's decode mode, every request there is split
        self.split_ttft_slack = float(split_ttft_slack)
        self.session_slack_long = float(session_slack_long)
        self.churn = Churn(churn_window_s)  # memory turnover per node: an eviction on a busy node costs more
        self.first_token_tail = FirstTokenTail()  # a lower bound of the recent p99 of first tokens: a split stays under it
        self.pending_arrivals = PendingArrivals()  # split KV on its way to decode nodes: not to be blocked
        self.answering = AnsweringContexts()  # what answers served whole read per step (disaggregated fleets)
        self.work_value = float(work_value)  # prefill spent beyond the least, priced by how busy the fleet is
        self.prefill_serves_whole_tokens = prefill_serves_whole_tokens  # a short answer may be served whole on a prefill node

    def decide(
        self, request: RoutingRequest, view: DirectoryView, profile: HardwareProfile, *, now: float,
        disaggregated: bool = False,
    ) -> Decision:
        """The cheapest node (module docstring). ``disaggregated``: ``view`` holds the nodes of a fleet
        with prefill/decode roles that may serve the request whole (``gateway.policy.whole``)."""
        nodes = view.nodes
        if not nodes:
            return no_nodes(self.name)
        memory = MemoryPricing(profile, request.block_size, self.memory_value) if self.memory_value > 0 else None
        est = TtftEstimator(
            profile, request, link=self.link, saturation_penalty_s=self.saturation_penalty_s, memory=memory
        )
        source = pull_source(nodes + view.pull_sources if view.pull_sources else nodes) if self.allow_pull else None
        tol = self.tie_tolerance_s

        turnover = self.churn.factors(nodes, now) if memory is not None else None
        costs = est.node_costs(
            nodes, source=source, min_pull_blocks=self.min_pull_blocks, pull_margin_s=tol, turnover=turnover
        )
        credits = self.warmup.credits(nodes, costs, est.prefill_s(0), now=now)
        # a long prefill where a split's KV is about to land makes that split wait (gateway.policy.arrivals)
        blocking = self.pending_arrivals.blocking_s(nodes, costs, now)
        ranked = credits
        if blocking:
            ranked = dict(credits)
            for i, delay in blocking.items():
                ranked[i] = ranked.get(i, 0.0) - delay
        work = added_work(nodes, costs, self.work_value) if self.work_value > 0 else {}
        if work:
            ranked = dict(ranked)
            for i, seconds in work.items():
                ranked[i] = ranked.get(i, 0.0) - seconds

        delays: dict[int, float] = {}  # disaggregated: first-token delays the ranking does not see
        if disaggregated:
            ranked, delays = self._decode_interference(request, nodes, costs, est, profile, ranked, now)
            if blocking:
                for i, delay in self.pending_arrivals.blocking_s(nodes, costs, now, landed=False).items():
                    delays[i] = delays.get(i, 0.0) + delay

        # A partial ranking keeps this O(n); at least two, so the reason can name the runner-up.
        top = rank_candidates(costs, nodes, tol, max(self.fallbacks, 1) + 1, request.affinity, ranked)
        soonest, passed = None, top[0]
        if disaggregated:  # a first token near the recent p99 comes where it comes soonest (gateway.policy.whole)
            soonest = tail_first(passed, costs, delays, tail_s=self.first_token_tail.p99_s,
                                 ttft_slack=self.split_ttft_slack, tie_tolerance_s=tol)
            if soonest is not None:
                top = [soonest, *(i for i in top if i != soonest)][: len(top)]
        slack = self.session_slack_long if request.retention == "long" else self.session_slack
        kept = keep_session(top, costs, nodes, request.session_node, slack, tol)
        if kept is not None:
            top = [kept] + [i for i in top if i != kept]
        chosen_i = top[0]
        fallbacks = distinct_addresses((nodes[i] for i in top), nodes[chosen_i], self.fallbacks)
        if len(fallbacks) < self.fallbacks and len(top) < len(nodes):  # repeated addresses: rank all
            everyone = rank_candidates(costs, nodes, tol, len(nodes), request.affinity, ranked)
            fallbacks = distinct_addresses((nodes[i] for i in everyone), nodes[chosen_i], self.fallbacks)

        chosen, chosen_view = costs[chosen_i], nodes[chosen_i]
        max_cached = max(nv.cached_blocks for nv in nodes)
        outcome = outcome_of(chosen, max_cached)
        plan = None
        cached_tokens = est.cached_tokens(chosen.cached_blocks)
        if chosen.via_pull:
            assert source is not None  # a pull candidate exists only with a source
            plan = PullPlan(
                source_node_id=source.node.node_id,
                source_endpoint=source.node.transfer_endpoint,
                blocks=source.cached_blocks,
            )
            cached_tokens = est.cached_tokens(source.cached_blocks)
        alt = costs[top[1]] if len(top) > 1 else None
        self.warmup.routed(chosen_view.node.node_id, now)
        if memory is not None:
            self.churn.wrote(
                chosen_view.node.node_id, request.total_blocks - chosen.cached_blocks, now
            )
            self.churn.forget(nodes)
        warmed = chosen_i in credits
        if warmed:
            self.warmup.spend(chosen_view.node.node_id, chosen.transfer_s, now)
        return Decision(
            policy=self.name,
            outcome=outcome,
            node=chosen_view.node,
            fallbacks=fallbacks,
            pull=plan,
            expected_cached_tokens=cached_tokens,
            candidates=tuple(costs),
            reason=("keeps its session's node; " if kept is not None else "")
            + (f"warms new node {chosen.node_id} (credit {credits[chosen_i]:.3f} s); " if warmed else "")
            + (f"first token near the recent p99: served where it comes soonest, not {costs[passed].node_id}; "
               if soonest is not None and chosen_i == soonest else "")
            + (f"delays splits arriving or answering here by {blocking[chosen_i] * 1e3:.1f}ms; " if chosen_i in blocking else "")
            + spent(work, costs, ranked, chosen_i)
            + spared(blocking, costs, credits, chosen_i)
            + explain(outcome, chosen, alt, plan, request, max_cached, self.link),
        )

    def _decode_interference(
        self, request: RoutingRequest, nodes: tuple[NodeView, ...], costs: list[CandidateCost], est: TtftEstimator,
        profile: HardwareProfile, ranked: dict[int, float], now: float,
    ) -> tuple[dict[int, float], dict[int, float]]:
        """(``ranked`` charged, index -> seconds) the decodes running on each candidate add to its
        prefill (``gateway.policy.whole.interference_s``; the KV they read: the splits answering there
        and the answers served whole there, this replica's and, through the directory, the others',
        ``gateway.policy.answering``)."""
        added: dict[int, float] = {}
        self.answering.expire(now)
        for i, (nv, c) in enumerate(zip(nodes, costs, strict=True)):
            node_id = nv.node.node_id
            if nv.node.role == "prefill":  # its answers are short ones served whole: a prefill there stalls them
                stalled = self.answering.stalled_s(node_id, now + c.total_s - c.prefill_s, now + c.total_s)
                if stalled > 0:
                    added[i] = stalled
                continue
            if nv.load.inflight <= 0:
                continue
            context = self.pending_arrivals.landed_tokens(node_id, now, request.block_size)
            context += self.answering.context_tokens(node_id, now)
            new_tokens = max(request.prompt_tokens - est.cached_tokens(c.cached_blocks), 1)  # at least one, always
            seconds = interference_s(profile, nv.load.inflight, context, new_tokens)
            if seconds > 0:
                added[i] = seconds
        if not added:
            return ranked, added
        charged = dict(ranked)
        for i, seconds in added.items():
            charged[i] = charged.get(i, 0.0) - seconds
        return charged, added


def added_work(nodes: tuple[NodeView, ...], costs: list[CandidateCost], value: float) -> dict[int, float]:
    """Index -> the prefill a candidate computes beyond the least any candidate would, times the
    share of live nodes busy (in flight > 0) and ``value``: the wait it puts on requests behind it.

    The estimate prices this request's first token only. A follow-up turn whose owner took a fresh
    prompt a moment ago gets its first token sooner by recomputing its whole conversation on an
    idle node, and the fleet pays a full prefill for it: on an idle fleet nobody waits for that,
    on a busy one the next arrivals do (replay, chat at 70% busy: 1-1.5% of prompt tokens
    recomputed so, hit rate a point below prefix affinity's). A pull moves KV instead of
    computing it, so its transfer is not counted.
    """
    busy = 0
    for nv in nodes:
        if nv.load.inflight > 0:
            busy += 1
    if not busy:
        return {}
    share = value * busy / len(nodes)
    least = min(c.prefill_s for c in costs)
    return {i: share * (c.prefill_s - least) for i, c in enumerate(costs) if c.prefill_s > least}


def spent(work: dict[int, float], costs: list[CandidateCost], ranked: dict[int, float], chosen_i: int) -> str:
    """The reason's note when a sooner first token lost to the prefill it would have cost the fleet."""
    mine = costs[chosen_i].score - ranked.get(chosen_i, 0.0)
    lost = [i for i in work if i != chosen_i and costs[i].score < costs[chosen_i].score and costs[i].score - ranked.get(i, 0.0) >= mine]
    if not lost:
        return ""
    i = min(lost, key=lambda j: costs[j].score)
    return f"not {costs[i].node_id}: {work[i] * 1e3:.0f}ms of the fleet's work for {(costs[chosen_i].score - costs[i].score) * 1e3:.0f}ms sooner; "


def spared(blocking: dict[int, float], costs: list[CandidateCost], credits: dict[int, float], chosen_i: int) -> str:
    """The reason's note when a cheaper node lost because its prefill would delay splits arriving or answering there."""
    mine = costs[chosen_i].score - credits.get(chosen_i, 0.0)
    lost = [(i, d) for i, d in blocking.items() if i != chosen_i and costs[i].score - credits.get(i, 0.0) < mine]
    if not lost:
        return ""
    i, delay = min(lost, key=lambda x: costs[x[0]].score)
    return f"not {costs[i].node_id}: its prefill would delay splits arriving or answering there by {delay * 1e3:.1f}ms; "


def keep_session(
    top: list[int], costs: list[CandidateCost], nodes: tuple[NodeView, ...], session_node: str, slack: float, tol: float
) -> int | None:
    """Index of the session's node when it should win over ``top[0]``: it is live, not already
    first, and its estimate is within ``slack`` (a fraction) of the best one."""
    if not session_node:
        return None
    i = next((j for j, nv in enumerate(nodes) if nv.node.node_id == session_node), None)
    if i is None or i == top[0] or costs[i].total_s > costs[top[0]].total_s * (1 + slack) + tol:
        return None
    return i


def rank_candidates(
    costs: list[CandidateCost],
    nodes: tuple[NodeView, ...],
    tol: float,
    count: int,
    affinity: int = 0,
    credits: dict[int, float] | None = None,
) -> list[int]:
    """Indices of the best ``count`` candidates, best first.

    Ranked by ``score`` (TTFT plus memory, which is 0 when memory is not priced) less any warm-up
    credit (``gateway.policy.warmup``: index → seconds). Costs within
    ``tol`` of the cheapest are tied and ordered least loaded first (then by the
    spread hash); the others follow by cost (then node_id, the view's order).
    """
    totals = [c.score for c in costs]
    for i, credit in (credits or {}).items():
        totals[i] -= credit
    floor = min(totals) + tol
    tied = [i for i, t in enumerate(totals) if t <= floor]
    if len(tied) > count:  # the same as sorting them all and keeping the first ``count``
        return heapq.nsmallest(count, tied, key=lambda i: load_rank(nodes[i], affinity))
    if len(tied) > 1:
        tied.sort(key=lambda i: load_rank(nodes[i], affinity))
    if len(tied) >= count or len(tied) == len(totals):
        return tied[:count]
    others = [i for i, t in enumerate(totals) if t > floor]
    need = count - len(tied)
    if len(others) <= need:  # a small fleet: what nsmallest returns, without its heap (~3 µs a decision)
        return tied + sorted(others, key=totals.__getitem__)
    return tied + heapq.nsmallest(need, others, key=totals.__getitem__)


def pull_source(nodes: tuple[NodeView, ...]) -> NodeView | None:
    """The owner with the longest prefix among nodes that can serve transfers.

    Ties prefer a faster tier, then the less loaded owner (its transfer agent competes with its
    own serving), then node_id.
    """
    best: NodeView | None = None
    best_key: tuple[int, int, int, int, str] | None = None
    for nv in nodes:
        if nv.cached_blocks <= 0 or not nv.node.transfer_endpoint:
            continue
        key = (-nv.cached_blocks, int(nv.tier), nv.load.inflight, nv.load.prefill_tokens, nv.node.node_id)
        if best_key is None or key < best_key:
            best, best_key = nv, key
    return best


def outcome_of(chosen: CandidateCost, max_cached: int) -> Outcome:
    """owner: served where the longest prefix lives; pull: fetched first; recompute: otherwise."""
    if chosen.via_pull:
        return "pull"
    if max_cached > 0 and chosen.cached_blocks == max_cached:
        return "owner"
    return "recompute"


def explain(
    outcome: Outcome,
    chosen: CandidateCost,
    alt: CandidateCost | None,
    plan: PullPlan | None,
    request: RoutingRequest,
    max_cached: int,
    link: str,
) -> str:
    """One line a human can check against the candidate table."""
    total = request.total_blocks
    if outcome == "owner":
        head = f"owner {chosen.node_id} holds {chosen.cached_blocks}/{total} blocks"
    elif outcome == "pull" and plan is not None:
        moved = plan.blocks - chosen.cached_blocks
        head = (
            f"{chosen.node_id} pulls {moved} blocks from {plan.source_node_id} over {link}"
            f" (to hold {plan.blocks}/{total})"
        )
    else:
        head = f"{chosen.node_id} recomputes ({chosen.cached_blocks}/{total} blocks cached, best holder {max_cached})"
    line = f"{head}: {describe(chosen)}"
    if alt is not None:
        line += f"; best alternative {outcome_of(alt, max_cached)} {describe(alt)}"
    return line
