"""The directory on a Redis Cluster.

A Lua script may only touch keys of one slot, and each node's keys share a hash tag, so a lookup
runs ``lookup_node.lua`` once per live node: all of them in one cluster pipeline, which sends one
batch per shard and waits for the shards in parallel (one round-trip time, not one per node).

Which nodes to ask comes from the registry (its own slot). Reading it on every lookup would add
a round trip, so the id list is cached for ``live_cache_s`` (default 1 s). Staleness is one-sided:
a node registered by another client shows up at most ``live_cache_s`` late, but a dead node never
shows: each per-node script checks the node's own heartbeat deadline and answers nil when it passed.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from directory_client.redis_base import RedisDirectoryBase


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """``redis+cluster://[user:password@]host:port[,host:port…]`` → seed nodes and client options."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis+cluster", "rediss+cluster"):
        raise ValueError(f"not a Redis Cluster URL: {url!r}")
    netloc = parts.netloc
    opts: dict[str, Any] = {}
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if user:
            opts["username"] = unquote(user)
        if password:
            opts["password"] = unquote(password)
    if parts.scheme == "rediss+cluster":
        opts["ssl"] = True
    seeds = []
    for hp in netloc.split(","):
        host, sep, port = hp.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"cluster seed {hp!r} in {url!r} is not host:port")
        seeds.append((host.strip("[]"), int(port)))
    return seeds, opts


class RedisClusterDirectory(RedisDirectoryBase):
    """``Directory`` on a Redis Cluster (redis.asyncio.cluster.RedisCluster)."""

    backend_name = "redis-cluster"

    def __init__(self, client: Any, *, live_cache_s: float = 1.0, **kw: Any) -> None:
        super().__init__(client, **kw)
        if live_cache_s < 0:
            raise ValueError(f"live_cache_s must be >= 0, got {live_cache_s!r}")
        self.live_cache_s = live_cache_s
        self._live_ids: list[str] = []
        self._live_ids_at = float("-inf")

    @classmethod
    def from_url(
        cls, url: str, *, op_timeout_s: float = 0.5, connection_options: dict[str, Any] | None = None, **kw: Any
    ) -> "RedisClusterDirectory":
        seeds, opts = parse_cluster_url(url)
        opts.update(connection_options or {})
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in seeds],
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 2),
            **opts,
        )
        return cls(client, op_timeout_s=op_timeout_s, **kw)

    def _live_ids_changed(self, node_id: str | None = None) -> None:
        if node_id is None or node_id not in self._live_ids:
            self._live_ids_at = float("-inf")

    async def _fan_out(self, blob: bytes) -> list[tuple[str, Any]]:
        now = time.monotonic()
        if now - self._live_ids_at >= self.live_cache_s:
            self._live_ids = await self._registry_ids()
            self._live_ids_at = now
        ids = self._live_ids
        if not ids:
            return []
        sha = self._scripts["lookup_node"].sha
        commands = []
        for nid in ids:
            nk = self._keys(nid)
            commands.append(("EVALSHA", sha, 4, nk.meta, nk.blocks, nk.load, nk.resv, blob))
        async with self._io("lookup"):
            replies = await self._pipeline(commands)
        return [(nid, r) for nid, r in zip(ids, replies) if r is not None]
