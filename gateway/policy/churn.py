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


class Churn:
    """Blocks written per node, fading with ``window_s``; turnover factors for a view."""

    __slots__ = ("window_s", "_written")

    def __init__(self, window_s: float = DEFAULT_CHURN_WINDOW_S) -> None:
        if not window_s >= 0:
            raise ValueError(f"churn_window_s must be >= 0 (0: eviction costs alike everywhere), got {window_s!r}")
        self.window_s = float(window_s)
        self._written: dict[str, tuple[float, float]] = {}  # node_id -> (faded blocks, as of)

    def wrote(self, node_id: str, blocks: int, now: float) -> None:
        """A decision sends ``blocks`` new blocks to ``node_id``."""
        if self.window_s <= 0 or blocks <= 0:
            return
        count, at = self._written.get(node_id, (0.0, now))
        self._written[node_id] = (count * math.exp(min(at - now, 0.0) / self.window_s) + blocks, now)

    def factors(self, nodes: Sequence[NodeView], now: float) -> list[float] | None:
        """Each node's turnover over the mean of the view's nodes of known capacity (None: no data)."""
        if self.window_s <= 0 or not self._written:
            return None
        written, tau, exp = self._written, self.window_s, math.exp
        rates: list[float] = []
        total, known = 0.0, 0
        for nv in nodes:
            capacity = nv.node.capacity_blocks
            if capacity <= 0:
                rates.append(-1.0)
                continue
            entry = written.get(nv.node.node_id)
            rate = entry[0] * exp(min(entry[1] - now, 0.0) / tau) / capacity if entry is not None else 0.0
            rates.append(rate)
            total += rate
            known += 1
        if total <= 0.0:
            return None
        mean = total / known
        lo, hi = 1.0 / MAX_FACTOR, MAX_FACTOR
        return [1.0 if r < 0 else min(max(r / mean, lo), hi) for r in rates]

    def forget(self, live: Sequence[NodeView]) -> None:
        """Drop nodes no longer in the view (a departed node's count would never fade away)."""
        if len(self._written) > 2 * len(live):
            ids = {nv.node.node_id for nv in live}
            self._written = {k: v for k, v in self._written.items() if k in ids}
