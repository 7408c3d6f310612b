"""Keeps a statically configured fleet alive in the directory.

Nodes that run a KV-event bridge are registered and heartbeated by it. Nodes of a static fleet
without one would never be "live", so kvgate probes them (``GET /health``) and heartbeats the
healthy ones itself by registering them again on every probe (registration is idempotent and also
restores a node after the directory lost its state, e.g. a Redis restart). A node that fails
``failures_to_drop`` probes in a row is deregistered, so the gateway stops sending it traffic at
once rather than after the heartbeat TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from directory_client.types import Directory, DirectoryUnavailable, NodeInfo

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
                return
            self._failures[node.node_id] += 1
            if node.node_id in self._registered and self._failures[node.node_id] >= self.failures_to_drop:
                await self.directory.deregister_node(node.node_id)
                self._registered.discard(node.node_id)
                log.warning("node %s (%s) failed %d probes; dropped", node.node_id, node.address, self.failures_to_drop)
        except DirectoryUnavailable:
            log.debug("directory unavailable while keeping node %s", node.node_id)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._session.close()
