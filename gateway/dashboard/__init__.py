"""The live dashboard: one static page (HTML, JS, CSS shipped in this package, no CDN) that polls
the admin server's ``/debug`` endpoints and draws the fleet, outcomes and hit rate over time,
and the recent decisions with their explanations.

The assets are read once, when the routes are added, and served from memory; they contain no
data, so they need no token (the page sends the token with each ``/debug`` call).
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

ASSETS = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "app.css": "text/css",
}


def load_assets() -> dict[str, tuple[bytes, str]]:
    """Asset name → (bytes, content type), read from the installed package."""
    root = resources.files(__name__)
    return {name: ((root / name).read_bytes(), ctype) for name, ctype in ASSETS.items()}


def add_routes(app: web.Application) -> None:
    assets = load_assets()

    def serve(name: str):
        body, ctype = assets[name]

        async def handler(_: web.Request) -> web.Response:
            return web.Response(
                body=body,
                content_type=ctype,
                charset="utf-8",
                headers={
                    "Cache-Control": "no-cache",
                    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'",
                    "X-Content-Type-Options": "nosniff",
                },
            )

        return handler

    async def redirect(_: web.Request) -> web.Response:
        raise web.HTTPFound("/dashboard/")

    app.router.add_get("/dashboard", redirect)
    app.router.add_get("/dashboard/", serve("index.html"))
    for name in ASSETS:
        if name != "index.html":
            app.router.add_get(f"/dashboard/{name}", serve(name))
