"""The fleet as an operator sees it: every node, live or not, with its load and cached blocks.

Built on demand (``/debug/nodes``, the dashboard, a ``/metrics`` scrape) and shared for
``max_age_s``, so any number of viewers cost the directory at most one call a second: a lookup of
no keys, which answers every live node with its load and the blocks it holds (estimated from the
directory's index: indexed keys × stride); concurrent callers wait for the same refresh. Nothing
runs between reads. The KV-event bridges running in this process add their own view of each
engine they follow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from directory_client.types import Directory, DirectoryUnavailable, NodeView
from gateway import metrics

if TYPE_CHECKING:
    from gateway.node_doctor import NodeVerdicts


class BridgeStats(Protocol):
    """What ``workers.bridge.KVEventBridge`` exposes per followed engine."""

    @property
    def node_ids(self) -> list[str]: ...

    def stats(self, node_id: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node_id: str
    address: str
    live: bool
    model: str = ""
    transfer_endpoint: str = ""
    capacity_blocks: int = 0
    inflight: int = 0
    prefill_tokens: int = 0
    cached_blocks: int | None = None
    bridge: dict[str, Any] | None = None  # the in-process bridge's view of this engine, if any
    cache_loop: dict[str, float] | None = None  # predicted vs delivered tokens (metrics.NodeCacheLoop.view)
    doctor: dict[str, Any] | None = None  # the last canary check of the node (gateway.node_doctor), if any


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    taken_at: float  # wall clock, seconds
    nodes: tuple[NodeStatus, ...]
    cached_blocks_source: str  # "directory" (indexed keys × stride) or "none" (directory unavailable)
    error: str = ""  # the directory could not be read; nodes are then those configured, not live

    def as_dict(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "cached_blocks_source": self.cached_blocks_source,
            "error": self.error,
            "nodes": [asdict(n) for n in self.nodes],
        }


_BRIDGE_FIELDS = ("connected", "registered", "writer", "authoritative", "degraded", "engine_block_size", "batches", "gaps_repaired",
                  "gaps_unrecoverable", "resets", "dropped_blocks", "malformed_batches", "replay_failures",
                  "directory_errors")  # fmt: skip


class FleetMonitor:
    def __init__(
        self,
        directory: Directory,
        *,
        configured: Sequence[tuple[str, str]] = (),
        bridges: Callable[[], Iterable[BridgeStats]] = tuple,
        verdicts: NodeVerdicts | None = None,
        max_age_s: float = 1.0,
        timeout_s: float = 0.5,
    ) -> None:
        """``configured``: (node_id, address) of the static fleet, shown even while down."""
        self._directory = directory
        self._configured = list(configured)
        self._bridges = bridges
        self._verdicts = verdicts
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._last: FleetSnapshot | None = None
        self._last_mono = float("-inf")
        self._refreshing: asyncio.Future[FleetSnapshot] | None = None

    @property
    def last(self) -> FleetSnapshot | None:
        return self._last

    def last_nodes(self) -> tuple[NodeStatus, ...]:
        return () if self._last is None else self._last.nodes

    async def snapshot(self) -> FleetSnapshot:
        """A snapshot at most ``max_age_s`` old."""
        if self._last is not None and time.monotonic() - self._last_mono < self._max_age_s:
            return self._last
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(self._refreshed)
        return await asyncio.shield(self._refreshing)

    def _refreshed(self, fut: asyncio.Future[FleetSnapshot]) -> None:
        self._refreshing = None
        if not fut.cancelled() and fut.exception() is None:
            self._last = fut.result()
            self._last_mono = time.monotonic()

    async def _refresh(self) -> FleetSnapshot:
        taken = time.time()
        try:
            async with asyncio.timeout(self._timeout_s):
                view = await self._directory.lookup([])
        except (DirectoryUnavailable, TimeoutError) as e:
            nodes = tuple(NodeStatus(node_id=i, address=a, live=False) for i, a in self._configured)
            return FleetSnapshot(taken, nodes, "none", error=f"directory unavailable: {type(e).__name__}")
        bridged = self._bridge_stats()
        by_id: dict[str, NodeStatus] = {}
        for nv in view.nodes:
            by_id[nv.node.node_id] = self._status(nv, bridged, self._doctor_view(nv.node.node_id))
        for node_id, address in self._configured:
            if node_id not in by_id:
                stats = bridged.get(node_id)
                by_id[node_id] = NodeStatus(node_id=node_id, address=address, live=False, bridge=_bridge_view(stats),
                                            doctor=self._doctor_view(node_id))  # fmt: skip
        return FleetSnapshot(taken, tuple(by_id[k] for k in sorted(by_id)), "directory")

    def degraded(self) -> dict[str, str]:
        """Nodes routed by load only, and why: by this process's bridges or its doctor (no directory call)."""
        out = {node_id: s.degraded for node_id, s in self._bridge_stats().items() if getattr(s, "degraded", "")}
        if self._verdicts is not None:
            for node_id, why in self._verdicts.degraded().items():
                out[node_id] = f"{out[node_id]}; {why}" if node_id in out else why
        return out

    def _doctor_view(self, node_id: str) -> dict[str, Any] | None:
        return None if self._verdicts is None else self._verdicts.view(node_id)

    def _bridge_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for bridge in self._bridges():
            for node_id in bridge.node_ids:
                out[node_id] = bridge.stats(node_id)
        return out

    @staticmethod
    def _status(nv: NodeView, bridged: dict[str, Any], doctor: dict[str, Any] | None = None) -> NodeStatus:
        info, load, cached = nv.node, nv.load, nv.total_blocks
        stats = bridged.get(info.node_id)
        return NodeStatus(
            node_id=info.node_id,
            address=info.address,
            live=True,
            model=info.model,
            transfer_endpoint=info.transfer_endpoint,
            capacity_blocks=info.capacity_blocks,
            inflight=load.inflight,
            prefill_tokens=load.prefill_tokens,
            cached_blocks=cached,
            bridge=_bridge_view(stats),
            cache_loop=metrics.CACHE_LOOP.view(info.node_id),
            doctor=doctor,
        )


def _bridge_view(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {f: getattr(stats, f) for f in _BRIDGE_FIELDS if hasattr(stats, f)}
