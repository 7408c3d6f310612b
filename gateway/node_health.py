"""Nodes that keep failing requests are taken out of the choice for a while (outlier ejection).

A node that answers 5xx (or resets) at once gives its load back at once, so to a load-aware
policy it always looks the least busy: one broken node got 76 of 120 requests. kvgate counts
each routed request's outcome per node where it sees it (ext_proc with response headers sent,
``EnvoySettings.observe_responses``); after ``consecutive`` failures in a row the node is ejected
from lookups for ``base_eject_s`` times the number of times it was ejected (capped at
``max_eject_s``), like Envoy's outlier detection. A success resets the count. Never all nodes:
if every node of a view is ejected, the view is left as it is. For ext_authz, which never sees
the response, the same job falls to Envoy's outlier detection on the destination cluster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from prometheus_client import Counter, Gauge

from directory_client.types import DirectoryView
from gateway.metrics import REGISTRY

NODE_FAILURES = Counter(
    "kvgate_node_failures", "Routed requests a node answered 5xx or reset, as kvgate saw them", ["node"], registry=REGISTRY
)
NODE_EJECTIONS = Counter(
    "kvgate_node_ejections", "Times a node was taken out of routing for failing requests in a row", ["node"], registry=REGISTRY
)
EJECTED = Gauge("kvgate_nodes_ejected", "Nodes currently out of routing for failing requests", registry=REGISTRY)


@dataclass(slots=True)
class _Record:
    failures: int = 0  # consecutive
    ejections: int = 0
    until: float = 0.0  # ejected until (monotonic)


class NodeHealth:
    """Per-node consecutive failures and ejections; ``vet`` drops ejected nodes from a view."""

    def __init__(
        self,
        *,
        consecutive: int = 5,
        base_eject_s: float = 10.0,
        max_eject_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.consecutive = consecutive
        self.base_eject_s = base_eject_s
        self.max_eject_s = max_eject_s
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._ejected: dict[str, float] = {}  # node id -> until

    def record(self, node_id: str, ok: bool) -> None:
        """One routed request's outcome on ``node_id`` (ok: not a 5xx, not a reset)."""
        rec = self._records.get(node_id)
        if ok:
            if rec is not None:
                rec.failures = 0
            return
        if rec is None:
            rec = self._records[node_id] = _Record()
        NODE_FAILURES.labels(node_id).inc()
        rec.failures += 1
        if rec.failures >= self.consecutive and node_id not in self._ejected:
            rec.ejections += 1
            rec.failures = 0
            rec.until = self._clock() + min(self.base_eject_s * rec.ejections, self.max_eject_s)
            self._ejected[node_id] = rec.until
            NODE_EJECTIONS.labels(node_id).inc()
            EJECTED.set(len(self._ejected))

    def ejected(self) -> frozenset[str]:
        if self._ejected:
            now = self._clock()
            for node_id in [n for n, until in self._ejected.items() if until <= now]:
                del self._ejected[node_id]
            EJECTED.set(len(self._ejected))
        return frozenset(self._ejected)

    def vet(self, view: DirectoryView) -> DirectoryView:
        """``view`` without ejected nodes (unchanged if none is, or if all would be)."""
        out = self.ejected()
        if not out:
            return view
        kept = tuple(nv for nv in view.nodes if nv.node.node_id not in out)
        return replace(view, nodes=kept) if kept and len(kept) != len(view.nodes) else view
