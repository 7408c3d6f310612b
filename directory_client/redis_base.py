"""What the single-Redis and the Redis Cluster backends share: key layout, scripts, error mapping.

Key layout (``P`` = key prefix; the braces are a hash tag, so on a cluster all of one node's keys
live in one slot and one script can touch them together):

  {P}:registry        zset node_id -> heartbeat deadline (ms, server clock): which nodes to ask
  {P}:config          hash  stride -> index stride every client must share
  P:{node}:meta       hash  info -> NodeInfo json, until -> heartbeat deadline (ms, server clock),
                            bridged -> the last writer-lease holder ("" once a lapse cleared its entries)
  P:{node}:blocks     hash  8-byte big-endian block key -> tier bitmask ("1".."7")
  P:{node}:load       hash  r -> in-flight requests, t -> reserved prefill tokens, a -> latest end of
                            an arrival in arr (lookups read arr only while it is ahead), c -> KV
                            tokens the decode steps of the requests served whole there read
  P:{node}:resv       zset  "token|prefill" -> when the reservation ends (ms) ("token*n|prefill":
                            it counts n requests in flight, a request generating n answers;
                            "token~c...": it counts c in the load's c while it lasts), and, while its
                            prefill counts, "p:token|prefill" -> when its first token is due;
                            "x:token|prefill" -> its end, for a reserve released before it ran
  P:{node}:hot        zset  msgpack [model, tokens] -> when the gateway last routed it (s, its clock)
  P:{node}:arr        zset  "id|blocks|lands" -> when its answer is estimated done (ms): split
                            requests whose KV is on its way to this decode node, written with the
                            reserve, read by every lookup, removed by the release; at most
                            MAX_ARRIVALS_PER_NODE, expiring (its scripts name it beside resv)
  {P}:draining        zset  node_id -> until when it takes no new requests (s, the drainer's clock)

Deadlines use the server's clock (``TIME`` inside scripts), so gateway replicas with skewed
clocks still agree on who is alive. Every I/O call runs under ``asyncio.timeout(op_timeout_s)``
and any failure in it becomes ``DirectoryUnavailable``; ``CancelledError`` passes untouched
(redis-py drops a connection interrupted mid-reply instead of returning it to the pool).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
import dataclasses
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from directory_client.breaker import CircuitBreaker
from directory_client.hot import check_hot, hot_prefix
from directory_client.memory import TIERS
from directory_client.sampling import KeySampler, check_keys, pack_keys
from directory_client.scripts import Script, scripts
from directory_client.types import (
    DirectoryUnavailable,
    DirectoryView,
    HotPrefix,
    NodeInfo,
    NodeLoad,
    NodeView,
    Reservation,
    ReservationConflict,
    SplitArrival,
    Tier,
    UnknownNode,
    WriterLease,
)
from directory_client.validate import (
    check_arrival,
    check_context_tokens,
    check_durations,
    check_node,
    check_node_id,
    check_prefill,
    check_requests,
    check_reservation,
    check_tier,
    reservation_times,
)
from tokenizer.keys import BlockKey

_NODE_FIELDS = tuple(f.name for f in dataclasses.fields(NodeInfo))
_IDLE = NodeLoad()


def _load(inflight: int, prefill: int, due_ms: int) -> NodeLoad:
    """A node's load as a lookup replied it (``due_ms`` counts only while prefill is queued)."""
    if not inflight:
        return _IDLE
    return NodeLoad(inflight, prefill, due_ms / 1000.0) if prefill else NodeLoad(inflight)


def _arrivals(rows: list[Any]) -> tuple[SplitArrival, ...]:
    """A lookup's ``"id|blocks|lands_ms|ends_ms"`` rows (ms from the lookup) as values."""
    out = []
    for raw in rows:
        aid, blocks, lands, ends = (raw.decode() if isinstance(raw, bytes) else raw).rsplit("|", 3)
        out.append(SplitArrival(aid, int(lands) / 1000.0, int(blocks), int(ends) / 1000.0))
    return tuple(out)


ALL_TIERS_MASK = 0b111


class DirectoryConfigError(ValueError):
    """This client's settings contradict what other clients of the same directory use."""


def encode_node(node: NodeInfo) -> bytes:
    return json.dumps(dataclasses.asdict(node), separators=(",", ":")).encode()


def decode_node(raw: bytes) -> NodeInfo:
    data = json.loads(raw)
    return NodeInfo(**{k: v for k, v in data.items() if k in _NODE_FIELDS})


class NodeKeys:
    """The four keys of one node; built once per node id and kept (they are on the hot path)."""

    __slots__ = ("meta", "blocks", "load", "resv")

    def __init__(self, prefix: str, node_id: str) -> None:
        base = f"{prefix}:{{{node_id}}}:"
        self.meta, self.blocks, self.load, self.resv = (base + s for s in ("meta", "blocks", "load", "resv"))


class ShardDown(Exception):
    """The call was not sent: the cluster shard holding its keys is known down (probed apart)."""


def refused_by_acl(error: Exception) -> bool:
    """Redis's ACL refused the call (e.g. a user not updated for a newer script): an answer, not an outage."""
    return isinstance(error, NoPermissionError) or (isinstance(error, ResponseError) and "NOPERM" in str(error))


MIN_REDIS_MAJOR = 7  # reservations use PEXPIRETIME (Redis 7.0)


def check_server_version(info: dict[str, Any]) -> None:
    """``DirectoryConfigError`` unless every server in ``INFO server`` (one, or per cluster node) runs Redis >= 7."""
    servers = [v for v in info.values() if isinstance(v, dict)] or [info]
    for server in servers:
        version = str(server.get("redis_version", "0"))
        if int(version.split(".")[0] or 0) < MIN_REDIS_MAJOR:
            raise DirectoryConfigError(
                f"the directory needs Redis >= {MIN_REDIS_MAJOR} (reservations use PEXPIRETIME); the server runs {version}"
            )


class RedisDirectoryBase(ABC):
    """Every ``Directory`` method except the lookup fan-out, which differs per deployment."""

    backend_name = "redis"

    in_process = False  # every operation is a network round trip: callers bound it with a timeout

    def __init__(
        self,
        client: Any,
        *,
        key_prefix: str = "kvgate",
        heartbeat_ttl_s: float = 10.0,
        index_stride: int = 1,
        op_timeout_s: float = 0.5,
        max_request_s: float = 600.0,
        dead_node_retention_s: float = 3600.0,
    ) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix must be non-empty and without braces, got {key_prefix!r}")
        check_durations(heartbeat_ttl_s, op_timeout_s, max_request_s, dead_node_retention_s)
        self._client = client
        self.key_prefix = key_prefix
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.op_timeout_s = op_timeout_s
        self.max_request_s = max_request_s
        self.dead_node_retention_s = dead_node_retention_s
        self.sampler = KeySampler(index_stride)
        self._registry = f"{{{key_prefix}}}:registry"
        self._config = f"{{{key_prefix}}}:config"
        self._draining_key = f"{{{key_prefix}}}:draining"
        self._ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self._retention_ms = int(dead_node_retention_s * 1000)
        self._keep_ms = self._ttl_ms + self._retention_ms
        self._scripts = scripts()
        self._node_keys: dict[str, NodeKeys] = {}
        self._infos: dict[bytes, NodeInfo] = {}  # raw json -> parsed: lookups never re-parse
        self._client_id = os.urandom(6).hex()
        self._tokens = itertools.count(1)
        self._config_checked = False
        self._config_lock = asyncio.Lock()
        self.breaker = CircuitBreaker()
        self._lost: set[asyncio.Task[None]] = set()  # releases of reserves whose answer was lost

    @property
    def index_stride(self) -> int:
        return self.sampler.stride

    # -- plumbing ------------------------------------------------------------------------------

    @asynccontextmanager
    async def _io(self, op: str) -> AsyncIterator[None]:
        """Bound one backend round trip and fold every failure into ``DirectoryUnavailable``.

        Only I/O runs inside: validation happens before, decoding after, so a bug in our own
        code is not disguised as an outage. ``Exception`` (not ``BaseException``) is caught,
        so cancellation propagates as it is.
        """
        breaker = self.breaker
        if not breaker.allow():
            raise DirectoryUnavailable(
                f"{self.backend_name} directory: {op} not tried, circuit open (retry in {breaker.retry_in_s:.2f} s)"
            )
        try:
            async with asyncio.timeout(self.op_timeout_s):
                yield
        except Exception as e:
            if refused_by_acl(e):  # the server answered at once: alive, so not a breaker failure
                breaker.success()
            elif isinstance(e, ShardDown):  # not sent: no answer either way (and one shard is not the directory)
                breaker.abandon()  # a probe refused so must let the next call probe, or the circuit stays open for good
            else:
                breaker.failure()
            raise DirectoryUnavailable(f"{self.backend_name} directory: {op} failed: {e!r}") from e
        except BaseException:
            breaker.abandon()
            raise
        breaker.success()

    def _on_key(self, key: str) -> AbstractAsyncContextManager[Any]:
        """Hook around a call on ``key`` (inside ``_io``): a cluster refuses calls on a shard known
        down and marks down one that does not answer."""
        return nullcontext()

    def _keys(self, node_id: str) -> NodeKeys:
        nk = self._node_keys.get(node_id)
        if nk is None:
            if len(self._node_keys) > 100_000:
                self._node_keys.clear()
            nk = self._node_keys[node_id] = NodeKeys(self.key_prefix, node_id)
        return nk

    def _node(self, raw: bytes) -> NodeInfo:
        info = self._infos.get(raw)
        if info is None:
            if len(self._infos) > 10_000:
                self._infos.clear()
            info = self._infos[raw] = decode_node(raw)
        return info

    async def _load_scripts(self) -> None:
        for s in self._scripts.values():
            await self._client.script_load(s.text)

    async def _eval(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """EVALSHA, loading the script once if the server does not know it (restart, failover)."""
        s: Script = self._scripts[name]
        try:
            return await self._client.evalsha(s.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._client.script_load(s.text)
            return await self._client.evalsha(s.sha, len(keys), *keys, *args)

    def _evalsha_args(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        return ("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]], *, one_shard: bool = False) -> list[Any]:
        """Send commands in one pipeline (one round trip per shard, shards in parallel);
        ``one_shard``: the caller knows they all go to one cluster shard."""
        results = await self._send(commands, one_shard)
        if any(isinstance(r, NoScriptError) for r in results):
            await self._load_scripts()
            results = await self._send(commands, one_shard)
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    async def _send(self, commands: Sequence[tuple[Any, ...]], one_shard: bool = False) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        return list(await pipe.execute(raise_on_error=False))

    async def _check_config(self) -> None:
        """First use: every client of one directory must index with the same stride (the first
        client to touch a key prefix fixes it; changing it means a new prefix)."""
        if self._config_checked:
            return
        async with self._config_lock:  # a burst of first calls: one checks, the rest wait
            if self._config_checked:
                return
            async with self._io("config check"), self._on_key(self._config):
                stride = str(self.sampler.stride).encode()
                await self._client.hsetnx(self._config, "stride", stride)
                stored = await self._client.hget(self._config, "stride")
                info = await self._server_info()
        check_server_version(info)
        if stored != stride:
            raise DirectoryConfigError(
                f"directory {self.key_prefix!r} is indexed with stride {stored!r}, this client uses {stride!r}"
            )
        self._config_checked = True

    async def _server_info(self) -> dict[str, Any]:
        """``INFO server`` of the server holding the config key (the one just asked)."""
        return await self._client.info("server")

    def _live_ids_changed(self, node_id: str | None = None) -> None:
        """Hook: a backend caching the live-node list drops it after this client changes it
        (``node_id``: a heartbeat, which changes the list only if that node was missing)."""

    # -- nodes ---------------------------------------------------------------------------------

    async def register_node(self, node: NodeInfo) -> None:
        check_node(node)
        await self._check_config()
        nk = self._keys(node.node_id)
        async with self._io("register_node"):
            await self._pipeline(
                [
                    self._evalsha_args("register", (nk.meta, nk.blocks), (encode_node(node), self._ttl_ms, self._keep_ms)),
                    self._evalsha_args(
                        "registry_touch", (self._registry,), (node.node_id, self._ttl_ms, self._retention_ms)
                    ),
                ]
            )
        self._live_ids_changed()

    async def heartbeat(self, node_id: str) -> None:
        check_node_id(node_id)
        await self._check_config()
        nk = self._keys(node_id)
        async with self._io("heartbeat"):
            known = await self._eval("heartbeat", (nk.meta, nk.blocks), (self._ttl_ms, self._keep_ms))
            if known:
                await self._eval("registry_touch", (self._registry,), (node_id, self._ttl_ms, self._retention_ms))
        if not known:
            raise UnknownNode(f"node {node_id!r} is not registered")
        self._live_ids_changed(node_id)

    async def deregister_node(self, node_id: str) -> None:
        check_node_id(node_id)
        await self._check_config()
        nk = self._keys(node_id)
        async with self._io("deregister_node"):
            await self._pipeline(
                [("DEL", nk.meta, nk.blocks, nk.load, nk.resv), ("ZREM", self._registry, node_id)]
            )
        self._live_ids_changed()

    async def _registry_ids(self) -> list[str]:
        """Node ids with a current heartbeat, sorted (the lookup order)."""
        async with self._io("registry"):
            raw = await self._eval("registry_live", (self._registry,), ())
        return sorted(r.decode() for r in raw)

    async def live_nodes(self) -> list[NodeInfo]:
        await self._check_config()
        ids = await self._registry_ids()
        if not ids:
            return []
        async with self._io("live_nodes"):
            infos = await self._pipeline([self._evalsha_args("node_info", (self._keys(i).meta,), ()) for i in ids])
        return [self._node(raw) for raw in infos if raw is not None]

    # -- blocks --------------------------------------------------------------------------------

    async def record_stored(self, node_id: str, keys: Sequence[BlockKey], tier: Tier = Tier.GPU) -> None:
        check_node_id(node_id)
        check_tier(tier, optional=False)
        check_keys(keys)
        await self._check_config()
        kept = self.sampler.select(keys)
        nk = self._keys(node_id)
        async with self._io("record_stored"):
            await self._eval("record_stored", (nk.meta, nk.blocks), (1 << int(tier), self._keep_ms, pack_keys(kept)))

    async def record_removed(self, node_id: str, keys: Sequence[BlockKey], tier: Tier | None = None) -> None:
        check_node_id(node_id)
        check_tier(tier, optional=True)
        check_keys(keys)
        await self._check_config()
        kept = self.sampler.select(keys)
        if not kept:
            return
        clear = ALL_TIERS_MASK if tier is None else 1 << int(tier)
        async with self._io("record_removed"):
            await self._eval("record_removed", (self._keys(node_id).blocks,), (clear, pack_keys(kept)))

    async def clear_node(self, node_id: str) -> None:
        check_node_id(node_id)
        await self._check_config()
        key = self._keys(node_id).blocks
        async with self._io("clear_node"), self._on_key(key):
            await self._client.delete(key)

    # -- one writer per node (P:{node}:writer holds the owner id, with a TTL) ---------------------

    _REPLACE_CHUNK = 4096  # keys per staging write: a script call stays short for other clients

    def _lease_key(self, node_id: str) -> str:
        return f"{self.key_prefix}:{{{node_id}}}:writer"

    async def claim_writer(self, node_id: str, owner: str, ttl_s: float) -> WriterLease:
        check_node_id(node_id)
        if not owner or ttl_s <= 0:
            raise ValueError("claim_writer needs an owner and a positive ttl")
        async with self._io("claim_writer"):
            held = await self._eval(
                "writer_claim", (self._lease_key(node_id), self._keys(node_id).meta), (owner, max(1, int(ttl_s * 1000)), self._keep_ms)
            )
        return WriterLease(int(held))

    async def writer(self, node_id: str) -> str | None:
        check_node_id(node_id)
        key = self._lease_key(node_id)
        async with self._io("writer"), self._on_key(key):
            owner = await self._client.get(key)
        return owner.decode() if isinstance(owner, bytes) else owner

    async def clear_if_unwritten(self, node_id: str) -> bool:
        check_node_id(node_id)
        await self._check_config()
        async with self._io("clear_if_unwritten"):
            nk = self._keys(node_id)
            cleared = await self._eval("writer_lapsed_clear", (self._lease_key(node_id), nk.blocks, nk.meta), ())
        return cleared == 1

    async def release_writer(self, node_id: str, owner: str) -> None:
        check_node_id(node_id)
        async with self._io("release_writer"):
            await self._eval("writer_release", (self._lease_key(node_id),), (owner,))

    async def replace_node(self, node_id: str, blocks: Mapping[Tier, Sequence[BlockKey]]) -> None:
        """Stage the new entries beside the old ones (same hash tag), then swap them in one script."""
        check_node_id(node_id)
        for tier, keys in blocks.items():
            check_tier(tier, optional=False)
            check_keys(keys)
        await self._check_config()
        nk = self._keys(node_id)
        staging = nk.blocks + ":next"
        async with self._io("replace_node"), self._on_key(staging):
            await self._client.delete(staging)
        for tier, keys in blocks.items():
            kept = self.sampler.select(keys)
            for i in range(0, len(kept), self._REPLACE_CHUNK):
                chunk = pack_keys(kept[i : i + self._REPLACE_CHUNK])
                async with self._io("replace_node"):  # each call bounded on its own: a big node takes many
                    await self._eval("record_stored", (nk.meta, staging), (1 << int(tier), self._keep_ms, chunk))
        async with self._io("replace_node"):
            await self._eval("replace_commit", (nk.meta, nk.blocks, staging), (self._keep_ms,))

    async def retire_node(self, node_id: str) -> None:
        check_node_id(node_id)
        await self._check_config()
        async with self._io("retire_node"):
            await self._eval("retire", (self._keys(node_id).meta,), ())
        async with self._io("retire_node"), self._on_key(self._registry):  # the registry may live on another shard
            await self._client.zadd(self._registry, {node_id: 0}, xx=True)
        self._live_ids_changed()

    # -- lookup --------------------------------------------------------------------------------

    @abstractmethod
    async def _fan_out(self, blob: bytes) -> list[tuple[str, Any]]:
        """Per live node, sorted by id: (node_id, [info, held, worst_tier, inflight, prefill, indexed, due_ms, arrivals, context])."""

    async def lookup(self, keys: Sequence[BlockKey], session: str = "") -> DirectoryView:
        await self._check_config()
        kept, positions = self.sampler.select_array(keys)
        blob = pack_keys(kept)
        if session:
            rows, raw = await self._fan_out_with(blob, self._session_key(session))
            session_node = raw.decode() if isinstance(raw, bytes) else (raw or "")
        else:
            rows, session_node = await self._fan_out(blob), ""
        blocks_for = KeySampler.blocks_for
        node = self._node
        views = []
        stride = self.sampler.stride
        for _, (info, held, worst, inflight, prefill, indexed, due_ms, arrivals, context) in rows:
            views.append(
                NodeView(
                    node(info),
                    blocks_for(held, positions),
                    TIERS[worst],
                    _load(inflight, prefill, due_ms),
                    indexed * stride,
                    _arrivals(arrivals) if arrivals else (),
                    context,
                )
            )
        return DirectoryView(tuple(views), blocks_for(len(kept), positions), session_node)

    # -- load ----------------------------------------------------------------------------------

    async def reserve(
        self,
        node_id: str,
        prefill_tokens: int,
        *,
        if_inflight_at_most: int | None = None,
        first_token_s: float | None = None,
        hold_s: float | None = None,
        arrival: SplitArrival | None = None,
        requests: int = 1,
        context_tokens: int = 0,
    ) -> Reservation:
        check_node_id(node_id)
        check_prefill(prefill_tokens)
        check_requests(requests)
        check_context_tokens(context_tokens)
        settle_s, end_s = reservation_times(first_token_s, hold_s, self.max_request_s)
        split: tuple[Any, ...] = ()
        if arrival is not None:
            a = check_arrival(arrival, self.max_request_s)
            split = (f"{a.arrival_id}|{a.blocks}", int(a.arrives_s * 1000), max(1, int(a.until_s * 1000)))
        await self._check_config()
        # the scripts read context and weight back: no caller can make counters drift
        weight = (f"~{context_tokens}" if context_tokens else "") + (f"*{requests}" if requests > 1 else "")
        member = f"{self._client_id}-{next(self._tokens)}{weight}|{prefill_tokens}"
        nk = self._keys(node_id)
        limit = "" if if_inflight_at_most is None else int(if_inflight_at_most)
        times = (max(1, int(end_s * 1000)), int(settle_s * 1000))
        reservation = Reservation(node_id, requests, prefill_tokens, member)
        sent = False
        try:
            async with self._io("reserve"):
                sent = True
                taken = await self._eval("reserve", (nk.load, nk.resv), (member, prefill_tokens, *times, limit, *split))
        except BaseException as e:
            # the script may run although its answer is lost: give it back later (not if it was
            # never sent: refused for a cluster shard known down)
            if sent and not isinstance(e.__cause__, ShardDown):
                self._release_lost(reservation, end_s)
            raise
        if taken == -1:
            raise ReservationConflict(node_id, if_inflight_at_most)
        if split and taken == 1:
            aid = split[0].rsplit("|", 1)[0]
            return Reservation(node_id, requests, prefill_tokens, member, arrival_recorded=True, arrival_id=aid)
        return reservation

    def _release_lost(self, reservation: Reservation, end_s: float) -> None:
        """Release a reservation whose reserve timed out or was cancelled after it was sent: the
        server may still run it (a stalled server wakes, a slow answer is dropped), and nobody
        else knows its token, so the node would look busy until the reservation's own end."""
        deadline = time.monotonic() + end_s
        nk = self._keys(reservation.node_id)

        async def retry() -> None:
            while (left_s := deadline - time.monotonic()) > 0:
                try:
                    # idempotent; a reserve not run yet finds a tombstone until its end and takes nothing
                    async with self._io("release"):
                        await self._eval("release", (nk.load, nk.resv), (reservation.token, max(1, int(left_s * 1000))))
                    return
                except DirectoryUnavailable:
                    await asyncio.sleep(max(self.op_timeout_s, self.breaker.retry_in_s))

        task = asyncio.ensure_future(retry())
        self._lost.add(task)
        task.add_done_callback(self._lost.discard)

    async def release(self, reservation: Reservation) -> None:
        check_reservation(reservation)
        if not reservation.token:
            return
        nk = self._keys(reservation.node_id)
        split = ("", reservation.arrival_id) if reservation.arrival_id else ()
        async with self._io("release"):
            await self._eval("release", (nk.load, nk.resv), (reservation.token, *split))

    async def loads(self) -> dict[str, NodeLoad]:
        await self._check_config()
        rows = await self._fan_out(b"")
        return {nid: _load(r[3], r[4], r[6]) for nid, r in rows}

    def _session_key(self, session: str) -> str:
        return f"{self.key_prefix}:session:{session}"

    @abstractmethod
    async def _fan_out_with(self, blob: bytes, key: str) -> tuple[list[tuple[str, Any]], Any]:
        """``_fan_out`` and the value of ``key`` (None if unset), in the lookup's round trip."""

    async def session_node(self, session: str) -> str | None:
        key = self._session_key(session)
        async with self._io("session_node"), self._on_key(key):
            raw = await self._client.get(key)
        return raw.decode() if isinstance(raw, bytes) else raw

    async def record_session(self, session: str, node_id: str, ttl_s: float) -> None:
        check_node_id(node_id)
        key = self._session_key(session)
        async with self._io("record_session"), self._on_key(key):
            await self._client.set(key, node_id, px=max(1, int(ttl_s * 1000)))

    async def record_hot(self, node_id: str, model: str, tokens: bytes, *, keep: int, ttl_s: float) -> None:
        check_node_id(node_id)
        member = check_hot(model, tokens, keep, ttl_s)
        key = f"{self.key_prefix}:{{{node_id}}}:hot"
        async with self._io("record_hot"):
            await self._pipeline([
                ("ZADD", key, time.time(), member),
                ("ZREMRANGEBYRANK", key, 0, -keep - 1),
                ("PEXPIRE", key, max(1, int(ttl_s * 1000))),
            ])  # fmt: skip

    async def hot_prefixes(self, node_id: str, limit: int) -> list[HotPrefix]:
        check_node_id(node_id)
        if limit <= 0:
            return []
        key = f"{self.key_prefix}:{{{node_id}}}:hot"
        async with self._io("hot_prefixes"), self._on_key(key):
            rows = await self._client.zrevrange(key, 0, limit - 1, withscores=True)
        out = [hot_prefix(bytes(m), float(at)) for m, at in rows]
        return [h for h in out if h is not None]

    async def set_draining(self, node_id: str, ttl_s: float) -> None:
        check_node_id(node_id)
        key = self._draining_key
        async with self._io("set_draining"), self._on_key(key):
            if ttl_s > 0:
                await self._client.zadd(key, {node_id: time.time() + ttl_s})
            else:
                await self._client.zrem(key, node_id)

    async def draining(self) -> frozenset[str]:
        async with self._io("draining"), self._on_key(self._draining_key):
            rows = await self._client.zrangebyscore(self._draining_key, time.time(), "+inf")
        return frozenset(r.decode() if isinstance(r, bytes) else r for r in rows)

    async def aclose(self) -> None:
        """Close the connection pool; a directory that is down closes without raising."""
        for task in self._lost:
            task.cancel()
        try:
            await self._client.aclose()
        except Exception:  # closing a pool whose server vanished must not fail shutdown
            pass
