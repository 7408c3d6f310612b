"""Keeps a statically configured fleet alive in the directory.

Nodes that run a KV-event bridge are registered and heartbeated by it. Nodes of a static fleet
without one would never be "live", so kvgate probes them (``GET /health``) and heartbeats the
healthy ones itself by registering them again on every probe (registration is idempotent and also
restores a node after the directory lost its state, e.g. a Redis restart). A node that fails
``failures_to_drop`` probes in a row is deregistered, so the gateway stops sending it traffic at
once rather than after the heartbeat TTL.

A static node may still have its entries written by a bridge running elsewhere (``kvgate bridge``
beside the engine). If that bridge dies, the keeper would keep the node alive with entries that
nothing keeps true any more; so a node whose entries a bridge wrote (the directory notes it) has
them cleared once no bridge holds its writer lease (it stays routable by load), until a bridge
takes the lease again and rewrites them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from directory_client.redis_base import refused_by_acl
from directory_client.types import Directory, DirectoryUnavailable, NodeInfo
from gateway.metrics import WRITER_LAPSES

log = logging.getLogger("kvgate.fleet")


class StaticFleetKeeper:
    def __init__(
        self,
        directory: Directory,
        nodes: Sequence[NodeInfo],
        *,
        interval_s: float,
        probe_timeout_s: float = 1.0,
        failures_to_drop: int = 2,
    ) -> None:
        self.directory = directory
        self.nodes = list(nodes)
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.failures_to_drop = failures_to_drop
        self._failures = {n.node_id: 0 for n in self.nodes}
        self._registered: set[str] = set()
        self._acl_warned = False  # a Redis user older than this keeper refuses its clear: said once
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s))
        await self.tick()
        self._task = asyncio.create_task(self._loop(), name="static-fleet-keeper")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.tick()

    async def tick(self) -> None:
        await asyncio.gather(*(self._keep(n) for n in self.nodes))

    async def _probe(self, node: NodeInfo) -> bool:
        try:
            async with self._session.get(f"http://{node.address}/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _keep(self, node: NodeInfo) -> None:
        healthy = await self._probe(node)
        try:
            if healthy:
                self._failures[node.node_id] = 0
                await self.directory.register_node(node)
                if node.node_id not in self._registered:
                    self._registered.add(node.node_id)
                    log.info("node %s (%s) is up", node.node_id, node.address)
                await self._check_writer(node)
                return
            self._failures[node.node_id] += 1
            if node.node_id in self._registered and self._failures[node.node_id] >= self.failures_to_drop:
                await self.directory.deregister_node(node.node_id)
                self._registered.discard(node.node_id)
                log.warning("node %s (%s) failed %d probes; dropped", node.node_id, node.address, self.failures_to_drop)
        except DirectoryUnavailable:
            log.debug("directory unavailable while keeping node %s", node.node_id)

    async def _check_writer(self, node: NodeInfo) -> None:
        """Clear the entries of a node whose bridge held the writer lease and no longer does.

        The directory remembers that a bridge wrote the node, so a keeper started after the bridge
        died clears too, and of several replicas only one does (and counts it). A failure: tried
        again next tick."""
        try:
            cleared = await self.directory.clear_if_unwritten(node.node_id)
        except DirectoryUnavailable as e:
            if refused_by_acl(e.__cause__) and not self._acl_warned:
                self._acl_warned = True
                log.warning("Redis refused clearing a dead bridge's entries (%s): update the gateway's Redis user from "
                            "helm/kvgate/files/redis-acl.conf", e)
            raise
        if cleared:
            WRITER_LAPSES.labels(node.node_id).inc()
            log.warning("node %s: its KV-event bridge stopped holding the writer lease; entries cleared, routed by load", node.node_id)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._session.close()
