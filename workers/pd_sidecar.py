"""``kvgate pd-sidecar``: the decode node's half of disaggregated prefill/decode (llm-d's contract).

It listens where the gateway routes (the decode node's address) and forwards to the local engine.
A generation request carrying ``x-prefiller-host-port`` (set by kvgate when it splits a request)
is first sent to that prefill node with ``max_tokens: 1`` and ``kv_transfer_params:
{"do_remote_decode": true}``; the ``kv_transfer_params`` of its answer are put into the request,
which then runs on the local engine, whose connector fetches the prompt's KV from the prefill
node (vLLM's NIXL connector, or the simulated engine's transfer agent). Without the header the
request passes through unchanged.

With ``--protocol sglang`` the handshake is SGLang's disaggregation mode instead: the request,
with ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` added, goes to the prefill node and
to the local decode-mode engine at the same time, and the two meet in that room to move the KV.

Faults never reach the client (nixl): a prefill node that errs, times out, answers without transfer
parameters or is not in ``--prefiller`` (when given) leaves the request as it came, served whole
on the local engine, and ``kvgate_pd_sidecar_fallbacks_total{reason}`` counts it. The prefill nodes
it may call are said at start (``--prefiller``, or ``--any-prefiller`` explicitly): a client
reaching the port past Envoy (which strips the header) must not pick a host to receive its request. The sidecar's
own metrics are at ``/pd-sidecar/metrics``; every other path is the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import secrets
import signal
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from gateway.conn_gate import ConnectionGuard
from gateway.envoy_config import PREFILLER_HEADER

log = logging.getLogger("kvgate.pd_sidecar")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PREFILLED_BY_HEADER = "x-kvgate-prefilled-by"  # on the answer of a split request: the node that prefilled it
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.split = Counter(
            "kvgate_pd_sidecar_split", "Requests prefilled on a prefill node, then decoded here", registry=self.registry
        )
        self.closed_connections = Counter(
            "kvgate_pd_sidecar_closed_connections",
            "Connections the sidecar closed before a request arrived whole, by why (head_timeout: 408; evicted: past 256 waiting)",
            ["reason"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "kvgate_pd_sidecar_fallbacks",
            "Split requests served whole here instead, by why (prefill_error, prefill_timeout, no_transfer_params, untrusted_prefiller)",
            ["reason"],
            registry=self.registry,
        )


PROTOCOLS = ("nixl", "sglang")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
# what x-prefiller-host-port may be: a host name, an IPv4 address or a bracketed IPv6 one, and a port
HOST_PORT = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}")
MAX_PREFILL_ANSWER_BYTES = 1 << 20  # a prefill's answer (one token, kv_transfer_params) is ~1 KiB


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """An answer's body; ``ValueError`` past ``limit`` bytes, so a prefill node answering without
    end costs the sidecar ``limit`` bytes, not its memory until the prefill timeout."""
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise ValueError(f"answer over {limit} bytes")
    return bytes(body)


def sglang_bootstrap(prefiller: str, bootstrap_port: int) -> dict[str, Any]:
    """The fields SGLang's disaggregation mode reads from a request (its OpenAI ``CompletionRequest``
    and ``ChatCompletionRequest``): the prefill node's host, its bootstrap server's port, and a
    room number both nodes meet in (a random 63-bit integer, as SGLang's own router draws it)."""
    host = prefiller.rsplit(":", 1)[0]
    return {"bootstrap_host": host, "bootstrap_port": bootstrap_port, "bootstrap_room": secrets.randbits(63)}


class Sidecar:
    """Forwards to ``engine`` (a base URL); runs the prefill step for split requests.

    ``protocol`` is how the prefill node hands over its KV: ``nixl`` (vLLM's ``kv_transfer_params``,
    the prefill first) or ``sglang`` (SGLang's bootstrap: both nodes get the request at once).
    """

    def __init__(
        self, engine: str, *, prefill_timeout_s: float, prefillers: frozenset[str] = frozenset(),
        protocol: str = "nixl", bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
    ) -> None:  # fmt: skip
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.engine = engine.rstrip("/")
        self.prefill_timeout_s = prefill_timeout_s
        self.prefillers = prefillers
        self.protocol = protocol
        self.bootstrap_port = bootstrap_port
        self._prefills: set[asyncio.Task[None]] = set()  # SGLang prefill calls in flight
        self.metrics = SidecarMetrics()
        # a request (head and body) within 10 s, at most 256 connections waiting for one: a client
        # trickling heads no longer holds the port's descriptors (Envoy's requests in progress are
        # never closed for it)
        self.guard = ConnectionGuard(lambda why: self.metrics.closed_connections.labels(why).inc(), whole_requests=True)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def callable_prefiller(self, prefiller: str) -> bool:
        """The header names a node this sidecar may call: in ``--prefiller`` when given, and always a
        plain ``host:port`` (no path, user or query a URL built from it would take); else counted."""
        if (self.prefillers and prefiller not in self.prefillers) or not HOST_PORT.fullmatch(prefiller):
            log.warning("x-prefiller-host-port %r is not a prefiller this sidecar may call", prefiller[:200])
            self.metrics.fallbacks.labels("untrusted_prefiller").inc()
            return False
        return True

    async def prefill(self, prefiller: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """The prefill node's ``kv_transfer_params`` for ``body``, or None (counted) to serve it whole."""
        if not self.callable_prefiller(prefiller):
            return None
        # one first token of one answer: the prompt's KV is what the decode node fetches, its n answers decode there
        ask = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
        ask.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                async with self.session.post(f"http://{prefiller}{path}", json=ask, headers=headers) as resp:
                    answer = json.loads(await _read_at_most(resp, MAX_PREFILL_ANSWER_BYTES)) if resp.status == 200 else None
                    status = resp.status
        except TimeoutError:
            log.warning("prefill on %s timed out after %.1f s: serving whole", prefiller, self.prefill_timeout_s)
            self.metrics.fallbacks.labels("prefill_timeout").inc()
            return None
        except (aiohttp.ClientError, ValueError, RecursionError, OSError) as e:  # RecursionError: JSON nested too deep
            log.warning("prefill on %s failed (%s): serving whole", prefiller, e)
            self.metrics.fallbacks.labels("prefill_error").inc()
            return None
        if answer is None:
            log.warning("prefill on %s answered %d: serving whole", prefiller, status)
            self.metrics.fallbacks.labels("prefill_error").inc()
            return None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            self.metrics.fallbacks.labels("no_transfer_params").inc()
            return None
        self.metrics.split.inc()
        return params

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS and k.lower() != PREFILLER_HEADER}
        prefiller = request.headers.get(PREFILLER_HEADER, "").strip()
        answer_headers: dict[str, str] = {}
        if prefiller and request.method == "POST" and request.path in GENERATION_PATHS:
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                body = None  # the engine answers the client's mistake
            if isinstance(body, dict) and self.protocol == "sglang":
                return await self.sglang_split(request, prefiller, body, headers)
            if isinstance(body, dict):
                params = await self.prefill(prefiller, request.path, body, {"content-type": "application/json"})
                if params is not None:
                    raw = json.dumps({**body, "kv_transfer_params": params}).encode()
                    answer_headers[PREFILLED_BY_HEADER] = prefiller
        return await self.forward(request, raw, headers, answer_headers)

    async def sglang_split(
        self, request: web.Request, prefiller: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """SGLang's handshake: the request with the same bootstrap fields goes to the prefill node
        and to the local (decode-mode) engine at once; the engine's answer is the client's, the
        prefill node's is read and dropped. A decode-mode engine cannot compute a prompt itself,
        so there is no whole-request fallback: a failed prefill is counted, and the engine's own
        bootstrap timeout ends the request."""
        if not self.callable_prefiller(prefiller):  # passed on without bootstrap
            return await self.forward(request, json.dumps(body).encode(), headers)
        split = {**body, **sglang_bootstrap(prefiller, self.bootstrap_port)}
        raw = json.dumps(split).encode()
        prefill = asyncio.create_task(self._sglang_prefill(prefiller, request.path, raw))  # ends by its timeout at most
        self._prefills.add(prefill)
        prefill.add_done_callback(self._prefills.discard)
        return await self.forward(request, raw, headers, {PREFILLED_BY_HEADER: prefiller})

    async def _sglang_prefill(self, prefiller: str, path: str, raw: bytes) -> None:
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                async with self.session.post(
                    f"http://{prefiller}{path}", data=raw, headers={"content-type": "application/json"}
                ) as resp:
                    async for _ in resp.content.iter_any():  # read and dropped as it comes, never kept whole
                        pass
                    if resp.status != 200:
                        log.warning("prefill on %s answered %d", prefiller, resp.status)
                        self.metrics.fallbacks.labels("prefill_error").inc()
                        return
        except TimeoutError:
            self.metrics.fallbacks.labels("prefill_timeout").inc()
            return
        except (aiohttp.ClientError, OSError) as e:
            log.warning("prefill on %s failed (%s)", prefiller, e)
            self.metrics.fallbacks.labels("prefill_error").inc()
            return
        self.metrics.split.inc()

    async def forward(
        self, request: web.Request, raw: bytes, headers: dict[str, str], answer_headers: dict[str, str] | None = None
    ) -> web.StreamResponse:
        """The request to the local engine; its answer streamed back as it comes (plus ``answer_headers``)."""
        url = f"{self.engine}{request.path_qs}"
        try:
            upstream = await self.session.request(request.method, url, data=raw, headers=headers)
        except aiohttp.ClientError as e:
            return web.json_response({"error": {"message": f"engine unreachable: {e}", "code": 502}}, status=502)
        async with upstream:
            resp = web.StreamResponse(
                status=upstream.status,
                headers={**{k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}, **(answer_headers or {})},
            )
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[self.guard.middleware])

        async def lifecycle(app: web.Application) -> Any:
            yield
            await self.close()

        app.cleanup_ctx.append(lifecycle)
        app.router.add_get("/pd-sidecar/metrics", self.metrics_page)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port the gateway routes to (the decode node's address)")
    parser.add_argument("--engine", required=True, help="the local engine's base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--prefill-timeout-s", type=float, default=30.0, help="a slower prefill is abandoned: serve whole")
    parser.add_argument(
        "--protocol", choices=PROTOCOLS, default="nixl",
        help="nixl: vLLM's kv_transfer_params, prefill first (default); sglang: SGLang's bootstrap fields, both at once",
    )
    parser.add_argument(
        "--bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT,
        help="with --protocol sglang: the prefill nodes' --disaggregation-bootstrap-port (default 8998)",
    )
    parser.add_argument(
        "--prefiller", action="append", default=[], metavar="HOST:PORT",
        help="a prefill node this sidecar may call (repeat): the fleet's prefill nodes",
    )
    parser.add_argument(
        "--any-prefiller", action="store_true",
        help="call whatever x-prefiller-host-port names instead (only where nothing but the gateway's Envoy reaches this port)",
    )


def run(args: argparse.Namespace) -> int:
    if not args.prefill_timeout_s > 0:
        raise SystemExit("--prefill-timeout-s must be positive")
    if not args.prefiller and not args.any_prefiller:
        # a client reaching this port past Envoy (which strips the header) would name any host
        # for the sidecar to POST its request to: the fleet's prefill nodes must be said
        raise SystemExit("kvgate pd-sidecar: name the fleet's prefill nodes with --prefiller HOST:PORT (repeat), "
                         "or pass --any-prefiller where only the gateway's Envoy reaches this port")  # fmt: skip
    if args.prefiller and args.any_prefiller:
        raise SystemExit("kvgate pd-sidecar: --prefiller and --any-prefiller exclude each other")
    bad = [p for p in args.prefiller if not HOST_PORT.fullmatch(p)]
    if bad:
        raise SystemExit(f"kvgate pd-sidecar: --prefiller must be HOST:PORT, got {bad[0]!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.any_prefiller:
        log.warning("--any-prefiller: any x-prefiller-host-port is called; only the gateway may reach this port")
    sidecar = Sidecar(args.engine, prefill_timeout_s=args.prefill_timeout_s, prefillers=frozenset(args.prefiller),
                      protocol=args.protocol, bootstrap_port=args.bootstrap_port)
    asyncio.run(_serve(sidecar, args.host, args.port, args.engine))
    return 0


async def _serve(sidecar: Sidecar, host: str, port: int, engine: str) -> None:
    """Serves until SIGINT/SIGTERM, through the sidecar's connection guard."""
    runner = web.AppRunner(sidecar.app(), access_log=None)
    await runner.setup()
    try:
        await sidecar.guard.listen(runner, host, port)
        print(f"kvgate pd-sidecar on {host}:{port} -> {engine}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await sidecar.guard.close()
        await runner.cleanup()
