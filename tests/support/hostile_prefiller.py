"""A prefill node answering garbage with status 200, for the P/D sidecar's hostile tests.

Run as ``python -m tests.support.hostile_prefiller --port P --mode M``; every POST is answered:
- ``deep``: a JSON document nested 100,000 levels deep (Python's ``json`` raises RecursionError);
- ``endless``: ``{"kv_transfer_params": `` and then whitespace for ever, as fast as it is read.
"""

from __future__ import annotations

import argparse

from aiohttp import web

CHUNK = b" " * (1 << 20)


def build_app(mode: str) -> web.Application:
    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        if mode == "deep":
            return web.Response(body=b"[" * 100_000 + b"]" * 100_000, content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"kv_transfer_params": ')
        while True:
            await resp.write(CHUNK)

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=("deep", "endless"), required=True)
    a = p.parse_args()
    web.run_app(build_app(a.mode), host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
