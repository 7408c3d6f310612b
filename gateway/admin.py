"""Admin HTTP API (aiohttp): liveness, readiness and Prometheus metrics.

``/readyz`` says whether this replica can make cache-aware decisions (tokenizer loaded,
directory answering). Not ready does not mean traffic stops: Envoy fails open around kvgate.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from directory_client.types import Directory, DirectoryUnavailable
from gateway.metrics import REGISTRY


def build_admin_app(directory: Directory, *, readiness_timeout_s: float = 0.5) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        try:
            nodes = await asyncio.wait_for(directory.live_nodes(), readiness_timeout_s)
        except (DirectoryUnavailable, asyncio.TimeoutError) as e:
            return web.json_response({"ready": False, "directory": f"unavailable: {type(e).__name__}"}, status=503)
        return web.json_response({"ready": True, "directory": "ok", "live_nodes": len(nodes)})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
