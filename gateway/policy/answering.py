"""Requests served whole on a node of a disaggregated fleet, while they answer: the KV their decodes read.

A long prompt computed on a decode node shares every chunk with the answers decoding there, and
each of their steps reads their whole context (``gateway.policy.whole.interference_s``). The
gateway knows the contexts of the splits answering on a node (``gateway.policy.arrivals``), but
until now not those of the requests it served whole there: a document answered in 64 tokens
reads its 20k-token prompt at every step. Measured (simulate, mixed, 4P+4D, RDMA, seed 2): the
two first tokens at the TTFT p99 were 22.8k-token documents sent to a decode node whose answers
read 60k and 22k tokens a step while another read 23k and 1k; they came 11-16 ms after their
estimates, 13-15 ms after the same documents on 8 aggregated nodes.

``AnsweringContexts`` is the replica's ledger of those answers. Each entry is a node, when the
answer's first token is estimated, when its last, its prompt, its answer budget and how many
answers it decodes side by side (``n``: each reads the prompt and its own answer); while it
answers, its context grows from the prompt by the budget over that span. It is dropped at its
estimated end, or when the request ends (``discard``: its response is over, or it was not made).
A node keeps the ``keep`` answers ending last (its engine's ``max_num_seqs``: it decodes no more
at once): every decision reads them all, and estimates held for minutes must not make each
decision slower with the request rate.

Replicas share them through the directory, in the reservation's own round trip: each entry's
``shared`` count (what its steps read on average: the prompt and half the budget, per answer) is
reserved with the request (``Directory.reserve(context_tokens=...)``) and counted in the node's
``NodeView.answering_tokens`` until the reservation is released or ends. ``share`` takes from a
view what the other replicas placed: the node's count less this replica's own entries the
directory holds (an entry counts as held from the moment it is decided, as the in-flight count of
its reservation does; ``unshared`` takes back one whose reserve failed, which the replica then
prices alone, and ``kvgate_pd_answering_unshared_total`` counts). The others' answers are priced
at that count, without the ramp: the directory keeps a sum, not the entries, so a lookup stays
one number per node. With the directory down, the replica prices its own answers as before.
"""

from __future__ import annotations

from directory_client.types import DirectoryView


class Answer:
    """A request answering on a node: from ``start`` (its estimated first token) to ``until``.

    ``shared``: what the directory counts for it; ``held_until``: until when (its reservation's
    end: the estimate, or the directory's ceiling when the response's end is seen), -inf once
    its reserve failed."""

    __slots__ = ("node_id", "start", "until", "prompt_tokens", "answer_tokens", "answers", "shared", "held_until")

    def __init__(self, node_id: str, start: float, until: float, prompt_tokens: int, answer_tokens: int, answers: int) -> None:
        self.node_id = node_id
        self.start = start
        self.until = until
        self.prompt_tokens = prompt_tokens
        self.answer_tokens = answer_tokens
        self.answers = answers
        self.shared = answers * (prompt_tokens + answer_tokens // 2)
        self.held_until = until

    def context(self, now: float) -> float:
        """What its steps read at ``now``: per answer, the prompt and the part decoded by then."""
        if not self.start <= now < self.until:
            return 0.0
        return self.answers * (self.prompt_tokens + self.answer_tokens * (now - self.start) / (self.until - self.start))


class AnsweringContexts:
    """The answers this replica sent to nodes whole, and the other replicas' as the last view
    counted them (module docstring)."""

    __slots__ = ("_by_node", "_others")

    def __init__(self) -> None:
        self._by_node: dict[str, list[Answer]] = {}
        self._others: dict[str, int] = {}  # node -> context the other replicas' answers read there

    def add(
        self,
        node_id: str,
        start: float,
        until: float,
        prompt_tokens: int,
        answer_tokens: int,
        answers: int = 1,
        *,
        keep: int = 256,
    ) -> Answer | None:
        """Record an answer this replica decided; the entry (its ``shared`` count) is what to reserve."""
        if until <= start:
            return None
        entry = Answer(node_id, start, until, prompt_tokens, answer_tokens, answers)
        rows = self._by_node.setdefault(node_id, [])
        rows.append(entry)
        if len(rows) > keep:  # the one ending soonest goes
            rows.remove(min(rows, key=lambda a: a.until))
        return entry

    def held(self, entry: Answer, until: float) -> None:
        """The directory counts ``entry`` until ``until`` (its reservation's end)."""
        entry.held_until = until

    def unshared(self, entry: Answer) -> None:
        """Its reserve failed: the directory does not count it, this replica alone prices it."""
        entry.held_until = float("-inf")

    def discard(self, entry: Answer) -> None:
        """Forget an answer that is over (its response ended) or was not made (conflict, explained)."""
        rows = self._by_node.get(entry.node_id)
        if rows and entry in rows:
            rows.remove(entry)
            if not rows:
                del self._by_node[entry.node_id]

    def expire(self, now: float) -> None:
        """Drop the answers estimated done by ``now`` that the directory no longer counts."""
        for node_id in [k for k, v in self._by_node.items() if any(a.until <= now and a.held_until <= now for a in v)]:
            kept = [a for a in self._by_node[node_id] if a.until > now or a.held_until > now]
            if kept:
                self._by_node[node_id] = kept
            else:
                del self._by_node[node_id]

    def share(self, view: DirectoryView, now: float) -> None:
        """Take the other replicas' answers from ``view``: each node's count less this replica's
        entries the directory holds (in place of the previous view's)."""
        others: dict[str, int] = {}
        for nv in view.nodes:
            if nv.answering_tokens > 0:
                nid = nv.node.node_id
                mine = sum(a.shared for a in self._by_node.get(nid, ()) if a.held_until > now)
                if nv.answering_tokens > mine:
                    others[nid] = nv.answering_tokens - mine
        self._others = others

    def __bool__(self) -> bool:
        return bool(self._by_node) or bool(self._others)

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
        """The KV the answers decoding on ``node_id`` at ``now`` read each step: this replica's,
        prompt plus the part of the answer estimated out by then, and the other replicas' count."""
        total = float(self._others.get(node_id, 0))
        for a in self._by_node.get(node_id, ()):
            total += a.context(now)
        return int(total)
