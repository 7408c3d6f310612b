"""The transfer agent's listening side: a head deadline and a cap on unauthenticated connections.

aiohttp's server waits for a request's head with no deadline but its keep-alive timeout (an hour
by default) and accepts any number of connections, so a client trickling header bytes holds a
connection for an hour, and enough of them use up the engine process's file descriptors (the
agent runs inside the engine). Here every connection is wrapped: until a request on it has been
signed by a fleet peer, it must send a request head within ``head_timeout_s`` of opening or of
its last answer (else 408 and closed), and at most ``max_unauthenticated`` such connections are
held (the oldest closed first). A peer's connection, once it carried a signed request, is
bounded by the keep-alive timeout alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web

from gateway.conn_gate import UntrustedConnections

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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.since = asyncio.get_running_loop().time()
        self.guard.opened(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
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
    """Wraps an aiohttp server's connections; ``trust`` one once a signed request came on it."""

    def __init__(self, head_timeout_s: float, max_unauthenticated: int, stats: Any) -> None:
        """``stats``: where ``head_timeouts`` and ``evicted_connections`` are counted."""
        if head_timeout_s <= 0:
            raise ValueError("head_timeout_s must be positive")
        self.head_timeout_s = head_timeout_s
        self.stats = stats
        self._untrusted: UntrustedConnections[GuardedConnection] = UntrustedConnections(max_unauthenticated, self._evict)
        self._by_inner: dict[Any, GuardedConnection] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def _evict(self, conn: GuardedConnection) -> None:
        self.stats.evicted_connections += 1
        conn.close()

    def protocol_factory(self, make_inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: GuardedConnection(make_inner(), self)

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep(), name="kv-transfer-head-deadline")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)

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
        conn.busy, conn.pending = True, False
        try:
            return await handler(request)
        finally:
            conn.busy = False
            conn.since = asyncio.get_running_loop().time()

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.head_timeout_s / 4))
            deadline = loop.time() - self.head_timeout_s
            for conn in self._untrusted:
                if not conn.busy and conn.since < deadline:
                    self._untrusted.forget(conn)
                    if conn.pending:
                        self.stats.head_timeouts += 1
                    conn.close(TIMEOUT_ANSWER if conn.pending else b"")
