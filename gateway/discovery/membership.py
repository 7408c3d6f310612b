"""Makes the directory's live nodes follow the discovered ready pods.

A node whose engine publishes KV events gets its own in-process KV-event bridge (a *follower*):
the bridge registers and heartbeats the node while the engine's event socket is connected and
writes its blocks. Other nodes are registered here and re-registered every heartbeat interval
(registration is idempotent and also restores a node the directory forgot, e.g. after a Redis
restart): Kubernetes readiness is their health probe.

A node that leaves (deleted, unready, or replaced by a new pod under the same name) is
deregistered at once, which also drops its directory entries: traffic stops on the next
decision, not after the heartbeat TTL. If the directory is down at that moment we stop
heartbeating it and the TTL retires it.

On shutdown nodes are *not* deregistered: the other gateway replicas follow the same pods and
keep them; if no replica is left, the heartbeat TTL retires them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from directory_client.types import Directory, DirectoryUnavailable
from gateway.discovery.reconcile import DiscoveredNode, FleetChange, diff

log = logging.getLogger("kvgate.discovery")


class NodeFollower(Protocol):
    """Follows one node's KV events into the directory (a ``workers.bridge.KVEventBridge``)."""

    async def start(self) -> None: ...
    async def aclose(self, *, deregister: bool = True) -> None: ...


FollowerFactory = Callable[[DiscoveredNode], NodeFollower]


def bridge_followers(directory: Directory, *, model: str, block_size: int, heartbeat_interval_s: float) -> FollowerFactory:
    """One single-engine KV-event bridge per node (the bridge's guarantees: workers/bridge.py)."""
    from workers.bridge import EngineSpec, KVEventBridge

    def follow(node: DiscoveredNode) -> NodeFollower:
        spec = EngineSpec(
            node_id=node.node_id,
            address=node.address,
            events=node.events_endpoint,
            replay=node.replay_endpoint or None,
            transfer=node.transfer_endpoint,
            role=node.role,
        )
        return KVEventBridge(
            directory, [spec], model=model, block_size=block_size, heartbeat_interval_s=heartbeat_interval_s
        )

    return follow


class FleetMembership:
    """Applies the discovered node set to the directory (see the module doc)."""

    def __init__(
        self,
        directory: Directory,
        *,
        model: str,
        heartbeat_interval_s: float,
        follow: FollowerFactory | None = None,
    ) -> None:
        self._directory = directory
        self._model = model
        self._interval_s = heartbeat_interval_s
        self._follow = follow
        self._nodes: dict[str, DiscoveredNode] = {}
        self._followers: dict[str, NodeFollower] = {}
        self._lock = asyncio.Lock()  # updates and heartbeats never interleave: no re-register after a drop
        self._task: asyncio.Task[None] | None = None

    @property
    def nodes(self) -> Mapping[str, DiscoveredNode]:
        return dict(self._nodes)

    @property
    def followed(self) -> frozenset[str]:
        """Node ids whose KV events are followed by a bridge."""
        return frozenset(self._followers)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._heartbeat_loop(), name="discovery-heartbeats")

    async def update(self, nodes: Mapping[str, DiscoveredNode]) -> FleetChange:
        """Make the directory match ``nodes``; returns what changed."""
        async with self._lock:
            change = diff(self._nodes, nodes)
            for node_id in change.removed:
                await self._drop(node_id)
            for node in change.replaced:
                await self._drop(node.node_id)
            self._nodes = dict(nodes)
            for node in change.replaced + change.added:
                await self._add(node)
            if change:
                log.info(
                    "fleet: %d ready nodes (+%d, -%d, replaced %d)",
                    len(self._nodes), len(change.added), len(change.removed), len(change.replaced),
                )
            return change

    async def _add(self, node: DiscoveredNode) -> None:
        if node.events_endpoint and self._follow is not None:
            follower = self._follow(node)
            await follower.start()
            self._followers[node.node_id] = follower
            log.info("node %s (%s) joined; following its KV events at %s", node.node_id, node.address, node.events_endpoint)
            return
        log.info("node %s (%s) joined", node.node_id, node.address)
        await self._register(node)

    async def _drop(self, node_id: str) -> None:
        follower = self._followers.pop(node_id, None)
        if follower is not None:
            await follower.aclose(deregister=True)
        else:
            try:
                await self._directory.deregister_node(node_id)
            except DirectoryUnavailable:
                log.warning("node %s left but the directory is unavailable; its heartbeat TTL will retire it", node_id)
        log.info("node %s left", node_id)

    async def _register(self, node: DiscoveredNode) -> None:
        try:
            await self._directory.register_node(node.node_info(self._model))
        except DirectoryUnavailable:
            log.debug("directory unavailable while registering node %s", node.node_id)

    async def heartbeat(self) -> None:
        """Re-register every node no bridge looks after (also done every interval by ``start``)."""
        async with self._lock:
            for node_id, node in self._nodes.items():
                if node_id not in self._followers:
                    await self._register(node)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.heartbeat()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        async with self._lock:
            followers, self._followers = list(self._followers.values()), {}
            for follower in followers:
                await follower.aclose(deregister=False)
