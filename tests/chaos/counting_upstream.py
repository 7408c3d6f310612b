"""An HTTP upstream that holds each request for a fixed time and counts how many it held at once.

Run as ``python -m tests.chaos.counting_upstream --port P --name N --delay 0.3``. ``GET /_stats``
answers ``{"requests": n, "peak": most held at once}``; ``POST /_reset`` zeroes both. It stands
in for a node whose queue matters, so load spreading can be seen from the nodes' side.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web


def build_app(name: str, delay_s: float) -> web.Application:
    state = {"requests": 0, "now": 0, "peak": 0}

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        state["requests"] += 1
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        try:
            await asyncio.sleep(delay_s)
        finally:
            state["now"] -= 1
        return web.json_response({"node": name})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"node": name})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"node": name, "requests": state["requests"], "peak": state["peak"]})

    async def reset(_: web.Request) -> web.Response:
        state["requests"] = state["peak"] = 0
        return web.json_response({"node": name})

    app = web.Application(client_max_size=16 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/_stats", stats)
    app.router.add_post("/_reset", reset)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--delay", type=float, default=0.3)
    a = p.parse_args()
    web.run_app(build_app(a.name, a.delay), host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
