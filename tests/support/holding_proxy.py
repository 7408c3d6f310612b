"""A TCP proxy in front of Redis that delivers one connection's bytes late, the others on time."""

from __future__ import annotations

import asyncio


class HoldingProxy:
    """A TCP proxy in front of Redis that, once armed, holds back the bytes of the connection whose
    next write carries ``marker`` (and every one of ``also``; and everything after on that connection) until ``deliver``:
    one connection's packets late (retransmitted, queued in a loaded network), the others on time."""

    def __init__(self, upstream_port: int, marker: bytes, *also: bytes) -> None:
        self.upstream_port = upstream_port
        self.markers = (marker, *also)  # all of them in one write
        self.armed = False
        self.held: list[tuple[asyncio.StreamWriter, bytearray, list[bool]]] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> "HoldingProxy":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._pipe(client_r, client_w)
        except asyncio.CancelledError:  # the proxy closes: end quietly
            client_w.close()

    async def _pipe(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def down() -> None:
            try:
                while data := await up_r.read(65536):
                    client_w.write(data)
                    await client_w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                client_w.close()

        pump = asyncio.ensure_future(down())
        held: bytearray | None = None
        closed = [False]
        try:
            while data := await client_r.read(65536):
                if held is None and self.armed and all(m in data for m in self.markers):
                    self.armed = False
                    held = bytearray()
                    self.held.append((up_w, held, closed))
                if held is not None:
                    held += data
                else:
                    up_w.write(data)
                    await up_w.drain()
        except (ConnectionError, OSError):
            pass
        closed[0] = True  # the client gave up on this connection (a timeout drops it)
        if held is None:
            up_w.close()
        await asyncio.gather(pump, return_exceptions=True)

    async def deliver(self) -> None:
        """The held bytes arrive at last, then their connection closes."""
        for up_w, held, _ in self.held:
            up_w.write(bytes(held))
            await up_w.drain()
            up_w.close()
        self.held.clear()

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
