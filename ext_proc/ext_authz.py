"""The same decision over plain HTTP, for Envoy's ext_authz filter (``with_request_body``).

Why a second integration: Python gRPC costs ~0.85 ms of CPU per ext_proc stream however it is
tuned, while an aiohttp handler on uvloop answering Envoy's ext_authz check costs ~0.2 ms and
adds under half a millisecond (FACTS.md). Both call ``RoutingCore.route``; only the wire differs.

Envoy sends the check as ``<method> /kvgate/authz<original path>`` with the buffered body. We
answer:
- 200 + ``x-gateway-destination-endpoint`` (+ pull headers): routed; Envoy copies the headers
  listed in ``allowed_upstream_headers`` onto the request and re-matches the route;
- 200 with no header: pass through (not an inference path) or fail open (kvgate could not decide);
- the client's own error (malformed body, unknown model, over a limit): that 4xx and the same
  JSON error body as the ext_proc path — ext_authz hands a 4xx to the client as a denial, which
  is why an internal problem is never answered with a 4xx.

One difference from ext_proc: ext_authz has no response phase, so the end of the response is
never seen. The node's load reservation is therefore released after the decision's estimate of
the whole service (``RouteResult.service_s``: queue + transfer + prefill + the answer's token
budget at the node's batch size), while the core settles its prefill part at the estimated first
token exactly as for ext_proc. ext_proc's accounting is exact; the README says which to choose.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from gateway.core import RouteResult, RoutingCore
from gateway.envoy_config import INFERENCE_PATHS
from gateway.logs import REQUEST_ID

log = logging.getLogger("kvgate.ext_authz")

AUTHZ_PATH_PREFIX = "/kvgate/authz"


class ExtAuthzService:
    def __init__(self, core: RoutingCore) -> None:
        self.core = core
        self._pending: dict[asyncio.TimerHandle, RouteResult] = {}

    async def check(self, request: web.Request) -> web.Response:
        path = request.path[len(AUTHZ_PATH_PREFIX) :] or "/"
        if request.method != "POST" or path not in INFERENCE_PATHS:
            return web.Response(status=200)
        request_id = request.headers.get("x-request-id", "")
        # Reset after: aiohttp may run the next request of this connection in the same context.
        token = REQUEST_ID.set(request_id)
        try:
            body = await request.read()
            result = await self.core.route(path, body, request_id, request.headers.get("traceparent", ""))
            if result.kind == "rejected":
                return web.Response(status=result.status, body=result.body, content_type="application/json")
            if result.kind != "routed":
                return web.Response(status=200)
            self._release_later(result)
            return web.Response(status=200, headers=dict(result.headers))
        finally:
            REQUEST_ID.reset(token)

    def _release_later(self, result: RouteResult) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._pending.pop(handle, None)
            loop.create_task(self.core.release(result))

        handle = loop.call_later(result.service_s, fire)
        self._pending[handle] = result

    async def aclose(self) -> None:
        """Give back every reservation still held, so a stopping replica leaves no phantom load."""
        pending, self._pending = self._pending, {}
        for handle in pending:
            handle.cancel()
        await asyncio.gather(*(self.core.release(r) for r in pending.values()))


def build_ext_authz_app(service: ExtAuthzService, *, max_body_bytes: int) -> web.Application:
    # A body over the limit must reach the core, which answers 413 with kvgate's JSON error.
    app = web.Application(client_max_size=max_body_bytes + (1 << 20))
    app.router.add_route("*", AUTHZ_PATH_PREFIX + "/{tail:.*}", service.check)
    return app
