"""Split requests whose KV is on its way to a decode node: what a later decision must not block.

A split request reaches its decode node when its prompt's KV has crossed the link; the node then
computes the prompt's last token and answers. An engine with chunked prefill (vLLM, the simulated
engine) gives each step's token budget to the requests already running first, so a long prompt
started on that node meanwhile takes whole budgets until its last chunk, and the arrived request
waits for it. Measured (simulate, mixed, 2P+6D, RDMA, seed 0): the four slowest first tokens were
split documents whose KV landed while a 15k–23k-token prompt, routed whole to the same decode
node after the split was decided, was being prefilled there: 1.3–2.0 s against estimates of
0.4–1.2 s, and the TTFT p99 3% above aggregated serving.

``PendingArrivals`` is the gateway replica's ledger of those arrivals (like ``FirstTokenTail``,
one per replica: another replica's splits are not in it). Each entry is a decode node, the time
the KV lands, the blocks it brings and when its answer is estimated done; it is dropped then.
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

from collections.abc import Sequence
from dataclasses import dataclass, replace

from directory_client.types import DirectoryView, NodeView
from gateway.types import CandidateCost


@dataclass(frozen=True, slots=True)
class Arrival:
    """A split request's KV landing on ``node_id`` at ``at`` (the policy's clock), ``blocks`` of it;
    its answer estimated done by ``until``."""

    node_id: str
    at: float
    blocks: int
    until: float = 0.0


class PendingArrivals:
    """The splits this replica decided whose KV has not landed yet (module docstring)."""

    __slots__ = ("_by_node",)

    def __init__(self) -> None:
        self._by_node: dict[str, list[Arrival]] = {}

    def add(self, node_id: str, at: float, blocks: int, until: float = 0.0) -> None:
        self._by_node.setdefault(node_id, []).append(Arrival(node_id, at, blocks, max(until, at)))

    def expire(self, now: float) -> None:
        """Drop what has been answered (estimated): its KV has long landed, its decode is done."""
        for node_id in [k for k, v in self._by_node.items() if any(a.until <= now for a in v)]:
            kept = [a for a in self._by_node[node_id] if a.until > now]
            if kept:
                self._by_node[node_id] = kept
            else:
                del self._by_node[node_id]

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
