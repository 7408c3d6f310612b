"""The admin API's drain endpoints (``gateway.drain``): what ``kvgate drain`` and a pod's
``preStop`` hook call.

- ``POST /admin/drain/{node_id}?deadline_s=30`` — drain the node and answer, by the deadline, with
  what was done (``DrainReport``): 200 when it completed, 202 when the deadline came first (the
  node is still marked draining; its pod may go), 404 for a node that is not live;
- ``DELETE /admin/drain/{node_id}`` — take the node back (an aborted scale-in).

A drain changes routing for the whole fleet, so both need ``Authorization: Bearer <admin token>``
and are routed only when ``admin.token`` (or ``token_file``) is set.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from collections.abc import Mapping

from directory_client.types import DirectoryUnavailable
from gateway.core import RoutingCore
from gateway.drain import DEFAULT_DEADLINE_S, Drainer, http_copy
from gateway.elastic import DrainingNodes
from tokenizer.keys import request_seed

MAX_DEADLINE_S = 3600.0


class DrainApi:
    def __init__(self, drainer: Drainer, draining: DrainingNodes, *, token: str) -> None:
        if not token:
            raise ValueError("the drain endpoints need a bearer token")
        self._drainer = drainer
        self._draining = draining
        self._expected = f"Bearer {token}".encode()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/drain/{node_id}", self.drain)
        app.router.add_delete("/admin/drain/{node_id}", self.undrain)

    def _refused(self, request: web.Request) -> web.Response | None:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")  # bytes not UTF-8: 401, not 500
        if hmac.compare_digest(given, self._expected):
            return None
        return web.json_response(
            {"error": "this endpoint needs Authorization: Bearer <admin token>"},
            status=401, headers={"WWW-Authenticate": 'Bearer realm="kvgate-admin"'},
        )  # fmt: skip

    async def drain(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        raw = request.query.get("deadline_s", str(DEFAULT_DEADLINE_S))
        try:
            deadline_s = float(raw)
        except ValueError:
            deadline_s = float("nan")
        if not 0 < deadline_s <= MAX_DEADLINE_S:
            return web.json_response({"error": f"deadline_s must be a number in (0, {MAX_DEADLINE_S:g}], got {raw!r}"}, status=400)
        node_id = request.match_info["node_id"]
        try:
            report = await self._drainer.drain(node_id, deadline_s)
        except LookupError as e:
            return web.json_response({"error": str(e)}, status=404)
        except DirectoryUnavailable as e:
            return web.json_response({"error": f"the directory is unavailable: {e}"}, status=503)
        return web.json_response(report.as_dict(), status=200 if report.complete else 202)

    async def undrain(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        node_id = request.match_info["node_id"]
        try:
            await self._drainer.directory.set_draining(node_id, 0)
            await self._draining.refresh()
        except DirectoryUnavailable as e:
            return web.json_response({"error": f"the directory is unavailable: {e}"}, status=503)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"node_id": node_id, "draining": False})


def drain_api(core: RoutingCore, *, token: str, link: str, adapters: Mapping[str, str]) -> DrainApi:
    """The endpoints over the gateway's own directory, policy and profile: a drain plans its copies
    exactly as this replica would route the prompts."""
    adapters = dict(adapters)
    drainer = Drainer(
        core.directory, core.policy, core.profile, http_copy,
        seed_of=lambda model: request_seed(model, adapters=adapters), block_size=core.limits.block_size,
        link=link, on_marked=core.draining.refresh,
    )  # fmt: skip
    return DrainApi(drainer, core.draining, token=token)
