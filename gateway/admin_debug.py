"""The admin server's debug endpoints: what kvgate decided, what it would decide, what it sees.

- ``GET /debug/decisions?limit=N`` — the last N decisions, newest first, each with every
  candidate's estimated cost and the reason (``gateway.decision_log``);
- ``POST /debug/explain[?path=/v1/completions]`` — the body of an inference request in, what
  kvgate would do with it now out; nothing is reserved, counted, logged or traced; a body with a
  ``cache_salt`` gets 403 (the answer would say who holds another tenant's prompt);
- ``GET /debug/nodes`` — every node with its load and cached blocks (``gateway.fleet_status``);
- ``GET /debug/timeline`` — per-second outcome counts and token totals of recent traffic;
- ``GET /dashboard`` — the live page over the endpoints above (``gateway.dashboard``).

They reveal traffic (model names, prompt sizes, request IDs, the fleet's addresses), so they are
off unless configured, and every ``/debug`` call needs ``Authorization: Bearer <admin token>``.
The dashboard's HTML and assets hold no data and are served without the token; the page reads
the token from its URL fragment (``/dashboard#token=…``), which browsers never send to a server.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from gateway import dashboard
from gateway.core import RoutingCore
from gateway.decision_log import DecisionLog, describe
from gateway.envoy_config import INFERENCE_PATHS
from gateway.fleet_status import FleetMonitor

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CHAT_PATH = "/v1/chat/completions"
_COMPLETIONS_PATH = "/v1/completions"


class DebugApi:
    def __init__(self, core: RoutingCore, decisions: DecisionLog, monitor: FleetMonitor, *, token: str) -> None:
        if not token:
            raise ValueError("the debug endpoints need a bearer token")
        self._core = core
        self._decisions = decisions
        self._monitor = monitor
        self._expected = f"Bearer {token}".encode()

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(self._auth)
        app.router.add_get("/debug/decisions", self.decisions)
        app.router.add_post("/debug/explain", self.explain)
        app.router.add_get("/debug/nodes", self.nodes)
        app.router.add_get("/debug/timeline", self.timeline)
        dashboard.add_routes(app)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/debug/") and not self._authorized(request):
            return web.json_response(
                {"error": "this endpoint needs Authorization: Bearer <admin token>"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="kvgate-admin"'},
            )
        return await handler(request)

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")  # bytes not UTF-8: 401, not 500
        return hmac.compare_digest(given, self._expected)

    async def decisions(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        return web.json_response(
            {"recorded": self._decisions.recorded, "decisions": self._decisions.recent(max(limit, 0))}
        )

    async def explain(self, request: web.Request) -> web.Response:
        body = await request.read()
        path = request.query.get("path") or _guess_path(body)
        if path not in INFERENCE_PATHS:
            return web.json_response({"error": f"path must be one of {sorted(INFERENCE_PATHS)}"}, status=400)
        if _salted(body):
            return web.json_response(
                {"error": "explain does not answer for a prompt with a cache_salt: it would tell which node holds "
                          "another tenant's prompt"},
                status=403,
            )  # fmt: skip
        result = await self._core.explain(path, body)
        return web.json_response({"path": path, "would_route": result.kind == "routed", **describe(result)})

    async def nodes(self, _: web.Request) -> web.Response:
        return web.json_response((await self._monitor.snapshot()).as_dict())

    async def timeline(self, _: web.Request) -> web.Response:
        return web.json_response({"seconds": self._decisions.timeline()})


def _salted(body: bytes) -> bool:
    """Does the body carry a ``cache_salt`` (whose cache is a tenant's own business)?"""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(doc, dict) and doc.get("cache_salt") is not None


def _guess_path(body: bytes) -> str:
    """A body with ``messages`` is a chat request; anything else is treated as a completion."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return _CHAT_PATH  # the core reports the JSON error either way
    return _CHAT_PATH if isinstance(doc, dict) and "messages" in doc else _COMPLETIONS_PATH
