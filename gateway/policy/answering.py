"""Requests served whole on a node of a disaggregated fleet, while they answer: the KV their decodes read.

A long prompt computed on a decode node shares every chunk with the answers decoding there, and
each of their steps reads their whole context (``gateway.policy.whole.interference_s``). The
gateway knows the contexts of the splits answering on a node (``gateway.policy.arrivals``), but
until now not those of the requests it served whole there: a document answered in 64 tokens
reads its 20k-token prompt at every step. Measured (simulate, mixed, 4P+4D, RDMA, seed 2): the
two first tokens at the TTFT p99 were 22.8k-token documents sent to a decode node whose answers
read 60k and 22k tokens a step while another read 23k and 1k; they came 11-16 ms after their
estimates, 13-15 ms after the same documents on 8 aggregated nodes.

``AnsweringContexts`` is the replica's ledger of those answers (like ``PendingArrivals``, one per
replica). Each entry is a node, when the answer's first token is estimated, when its last, its
prompt and its answer budget; while it answers, its context grows from the prompt by the budget
over that span. It is dropped at its estimated end. A node keeps the ``keep`` answers ending last
(its engine's ``max_num_seqs``: it decodes no more at once): every decision reads them all, and
estimates held for minutes must not make each decision slower with the request rate.
"""

from __future__ import annotations

from typing import NamedTuple


class Answer(NamedTuple):
    """A request answering on a node: from ``start`` (its estimated first token) to ``until``."""

    start: float
    until: float
    prompt_tokens: int
    answer_tokens: int


class AnsweringContexts:
    """The answers this replica sent to nodes whole, until their estimated end (module docstring)."""

    __slots__ = ("_by_node",)

    def __init__(self) -> None:
        self._by_node: dict[str, list[Answer]] = {}

    def add(self, node_id: str, start: float, until: float, prompt_tokens: int, answer_tokens: int, *, keep: int = 256) -> None:
        if until > start:
            rows = self._by_node.setdefault(node_id, [])
            rows.append(Answer(start, until, prompt_tokens, answer_tokens))
            if len(rows) > keep:  # the one ending soonest goes
                rows.remove(min(rows, key=lambda a: a.until))

    def expire(self, now: float) -> None:
        """Drop the answers estimated done by ``now``."""
        for node_id in [k for k, v in self._by_node.items() if any(a.until <= now for a in v)]:
            kept = [a for a in self._by_node[node_id] if a.until > now]
            if kept:
                self._by_node[node_id] = kept
            else:
                del self._by_node[node_id]

    def __bool__(self) -> bool:
        return bool(self._by_node)

    def stalled_s(self, node_id: str, begin: float, end: float) -> float:
        """How long a prefill running on ``node_id`` from ``begin`` to ``end`` holds up the answers
        decoding there: each waits for it while both run (a chunk takes a step budget, and an
        answer's token comes once a step). Charged on prefill nodes, where the only answers are the
        short ones served whole (``gateway.policy.disagg.prefill_serves_whole``): at 2P+6D, prefills
        placed beside them paced their tokens by 0.3-0.5 s chunks, and the TPOT p99 lost its lead
        over 8 aggregated nodes."""
        total = 0.0
        for a in self._by_node.get(node_id, ()):
            overlap = min(end, a.until) - max(begin, a.start)
            if overlap > 0:
                total += overlap
        return total

    def context_tokens(self, node_id: str, now: float) -> int:
        """The KV the answers decoding on ``node_id`` at ``now`` read each step: prompt plus the
        part of the answer estimated out by then."""
        total = 0.0
        for a in self._by_node.get(node_id, ()):
            if a.start <= now < a.until:
                total += a.prompt_tokens + a.answer_tokens * (now - a.start) / (a.until - a.start)
        return int(total)
