"""Only nodes the operator declared are routed to: the directory's node records are not trusted.

Node records live in the shared directory (Redis), where bridges register them. Anyone who can
write there could register a node at an address of its choice (``169.254.169.254:80``, an
internal admin service) holding any prompt's blocks, and kvgate would send requests there, and
engines would pull KV from its ``transfer_endpoint``. So a lookup's view is vetted against what
this replica knows from its own configuration: the static fleet and what Kubernetes discovery
currently reports. A node whose address is in neither is dropped from the view (counted in
``kvgate_untrusted_nodes_total`` and logged once per address); a known address keeps the transfer
endpoint configured for it, whatever the record says. Redis ACLs (docs/security.md) keep
strangers from writing at all; this keeps a writer from choosing where traffic goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Counter

from directory_client.types import Directory, DirectoryView
from gateway.metrics import REGISTRY
from gateway.node_health import NodeHealth

if TYPE_CHECKING:
    from gateway.node_doctor import NodeVerdicts

log = logging.getLogger("kvgate.trusted_fleet")
REFRESH_S = 1.0  # discovered nodes are read again at most this often (discovery itself lags seconds)

UNTRUSTED_NODES = Counter(
    "kvgate_untrusted_nodes",
    "Directory node records skipped by a lookup: their address is in neither the static fleet nor discovery",
    registry=REGISTRY,
)


class TrustedFleet:
    """The addresses kvgate may route to, each with the transfer endpoint it may pull from."""

    def __init__(
        self,
        static: Iterable[tuple[str, str]],
        discovered: Callable[[], Iterable[tuple[str, str]]] | None = None,
    ) -> None:
        """``static``: (address, transfer_endpoint) pairs of the configured fleet; ``discovered``:
        the same for the nodes discovery reports now (called on each lookup)."""
        self._static = dict(static)
        self._discovered = discovered
        self._known: Mapping[str, str] = self._static
        self._read_at = -REFRESH_S
        self._warned: set[str] = set()

    def endpoints(self) -> Mapping[str, str]:
        if self._discovered is not None and time.monotonic() - self._read_at >= REFRESH_S:
            self._known = {**dict(self._discovered()), **self._static}
            self._read_at = time.monotonic()
        return self._known

    def vet(self, view: DirectoryView) -> DirectoryView:
        """``view`` without the nodes at unknown addresses, with the configured transfer endpoints."""
        known = self.endpoints()
        kept = []
        changed = False
        for nv in view.nodes:
            node = nv.node
            transfer = known.get(node.address)
            if transfer is None:
                changed = True
                UNTRUSTED_NODES.inc()
                if node.address not in self._warned and len(self._warned) < 1024:
                    self._warned.add(node.address)
                    log.warning("directory node %r at %r is not in the fleet or discovery: never routed to", node.node_id, node.address)
                continue
            if transfer != node.transfer_endpoint:
                changed = True
                nv = replace(nv, node=replace(node, transfer_endpoint=transfer))
            kept.append(nv)
        return replace(view, nodes=tuple(kept)) if changed else view


class TrustedDirectory:
    """A ``Directory`` whose lookups show only the nodes of a ``TrustedFleet`` that are not ejected
    for failing (``NodeHealth``), with the cached prefixes of nodes failing the doctor's canary
    check hidden (``NodeVerdicts``: routed by load only); all else delegates."""

    def __init__(
        self, directory: Directory, fleet: TrustedFleet, health: NodeHealth | None = None, verdicts: NodeVerdicts | None = None
    ) -> None:
        self._directory = directory
        self._fleet = fleet
        self._health = health
        self._verdicts = verdicts

    async def lookup(self, keys: np.ndarray, session: str = "") -> DirectoryView:
        found = await (self._directory.lookup(keys, session) if session else self._directory.lookup(keys))
        view = self._fleet.vet(found)
        if self._verdicts is not None:
            view = self._verdicts.vet(view)
        return view if self._health is None else self._health.vet(view)

    def __getattr__(self, name: str):
        return getattr(self._directory, name)
