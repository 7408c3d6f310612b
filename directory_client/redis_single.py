"""The directory on one Redis server (or a primary with replicas behind one address).

A lookup is a single EVALSHA: the script reads the registry, and for each live node scans its
blocks and load, so the answer for every node costs one round trip whatever the fleet size.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from directory_client.redis_base import RedisDirectoryBase


class RedisDirectory(RedisDirectoryBase):
    """``Directory`` on a standalone Redis (redis.asyncio with hiredis)."""

    backend_name = "redis"

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

        The pool is a blocking one: a burst of concurrent requests waits (within the op
        timeout) for one of ``max_connections`` connections instead of failing at once.
        """
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
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
        return cls(client, op_timeout_s=op_timeout_s, **kw)

    async def _fan_out(self, blob: bytes) -> list[tuple[str, Any]]:
        async with self._io("lookup"):
            flat = await self._eval("lookup_all", (self._registry,), (self.key_prefix, blob))
        return [(flat[i].decode(), flat[i + 1 : i + 7]) for i in range(0, len(flat), 7)]
