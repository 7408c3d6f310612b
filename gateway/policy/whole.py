"""Which node serves a request whole, in a fleet that declared prefill/decode roles.

``split_or_not`` (``gateway.policy.disagg``) weighs a split against the node the policy chose to
serve the request whole; two things make that choice different from an aggregated fleet's.

**Running decodes slow a prefill.** An engine with chunked prefill computes a long prompt in
``max_num_batched_tokens`` steps, and every step also carries one token of each answer decoding
there and reads their KV: per chunk, ``running × (1/prefill rate + per-sequence cost)`` plus the
KV read. A decode node runs the answers of what the prefill nodes computed as well as its own,
so this is no rounding error there: a 22.6k-token document beside 25 decodes took 22 ms longer
than estimated (simulate, mixed, 4P+4D, seed 5). ``interference_s`` prices it from what the
gateway knows, the node's in-flight count and the contexts answering there: the prompts of the
splits (the ledger, ``gateway.policy.arrivals``) and the contexts of the answers served whole
there (``gateway.policy.answering``, shared by the replicas); the policy charges it in the ranking (not in
the estimate a reservation holds).

**The tail is served where its first token comes soonest.** The policy's ranking also charges
what a choice does to others: memory it evicts, and the splits answering on a node (their steps
are shared with the prefill; ``PendingArrivals.blocking_s``). For most requests that is right; for
one whose first token is already near the recent p99 (``tail_s``, ``FirstTokenTail``, divided by
``1 + ttft_slack``), any delay lands in the p99, which the longest prompts make. Charged so, the
longest documents went to decode nodes with a prefill queued, the split then looked sooner, and
its transfer (60+ ms for a 23k-token prompt over RDMA) put it among the slowest first tokens. So
``tail_first`` serves such a request on the node where its first token comes soonest, counting
the interference and the first tokens of splits still arriving there that it would delay. Until a
replica has seen enough first tokens to know the tail (``FirstTokenTail.warmup``), every request
counts as near it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.profile import HardwareProfile
from gateway.types import CandidateCost


def interference_s(profile: HardwareProfile, running: int, context_tokens: int, new_tokens: int) -> float:
    """What ``running`` decodes (reading ``context_tokens`` of KV per step, where known) add to a
    prefill of ``new_tokens`` on their node: one token of each, and their KV read, in every chunk."""
    if running <= 0 or new_tokens <= 0:
        return 0.0
    chunks = -(-new_tokens // profile.max_num_batched_tokens)
    per_step = running * (1.0 / profile.prefill_tokens_per_s + profile.decode_step_per_seq_s)
    return chunks * (per_step + profile.decode_step_per_context_token_s * context_tokens)


def tail_first(
    chosen: int,
    costs: Sequence[CandidateCost],
    delays: dict[int, float],
    *,
    tail_s: float,
    ttft_slack: float,
    tie_tolerance_s: float,
) -> int | None:
    """Index of the candidate whose first token comes soonest (``total_s`` plus ``delays``: the
    interference of its decodes and the first tokens of arriving splits it would delay) when
    ``chosen``'s lies beyond ``tail_s / (1 + ttft_slack)`` and that one is sooner by more than
    the tie tolerance; None otherwise (``chosen`` stays)."""
    def soon(i: int) -> float:
        return costs[i].total_s + delays.get(i, 0.0)

    mine = soon(chosen)
    if mine <= tail_s / (1.0 + ttft_slack):
        return None
    best = min(range(len(costs)), key=lambda i: (soon(i), i))
    return best if best != chosen and soon(best) < mine - tie_tolerance_s else None
