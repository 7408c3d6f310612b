"""The same decision over plain HTTP, for Envoy's ext_authz filter (``with_request_body``).

Why a second integration: Python gRPC costs ~0.85 ms of CPU per ext_proc stream however it is
tuned, while an HTTP check is cheap if the HTTP layer is. The server here is a bare
``asyncio.Protocol`` over ``httptools`` (llhttp): with Envoy sending ~35 KB bodies it costs
~35 µs of CPU per check where an aiohttp application cost ~128 µs, against a budget of 300 µs
for the whole check including the decision. Both integrations call ``RoutingCore.route``; only
the wire differs.

Envoy sends the check as ``<method> /kvgate/authz<original path>`` with the buffered body. We
answer:
- 200 + ``x-gateway-destination-endpoint`` (+ pull headers): routed; Envoy copies the headers
  listed in ``allowed_upstream_headers`` onto the request and re-matches the route;
- 200 with no header: pass through (not an inference path) or fail open (kvgate could not decide);
- the client's own error (malformed body, unknown model, over a limit): that 4xx and the same
  JSON error body as the ext_proc path — ext_authz hands a 4xx to the client as a denial, which
  is why an internal problem is answered 500 (Envoy's ``failure_mode_allow`` passes it through),
  never with a 4xx.

One difference from ext_proc: ext_authz has no response phase, so the end of the response is
never seen. The node's load is therefore held for the decision's estimate of the whole service
(``RouteResult.service_s``: queue + transfer + prefill + the answer's token budget at the node's
batch size) and the directory drops it by itself then (``route(sees_response_end=False)``): no
release call, and no phantom load if this replica dies. Its prefill part stops counting at the
estimated first token exactly as for ext_proc. ext_proc's accounting is exact; the README says
which to choose. A check whose connection closed before its answer (Envoy gave up on it) gives
its load back at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from http import HTTPStatus
from typing import cast
from urllib.parse import unquote

import httptools
from prometheus_client import Counter

from gateway.conn_gate import UntrustedConnections
from gateway.core import RouteResult, RoutingCore, error_body
from gateway.envoy_config import CALLER_TOKEN_HEADER, INFERENCE_PATHS
from gateway.logs import REQUEST_ID
from gateway.metrics import CLOSED_CONNECTIONS, REGISTRY
from gateway.sessions import RETENTION_HEADER, SESSION_HEADER

log = logging.getLogger("kvgate.ext_authz")

AUTHZ_PATH_PREFIX = "/kvgate/authz"
CALLER_TOKEN = CALLER_TOKEN_HEADER.encode()
SESSION = SESSION_HEADER.encode()
RETENTION = RETENTION_HEADER.encode()
UNAUTHENTICATED = Counter(
    "kvgate_ext_authz_unauthenticated",
    "ext_authz checks without Envoy's caller token, passed through unrouted",
    registry=REGISTRY,
)
BODY_SLACK = 1 << 20  # bodies up to max_body_bytes + this reach the core, which answers its own 413
PIPELINE_DEPTH = 8  # complete requests waiting on one connection before we stop reading it
LINGER_S = 2.0  # after a last answer (413, 400), how long unread input is drained before closing
CLOSE_GRACE_S = 5.0  # on shutdown, how long checks in progress may take to finish
MAX_HEAD_BYTES = 64 << 10  # request line + headers, counted while they arrive (Envoy sends < 60 KiB)
RECEIVE_TIMEOUT_S = 10.0  # a request that has begun must have arrived whole by then (slow clients)
IDLE_TIMEOUT_S = 300.0  # a connection with nothing received, queued or being answered is closed
SWEEP_S = 1.0  # how often connections are checked against the two timeouts
MAX_UNTRUSTED = 256  # connections held that have not yet carried a whole request with Envoy's token
MAX_CONNECTIONS = 4096  # connections held in all; past it the one idle the longest is closed

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_JSON = b"content-type: application/json\r\n"
_PLAIN = b"content-type: text/plain\r\n"


def _http_response(status: int, headers: bytes = b"", body: bytes = b"") -> bytes:
    """One whole HTTP/1.1 response; ``headers``: header lines, each ending in CRLF."""
    reason = _REASONS.get(status, b"")
    return b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, reason, len(body), headers, body)


@lru_cache(maxsize=4096)
def _routed_answer(headers: tuple[tuple[str, str], ...], connection: bytes) -> bytes:
    """200 with the routing headers: a pure function of them, and a fleet routes to few distinct
    ones (a node, or a node pulling from another), so each answer is built once."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers).encode("latin-1")
    return _http_response(200, lines + connection)


def _internal_error(connection: bytes) -> bytes:
    """500, never a 4xx: Envoy's ``failure_mode_allow`` then passes the request through."""
    return _http_response(500, _PLAIN + connection, b"kvgate ext_authz internal error")


def _closing_error(status: int, message: str) -> bytes:
    return _http_response(status, _PLAIN + b"connection: close\r\n", message.encode())


def _decision_path(url: bytes) -> str | None:
    """The original request path Envoy checks, or None when ``url`` is not under our prefix."""
    path = url.partition(b"?")[0].decode("latin-1")
    if "%" in path:  # decoded as aiohttp did, so an escaped path is judged the same
        path = unquote(path)
    if path == AUTHZ_PATH_PREFIX:
        return "/"
    if path.startswith(AUTHZ_PATH_PREFIX + "/"):
        return path[len(AUTHZ_PATH_PREFIX) :]
    return None


class ExtAuthzService:
    """The ext_authz check server: ``start`` listens, ``aclose`` stops.

    ``caller_token``: the token Envoy sends with every check (``x-kvgate-authz-token``, added by
    the rendered filter). A check without it is answered 200 with nothing routed: anyone else
    reaching the port would learn which node holds a prompt, under any tenant's ``cache_salt``.
    """

    def __init__(self, core: RoutingCore, *, caller_token: str = "") -> None:
        self.core = core
        self.caller_token = caller_token.encode()
        self.warned = False
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._sweeper: asyncio.Task | None = None
        # Envoy's connections carry its token on their first check; the others are capped, the
        # oldest closed first, so a flood of them cannot use up the descriptors Envoy needs
        self._untrusted: UntrustedConnections[_Connection] = UntrustedConnections(MAX_UNTRUSTED, _evict)

    async def start(self, host: str, port: int, *, max_body_bytes: int) -> None:
        """Listen on exactly ``host:port``; returns once the socket is bound."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self, max_body_bytes), host, port)
        self._sweeper = loop.create_task(self._sweep())

    def _make_room(self, newcomer: _Connection) -> None:
        """Past ``MAX_CONNECTIONS``, close the connection idle the longest (the newcomer if none
        is idle). Without a caller token any client's request makes its connection look like
        Envoy's; Envoy's pooled connections are in use, an attacker's wait."""
        if len(self._connections) <= MAX_CONNECTIONS:
            return
        idle = [c for c in self._connections if c is not newcomer and c.idle()]
        victim = min(idle, key=lambda c: c.last_active) if idle else newcomer
        _evict(victim)

    async def _sweep(self) -> None:
        """Time out slow and idle connections: one timer for all of them, not one per request."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            now = loop.time()
            for conn in list(self._connections):
                conn.check_timeouts(now)

    async def check(
        self, method: str, path: str, body: bytes, request_id: str, traceparent: str, session: str = "", retention: str = ""
    ) -> RouteResult | None:
        """The decision for one check of ``path`` (the original path); None: not ours, pass through.
        ``session``, ``retention``: the request's ``x-session-id`` and ``x-kvgate-retention``
        (Envoy forwards them: the rendered filter's ``allowed_headers``)."""
        if method != "POST" or path not in INFERENCE_PATHS:
            return None
        # Reset after: the next check on this connection runs in the same task.
        token = REQUEST_ID.set(request_id)
        try:
            return await self.core.route(
                path, body, request_id, traceparent, sees_response_end=False, session_header=session, retention_header=retention
            )
        finally:
            REQUEST_ID.reset(token)

    async def aclose(self) -> None:
        """Stop listening and close connections; checks in progress finish and give their load back
        at once. Routed requests keep theirs: they are still running on their nodes, and the
        directory drops it at their estimated end."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
            connections = list(self._connections)
            for conn in connections:
                conn.close()
            workers = [c.worker for c in connections if c.worker is not None]
            if workers:  # idle ones end at once; busy ones when their check does
                await asyncio.wait(workers, timeout=CLOSE_GRACE_S)
            await self._server.wait_closed()
            self._server = None


def _evict(conn: _Connection) -> None:
    CLOSED_CONNECTIONS.labels("ext_authz", "evicted").inc()
    conn.close()


@dataclass(slots=True)
class _Request:
    method: str
    path: str | None  # the original path; None: not under AUTHZ_PATH_PREFIX
    body: bytes
    request_id: str
    traceparent: str
    connection: bytes  # the ``connection`` header line the answer carries (b"": none)
    keep_alive: bool
    caller_token: bytes  # the x-kvgate-authz-token it came with
    session: str  # its x-session-id ("" if none)
    retention: str  # its x-kvgate-retention ("" if none)


class _Connection(asyncio.Protocol):
    """One client connection: llhttp parses, complete requests queue up, one task per connection
    answers them in order (pipelining-safe); reading pauses while too many wait or the client
    does not read. What a client can make it hold is bounded: ``MAX_HEAD_BYTES`` of request line
    and headers (431), a body up to ``max_body_bytes + BODY_SLACK`` (413), ``PIPELINE_DEPTH``
    requests or ``max_body_bytes`` of bodies queued (reading pauses), ``RECEIVE_TIMEOUT_S`` to
    send a request (408), ``IDLE_TIMEOUT_S`` doing nothing (closed)."""

    def __init__(self, service: ExtAuthzService, max_body_bytes: int) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.worker: asyncio.Task | None = None  # answers the queue while the connection lives
        self._busy = False  # a check is being decided
        self._wakeup: asyncio.Future[None] | None = None  # the idle worker waits on this
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: deque[_Request | bytes] = deque()  # bytes: a last answer, then close
        self._done = False  # a last answer is queued: further input is read and dropped
        self._reading = True
        self._write_paused = False
        self._linger: asyncio.TimerHandle | None = None
        self._queued_bytes = 0  # bodies of the queued requests
        self._loop = asyncio.get_running_loop()
        self._active = self._loop.time()  # when something was last received or answered
        self._began: float | None = None  # when the request being received began (None: between requests)
        self._head_bytes = 0  # bytes received since the request being received began, until its headers end
        # the request being parsed
        self._url = b""
        self._request_id = b""
        self._traceparent = b""
        self._expect_continue = False
        self._caller_token = b""
        self._session = self._retention = b""
        self._chunks: list[bytes] = []
        self._size = 0

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.service._connections.add(self)
        self.service._untrusted.admit(self)
        self.service._make_room(self)
        self.worker = asyncio.get_running_loop().create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.service._connections.discard(self)
        self.service._untrusted.forget(self)
        if self._linger is not None:
            self._linger.cancel()
        self._wake()  # an idle worker sees the transport closed and ends

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        self._active = self._loop.time()
        in_head = self._began is None or self._head_bytes >= 0
        if in_head:
            self._head_bytes += len(data)
        if self._began is None:  # the deadline runs from the first byte, even CRLFs before a request line
            self._began = self._active
        try:
            self._parser.feed_data(data)
            # still in a request's head (a message begun, or bytes before its first line)
            if in_head and self._head_bytes > MAX_HEAD_BYTES and not self._done:
                self._last(_closing_error(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes"))
        except httptools.HttpParserCallbackError:  # our bug, not the client's: never a 4xx
            log.exception("ext_authz: parsing callback failed")
            self._last(_internal_error(b"connection: close\r\n"))
        except httptools.HttpParserError as e:
            body = b"malformed HTTP request: %s" % str(e).encode()
            self._last(_http_response(400, _PLAIN + b"connection: close\r\n", body))
        except httptools.HttpParserUpgrade:  # Envoy never asks; answer what came before, then close
            self._last(b"")

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    @property
    def last_active(self) -> float:
        return self._active

    def idle(self) -> bool:
        """Nothing being received, queued or answered, and still open."""
        transport = self._transport
        return (
            self._began is None and not self._busy and not self._queue
            and transport is not None and not transport.is_closing()
        )  # fmt: skip

    def check_timeouts(self, now: float) -> None:
        """408 for a request that is taking too long to arrive; close a connection idle too long."""
        if self._done:
            return
        if self._began is not None and now - self._began > RECEIVE_TIMEOUT_S:
            CLOSED_CONNECTIONS.labels("ext_authz", "receive_timeout").inc()
            self._last(_closing_error(408, f"request not received within {RECEIVE_TIMEOUT_S:g} s"))
        elif self._began is None and not self._busy and not self._queue and now - self._active > IDLE_TIMEOUT_S:
            self.close()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self._began is None:
            self._began = self._loop.time()
        self._url = self._request_id = self._traceparent = self._caller_token = self._session = self._retention = b""
        self._expect_continue = False
        self._chunks = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url  # may arrive in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"x-request-id":
            self._request_id = self._request_id or value  # the first one, as aiohttp's get()
        elif name == b"traceparent":
            self._traceparent = self._traceparent or value
        elif name == CALLER_TOKEN:
            self._caller_token = value
        elif name == SESSION:
            self._session = self._session or value
        elif name == RETENTION:
            self._retention = self._retention or value
        elif name == b"expect":  # curl asks before sending a body over 1 MB, then waits 1 s
            self._expect_continue = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self._head_bytes = -1  # the body's bytes are counted (and bounded) by on_body
        if self._expect_continue and not self._done and not self._busy and not self._queue:
            assert self._transport is not None
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._done:
            return
        self._size += len(body)
        if self._size > self.max_body_bytes + BODY_SLACK:  # stop buffering: not even the core needs it
            message = f"request body of at least {self._size} bytes exceeds the limit of {self.max_body_bytes} bytes"
            self._last(_http_response(413, _JSON + b"connection: close\r\n", error_body(413, message)))
            return
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if self._done:
            return
        expected = self.service.caller_token
        if not expected or hmac.compare_digest(self._caller_token, expected):
            self.service._untrusted.trust(self)
        parser = self._parser
        keep_alive = parser.should_keep_alive()
        if not keep_alive:
            connection = b"connection: close\r\n"
        elif parser.get_http_version() == "1.0":
            connection = b"connection: keep-alive\r\n"
        else:
            connection = b""
        self._began = None
        self._head_bytes = 0
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._queued_bytes += len(body)
        self._enqueue(
            _Request(
                parser.get_method().decode("ascii"),
                _decision_path(self._url),
                body,
                self._request_id.decode("utf-8", "surrogateescape"),
                self._traceparent.decode("latin-1"),
                connection,
                keep_alive,
                self._caller_token,
                self._session.decode("utf-8", "replace"),  # as ext_proc reads it
                self._retention.decode("latin-1"),
            )
        )
        self._chunks = []
        if not keep_alive:
            self._done = True  # the client said this is the last one

    # -- answering

    def _enqueue(self, item: _Request | bytes) -> None:
        self._queue.append(item)
        self._update_reading()
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _last(self, response: bytes) -> None:
        """Queue a last answer (after those of the requests before it) and ignore further input."""
        self._done = True
        self._enqueue(response)

    def _update_reading(self) -> None:
        transport = self._transport
        want = len(self._queue) < PIPELINE_DEPTH and self._queued_bytes <= self.max_body_bytes and not self._write_paused
        if transport is None or want == self._reading or transport.is_closing():
            return
        self._reading = want
        if want:
            transport.resume_reading()
        else:
            transport.pause_reading()

    async def _serve(self) -> None:
        """For the connection's life, answer the queued requests one at a time, so answers leave
        in request order. Between requests it waits to be woken: a task per request would cost
        ~6 µs more (measured at concurrency 1)."""
        loop = asyncio.get_running_loop()
        transport = self._transport
        assert transport is not None
        while not transport.is_closing():
            if not self._queue:
                self._wakeup = loop.create_future()
                await self._wakeup
                continue
            item = self._queue.popleft()
            if isinstance(item, _Request):
                self._queued_bytes -= len(item.body)
            self._update_reading()
            if isinstance(item, bytes):
                self._finish(transport, item)
                return
            self._busy = True
            try:
                response = await self._answer(item)
            finally:
                self._busy = False
            if transport.is_closing():  # the client left: _answer gave its load back
                return
            transport.write(response)
            self._active = loop.time()
            if not item.keep_alive:
                transport.close()
                return

    async def _answer(self, req: _Request) -> bytes:
        if req.path is None:
            return _http_response(404, _PLAIN + req.connection, b"not an ext_authz check path")
        expected = self.service.caller_token
        if expected and not hmac.compare_digest(req.caller_token, expected):
            UNAUTHENTICATED.inc()
            if not self.service.warned:
                self.service.warned = True
                log.warning("ext_authz check without Envoy's caller token: passed through unrouted (counted from now on)")
            return _http_response(200, req.connection)
        try:
            result = await self.service.check(
                req.method, req.path, req.body, req.request_id, req.traceparent, req.session, req.retention
            )
            if result is None or result.kind not in ("routed", "rejected"):  # pass through, fail open
                return _http_response(200, req.connection)
            if result.kind == "rejected":
                return _http_response(result.status, _JSON + req.connection, result.body)
            assert self._transport is not None
            if self._transport.is_closing():  # nobody will use this route: give its load back now
                await self.service.core.release(result)
                return b""
            return _routed_answer(result.headers, req.connection)
        except Exception:
            log.exception("ext_authz check failed (request_id=%s): answering 500, Envoy passes it on", req.request_id)
            return _internal_error(req.connection)

    def _finish(self, transport: asyncio.Transport, response: bytes) -> None:
        """Write a last answer and close: half-close first and drain what the client still sends,
        since closing with unread input resets the connection and can lose the answer."""
        if response:
            transport.write(response)
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        else:
            transport.close()
