"""The directory on one Redis server (or a primary with replicas behind one address).

A lookup is a single EVALSHA: the script reads the registry, and for each live node scans its
blocks and load, so the answer for every node costs one round trip whatever the fleet size.

The scripts, which are every call of the request path, go straight to redis-py connections
kept idle here: through the client (pool, retries, instrumentation) an EVALSHA costs ~95 µs of
CPU, on the connection ~50 (measured with PING). What the client gave them is kept: a
connection interrupted mid-call (a timeout, an error) is never reused, and one that died idle
(a restarted server) is replaced and the call made once more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from directory_client.redis_base import RedisDirectoryBase
from directory_client.scripts import Script

MAX_IDLE = 32  # connections kept for the scripts; more in flight at once are closed after use


class RedisDirectory(RedisDirectoryBase):
    """``Directory`` on a standalone Redis (redis.asyncio with hiredis)."""

    backend_name = "redis"

    def __init__(self, client: aioredis.Redis, *, max_connections: int = 64, **kw: Any) -> None:
        super().__init__(client, **kw)
        self._idle: list[AbstractConnection] = []  # connections for ``_eval``, most recent last
        # the scripts' own connections count against the pool's limit too: at most this many at once
        self._slots = asyncio.Semaphore(_script_connections(max_connections))

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        op_timeout_s: float = 0.5,
        max_connections: int = 64,
        connection_options: dict[str, Any] | None = None,
        **kw: Any,
    ) -> "RedisDirectory":
        """``redis://[:password@]host:port/db`` or ``rediss://…`` (TLS; ``connection_options``
        carries redis-py's ``ssl_*`` keywords, e.g. ``ssl_ca_certs``).

        ``max_connections`` bounds every connection to the server: half for the request path's
        scripts, half for the client's pool. Both block: a burst of concurrent requests waits
        (within the op timeout) for a connection instead of opening more.
        """
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max(1, max_connections - _script_connections(max_connections)),
            timeout=op_timeout_s,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            # one immediate retry replaces a pooled connection that died with a restarted server;
            # more would only push an outage past op_timeout_s
            retry=Retry(NoBackoff(), 1),
            health_check_interval=0,
            **(connection_options or {}),
        )
        client = aioredis.Redis(connection_pool=pool)
        return cls(client, op_timeout_s=op_timeout_s, max_connections=max_connections, **kw)

    async def _eval(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script call on a connection of our own, at most ``max_connections // 2`` at once (a
        burst waits, within the caller's op timeout, instead of opening one connection per request)."""
        async with self._slots:
            return await self._eval_on_connection(name, keys, args)

    async def _eval_on_connection(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        script = self._scripts[name]
        idle = self._idle
        reused = bool(idle)
        conn = idle.pop() if reused else self._client.connection_pool.make_connection()
        try:
            try:
                reply = await _evalsha(conn, script, keys, args)
            except (RedisConnectionError, OSError):
                if not reused:
                    raise
                await conn.disconnect(nowait=True)  # it died while idle: once more, on a new one
                conn = self._client.connection_pool.make_connection()
                reply = await _evalsha(conn, script, keys, args)
        except BaseException:
            await conn.disconnect(nowait=True)  # interrupted mid-call: its next reply is not ours
            raise
        if len(idle) < MAX_IDLE:
            idle.append(conn)
        else:
            await conn.disconnect()
        return reply

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect(nowait=True)
        await super().aclose()

    async def _fan_out(self, blob: bytes) -> list[tuple[str, Any]]:
        async with self._io("lookup"):
            flat = await self._eval("lookup_all", (self._registry,), (self.key_prefix, blob))
        return _rows(flat)

    async def _fan_out_with(self, blob: bytes, key: str) -> tuple[list[tuple[str, Any]], Any]:
        """The same script reads ``key`` too (the reply's last element): one round trip."""
        async with self._io("lookup"):
            flat = await self._eval("lookup_all", (self._registry,), (self.key_prefix, blob, key))
        return _rows(flat[:-1]), flat[-1] or None


def _rows(flat: list[Any]) -> list[tuple[str, Any]]:
    return [(flat[i].decode(), flat[i + 1 : i + 10]) for i in range(0, len(flat), 10)]


def _script_connections(max_connections: int) -> int:
    return max(1, max_connections // 2)


async def _evalsha(conn: AbstractConnection, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """EVALSHA on one connection, loading the script first if the server does not know it."""
    await conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
    try:
        return await conn.read_response()
    except NoScriptError:  # a restarted or failed-over server
        await conn.send_command("SCRIPT", "LOAD", script.text)
        await conn.read_response()
        await conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return await conn.read_response()
