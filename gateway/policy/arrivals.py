"""Split requests whose KV is on its way to a decode node: what a later decision must not block.

A split request reaches its decode node when its prompt's KV has crossed the link; the node then
computes the prompt's last token and answers. An engine with chunked prefill (vLLM, the simulated
engine) gives each step's token budget to the requests already running first, so a long prompt
started on that node meanwhile takes whole budgets until its last chunk, and the arrived request
waits for it. Measured (simulate, mixed, 2P+6D, RDMA, seed 0): the four slowest first tokens were
split documents whose KV landed while a 15k–23k-token prompt, routed whole to the same decode
node after the split was decided, was being prefilled there: 1.3–2.0 s against estimates of
0.4–1.2 s, and the TTFT p99 3% above aggregated serving.

``PendingArrivals`` is the gateway replica's ledger of those arrivals. Each entry is a decode
node, the time the KV lands, the blocks it brings and when its answer is estimated done; it is
dropped then, or when the request ends first (``gateway.decision_round.end_round``: the response
is over, or the split is not made after all). Replicas share them through the directory: a split's arrival is written with its
decode node's reservation (``Directory.reserve(arrival=...)``, same round trip) and every lookup
returns each node's arrivals (``NodeView.arrivals``), so before deciding, ``share`` adds the other
replicas' arrivals from the view to this one's (its own, recognised by id, counted once). With the
directory down or refusing the write, the replica's own ledger still holds its splits: the
request is routed all the same, and its KV lands there whatever the directory knows
(``kvgate_pd_arrivals_unshared_total`` counts those the others cannot see; the write is not tried
again: a split's life is seconds). Its release removes the directory's copy as well. A node keeps its
``MAX_ARRIVALS_PER_NODE`` arrivals ending last, the directory's rule: every decision reads them
all, and a client sending splits faster (each held until its estimated end, up to minutes) must
not make each decision slower (unbounded, 4,000 held: ~4 ms a decision instead of ~0.3).
Decisions use it twice:

- ``blocking_s`` prices a candidate by the split requests its prefill would hold up: an arrival
  landing before the candidate's prefill is done waits for its end for its first token; one that
  has landed and is still answering shares every step with that prefill, and is priced the same
  way (an overstatement of what its decode loses, which keeps long prefills away from decode
  nodes' running answers: counting it less lowered the TTFT p99 of 4P+4D fleets but raised their
  time-per-token p99 above aggregated serving's on 7 of 12 seeds). The policy adds it to the
  candidate's score, so a long prompt goes to a decode node with nothing arriving or answering
  (a short one delays them by one step at most) — unless its first token is near the recent p99:
  then only the splits still arriving count (``gateway.policy.whole.tail_first``);
- ``pending_blocks`` is the KV memory a node is about to receive: counted in that node's block
  total for memory pricing until its KV events report it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from directory_client.types import MAX_ARRIVALS_PER_NODE, DirectoryView, NodeView, SplitArrival
from gateway.types import CandidateCost


@dataclass(frozen=True, slots=True)
class Arrival:
    """A split request's KV landing on ``node_id`` at ``at`` (the policy's clock), ``blocks`` of it;
    its answer estimated done by ``until``. ``arrival_id``: how the directory's copy is recognised."""

    node_id: str
    at: float
    blocks: int
    until: float = 0.0
    arrival_id: str = ""


class PendingArrivals:
    """The splits whose KV is arriving or answering on decode nodes: this replica's own, and the
    other replicas' as the last view showed them (module docstring)."""

    __slots__ = ("_own", "_ids", "_by_node", "_origin", "_count")

    def __init__(self) -> None:
        self._own: dict[str, list[Arrival]] = {}  # this replica's splits
        self._ids: set[str] = set()  # their ids: a view's copy of them is not counted twice
        self._by_node: dict[str, list[Arrival]] = self._own  # what the reads use: own, or own + shared
        self._origin = os.urandom(5).hex()  # replica-unique prefix of the ids
        self._count = itertools.count(1)

    def add(self, node_id: str, at: float, blocks: int, until: float = 0.0) -> Arrival:
        """Record a split this replica decided; the entry (with its id) is what to share."""
        entry = Arrival(node_id, at, blocks, max(until, at), f"{self._origin}-{next(self._count)}")
        rows = self._own.setdefault(node_id, [])
        rows.append(entry)
        self._ids.add(entry.arrival_id)
        if self._by_node is not self._own:
            self._by_node.setdefault(node_id, []).append(entry)
        if len(rows) > MAX_ARRIVALS_PER_NODE:  # the one ending soonest goes, as from the directory
            self.discard(min(rows, key=lambda a: a.until))
        return entry

    def discard(self, entry: Arrival) -> None:
        """Forget a split that was not made after all (its reservation conflicted, or only explained)."""
        for ledger in {id(d): d for d in (self._own, self._by_node)}.values():
            rows = ledger.get(entry.node_id)
            if rows and entry in rows:
                rows.remove(entry)
                if not rows:
                    del ledger[entry.node_id]
        self._ids.discard(entry.arrival_id)

    def expire(self, now: float) -> None:
        """Drop what has been answered (estimated): its KV has long landed, its decode is done."""
        for ledger in {id(d): d for d in (self._own, self._by_node)}.values():
            for node_id in [k for k, v in ledger.items() if any(a.until <= now for a in v)]:
                kept = [a for a in ledger[node_id] if a.until > now]
                if kept:
                    ledger[node_id] = kept
                else:
                    del ledger[node_id]
        if len(self._ids) > sum(map(len, self._own.values())):
            self._ids = {a.arrival_id for rows in self._own.values() for a in rows}

    def share(self, view: DirectoryView, now: float) -> None:
        """Take the other replicas' arrivals from ``view`` (times from the lookup, read at ``now``)
        in place of those of the previous view; this replica's own stay as they are."""
        shared: dict[str, list[Arrival]] = {}
        ids = self._ids
        for nv in view.nodes:
            if nv.arrivals:
                nid = nv.node.node_id
                rows = [
                    Arrival(nid, now + a.arrives_s, a.blocks, now + a.until_s, a.arrival_id)
                    for a in nv.arrivals if a.arrival_id not in ids and a.until_s > 0
                ]
                if rows:
                    shared[nid] = rows
        if not shared:
            self._by_node = self._own
            return
        merged = {k: list(v) for k, v in self._own.items()}
        for k, rows in shared.items():
            merged.setdefault(k, []).extend(rows)
        self._by_node = merged

    @staticmethod
    def for_directory(entry: Arrival, now: float) -> SplitArrival:
        """``entry`` as the directory stores it: times from ``now``."""
        return SplitArrival(entry.arrival_id, entry.at - now, entry.blocks, entry.until - now)

    def __bool__(self) -> bool:
        return bool(self._by_node)

    def arrivals(self, node_id: str) -> list[Arrival]:
        return list(self._by_node.get(node_id, ()))

    def pending_blocks(self, node_id: str, now: float) -> int:
        """Blocks still on their way to ``node_id``: once landed, the node's KV events count them."""
        return sum(a.blocks for a in self._by_node.get(node_id, ()) if a.at > now)

    def landed_tokens(self, node_id: str, now: float, block_size: int) -> int:
        """Prompt tokens of the splits answering on ``node_id`` (landed, not yet done): KV each decode step reads."""
        return sum(a.blocks for a in self._by_node.get(node_id, ()) if a.at <= now) * block_size

    def with_pending_memory(self, view: DirectoryView, now: float) -> DirectoryView:
        """``view`` with each node's block total raised by the KV about to land there."""
        if not self._by_node:
            return view
        nodes = tuple(
            replace(nv, total_blocks=nv.total_blocks + self.pending_blocks(nv.node.node_id, now))
            if nv.node.node_id in self._by_node else nv
            for nv in view.nodes
        )
        return replace(view, nodes=nodes)

    def blocking_s(
        self,
        nodes: Sequence[NodeView],
        costs: Sequence[CandidateCost],
        now: float,
        *,
        landed: bool = True,
    ) -> dict[int, float]:
        """Candidate index → the delay its prefill would cause the splits arriving or answering there.

        The candidate's prefill ends at ``now + total_s``. An arrival landing before then waits
        for it: for the step in progress to end, and then for a step with budget to spare, which
        a prompt longer than one budget leaves only in its last chunk. (Measured: a 15.6k-token
        prompt had 7.5k tokens left when a split's KV landed, and the split's first token came
        with that prompt's, 212 ms late.) A short prefill delays it by at most its one step.
        ``landed`` False counts only the arrivals still on their way (whose first token it delays).
        """
        if not self._by_node:
            return {}
        out: dict[int, float] = {}
        for i, (nv, c) in enumerate(zip(nodes, costs, strict=True)):
            pending = self._by_node.get(nv.node.node_id)
            if not pending:
                continue
            end = now + c.total_s
            start = end - c.prefill_s
            delay = sum(end - max(a.at, now) for a in pending if a.at < end and a.until > start and (landed or a.at > now))
            if delay > 0:
                out[i] = delay
        return out
