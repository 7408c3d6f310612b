"""Admin HTTP API (aiohttp): liveness, readiness, Prometheus metrics, and (when enabled) the
debug endpoints and the live dashboard (``gateway.admin_debug``, ``gateway.dashboard``).

``/readyz`` says whether this replica can make cache-aware decisions (tokenizer loaded,
directory answering), and which tokenizer and chat template it loaded: with another model's,
no block key ever matches and routing silently degrades to load only. Not ready does not mean traffic stops: Envoy fails open around kvgate.

``/metrics`` renders three registries: the request path's (``gateway.metrics.REGISTRY``),
prometheus_client's default one (the in-process KV-event bridges register there, and so do the
process and GC collectors), and this app's own, whose collectors read the tokenizer cache and
the fleet snapshot at scrape time.
"""

from __future__ import annotations

import asyncio
import logging

import prometheus_client
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from directory_client.types import Directory, DirectoryUnavailable
from gateway.admin_debug import DebugApi
from gateway.admin_drain import DrainApi
from gateway.fleet_status import FleetMonitor
from gateway.metrics import REGISTRY, FleetCollector, TokenizerCacheCollector, exposition
from tokenizer import PromptTokenizer

log = logging.getLogger("kvgate.admin")


def build_admin_app(
    directory: Directory,
    *,
    tokenizer: PromptTokenizer | None = None,
    monitor: FleetMonitor | None = None,
    debug: DebugApi | None = None,
    drain: DrainApi | None = None,
    readiness_timeout_s: float = 0.5,
    client_max_size: int = 9 << 20,
) -> web.Application:
    """The admin app; ``debug`` None leaves ``/debug/*`` and ``/dashboard`` unrouted (404), ``drain``
    None ``/admin/drain/*``."""
    own = CollectorRegistry(auto_describe=False)
    if tokenizer is not None:
        own.register(TokenizerCacheCollector(lambda: tokenizer.cache_stats))
    if monitor is not None:
        own.register(FleetCollector(monitor.last_nodes))
    registries = (REGISTRY, prometheus_client.REGISTRY, own)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        body: dict[str, object] = {}
        ready = True
        if tokenizer is not None:
            try:
                tokenizer.encode_text("ready", add_special_tokens=False)
                body["tokenizer"] = {"loaded": True, **tokenizer.loaded()}
            except Exception as e:  # a broken tokenizer makes every decision fail open: not ready
                ready = False
                body["tokenizer"] = {"loaded": False, "error": f"{type(e).__name__}: {e}"}
        try:
            nodes = await asyncio.wait_for(directory.live_nodes(), readiness_timeout_s)
            body["directory"] = "ok"
            body["live_nodes"] = len(nodes)
        except (DirectoryUnavailable, asyncio.TimeoutError) as e:
            ready = False
            body["directory"] = f"unavailable: {type(e).__name__}"
        if monitor is not None and (degraded := monitor.degraded()):
            body["degraded_nodes"] = degraded  # routed by load only; the replica itself is ready
        body["ready"] = ready
        return web.json_response(body, status=200 if ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        if monitor is not None:
            try:
                await monitor.snapshot()
            except Exception:  # the scrape still answers, with the last snapshot
                log.exception("fleet snapshot failed during a scrape")
        body = await asyncio.get_running_loop().run_in_executor(None, exposition, registries)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=client_max_size)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    if debug is not None:
        debug.add_routes(app)
    if drain is not None:
        drain.add_routes(app)
    return app
