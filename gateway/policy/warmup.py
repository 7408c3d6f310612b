"""Scale-out warm-up: a node that joins is made attractive while it is cold, within bounds.

Cache affinity starves a new node: every conversation's next turn is cheapest where its prefix
already lives, so a node that joins gets only brand-new conversations and stays under-used for
as long as conversations last. The cost model already lets an idle node pull a hot prefix when
the owner is queued; warm-up adds a *credit* to a young node's pull option so it takes over
conversations before anyone is queued. The credit is subtracted from the candidate's score for
ranking only: the candidate's estimated TTFT, and every figure reported from it, stays the
estimate.

A young node's pull option gets the credit only when all of these hold:

- **young**: the policy first saw the node less than ``window_s`` ago (nodes in its first view
  are established; a node absent for more than ``rejoin_gap_s`` and back is new again: a
  restarted engine has an empty cache; absent means missing from a view the policy saw, so an
  idle spell without decisions makes no node new). The credit fades linearly over the window;
- **a pull**: the node receives a copy of the prefix, so the conversation keeps its hit and the
  fleet's hit rate does not drop (a young node is never credited for recomputing);
- **below the fleet's mean**, in requests in flight *and* in requests this policy routed to it
  lately (a count fading with a ``RATE_TAU_S`` time constant, against the fleet's count per
  node): no herd. Once the new node carries its share of the traffic, it is an ordinary node.
  (Blocks held would be the wrong yardstick: established nodes keep finished conversations'
  blocks until evicted, so a new node stays "below the mean" long after it has its share);
- **within its link budget**: credited pulls into one young node use at most ``link_share`` of
  its link (a bucket of link-seconds refilled at ``link_share`` per second, holding one second's
  worth), so warm-up cannot flood the network whatever the traffic.

The credit is ``credit × prefill(whole prompt) × (1 − age/window)``: a fraction of what the copy
saves compared to computing the prompt. Over a link where moving KV costs about as much as
computing it (an 8B model over 25 Gb/s TCP), no credit makes a pull win and warm-up falls back to
the new conversations the load terms already send to the emptiest node.

State lives in the policy object (deterministic given the sequence of calls, like round-robin's
position), so each gateway replica warms on its own: with R replicas the link bound is R times
``link_share`` at most.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from directory_client.types import NodeView
from gateway.types import CandidateCost

DEFAULT_WARMUP_S = 180.0
DEFAULT_WARMUP_CREDIT = 0.5
DEFAULT_WARMUP_LINK_SHARE = 0.5
REJOIN_GAP_S = 30.0
RATE_TAU_S = 30.0  # time constant of the routed-requests count that says who carries its share
SCAN_INTERVAL_S = 1.0  # membership is re-read at most this often (a decision must stay O(live nodes))


class WarmUp:
    """Which nodes are young, what credit their pulls get, and the link budget they spend."""

    __slots__ = (
        "window_s", "credit", "link_share", "_first_seen", "_last_seen", "_young", "_budget", "_scanned_at",
        "_routed", "_routed_all",
    )

    def __init__(
        self,
        window_s: float = DEFAULT_WARMUP_S,
        credit: float = DEFAULT_WARMUP_CREDIT,
        link_share: float = DEFAULT_WARMUP_LINK_SHARE,
    ) -> None:
        if not window_s >= 0:
            raise ValueError(f"warmup_s must be >= 0 (0: no warm-up), got {window_s!r}")
        if not credit >= 0:
            raise ValueError(f"warmup_credit must be >= 0, got {credit!r}")
        if not 0 < link_share <= 1:
            raise ValueError(f"warmup_link_share must be in (0, 1], got {link_share!r}")
        self.window_s = float(window_s)
        self.credit = float(credit)
        self.link_share = float(link_share)
        self._first_seen: dict[str, float] = {}
        self._last_seen: dict[str, float] = {}
        self._young: dict[str, float] = {}  # node_id -> first seen, for nodes younger than the window
        self._budget: dict[str, tuple[float, float]] = {}  # node_id -> (link-seconds left, at)
        self._scanned_at: float | None = None
        self._routed: dict[str, tuple[float, float]] = {}  # young node -> (fading count of requests routed, at)
        self._routed_all = (0.0, 0.0)  # the same over the whole fleet

    @property
    def enabled(self) -> bool:
        return self.window_s > 0 and self.credit > 0

    def _scan(self, nodes: Sequence[NodeView], now: float) -> None:
        """Note new and returning nodes; forget those gone long enough to count as new again.

        A node is back from an absence only if an earlier scan saw the fleet without it: a node
        present at the previous scan never left, however long ago that scan was (a gateway with
        no request for minutes has seen nobody leave, and must not take its fleet for new).
        """
        previous = self._scanned_at
        first = previous is None
        self._scanned_at = now
        first_seen, last_seen = self._first_seen, self._last_seen
        for nv in nodes:
            nid = nv.node.node_id
            seen = last_seen.get(nid)
            if seen is None or (seen != previous and now - seen > REJOIN_GAP_S):
                first_seen[nid] = float("-inf") if first else now
                self._budget.pop(nid, None)
            last_seen[nid] = now
        for nid in [n for n, t in last_seen.items() if now - t > 2 * REJOIN_GAP_S]:
            del last_seen[nid], first_seen[nid]
            self._budget.pop(nid, None)
        self._young = {n: t for n, t in first_seen.items() if now - t < self.window_s and last_seen[n] == now}
        self._routed = {n: c for n, c in self._routed.items() if n in self._young}

    def credits(
        self, nodes: Sequence[NodeView], costs: Sequence[CandidateCost], full_prefill_s: float, *, now: float
    ) -> dict[int, float]:
        """Index → seconds taken off the score of each credited candidate (empty: nobody is)."""
        if not self.enabled:
            return {}
        if self._scanned_at is None or now - self._scanned_at >= SCAN_INTERVAL_S or now < self._scanned_at:
            self._scan(nodes, now)
        if not self._young:
            return {}
        n = len(nodes)
        mean_inflight = sum(nv.load.inflight for nv in nodes) / n
        mean_routed = _faded(self._routed_all, now) / n
        out: dict[int, float] = {}
        for i, nv in enumerate(nodes):
            born = self._young.get(nv.node.node_id)
            if born is None or not costs[i].via_pull:
                continue
            if nv.load.inflight > mean_inflight or _faded(self._routed.get(nv.node.node_id), now) >= mean_routed:
                continue  # carries its share already: no herd onto it
            if self._level(nv.node.node_id, now) < costs[i].transfer_s:
                continue  # its warm-up pulls have used their share of the link
            fade = 1.0 - (now - born) / self.window_s
            out[i] = self.credit * full_prefill_s * fade
        return out

    def _level(self, node_id: str, now: float) -> float:
        """Link-seconds this young node may still spend on credited pulls (refilled since last use)."""
        left, at = self._budget.get(node_id, (self.link_share, now))
        return min(self.link_share, left + self.link_share * max(now - at, 0.0))

    def routed(self, node_id: str, now: float) -> None:
        """Count a decision for ``node_id`` (every decision: the fleet's mean is the yardstick)."""
        if not self.enabled:
            return
        self._routed_all = (_faded(self._routed_all, now) + 1.0, now)
        if node_id in self._young:
            self._routed[node_id] = (_faded(self._routed.get(node_id), now) + 1.0, now)

    def spend(self, node_id: str, link_s: float, now: float) -> None:
        """A credited pull was chosen: it takes ``link_s`` of the node's link budget."""
        self._budget[node_id] = (self._level(node_id, now) - link_s, now)

    def young(self) -> dict[str, float]:
        """Young nodes (id → first seen) as of the last scan."""
        return dict(self._young)


def _faded(count: tuple[float, float] | None, now: float) -> float:
    """A count that fades by e every ``RATE_TAU_S`` seconds, as of ``now``."""
    if count is None:
        return 0.0
    value, at = count
    return value * math.exp(-max(now - at, 0.0) / RATE_TAU_S)
