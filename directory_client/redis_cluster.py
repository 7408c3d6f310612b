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
and is skipped for ``SHARD_RETRY_S``, and until a background probe (at once, then every
``SHARD_RETRY_S``) finds it answering again: a dead shard costs one request, not one every retry,
and calls on its keys fail at once until it answers. Only when every shard fails does the lookup.
If the registry's own shard fails or is too slow, the last known node list is used (also after
this client registered a node meanwhile), and the registry is read again only once its shard answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from prometheus_client import Counter, Gauge

from redis.exceptions import (
    ConnectionError as RedisConnectionError,
    RedisClusterException,
    RedisError,
    TimeoutError as RedisTimeoutError,
)
from redis.utils import str_if_bytes

from directory_client.redis_base import RedisDirectoryBase, ShardDown
from directory_client.types import DirectoryUnavailable

log = logging.getLogger(__name__)
SHARD_RETRY_S = 1.0  # how often a failed shard is probed in the background
SHARD_FAILURES = Counter(
    "kvgate_directory_shard_failures", "Redis Cluster shards that failed or timed out in a lookup (their nodes left out)"
)
SHARDS_DOWN = Gauge(
    "kvgate_directory_shards_down",
    "Redis Cluster shards marked down now: calls on their keys fail open, lookups leave their nodes out "
    "(the circuit stays closed while other shards answer, and may read 0 when every shard is down)",
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


def _first_key(cmd: tuple[Any, ...]) -> Any:
    """The first key of a command we send (``EVALSHA sha numkeys key …`` or ``CMD key …``)."""
    return cmd[3] if cmd[0] == "EVALSHA" else cmd[1]


class RedisClusterDirectory(RedisDirectoryBase):
    """``Directory`` on a Redis Cluster (redis.asyncio.cluster.RedisCluster)."""

    backend_name = "redis-cluster"

    def __init__(self, client: Any, *, live_cache_s: float = 1.0, shard_timeout_s: float | None = None, **kw: Any) -> None:
        """``shard_timeout_s``: how long a lookup waits for one shard (default: the op timeout)."""
        super().__init__(client, **kw)
        if live_cache_s < 0:
            raise ValueError(f"live_cache_s must be >= 0, got {live_cache_s!r}")
        self.shard_timeout_s = min(shard_timeout_s or self.op_timeout_s, self.op_timeout_s)
        self._shards_down: dict[str, asyncio.Task] = {}  # shard name -> its background probe
        self._closing = False  # no probe starts once closing has begun (nobody would stop it)
        self._skip_until: dict[str, float] = {}  # shard name -> lookups leave it out until then (monotonic)
        self.live_cache_s = live_cache_s
        self._live_ids: list[str] | None = None  # None: never read
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
        if node_id is None or self._live_ids is None or node_id not in self._live_ids:
            self._live_ids_at = float("-inf")  # read again when the registry answers; kept till then

    async def aclose(self) -> None:
        self._closing = True
        probes = list(self._shards_down.values())
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        SHARDS_DOWN.dec(len(self._shards_down))  # probes cancelled before they began never reached their finally
        self._shards_down.clear()
        await super().aclose()

    def _shard_of(self, key: str) -> str:
        try:
            shard = self._client.get_node_from_key(key)
        except (RedisError, RedisClusterException):  # the slot map is not read yet (first call) or lacks the slot
            return ""
        return shard.name if shard is not None else ""

    def _mark_down(self, name: str) -> None:
        """Leave a shard out of lookups for ``SHARD_RETRY_S`` at least (one slow now may stay slow),
        and refuse calls on its keys until a background probe finds it answering again: at once for
        a shard only slow once, so a request's release is not lost to one slow lookup."""
        if not name or self._closing:
            return
        self._skip_until[name] = time.monotonic() + SHARD_RETRY_S
        if name not in self._shards_down:
            self._shards_down[name] = asyncio.create_task(self._probe(name), name=f"directory-shard-probe-{name}")
            SHARDS_DOWN.inc()

    def _skipped(self, name: str, now: float) -> bool:
        """Is this shard left out of lookups now?"""
        return name in self._shards_down or self._skip_until.get(name, 0.0) > now

    async def _probe(self, name: str) -> None:
        try:
            while True:
                node = self._client.get_node(node_name=name)
                if node is None:  # no longer in the slot map (failed over): its keys' new shard is asked
                    return
                try:  # the node alone: a failure here must not make the client drop every shard's connections
                    async with asyncio.timeout(self.op_timeout_s):
                        await node.execute_command("PING")
                    log.info("directory shard %s answers again", name)
                    return
                except Exception:
                    await asyncio.sleep(SHARD_RETRY_S)
                try:  # a replica may have taken its slots: no call is sent there to tell the client
                    if await self._left_slot_map(name):
                        async with asyncio.timeout(self.op_timeout_s):
                            await self._client.nodes_manager.initialize(last_failed_node_name=name)
                except Exception:  # slots uncovered mid-failover: next round
                    pass
        finally:
            if self._shards_down.pop(name, None) is not None:
                SHARDS_DOWN.dec()

    async def _left_slot_map(self, name: str) -> bool:
        """Does a live primary's ``CLUSTER SLOTS`` no longer name shard ``name`` a primary? (Cheap,
        unlike re-reading the slot map, which costs the event loop milliseconds every round.)"""
        for node in self._client.get_primaries():
            if node.name == name:
                continue
            try:
                async with asyncio.timeout(self.op_timeout_s):
                    rows = await node.execute_command("CLUSTER SLOTS")
            except Exception:
                continue
            primaries = {f"{str_if_bytes(row[2][0]) or node.host}:{int(row[2][1])}" for row in rows}
            return name not in primaries
        return False

    def _check_shard(self, key: str) -> None:
        """Fail at once if the key's shard is known down (a call to a dead primary makes the
        cluster client drop and rebuild every shard's connections, costing the live ones)."""
        if not self._shards_down:  # the usual case: nothing to look up
            return
        name = self._shard_of(key)
        if name in self._shards_down:
            raise ShardDown(f"shard {name} is down (probed every {SHARD_RETRY_S} s)")

    @asynccontextmanager
    async def _on_key(self, key: str) -> AsyncIterator[None]:
        self._check_shard(key)
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError, TimeoutError):
            self._mark_down(self._shard_of(key))
            raise

    async def _eval(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if not keys:
            return await super()._eval(name, keys, args)
        async with self._on_key(keys[0]):
            return await super()._eval(name, keys, args)

    async def _send(self, commands: Sequence[tuple[Any, ...]], one_shard: bool = False) -> list[Any]:
        """One pipeline per shard, in parallel (as the cluster client would send them), each
        refused or marked down on its own: one shard down must not keep the others' part unsent
        (a node's meta beside its registry entry: its heartbeat deadline) nor go unnoticed."""
        if one_shard:  # a lookup's part: no grouping to pay per node on the request path
            return await self._send_to_shard(commands)
        by_shard: dict[str, list[int]] = {}
        for i, cmd in enumerate(commands):
            by_shard.setdefault(self._shard_of(_first_key(cmd)), []).append(i)
        if len(by_shard) <= 1:
            return await self._send_to_shard(commands)
        results: list[Any] = [None] * len(commands)

        async def send(rows: list[int]) -> None:
            try:
                out = await self._send_to_shard([commands[i] for i in rows])
            except Exception as e:  # every command of that shard gets its failure
                out = [e] * len(rows)
            for i, r in zip(rows, out):
                results[i] = r

        await asyncio.gather(*(send(rows) for rows in by_shard.values()))
        return results

    async def _send_to_shard(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        if not commands:
            return []
        key = _first_key(commands[0])
        async with self._on_key(key):
            out = await super()._send(commands)
        if any(isinstance(r, (RedisConnectionError, RedisTimeoutError)) for r in out):  # a pipeline reports, not raises
            self._mark_down(self._shard_of(key))
        return out

    async def _live_node_ids(self) -> list[str]:
        """The registry's live ids, cached; the last known list while the registry's shard is down."""
        now = time.monotonic()
        if self._live_ids is None:
            self._live_ids = await self._registry_ids()  # nothing to fall back on: the whole op timeout
            self._live_ids_at = now
            return self._live_ids
        if now - self._live_ids_at < self.live_cache_s or (
            (self._shards_down or self._skip_until) and self._skipped(self._shard_of(self._registry), now)
        ):
            return self._live_ids
        try:
            async with asyncio.timeout(self.shard_timeout_s):  # on the lookup's path, like any shard's part of it
                self._live_ids = await self._registry_ids()
            self._live_ids_at = now
        except (DirectoryUnavailable, TimeoutError) as e:
            self._mark_down(self._shard_of(self._registry))
            log.warning("registry shard failed (%r): looking up the last known %d nodes", e, len(self._live_ids))
        return self._live_ids

    async def _fan_out(self, blob: bytes) -> list[tuple[str, Any]]:
        ids = await self._live_node_ids()
        if not ids:
            return []
        sha = self._scripts["lookup_node"].sha
        by_shard: dict[str, list[tuple[str, tuple[Any, ...]]]] = {}
        for nid in ids:
            nk = self._keys(nid)
            by_shard.setdefault(self._shard_of(nk.meta), []).append(
                (nid, ("EVALSHA", sha, 4, nk.meta, nk.blocks, nk.load, nk.resv, blob))
            )
        now = time.monotonic()
        asked = {name: rows for name, rows in by_shard.items() if not self._skipped(name, now)}
        async with self._io("lookup"):
            results = await asyncio.gather(*(self._ask_shard(rows) for rows in asked.values()), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, Exception):
                    raise r
            if asked and all(isinstance(r, Exception) for r in results):
                raise next(r for r in results if isinstance(r, Exception))
        if not asked:
            raise DirectoryUnavailable(f"{self.backend_name} directory: lookup: every shard is down (probed every {SHARD_RETRY_S} s)")
        out: list[tuple[str, Any]] = []
        for (name, rows), result in zip(asked.items(), results):
            if isinstance(result, Exception):
                SHARD_FAILURES.inc()
                self._mark_down(name)
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
        try:  # a shard's part of the lookup: its budget, and its shard marked down if it does not answer
            async with self._io("session_node"), self._on_key(key), asyncio.timeout(self.shard_timeout_s):
                return await self._client.get(key)
        except DirectoryUnavailable:
            return None

    async def _ask_shard(self, rows: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        async with asyncio.timeout(self.shard_timeout_s):
            return await self._pipeline([cmd for _, cmd in rows], one_shard=True)
