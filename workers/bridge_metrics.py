"""``kvgate bridge --metrics-port``: /metrics served on the bridge's event loop.

Why not prometheus_client's ``start_http_server``: it gives every connection a thread that waits
for the request with no deadline, so a client opening connections and sending half a request
line held a thread and a descriptor each until the bridge ran out of descriptors (its liveness
probe, which scrapes this port, then failed). Here the connections get kvgate's admin-port bounds
(``gateway.conn_gate``): a head within 10 s, at most 256 connections, the oldest closed first.
"""

from __future__ import annotations

import asyncio

import prometheus_client
from aiohttp import web

from gateway.conn_gate import ConnectionGuard


class MetricsServer:
    """Serves the default Prometheus registry at ``/metrics``; ``start``, then ``aclose``."""

    def __init__(self) -> None:
        self.closed = {"head_timeout": 0, "evicted": 0}  # what the guard closed, by reason
        self._guard = ConnectionGuard(self._count)  # the admin port's bounds
        app = web.Application(middlewares=[self._guard.middleware])
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)

    def _count(self, reason: str) -> None:
        self.closed[reason] += 1

    async def _metrics(self, _: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, prometheus_client.generate_latest)
        return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    async def start(self, host: str, port: int) -> None:
        await self._runner.setup()
        await self._guard.listen(self._runner, host, port)

    async def aclose(self) -> None:
        await self._guard.close()
        await self._runner.cleanup()
