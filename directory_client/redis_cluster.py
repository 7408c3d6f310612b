"""The directory on a Redis Cluster.

A Lua script may only touch keys of one slot, and each node's keys share a hash tag, so a lookup
runs ``lookup_node.lua`` once per live node: all of them in one cluster pipeline, which sends one
batch per shard and waits for the shards in parallel (one round-trip time, not one per node).

Which nodes to ask comes from the registry (its own slot). Reading it on every lookup would add
a round trip, so the id list is cached for ``live_cache_s`` (default 1 s). Staleness is one-sided:
a node registered by another client shows up at most ``live_cache_s`` late, but a dead node never
shows: each per-node script checks the node's own heartbeat deadline and answers nil when it passed.

A lookup must not fail because one shard does: the per-node scripts are sent as one pipeline per
shard, each bounded by ``shard_timeout_s`` (set it below the request's lookup budget). A shard
that fails or is too slow leaves its nodes out of the view (``kvgate_directory_shard_failures_total``)
and is skipped for ``SHARD_RETRY_S``; only when every shard fails does the lookup. If the
registry's own shard fails, the last known node list is used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from prometheus_client import Counter

from directory_client.redis_base import RedisDirectoryBase
from directory_client.types import DirectoryUnavailable

log = logging.getLogger(__name__)
SHARD_RETRY_S = 1.0  # a failed shard is not asked again for this long
SHARD_FAILURES = Counter(
    "kvgate_directory_shard_failures", "Redis Cluster shards that failed or timed out in a lookup (their nodes left out)"
)


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

    def __init__(self, client: Any, *, live_cache_s: float = 1.0, shard_timeout_s: float | None = None, **kw: Any) -> None:
        """``shard_timeout_s``: how long a lookup waits for one shard (default: the op timeout)."""
        super().__init__(client, **kw)
        if live_cache_s < 0:
            raise ValueError(f"live_cache_s must be >= 0, got {live_cache_s!r}")
        self.shard_timeout_s = min(shard_timeout_s or self.op_timeout_s, self.op_timeout_s)
        self._shard_down_until: dict[str, float] = {}
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

    async def _server_info(self) -> dict[str, Any]:
        # one shard, not all (INFO's default): a shard down must not fail the first call
        return await self._client.info("server", target_nodes=self._client.get_node_from_key(self._config))

    def _live_ids_changed(self, node_id: str | None = None) -> None:
        if node_id is None or node_id not in self._live_ids:
            self._live_ids_at = float("-inf")

    async def _fan_out(self, blob: bytes) -> list[tuple[str, Any]]:
        now = time.monotonic()
        if now - self._live_ids_at >= self.live_cache_s:
            try:
                self._live_ids = await self._registry_ids()
                self._live_ids_at = now
            except DirectoryUnavailable:
                if self._live_ids_at == float("-inf"):
                    raise
                log.warning("registry shard failed: looking up the last known %d nodes", len(self._live_ids))
        ids = self._live_ids
        if not ids:
            return []
        sha = self._scripts["lookup_node"].sha
        by_shard: dict[str, list[tuple[str, tuple[Any, ...]]]] = {}
        for nid in ids:
            nk = self._keys(nid)
            shard = self._client.get_node_from_key(nk.meta)
            name = shard.name if shard is not None else ""
            by_shard.setdefault(name, []).append((nid, ("EVALSHA", sha, 4, nk.meta, nk.blocks, nk.load, nk.resv, blob)))
        asked = {name: rows for name, rows in by_shard.items() if self._shard_down_until.get(name, 0.0) <= now}
        async with self._io("lookup"):
            results = await asyncio.gather(*(self._ask_shard(rows) for rows in asked.values()), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, Exception):
                    raise r
            if asked and all(isinstance(r, Exception) for r in results):
                raise next(r for r in results if isinstance(r, Exception))
        if not asked:
            raise DirectoryUnavailable(f"{self.backend_name} directory: lookup: every shard failed within {SHARD_RETRY_S} s")
        out: list[tuple[str, Any]] = []
        for (name, rows), result in zip(asked.items(), results):
            if isinstance(result, Exception):
                SHARD_FAILURES.inc()
                self._shard_down_until[name] = time.monotonic() + SHARD_RETRY_S
                log.warning("directory shard %s failed (%r): its %d nodes are left out of lookups", name, result, len(rows))
                continue
            out.extend((nid, r) for (nid, _), r in zip(rows, result) if r is not None)
        out.sort(key=lambda row: row[0])  # the view's order: by node id
        return out

    async def _fan_out_with(self, blob: bytes, key: str) -> tuple[list[tuple[str, Any]], Any]:
        """The session lives on a shard of its own: read beside the fan-out, not after it. A
        session read that fails costs the request its session hint, not its lookup."""
        rows, raw = await asyncio.gather(self._fan_out(blob), self._session_value(key))
        return rows, raw

    async def _session_value(self, key: str) -> Any:
        try:
            async with self._io("session_node"):
                return await self._client.get(key)
        except DirectoryUnavailable:
            return None

    async def _ask_shard(self, rows: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        async with asyncio.timeout(self.shard_timeout_s):
            return await self._pipeline([cmd for _, cmd in rows])
