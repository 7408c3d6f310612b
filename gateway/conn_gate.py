"""A cap on the connections a server holds before their client has proven to be a legitimate one.

Why: a port a stranger can reach (a transfer agent's, kvgate's ext_authz port) would otherwise
hold every connection opened to it until a timeout, and enough of them use up the process's file
descriptors: the legitimate client (a fleet peer, Envoy) then cannot connect at all. A connection
is *untrusted* from its opening until its client proves itself (a signed request, Envoy's caller
token); past ``cap`` untrusted connections, the oldest is closed. A legitimate client proves
itself with its first request, sent whole at once, so it is closed only if ``cap`` newer
connections arrive in that moment; an attacker must keep opening connections to keep any.

``ConnectionGuard`` applies this to an aiohttp server (a transfer agent's port, kvgate's admin
port), whose own server waits for a request's head with no deadline but its keep-alive timeout
(an hour by default) and accepts any number of connections: every connection is wrapped, and
until its client proves itself it must send a request head within ``head_timeout_s`` of opening
or of its last answer (else 408 and closed).

A port on the request path (an engine's, the P/D sidecar's) takes ``whole_requests=True``: its
connections are Envoy's pooled upstream connections, hundreds of them busy at once with
generations that run for minutes. There a request's body must also arrive within the deadline,
and a connection is not counted (never closed by the cap) while its request, received whole, is
being served; once answered it waits for its next request as long as the server's keep-alive
allows (Envoy's pool keeps an idle connection an hour, so closing it sooner races a request sent
on it), counted again as the newest untrusted connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Generic, Hashable, TypeVar, cast

from aiohttp import web

C = TypeVar("C", bound=Hashable)

HEAD_TIMEOUT_S = 10.0  # a request head must arrive within this of opening or of the last answer (408)
MAX_UNTRUSTED = 256  # untrusted connections held at once; the oldest is closed past it


class UntrustedConnections(Generic[C]):
    """Untrusted connections in the order they opened; ``admit`` closes the oldest past ``cap``."""

    def __init__(self, cap: int, close: Callable[[C], None]) -> None:
        if cap < 1:
            raise ValueError("the cap on untrusted connections must be at least 1")
        self.cap = cap
        self.evicted = 0  # connections closed because the cap was reached
        self._close = close
        self._conns: dict[C, None] = {}  # insertion-ordered: the oldest first

    def admit(self, conn: C) -> None:
        """A new connection; closes the oldest untrusted ones while more than ``cap`` are open."""
        self._conns[conn] = None
        while len(self._conns) > self.cap:
            oldest = next(iter(self._conns))
            del self._conns[oldest]
            self.evicted += 1
            self._close(oldest)

    def trust(self, conn: C) -> None:
        """Its client proved itself: no longer counted, never closed by the cap."""
        self._conns.pop(conn, None)

    def forget(self, conn: C) -> None:
        """The connection closed."""
        self._conns.pop(conn, None)

    def __contains__(self, conn: object) -> bool:
        return conn in self._conns

    def __len__(self) -> int:
        return len(self._conns)

    def __iter__(self) -> Iterator[C]:
        return iter(list(self._conns))


_TIMEOUT_BODY = b'{"error": "request head not received in time"}'
TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with what the guard needs to know about it."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.since = 0.0  # opened, or last answered: the head deadline runs from here
        self.busy = False  # a request is being handled
        self.pending = False  # bytes of a request arrived since the last answer
        self.answered = False  # at least one request was answered on it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.since = asyncio.get_running_loop().time()
        self.guard.opened(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.pending and self.answered and self.guard.whole_requests:
            self.since = asyncio.get_running_loop().time()  # a keep-alive's next request: its deadline starts now
        self.pending = True
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def close(self, answer: bytes = b"") -> None:
        if self.transport is not None and not self.transport.is_closing():
            if answer:
                self.transport.write(answer)
            self.transport.close()


class ConnectionGuard:
    """Serves an aiohttp application with a head deadline and a cap on untrusted connections;
    ``trust`` a connection once its client proved itself (nothing calls it: none is trusted).

    ``on_close(reason)`` counts what the guard closed: ``"head_timeout"`` (answered 408) or
    ``"evicted"`` (the cap was reached). Add ``middleware`` to the application.

    ``whole_requests``: a request's body too must arrive within the deadline, a connection whose
    request arrived whole is not counted while it is served, and an answered connection idles as
    long as the server lets it (see the module's docstring)."""

    def __init__(
        self, on_close: Callable[[str], None], *, head_timeout_s: float = HEAD_TIMEOUT_S, max_untrusted: int = MAX_UNTRUSTED,
        whole_requests: bool = False,
    ) -> None:  # fmt: skip
        if head_timeout_s <= 0:
            raise ValueError("head_timeout_s must be positive")
        self.head_timeout_s = head_timeout_s
        self.whole_requests = whole_requests
        self._on_close = on_close
        self._untrusted: UntrustedConnections[GuardedConnection] = UntrustedConnections(max_untrusted, self._evict)
        self._by_inner: dict[Any, GuardedConnection] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._server: asyncio.Server | None = None

    def _evict(self, conn: GuardedConnection) -> None:
        self._on_close("evicted")
        conn.close()

    async def listen(self, runner: web.BaseRunner, host: str, port: int) -> None:
        """Serve ``runner``'s (set up) application on ``host:port``, instead of a ``TCPSite``."""
        make_inner = runner.server
        assert make_inner is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: GuardedConnection(make_inner(), self), host, port, reuse_address=True)
        self._sweeper = asyncio.create_task(self._sweep(), name="head-deadline")

    async def close(self) -> None:
        """Stop listening (``runner.cleanup()`` then closes the connections)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._server is not None:
            self._server.close()

    def opened(self, conn: GuardedConnection) -> None:
        self._by_inner[conn.inner] = conn
        self._untrusted.admit(conn)

    def closed(self, conn: GuardedConnection) -> None:
        self._by_inner.pop(conn.inner, None)
        self._untrusted.forget(conn)

    def trust(self, request: web.BaseRequest) -> None:
        conn = self._by_inner.get(request.protocol)
        if conn is not None:
            self._untrusted.trust(conn)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Marks the connection busy while its request is handled; the deadline restarts after."""
        conn = self._by_inner.get(request.protocol)
        if conn is None:
            return await handler(request)
        if self.whole_requests:
            try:
                await request.read()  # under the deadline (the sweeper's 408); kept for the handler
            except ConnectionError:  # closed meanwhile (by the sweeper, or its client): nothing to answer
                return web.Response(status=408)
            self._untrusted.forget(conn)  # served: never closed by the cap
        conn.busy, conn.pending = True, False
        try:
            return await handler(request)
        finally:
            conn.busy, conn.answered = False, True
            conn.since = asyncio.get_running_loop().time()
            if self.whole_requests and self._by_inner.get(conn.inner) is conn and not _closing(conn):
                self._untrusted.admit(conn)  # waiting for its next request: counted again, the newest

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.head_timeout_s / 4))
            deadline = loop.time() - self.head_timeout_s
            for conn in self._untrusted:
                if conn.busy or (self.whole_requests and conn.answered and not conn.pending):
                    continue  # served, or idle between requests: the server's keep-alive decides
                if conn.since < deadline:
                    self._untrusted.forget(conn)
                    if conn.pending:
                        self._on_close("head_timeout")
                    conn.close(TIMEOUT_ANSWER if conn.pending else b"")


def _closing(conn: GuardedConnection) -> bool:
    return conn.transport is None or conn.transport.is_closing()
