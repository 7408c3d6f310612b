"""How fast each node's KV memory turns over, so an eviction on a busy node costs more.

A full node evicts its least recently used blocks, and how old those are depends on how fast the
node writes new ones: with ``w`` blocks written per second into ``C`` blocks of memory, a block
survives about ``C / w`` seconds untouched. A block evicted from a node that turns over slowly has
sat unused for long and is unlikely to be asked for again; one evicted from a node that turns
over fast may be the prefix of a conversation whose next turn is seconds away. One pooled memory
of the fleet's size (the ``oracle_pool`` ceiling) always evicts the fleet's oldest block; a
router of separate memories gets closest to it by writing where turnover is slow.

The policy records the blocks each decision makes its node write (prompt blocks not expected
cached) in a count that fades with time constant ``window_s``; a node's turnover is that count
over its capacity. ``factors`` gives each node's turnover relative to the fleet's mean, which
scales the eviction cost of ``gateway.policy.memory`` (1.0 everywhere while nothing is known or
every node turns over alike). Factors are clamped to ``[1 / MAX_FACTOR, MAX_FACTOR]``: a node
that wrote nothing yet is not free to fill.

State lives in the policy object (deterministic given the sequence of calls, like warm-up's), so
each gateway replica counts the writes it routed: with several replicas each sees its share, and
the ratios, which are all that is used, stay the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from directory_client.types import NodeView

DEFAULT_CHURN_WINDOW_S = 600.0
MAX_FACTOR = 4.0
REBASE_WINDOWS = 30.0  # counts are rescaled once the reference is this many windows old


class Churn:
    """Blocks written per node, fading with ``window_s``; turnover factors for a view.

    Every count fades at the same rate, so each is kept scaled to a common reference time
    (``blocks · e^((t − ref)/window)``): the ratios ``factors`` needs come out with no
    exponential per node (a decision prices hundreds), and the reference moves on now and then
    so the scale stays small.
    """

    __slots__ = ("window_s", "_written", "_ref")

    def __init__(self, window_s: float = DEFAULT_CHURN_WINDOW_S) -> None:
        if not window_s >= 0:
            raise ValueError(f"churn_window_s must be >= 0 (0: eviction costs alike everywhere), got {window_s!r}")
        self.window_s = float(window_s)
        self._written: dict[str, float] = {}  # node_id -> blocks written, each scaled by e^((t - ref)/window)
        self._ref: float | None = None

    def wrote(self, node_id: str, blocks: int, now: float) -> None:
        """A decision sends ``blocks`` new blocks to ``node_id``."""
        if self.window_s <= 0 or blocks <= 0:
            return
        if self._ref is None:
            self._ref = now
        elif now - self._ref > REBASE_WINDOWS * self.window_s:  # keep the scale small: fade everyone once
            fade = math.exp((self._ref - now) / self.window_s)
            self._written = {k: v * fade for k, v in self._written.items()}
            self._ref = now
        written = self._written
        written[node_id] = written.get(node_id, 0.0) + blocks * math.exp((now - self._ref) / self.window_s)

    def factors(self, nodes: Sequence[NodeView], now: float) -> list[float] | None:
        """Each node's turnover over the mean of the view's nodes of known capacity (None: no data).

        ``now`` is not needed: every count has faded by the same factor since it was scaled.
        """
        if self.window_s <= 0 or not self._written:
            return None
        written = self._written
        rates = [written.get(nv.node.node_id, 0.0) / c if (c := nv.node.capacity_blocks) > 0 else -1.0 for nv in nodes]
        known = [r for r in rates if r >= 0.0]
        total = sum(known)
        if total <= 0.0:
            return None
        inv_mean = len(known) / total
        lo, hi = 1.0 / MAX_FACTOR, MAX_FACTOR
        # clamped without min/max calls: this runs over every live node on every decision
        return [1.0 if r < 0.0 else (hi if (f := r * inv_mean) > hi else lo if f < lo else f) for r in rates]

    def forget(self, live: Sequence[NodeView]) -> None:
        """Drop nodes no longer in the view (a departed node's count would never fade away)."""
        if len(self._written) > 2 * len(live):
            ids = {nv.node.node_id for nv in live}
            self._written = {k: v for k, v in self._written.items() if k in ids}
