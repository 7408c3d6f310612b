"""A minimal HTTP upstream for request-path tests: says which node answered and what it saw.

Run as ``python -m tests.support.echo_upstream --port P --name B [--delay S]``. It is a real server
on a real socket; it does no inference (the simulated engine is tested elsewhere), so routing
tests stay fast. ``--delay`` holds each request, standing in for a node whose queue matters:
``GET /_stats`` then also says how many it held at once (``peak``); ``POST /_reset`` zeroes counts.
``--fail-status`` makes a broken node: every request answered with that status, health still 200.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web


def build_app(name: str, delay_s: float, fail_status: int = 0) -> web.Application:
    seen: list[dict] = []
    held = {"now": 0, "peak": 0}

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        entry = {
            "node": name,
            "method": request.method,
            "path": request.path,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body_len": len(body),
        }
        seen.append(entry)
        held["now"] += 1
        held["peak"] = max(held["peak"], held["now"])
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
        finally:
            held["now"] -= 1
        if fail_status:  # a broken node: fails every request at once, yet passes its health check
            return web.json_response({"error": "broken", **entry}, status=fail_status)
        return web.json_response(entry)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"node": name})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"node": name, "requests": len(seen), "peak": held["peak"], "seen": seen[-50:]})

    async def reset(_: web.Request) -> web.Response:
        seen.clear()
        held["peak"] = 0
        return web.json_response({"node": name})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/_stats", stats)
    app.router.add_post("/_reset", reset)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--fail-status", type=int, default=0, help="answer every request with this status (0: never)")
    a = p.parse_args()
    web.run_app(build_app(a.name, a.delay, a.fail_status), host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
