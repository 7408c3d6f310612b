"""The KV-event bridge: engines' ZMQ KV events in, the prefix directory kept in step.

One ``KVEventBridge`` follows any number of engines (one asyncio task each) and is used both by
``kvgate bridge`` (a sidecar per node, or one per fleet) and inside ``kvgate serve`` for the
embedded single-gateway default.

What it guarantees (and what it does not):

* **Keys, not engine hashes.** Each ``BlockStored`` is keyed with ``tokenizer.keys.block_keys``
  over its ``token_ids``, chained from the kvgate key of ``parent_block_hash``; a per-node map
  engine-hash → key lets ``BlockRemoved`` (hashes only) be applied. A block whose parent hash we
  never saw (we missed it, or the engine names a parent it never announced) is **dropped and
  counted**, never keyed from a guess: a wrong key would claim a prefix the node does not hold,
  a missing one only costs a cache hit. Its descendants are dropped the same way.
* **Idempotent, coalesced writes.** Changes are folded per key (last state wins) and written every
  ``flush_interval_s`` or ``flush_max_keys`` changes, whichever comes first.
* **One writer per node.** Several gateway replicas (each with its embedded bridge) may follow
  one engine. Only the holder of the node's writer lease (``Directory.claim_writer``, a Redis key
  with a TTL of two heartbeat intervals, renewed every interval) registers, heartbeats and writes
  the node; the others apply the same events to their own maps without writing, and the first to
  find the lease lapsed (its holder died or left) takes the node over by rewriting it from its map.
  A starting replica therefore never touches what another writes.
* **Gaps are repaired.** Sequence numbers must grow by one. A jump asks the engine's replay socket
  for everything from the first missing batch. If the replay cannot cover the gap (no replay
  socket, timeout, or the engine's buffer moved past it) what happened in it is unknowable, so the
  node is **cleared and rebuilt** from whatever the buffer still holds (blocks chained to older,
  unseen parents are dropped as above): the directory then under-reports the node until the
  engine stores those blocks again, and never over-reports it.
* **Catching up never clears what is still true.** On every new connection to the engine's PUB
  socket (a bridge starting, the engine restarted, the link broke) the bridge rebuilds its map from
  the engine's replay buffer, then rewrites the node: if the buffer reaches back to seq 0 the map
  is the engine's whole life and *replaces* the node's entries in one step (``replace_node``:
  lookups never see it half written; an engine restart's stale entries go); if it does not (a
  long-running engine; vLLM keeps 10,000 batches) what the map lacks cannot be proven gone, so
  the map is *added* to the entries already there and the node is **partially known**
  (``kvgate_bridge_node_partially_known``): those older entries stay until ``unproven_ttl_s``
  (30 min), then the node is rewritten from the map alone — an engine may have evicted them while
  no bridge listened, and their removals can never be keyed. ``AllBlocksCleared`` and a sequence number that goes backwards
  on one connection (the engine restarted) do clear the node.
* **Liveness follows the engine.** The node is registered and heartbeated only while the bridge
  holds a live ZMQ connection to its publisher: one whose ZMTP handshake completed and whose ZMTP
  heartbeats are answered within ``engine_timeout_s``. When the connection drops (a ZMQ socket
  monitor sees it at once on ``kill -9``; a paused or hung engine stops answering heartbeats) the
  node is **retired at once** (``retire_node``: not returned by lookups, entries kept), so the
  gateway stops choosing it in milliseconds rather than after the heartbeat TTL, and a socket that
  comes back brings the entries back with it. If the directory is down at that moment, the TTL
  retires the node.
* **A directory outage never stops the bridge.** Events keep being applied to the in-memory map;
  after any ``DirectoryUnavailable`` the next successful flush re-registers the node and rewrites
  its entries from the map (replaced or added to, as above), so nothing is lost but freshness
  during the outage.
* **Bounded memory.** The map holds one entry per block the engine currently caches (every store
  is matched by a removal), so it is bounded by the engine's capacity: ~210 B per tracked block
  (``python -m workers.bridge_memory``; plain ints in two dicts, it was ~310 B as objects), held
  by every replica following the node, writer or not. ``max_blocks_per_node`` (default 8× the
  declared capacity, else 1M blocks ≈ 200 MiB) guards against an engine that never sends
  removals: past it the node is cleared and rebuilt. Pending changes are a dict over the same
  keys, emptied by every flush.
* **Untrusted input.** A batch that does not decode, or is larger than ``max_batch_bytes``
  (default 16 MiB; vLLM's per-step batches are kilobytes), is logged, counted
  (``kvgate_bridge_malformed_batches_total``) and skipped unread; its sequence number is consumed
  and, since it may have removed blocks, the node is cleared like after an unrepairable gap (routed
  by load until the engine stores blocks again). Bad events inside a good batch are dropped one by
  one (``kvgate_bridge_rejected_events_total``); fields of newer engines are ignored.
* **Degraded nodes are routed by load, and say so.** The bridge learns the engine's block size
  from its GPU ``BlockStored`` events; one that differs from the configured ``block_size`` (vLLM
  forces 64 or more for MLA and hybrid models) cannot be keyed at all, so the node is marked
  degraded: a log line names the node and both sizes, ``kvgate_bridge_engine_block_size`` and
  ``kvgate_bridge_node_degraded{reason}`` show it, ``/readyz`` lists it under ``degraded_nodes``,
  and its entries are withheld (it stays live, chosen by load alone) until a new connection. A
  replay socket that answers garbage or never answers a catch-up degrades the node the same way
  (``kvgate_bridge_replay_failures_total``) until a retry, made on live events every
  ``replay_retry_s``, succeeds.
* **Offloaded copies.** A ``BlockStored`` without token IDs (vLLM's CPU-offload connector when it
  lacks a block's metadata; ``block_size`` 0) adds its tier to blocks whose engine hash we keyed
  when they were stored on the GPU; the others cannot be keyed and are dropped and counted
  (``reason="no_tokens"``). Offloaded blocks with a block size other than the configured one
  (offload chunks spanning several GPU blocks) are dropped as ``reason="block_size"`` without
  degrading the node.
* **Backpressure.** A flood cannot queue without bound: ZMQ holds at most ``RCVHWM`` batches for
  us and drops the rest at the publisher, which the bridge sees as a sequence gap and repairs by
  replay; pending directory writes are folded per key, so they are bounded by the blocks held.

* **Salt and LoRA key like the gateway's.** ``lora_name`` and the ``cache_salt`` vLLM puts in
  block 0's ``extra_keys`` seed the chain (``tokenizer.keys``: one rule on both sides), so a
  tenant's salted blocks are found only by prompts with the same salt. Blocks whose content is
  not their token IDs (multimodal, prompt embeddings) or whose adapter has no name (deprecated
  ``lora_id`` only) are dropped and counted (``reason``: ``extra_keys``, ``lora_unnamed``), as are
  blocks under an adapter name longer than any request may name (``lora_name``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio
from prometheus_client import Counter, Gauge, Histogram
from zmq.utils.monitor import parse_monitor_message

from directory_client.types import Directory, DirectoryUnavailable, NodeInfo, NodeRole, Tier, UnknownNode, WriterLease
from directory_client.validate import check_node_id
from tokenizer.keys import BlockKey, block_keys, namespace_seed
from workers.collector_peers import NodeHosts, sender_ip
from workers.engine_capacity import fetch_capacity_blocks
from workers.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventDecodeError,
    decode_batch_steps,
    decode_seq,
    encode_seq,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# metrics (module level: several bridges in one process share them, told apart by `node`)

BATCHES = Counter("kvgate_bridge_batches_total", "KV-event batches applied", ["node"])
MALFORMED = Counter("kvgate_bridge_malformed_batches_total", "KV-event batches that did not decode", ["node"])
REJECTED_EVENTS = Counter(
    "kvgate_bridge_rejected_events_total", "malformed or unknown events dropped from good batches", ["node"]
)
DROPPED_BLOCKS = Counter(
    "kvgate_bridge_dropped_blocks_total",
    "stored blocks not recorded (reason: unknown_parent, block_size, token_count, extra_keys, lora_unnamed, lora_name, no_tokens)",
    ["node", "reason"],
)
GAPS = Counter("kvgate_bridge_gaps_total", "sequence gaps (outcome: repaired, unrecoverable)", ["node", "outcome"])
RESETS = Counter("kvgate_bridge_node_resets_total", "node cleared and rebuilt, by reason", ["node", "reason"])
DIRECTORY_ERRORS = Counter("kvgate_bridge_directory_errors_total", "directory calls that failed", ["node"])
EVENT_LAG = Histogram(
    "kvgate_bridge_event_lag_seconds",
    "engine timestamp of a batch to the bridge applying it (wall clocks: includes their skew)",
    ["node"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
TRACKED_BLOCKS = Gauge("kvgate_bridge_tracked_blocks", "engine blocks the bridge maps to keys", ["node"])
ENGINE_BLOCK_SIZE = Gauge(
    "kvgate_bridge_engine_block_size", "block size the engine's own KV events use (learned from them)", ["node"]
)
DEGRADED = Gauge(
    "kvgate_bridge_node_degraded",
    "1 while the node's entries are withheld and it is routed by load only (reason: block_size, replay)",
    ["node", "reason"],
)
REPLAY_FAILURES = Counter(
    "kvgate_bridge_replay_failures_total", "replay requests that failed (reason: timeout, garbage)", ["node", "reason"]
)
UNKNOWN_TOPICS = Counter(
    "kvgate_bridge_unknown_topic_messages_total", "collector messages whose topic names no configured node", []
)
FOREIGN = Counter(
    "kvgate_bridge_foreign_messages_total",
    "collector messages under a node's topic sent from another host than the node's: dropped",
    ["node"],
)
PARTIALLY_KNOWN = Gauge(
    "kvgate_bridge_node_partially_known",
    "1 while the node's entries include some written before the engine's replay window (not proven by this "
    "bridge; dropped after unproven_ttl_s unless the node is replayed from seq 0)",
    ["node"],
)
WRITER = Gauge(
    "kvgate_bridge_writer", "1 while this bridge holds the node's writer lease (0: another replica writes it)", ["node"]
)

_TIERS = (Tier.GPU, Tier.CPU, Tier.STORAGE)  # indexed by Tier value
MAX_LORA_NAME_CHARS = 1024
"""Blocks under a longer adapter name are dropped: no request can name it (the gateway refuses
longer model names), and the key seeds cached per name would keep every such name."""
DEFAULT_MAX_BLOCKS_PER_NODE = 1_000_000
"""Blocks tracked per node when the engine's capacity is unknown (~200 MiB at ~210 B a block)."""
CAPACITY_RETRY_S = 30.0
"""How often an engine that did not say its KV capacity is asked again."""


# ---------------------------------------------------------------------------------------------
# configuration


COLLECTOR = "collector"
"""``EngineSpec.events`` of an engine whose PUB socket connects to the bridge's collector."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine the bridge follows, and how the node is announced in the directory.

    ``events`` is the engine's PUB endpoint, which the bridge connects to (vLLM binds
    ``tcp://*:P``), or ``COLLECTOR``: the engine's PUB connects to the endpoint the bridge binds
    (vLLM given ``tcp://kvgate:P``), its messages told apart by ``topic`` (default
    ``kv@<address>@<model>``, also matched as ``kv@<host>@<model>``). A collector-fed node cannot
    be followed per connection, so its liveness is left to the static fleet's health checks.
    """

    node_id: str
    address: str  # "ip:port" of its OpenAI-compatible server (what Envoy routes to)
    events: str  # ZMQ PUB endpoint, e.g. "tcp://127.0.0.1:5557", or COLLECTOR
    replay: str | None = None  # ZMQ ROUTER replay endpoint; None = gaps cannot be repaired
    transfer: str = ""  # "ip:port" of its KV transfer agent
    capacity: int = 0  # KV cache size in blocks (0 = ask the engine's /metrics: workers.engine_capacity)
    topic: str = ""  # subscribe: topic prefix ("" = all); collector: the exact topic (see above)
    model: str = ""  # the base model it serves ("" = the bridge's)
    role: NodeRole = "both"  # prefill, decode or both (disaggregated serving)
    sources: tuple[str, ...] = ()  # collector: further hosts its engine may publish from (multi-homed)

    @property
    def collected(self) -> bool:
        return self.events == COLLECTOR

    def node_info(self, model: str) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            address=self.address,
            transfer_endpoint=self.transfer,
            capacity_blocks=self.capacity,
            model=self.model or model,
            role=self.role,
        )

    def collector_topics(self, model: str) -> list[str]:
        if self.topic:
            return [self.topic]
        model = self.model or model
        host = self.address.rsplit(":", 1)[0]
        return [f"kv@{self.address}@{model}", f"kv@{host}@{model}"]


_SPEC_KEYS = {"node_id", "address", "events", "replay", "transfer", "capacity", "topic", "model", "sources"}


def parse_engine_spec(text: str) -> EngineSpec:
    """``node_id=n1,address=127.0.0.1:8001,events=tcp://…:5557|collector[,replay=…][,transfer=…][,capacity=N][,topic=…][,model=…][,sources=ip;ip…]``."""
    values: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not value.strip():
            raise ValueError(f"engine spec item {part!r} is not name=value")
        if name not in _SPEC_KEYS:
            raise ValueError(f"unknown engine spec key {name!r} (known: {', '.join(sorted(_SPEC_KEYS))})")
        if name in values:
            raise ValueError(f"engine spec key {name!r} given twice")
        values[name] = value.strip()
    missing = [k for k in ("node_id", "address", "events") if k not in values]
    if missing:
        raise ValueError(f"engine spec {text!r} lacks {', '.join(missing)}")
    check_node_id(values["node_id"])
    capacity = 0
    if "capacity" in values:
        try:
            capacity = int(values["capacity"])
        except ValueError:
            raise ValueError(f"engine capacity {values['capacity']!r} is not an integer") from None
        if capacity < 0:
            raise ValueError("engine capacity must not be negative")
    return EngineSpec(
        node_id=values["node_id"],
        address=values["address"],
        events=values["events"],
        replay=values.get("replay"),
        transfer=values.get("transfer", ""),
        capacity=capacity,
        topic=values.get("topic", ""),
        model=values.get("model", ""),
        sources=tuple(s.strip() for s in values.get("sources", "").split(";") if s.strip()),
    )


# ---------------------------------------------------------------------------------------------
# the per-node map (pure: no I/O, no clock)


class BlockMapOverflow(Exception):
    """More blocks than ``max_blocks``: the engine is not announcing its evictions."""


_TIER_BITS = 3  # an engine block is one int: its kvgate key << 3 | bitmask of tiers (1 << Tier) holding it
_COUNT_BITS = 32  # a key's holders are one int: a 32-bit holder count per tier
_COUNT_MASK = (1 << _COUNT_BITS) - 1


@dataclass(frozen=True, slots=True)
class TierChange:
    """One key's directory update: the tiers to record it in, and the tiers to drop it from."""

    key: BlockKey
    stored: tuple[Tier, ...]
    removed: tuple[Tier, ...]


@dataclass(slots=True)
class DirectoryWrites:
    """One flush of a node's changes, grouped into as few directory calls as possible."""

    cleared: bool
    removed: dict[Tier, list[BlockKey]] = field(default_factory=dict)
    stored: dict[Tier, list[BlockKey]] = field(default_factory=dict)

    async def apply(self, directory: Directory, node_id: str) -> None:
        """Clear first, then removals, then stores: the order that keeps the node's entries true."""
        if self.cleared:
            await directory.clear_node(node_id)
        for tier, keys in self.removed.items():
            await directory.record_removed(node_id, keys, tier)
        for tier, keys in self.stored.items():
            await directory.record_stored(node_id, keys, tier)


class NodeBlockMap:
    """Engine hash → kvgate key for one node, and the directory changes events imply.

    Engine hashes are namespaced by ``group_idx`` (hybrid models hash per KV-cache group). Several
    engine blocks can share one key (the same tokens under different engine-side salts or groups),
    and one engine block can sit on several tiers (GPU and its CPU offload copy), so each key
    counts its holders per tier and the directory is told about a tier only when its first holder
    arrives or its last one leaves: removing one holder never deletes a key another still holds.

    Changes are folded per key: ``take_changes`` compares each touched key's tiers now with its
    tiers at the previous ``take_changes`` (or none, after a ``reset``) and returns only the
    difference, so a block stored and evicted between two flushes costs no directory write.
    """

    def __init__(self, *, model: str, block_size: int, max_blocks: int) -> None:
        self._model = model
        self._block_size = block_size
        self._max_blocks = max_blocks
        # plain ints, not objects: ~200 B a tracked block instead of ~310 (bench: workers/bridge_memory.py)
        self._by_hash: dict[int, int] = {}  # engine hash (+ group) -> key << 3 | tiers
        self._holders: dict[int, int] = {}  # key -> holder count per tier, packed
        self._seeds: dict[str | None, int] = {}  # unsalted seed per LoRA name
        self._touched: dict[int, int] = {}  # key -> its tier mask at the last take_changes
        self.cleared = False  # the directory must clear the node before the next changes

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def key_count(self) -> int:
        return len(self._holders)

    @property
    def pending(self) -> int:
        """Keys touched since the last ``take_changes`` (an upper bound on the writes due)."""
        return len(self._touched)

    def reset(self) -> None:
        """Forget everything; the directory must clear the node before later changes."""
        self.forget()
        self.cleared = True

    def forget(self) -> None:
        """Forget everything, leaving the directory alone (it is rewritten from a fresh history)."""
        self._by_hash.clear()
        self._holders.clear()
        self._touched.clear()
        self.cleared = False

    def take_changes(self) -> tuple[bool, list[TierChange]]:
        """``(clear the node first?, per-key tier changes)`` since the previous call."""
        out: list[TierChange] = []
        for key, before in self._touched.items():
            after = _mask(self._holders.get(key))
            if after != before:
                out.append(
                    TierChange(
                        key,
                        tuple(t for t in _TIERS if after & ~before & (1 << t)),
                        tuple(t for t in _TIERS if before & ~after & (1 << t)),
                    )
                )
        cleared = self.cleared
        self._touched = {}
        self.cleared = False
        return cleared, out

    def take_writes(self) -> DirectoryWrites | None:
        """The directory calls that bring the node up to date since the previous call (None: none).

        ``take_changes`` grouped per tier, without its per-key objects: a flush after a long
        prompt's blocks touches thousands of keys."""
        cleared, touched, holders = self.cleared, self._touched, self._holders
        self._touched, self.cleared = {}, False
        writes = DirectoryWrites(cleared)
        gpu_stored: list[BlockKey] = []
        gpu_removed: list[BlockKey] = []
        for key, before in touched.items():
            counts = holders.get(key, 0)
            after = (1 if counts else 0) if counts <= _COUNT_MASK else _mask(counts)  # GPU-only: no _mask
            if after == before:
                continue
            if before | after == 1:  # the common case: a key entering or leaving the GPU alone
                (gpu_stored if after else gpu_removed).append(key)  # type: ignore[arg-type]
                continue
            for tier in _TIERS:
                b = 1 << tier
                if after & b and not before & b:
                    writes.stored.setdefault(tier, []).append(key)  # type: ignore[arg-type]
                elif before & b and not after & b:
                    writes.removed.setdefault(tier, []).append(key)  # type: ignore[arg-type]
        if gpu_stored:
            writes.stored.setdefault(Tier.GPU, []).extend(gpu_stored)
        if gpu_removed:
            writes.removed.setdefault(Tier.GPU, []).extend(gpu_removed)
        if not cleared and not writes.stored and not writes.removed:
            return None
        return writes

    def drop_changes(self) -> None:
        """Forget what changed since the previous ``take_changes`` (the node is rewritten whole,
        or another bridge writes it)."""
        self._touched, self.cleared = {}, False

    def snapshot(self) -> dict[Tier, list[BlockKey]]:
        """Every key held, per tier (for rewriting the node from scratch)."""
        out: dict[Tier, list[BlockKey]] = {}
        for key, counts in self._holders.items():
            for tier in _TIERS:
                if counts >> (tier * _COUNT_BITS) & _COUNT_MASK:
                    out.setdefault(tier, []).append(BlockKey(key))
        return out

    def key_of(self, engine_hash: int, group_idx: int | None = None) -> BlockKey | None:
        held = self._by_hash.get(_slot(engine_hash, group_idx))
        return None if held is None else BlockKey(held >> _TIER_BITS)

    def apply(self, event: KVEvent) -> tuple[str, int] | None:
        """Apply one event; returns ``(reason, blocks)`` when stored blocks had to be dropped.

        ``AllBlocksCleared`` resets the map. Raises ``BlockMapOverflow`` past ``max_blocks``.
        """
        steps = self.apply_steps(event, 0)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def apply_steps(self, event: KVEvent, step_blocks: int) -> Generator[None, None, tuple[str, int] | None]:
        """``apply`` a slice of at most ``step_blocks`` blocks at a time (0: all at once), pausing
        between slices, so a caller on an event loop can let other work in during a long run of
        blocks. Between two slices the map holds a prefix of the event's blocks: what it would
        hold had the engine published them as several events. The generator returns ``apply``'s
        value."""
        if isinstance(event, BlockStored):
            return (yield from self._stored(event, step_blocks))
        if isinstance(event, BlockRemoved):
            yield from self._removed(event, step_blocks)
            return None
        self.reset()
        return None

    def _seed(self, lora_name: str | None, cache_salt: str | None) -> int:
        if cache_salt:  # per tenant, chosen by clients: not worth caching (and not bounded)
            return namespace_seed(self._model, lora=lora_name, cache_salt=cache_salt)
        seed = self._seeds.get(lora_name)
        if seed is None:
            if len(self._seeds) >= 1024:
                self._seeds.clear()
            seed = self._seeds[lora_name] = namespace_seed(self._model, lora=lora_name)
        return seed

    def _stored(self, ev: BlockStored, step_blocks: int) -> Generator[None, None, tuple[str, int] | None]:
        n = len(ev.block_hashes)
        if not ev.token_ids and n:
            return (yield from self._stored_without_tokens(ev, step_blocks))
        if ev.block_size != self._block_size:
            return ("block_size", n)
        if len(ev.token_ids) != n * self._block_size:
            return ("token_count", n)
        if ev.lora_id is not None and not ev.lora_name:
            return ("lora_unnamed", n)  # an adapter we cannot name: keying it as the base would lie
        if ev.lora_name is not None and len(ev.lora_name) > MAX_LORA_NAME_CHARS:
            return ("lora_name", n)
        salt, keyable = read_extra_keys(ev.extra_keys, n, root=ev.parent_block_hash is None, lora_name=ev.lora_name)
        if keyable == 0:
            return ("extra_keys", n)
        parent_key: int | None = None
        if ev.parent_block_hash is not None:
            parent = self._by_hash.get(_slot(ev.parent_block_hash, ev.group_idx))
            if parent is None:
                return ("unknown_parent", n)
            parent_key = parent >> _TIER_BITS
        chain = self._seed(ev.lora_name, salt) if parent_key is None else parent_key
        tier, size = Tier.from_medium(ev.medium), self._block_size
        step = step_blocks if 0 < step_blocks < keyable else keyable
        for lo in range(0, keyable, step):
            if lo:
                yield  # a slice done: the caller may let other work in
            hi = min(lo + step, keyable)
            whole = lo == 0 and hi == n  # no copies of the lists
            tokens = ev.token_ids if whole else ev.token_ids[lo * size : hi * size]
            keys = block_keys(tokens, block_size=size, seed=chain)
            self._store_run(ev.block_hashes if whole else ev.block_hashes[lo:hi], keys, ev.group_idx, tier)
            chain = keys[-1]  # the next slice continues this one's chain
        return None if keyable == n else ("extra_keys", n - keyable)

    def _store_run(self, hashes: Sequence[int], keys: Sequence[int], group_idx: int | None, tier: Tier) -> None:
        """Record consecutive blocks (engine hash, key) as held on ``tier``: the per-block loop,
        kept to dict operations on plain ints."""
        bit = 1 << tier
        delta = 1 << (tier * _COUNT_BITS)
        group = (group_idx or 0) << 64  # _slot, inlined
        by_hash, holders, touched = self._by_hash, self._holders, self._touched
        for engine_hash, key in zip(hashes, keys):
            slot = engine_hash | group
            held = by_hash.get(slot)
            if held is not None and held >> _TIER_BITS != key:
                self._forget(slot, held)  # same engine hash, other tokens: the engine reused it
                held = None
            if held is None:
                if len(by_hash) >= self._max_blocks:
                    raise BlockMapOverflow(f"more than {self._max_blocks} blocks tracked")
                held = key << _TIER_BITS
            if not held & bit:
                by_hash[slot] = held | bit
                counts = holders.get(key, 0)  # _count(key, tier, +1), inlined
                if key not in touched:
                    touched[key] = _mask(counts)
                holders[key] = counts + delta

    def _stored_without_tokens(self, ev: BlockStored, step_blocks: int) -> Generator[None, None, tuple[str, int] | None]:
        """A copy (CPU offload) announced by engine hash alone: the blocks we keyed when they were
        stored elsewhere gain the tier; the others cannot be keyed and are dropped."""
        tier = Tier.from_medium(ev.medium)
        bit = 1 << tier
        unknown = 0
        for i, engine_hash in enumerate(ev.block_hashes):
            if step_blocks and i and not i % step_blocks:
                yield
            slot = _slot(engine_hash, ev.group_idx)
            held = self._by_hash.get(slot)
            if held is None:
                unknown += 1
            elif not held & bit:
                self._by_hash[slot] = held | bit
                self._count(held >> _TIER_BITS, tier, +1)
        return ("no_tokens", unknown) if unknown else None

    def _removed(self, ev: BlockRemoved, step_blocks: int) -> Generator[None, None, None]:
        tier = Tier.from_medium(ev.medium)
        bit = 1 << tier
        group = (ev.group_idx or 0) << 64  # _slot, inlined
        by_hash = self._by_hash
        for i, engine_hash in enumerate(ev.block_hashes):
            if step_blocks and i and not i % step_blocks:
                yield
            slot = engine_hash | group
            held = by_hash.get(slot)
            if held is None or not held & bit:
                continue  # never announced to us (or already gone): nothing to undo
            held &= ~bit
            self._count(held >> _TIER_BITS, tier, -1)
            if held & _TIERS_MASK:
                by_hash[slot] = held
            else:
                del by_hash[slot]

    def _forget(self, slot: int, held: int) -> None:
        for tier in _TIERS:
            if held & (1 << tier):
                self._count(held >> _TIER_BITS, tier, -1)
        del self._by_hash[slot]

    def _count(self, key: int, tier: Tier, delta: int) -> None:
        counts = self._holders.get(key, 0)
        if key not in self._touched:
            self._touched[key] = _mask(counts)
        counts += delta << (tier * _COUNT_BITS)
        if counts:
            self._holders[key] = counts
        else:
            del self._holders[key]


def read_extra_keys(extra: list | None, n: int, *, root: bool, lora_name: str | None) -> tuple[str | None, int]:
    """``(cache salt, how many leading blocks token IDs alone can key)`` from ``extra_keys``.

    vLLM 0.32 publishes one entry per block (None when empty), each holding in order: the LoRA
    name (every block of a LoRA request), ``(mm_identifier, offset)`` pairs, the cache salt (block
    0 of a sequence only) and prompt-embedding digests (bytes); newer engines may tag them
    (``("cache_salt", salt)``, ``("lora", name, path)``). The salt becomes part of the key seed.
    Multimodal and embedding entries mean the block's content is not its token IDs: that block
    and every later one (they chain on it) cannot be keyed, nor can anything we do not understand
    (a salt past block 0, an unknown type, a list of the wrong length).
    """
    if extra is None:
        return None, n
    if len(extra) != n:
        return None, 0
    salt: str | None = None
    for i, entry in enumerate(extra):
        if entry is None:
            continue
        if not isinstance(entry, list):
            return salt, i
        for j, item in enumerate(entry):
            if isinstance(item, list) and len(item) >= 2 and item[0] == "lora":
                continue  # tagged adapter: lora_name already names it
            if isinstance(item, list) and len(item) == 2 and item[0] == "cache_salt":
                item = item[1]
            elif j == 0 and lora_name and item == lora_name:
                continue  # the untagged adapter name leads every entry of a LoRA request
            if isinstance(item, str) and root and i == 0 and salt is None:
                salt = item
                continue
            return salt, i  # multimodal pair, embedding digest, a misplaced salt, or unknown
    return salt, n


def _slot(engine_hash: int, group_idx: int | None) -> int:
    return engine_hash | ((group_idx or 0) << 64)


_TIERS_MASK = (1 << len(_TIERS)) - 1


def _mask(counts: int | None) -> int:
    """Bitmask of the tiers a key has at least one holder in."""
    if not counts:
        return 0
    return (
        (counts & _COUNT_MASK > 0)
        | (counts >> _COUNT_BITS & _COUNT_MASK > 0) << 1
        | (counts >> 2 * _COUNT_BITS & _COUNT_MASK > 0) << 2
    )


# ---------------------------------------------------------------------------------------------
# the bridge


@dataclass(frozen=True, slots=True)
class NodeStats:
    """What the bridge knows of one engine right now (for tests, the admin API and logs)."""

    node_id: str
    connected: bool
    registered: bool
    writer: bool  # this bridge holds the node's writer lease (others follow without writing)
    authoritative: bool  # its map accounts for all the node's entries (rewrites replace, not merge)
    degraded: str  # "" or why the node's entries are withheld (it is routed by load only)
    engine_block_size: int | None  # as the engine's events say (None: no GPU block seen yet)
    next_seq: int | None  # sequence number expected next (None: not in step yet)
    tracked_blocks: int
    tracked_keys: int
    batches: int
    malformed_batches: int
    rejected_events: int
    dropped_blocks: int
    gaps_repaired: int
    gaps_unrecoverable: int
    resets: int
    directory_errors: int
    replay_failures: int


@dataclass(frozen=True, slots=True)
class _BatchMetrics:
    """A node's children of the metrics every batch updates (``labels()`` takes a lock and a
    lookup each time). Counters and histograms only: gauges are removed on close."""

    batches: Counter
    event_lag: Histogram

    @classmethod
    def of(cls, node: str) -> _BatchMetrics:
        return cls(BATCHES.labels(node), EVENT_LAG.labels(node))


@dataclass(eq=False)
class _Stream:
    """Mutable state of one followed engine."""

    spec: EngineSpec
    info: NodeInfo
    blocks: NodeBlockMap
    metrics: _BatchMetrics
    expected: int | None = None  # next sequence number to apply; None = not in step
    last_live: int | None = None  # last live seq on the current connection
    connected: bool = False
    registered: bool = False
    announced: NodeInfo | None = None  # the info last registered: `info` changed since → announced again
    writer: bool = False  # holds the node's writer lease: the only bridge writing its entries
    authoritative: bool = False  # `blocks` accounts for every entry the node may rightly have
    degraded: dict[str, str] = field(default_factory=dict)  # reason -> detail; entries withheld
    engine_block_size: int | None = None
    replay_retry_at: float = 0.0  # monotonic time of the next catch-up try while replay fails
    unproven_since: float | None = None  # monotonic time entries we cannot prove were merged into the node
    withdraw: bool = False  # the engine went away while we wrote it: retire the node
    rewrite_all: bool = False  # the directory may lack our writes: rewrite the node from `blocks`
    replaying: bool = False  # a catch-up or gap repair is being applied: `blocks` is half done, not written
    directory_down: bool = False  # for logging the outage once, not per failed call
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    liveness_changed: asyncio.Event = field(default_factory=asyncio.Event)
    consumer: asyncio.Task[None] | None = None
    flusher: asyncio.Task[None] | None = None
    heartbeat: asyncio.Task[None] | None = None
    capacity_probe: asyncio.Task[None] | None = None
    batches: int = 0
    malformed: int = 0
    rejected: int = 0
    dropped: int = 0
    gaps_repaired: int = 0
    gaps_unrecoverable: int = 0
    resets: int = 0
    directory_errors: int = 0
    replay_failures: int = 0


class KVEventBridge:
    """Follow engines' KV events and mirror their caches into ``directory`` (see module doc)."""

    _WRITE_CHUNK = 4096  # keys per directory call when rewriting a node
    STEP_BLOCKS = 256
    """Blocks of live events applied between two yields to the event loop (~0.2 ms of work)."""
    REPLAY_SLICE_S = 0.002
    """Work done applying a replayed history (catch-up, gap repair) between two yields to the loop."""
    REPLAY_SPAN_TIMEOUTS = 15
    """A replay answers each batch within ``replay_timeout_s`` of the last and ends within this many
    of them (30 s by default): an engine's whole buffer (vLLM keeps 10,000 batches) read by a busy
    gateway may take longer than one timeout, yet a trickling replay socket cannot hold it for ever."""

    def __init__(
        self,
        directory: Directory,
        engines: Sequence[EngineSpec],
        *,
        model: str,
        block_size: int = 16,
        heartbeat_interval_s: float = 1.0,
        flush_interval_s: float = 0.01,
        flush_max_keys: int = 2048,
        replay_timeout_s: float = 2.0,
        max_blocks_per_node: int | None = None,
        engine_timeout_s: float = 3.0,
        max_batch_bytes: int = 16 << 20,
        replay_retry_s: float = 30.0,
        collector: str | None = None,
        unproven_ttl_s: float = 1800.0,
    ) -> None:
        for spec in engines:
            check_node_id(spec.node_id)
        ids = [e.node_id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine node_ids must be unique: {ids}")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if max_blocks_per_node is not None and max_blocks_per_node <= 0:
            raise ValueError("max_blocks_per_node must be positive")
        self._directory = directory
        self._model = model
        self._heartbeat_interval_s = heartbeat_interval_s
        # the writer renews every interval; a lapsed lease is taken within one more
        self._lease_ttl_s = 2 * heartbeat_interval_s
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._flush_interval_s = flush_interval_s
        self._flush_max_keys = flush_max_keys
        self._replay_timeout_s = replay_timeout_s
        self._replay_retry_s = replay_retry_s
        if unproven_ttl_s <= 0:
            raise ValueError("unproven_ttl_s must be positive")
        self._unproven_ttl_s = unproven_ttl_s
        self._block_size = block_size
        if engine_timeout_s <= 0:
            raise ValueError("engine_timeout_s must be positive")
        self._engine_timeout_ms = max(int(engine_timeout_s * 1000), 10)
        self._max_batch_bytes = max_batch_bytes
        self._replay_yield_at = 0.0  # perf_counter time after which a replayed history yields to the loop
        self._streams: dict[str, _Stream] = {}
        for spec in engines:
            cap = max_blocks_per_node or (spec.capacity * 8 if spec.capacity else DEFAULT_MAX_BLOCKS_PER_NODE)
            blocks = NodeBlockMap(model=spec.model or model, block_size=block_size, max_blocks=cap)
            self._streams[spec.node_id] = _Stream(
                spec=spec, info=spec.node_info(model), blocks=blocks, metrics=_BatchMetrics.of(spec.node_id)
            )
        self._collector = collector
        self._routes: dict[bytes, _Stream] = {}  # collector topic -> stream
        ambiguous: set[bytes] = set()
        for st in self._streams.values():
            if not st.spec.collected:
                continue
            if collector is None:
                raise ValueError(f"engine {st.spec.node_id} sends its events to a collector, but none is configured")
            for topic in (t.encode() for t in st.spec.collector_topics(model)):
                if topic in self._routes and self._routes[topic] is not st:
                    ambiguous.add(topic)  # e.g. two engines on one host, both topics host-only
                self._routes[topic] = st
        for topic in ambiguous:
            del self._routes[topic]
        self._unknown_topics: set[bytes] = set()
        self._hosts = NodeHosts()
        self._foreign_seen: set[tuple[str, str]] = set()  # (node, sender) pairs logged, at most 64
        self._collector_task: asyncio.Task[None] | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to every engine; returns at once (connections and registration follow)."""
        if self._ctx is not None:
            raise RuntimeError("bridge already started")
        self._ctx = zmq.asyncio.Context()
        if self._routes:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.bind(self._collector)  # a taken port fails the start, loudly
            self._collector_task = asyncio.create_task(self._collect(sock), name="kv-bridge-collector")
        for st in self._streams.values():
            node = st.spec.node_id
            if not st.spec.collected:
                st.consumer = asyncio.create_task(self._consume(st), name=f"kv-bridge-events-{node}")
            st.flusher = asyncio.create_task(self._flush_loop(st), name=f"kv-bridge-flush-{node}")
            st.heartbeat = asyncio.create_task(self._heartbeat_loop(st), name=f"kv-bridge-heartbeat-{node}")
            if not st.spec.capacity and not st.spec.collected:  # a collected node is announced by the static fleet
                st.capacity_probe = asyncio.create_task(self._learn_capacity(st), name=f"kv-bridge-capacity-{node}")

    async def aclose(self, *, deregister: bool = True, timeout_s: float = 2.0) -> None:
        """Stop consuming, write what is pending, deregister the nodes (if asked), close sockets.

        Only for nodes this bridge writes (holds the lease of); the lease is given back, so another
        replica's bridge takes the node over within one heartbeat interval. ``deregister=False``
        leaves the entries and registration as they are (the engine is still serving; the TTL
        retires the node if nobody takes over). The directory is not closed: whoever opened it
        closes it.
        """
        if self._closed:
            return
        self._closed = True
        if self._ctx is None:
            return  # never started: nothing was registered or written
        # stop taking events and heartbeating first, then write what is left, then leave
        first = [t for st in self._streams.values() for t in (st.consumer, st.heartbeat, st.capacity_probe) if t is not None]
        if self._collector_task is not None:
            first.append(self._collector_task)
        for task in first:
            task.cancel()
        await _settle(first)
        for st in self._streams.values():
            if st.flusher is not None:
                st.flusher.cancel()
                await _settle([st.flusher])
            try:
                async with asyncio.timeout(timeout_s):
                    if st.writer:  # only the lease holder touches the node's entries
                        await self._flush_once(st)
                        if deregister:
                            await self._directory.deregister_node(st.spec.node_id)
                        await self._directory.release_writer(st.spec.node_id, self._owner)
            except Exception as exc:  # closing must finish; the TTL retires what we could not
                log.warning("node %s: final flush/deregister failed: %r", st.spec.node_id, exc)
            for gauge, labels in [(g, (st.spec.node_id,)) for g in (TRACKED_BLOCKS, WRITER, ENGINE_BLOCK_SIZE, PARTIALLY_KNOWN)] + [
                (DEGRADED, (st.spec.node_id, reason)) for reason in ("block_size", "replay")
            ]:
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> KVEventBridge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- inspection -------------------------------------------------------------------------

    @property
    def node_ids(self) -> list[str]:
        return list(self._streams)

    def spec(self, node_id: str) -> EngineSpec:
        return self._streams[node_id].spec

    def stats(self, node_id: str) -> NodeStats:
        st = self._streams[node_id]
        return NodeStats(
            node_id=node_id,
            connected=st.connected,
            registered=st.registered,
            writer=st.writer,
            authoritative=st.authoritative,
            degraded="; ".join(f"{k}: {v}" for k, v in st.degraded.items()),
            engine_block_size=st.engine_block_size,
            next_seq=st.expected,
            tracked_blocks=len(st.blocks),
            tracked_keys=st.blocks.key_count,
            batches=st.batches,
            malformed_batches=st.malformed,
            rejected_events=st.rejected,
            dropped_blocks=st.dropped,
            gaps_repaired=st.gaps_repaired,
            gaps_unrecoverable=st.gaps_unrecoverable,
            resets=st.resets,
            directory_errors=st.directory_errors,
            replay_failures=st.replay_failures,
        )

    # -- event path -------------------------------------------------------------------------

    async def _consume(self, st: _Stream) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, st.spec.topic.encode())
        # ZMTP heartbeats: an engine that is paused or hung (socket open, nobody home) stops
        # answering them and the connection is dropped, exactly as if it had died
        sub.setsockopt(zmq.HEARTBEAT_IVL, max(self._engine_timeout_ms // 3, 1))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._engine_timeout_ms)
        # a connection counts once the engine completed the ZMTP handshake: a paused engine's
        # kernel still accepts TCP connections, but never greets
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(st.spec.events)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        # plain (blocking-API) views of the same sockets: what is queued is read without a
        # future per message (pyzmq's asyncio recv costs about what applying a small batch does)
        sub_now, monitor_now = zmq.Socket.shadow(sub.underlying), zmq.Socket.shadow(monitor.underlying)
        try:
            while True:
                ready = dict(await poller.poll())
                # connection changes first: they decide how the next message is read
                if monitor in ready:
                    await self._on_monitor(st, parse_monitor_message(await monitor.recv_multipart()))
                    if not st.connected:
                        await _discard_queued(sub)  # from the lost connection; we resync on reconnect
                    continue
                if sub in ready:
                    await self._drain(st, sub_now, monitor_now)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _drain(self, st: _Stream, sub: zmq.Socket, monitor: zmq.Socket) -> None:
        """Apply the batches queued on ``sub``, one per turn of the event loop, until none is left
        or the connection changed (the caller's poll handles that first)."""
        while not monitor.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                await self._on_message(st, frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the node's event stream
                log.exception("node %s: failed to apply a KV-event message", st.spec.node_id)
                self._count_malformed(st)
            await asyncio.sleep(0)  # a burst of batches never holds the loop: decisions go between them

    async def _on_monitor(self, st: _Stream, event: dict[str, object]) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            log.info("node %s: connected to %s", st.spec.node_id, st.spec.events)
            await self._connected(st)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            log.warning("node %s: lost %s; heartbeats stop", st.spec.node_id, st.spec.events)
            st.connected = False
            st.withdraw = st.withdraw or st.writer
            st.registered = False
            st.expected = None
            st.liveness_changed.set()

    async def _connected(self, st: _Stream, live_seq: int | None = None) -> None:
        """Events may have been lost while we were not connected: rebuild the map from the
        engine's history, then rewrite the node from it. Never clear it first: what the directory
        holds may still be true (another bridge wrote it, or we did before a dropped socket), and
        a history that no longer reaches seq 0 cannot prove otherwise."""
        RESETS.labels(st.spec.node_id, "connect").inc()
        st.resets += 1
        st.blocks.forget()
        st.authoritative = False
        st.expected = None
        st.last_live = None
        st.engine_block_size = None  # the engine may have been restarted with other settings
        self._recover(st, "block_size")
        await self._catch_up(st, live_seq=live_seq)
        st.rewrite_all = True
        st.dirty.set()
        st.connected = True  # registration follows the catch-up: no stale entries go live first
        st.liveness_changed.set()

    async def _collect(self, sock: zmq.asyncio.Socket) -> None:
        """Engines whose PUB connects to us: one bound SUB, messages routed by topic."""
        try:
            while True:
                received = await sock.recv_multipart(copy=False)
                frames = [f.bytes for f in received]
                st = self._routes.get(frames[0]) if len(frames) == 3 else None
                if st is not None and not await self._from_its_host(st, received[0]):
                    continue
                if st is None:
                    UNKNOWN_TOPICS.inc()
                    if len(self._unknown_topics) < 64 and frames[0] not in self._unknown_topics:
                        self._unknown_topics.add(frames[0])
                        log.warning("collector: ignoring messages of topic %r (no configured node)", frames[0][:200])
                    continue
                try:
                    if not st.connected:  # its first message since we started: catch up first
                        try:
                            live = decode_seq(frames[1])
                        except KVEventDecodeError:
                            live = None
                        log.info("node %s: events arriving at the collector", st.spec.node_id)
                        await self._connected(st, live_seq=live)
                    await self._on_message(st, frames)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug must not stop every collected node's events
                    log.exception("node %s: failed to apply a KV-event message", st.spec.node_id)
                    self._count_malformed(st)
                await asyncio.sleep(0)  # queued messages are read without yielding: yield here
        finally:
            sock.close(linger=0)

    async def _from_its_host(self, st: _Stream, frame: zmq.Frame) -> bool:
        """Whether a collector message under ``st``'s topic came from the node's host (else counted)."""
        ip = sender_ip(frame)
        if ip is None or await self._hosts.allows(st.spec.address, ip, st.spec.sources):
            return True
        FOREIGN.labels(st.spec.node_id).inc()
        if len(self._foreign_seen) < 64 and (st.spec.node_id, ip) not in self._foreign_seen:
            self._foreign_seen.add((st.spec.node_id, ip))
            log.warning("collector: dropping messages under node %s's topic from %s, not the node's host %s "
                        "(a multi-homed engine: list its other addresses in the node's events_sources)",
                        st.spec.node_id, ip, ", ".join((st.spec.address, *st.spec.sources)))  # fmt: skip
        return False

    async def _on_message(self, st: _Stream, frames: list[bytes]) -> None:
        if not st.connected:
            return  # a reconnect resyncs the node from the engine's replay buffer anyway
        if len(frames) != 3:
            log.warning("node %s: message of %d frames, expected 3", st.spec.node_id, len(frames))
            self._count_malformed(st)
            return
        try:
            seq = decode_seq(frames[1])
        except KVEventDecodeError as exc:
            log.warning("node %s: %s", st.spec.node_id, exc)
            self._count_malformed(st)
            return
        if "replay" in st.degraded and time.monotonic() >= st.replay_retry_at:
            log.info("node %s: trying its replay socket again", st.spec.node_id)
            st.blocks.forget()
            st.authoritative = False
            st.expected = None
            await self._catch_up(st, live_seq=seq)
            st.rewrite_all = True
            st.dirty.set()
        if st.last_live is not None and seq <= st.last_live:
            # within one connection a publisher's sequence only grows: this one started over
            self._reset(st, "seq_reset")
        st.last_live = seq
        if st.expected is None:
            if seq > 0:
                await self._catch_up(st, live_seq=seq)
            else:
                st.expected = 0  # the engine's very first batch: nothing came before it
                if not st.authoritative:
                    st.authoritative = True
                    st.rewrite_all = True
        elif seq > st.expected:
            await self._repair_gap(st, seq)
        if seq == st.expected:
            await self._apply_live(st, seq, frames[2])
            st.expected = seq + 1
        # seq < expected: a replay already delivered it

    async def _catch_up(self, st: _Stream, live_seq: int | None = None) -> None:
        """The node was just reset: rebuild it from everything the engine's buffer holds."""
        batches = await self._fetch_replay(st, 0)
        if batches is None:
            st.expected = live_seq  # no history to be had: follow live events from here
            if st.spec.replay:
                st.replay_retry_at = time.monotonic() + self._replay_retry_s
                self._degrade(st, "replay", "the replay socket did not answer a catch-up; retried on later events")
            return
        self._recover(st, "replay")
        with self._replaying(st):
            for seq, payload in batches:
                await self._apply_replayed(st, seq, payload)
        if batches:
            st.expected = batches[-1][0] + 1
            if batches[0][0] == 0:
                st.authoritative = True  # the engine's whole life: what we hold is all it holds
            else:
                log.info(
                    "node %s: engine history starts at seq %d; its older blocks are kept as the directory has them",
                    st.spec.node_id, batches[0][0],
                )  # fmt: skip
        else:
            st.expected = 0 if live_seq is None else live_seq
            st.authoritative = live_seq is None  # nothing published yet

    async def _repair_gap(self, st: _Stream, live_seq: int) -> None:
        assert st.expected is not None
        start = st.expected
        log.info("node %s: gap, expected seq %d, got %d; replaying", st.spec.node_id, start, live_seq)
        batches = await self._fetch_replay(st, start)
        if batches and batches[0][0] == start:
            GAPS.labels(st.spec.node_id, "repaired").inc()
            st.gaps_repaired += 1
            with self._replaying(st):
                for seq, payload in batches:
                    if seq == st.expected:
                        await self._apply_replayed(st, seq, payload)
                        st.expected = seq + 1
            if st.expected >= live_seq:
                return
        # the missed batches are gone for good: clear the node, rebuild from what is left
        log.warning("node %s: gap from seq %d cannot be replayed; clearing the node", st.spec.node_id, start)
        GAPS.labels(st.spec.node_id, "unrecoverable").inc()
        st.gaps_unrecoverable += 1
        remaining = [(s, p) for s, p in batches or () if s >= start]
        with self._replaying(st):  # the clear and the rebuild are written as one
            self._reset(st, "gap")
            if remaining and remaining[-1][0] >= live_seq - 1:
                # the buffer's tail reaches the live stream without a hole: rebuild from it
                for seq, payload in remaining:
                    await self._apply_replayed(st, seq, payload)
                st.expected = remaining[-1][0] + 1
            else:
                st.expected = live_seq  # a hole before live_seq could hide removals: start clean here

    async def _fetch_replay(self, st: _Stream, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from ``start`` on, or None if the replay socket did not answer
        (a batch not within ``replay_timeout_s`` of the last, or the whole not within
        ``REPLAY_SPAN_TIMEOUTS`` of them).

        A fresh DEALER per request: a late answer to a timed-out request can never be mistaken
        for the answer to the next one.
        """
        if not st.spec.replay or self._ctx is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        out: list[tuple[int, bytes]] = []
        ends_by = time.monotonic() + self._replay_timeout_s * self.REPLAY_SPAN_TIMEOUTS
        try:
            sock.connect(st.spec.replay)
            await sock.send_multipart((b"", encode_seq(start)))
            while True:
                left = min(self._replay_timeout_s, ends_by - time.monotonic())
                if left <= 0 or not await sock.poll(left * 1000):
                    log.warning("node %s: replay from seq %d timed out", st.spec.node_id, start)
                    self._replay_failed(st, "timeout")
                    return None
                frames = await sock.recv_multipart()
                # [b"", topic, seq, payload] (current vLLM), [b"", seq, payload] (older vLLM,
                # SGLang), [seq, payload]: the last two frames are always the sequence and payload
                if len(frames) not in (2, 3, 4):
                    log.warning("node %s: replay answer of %d frames", st.spec.node_id, len(frames))
                    self._replay_failed(st, "garbage")
                    return None
                try:
                    seq = decode_seq(frames[-2])
                except KVEventDecodeError as exc:
                    log.warning("node %s: replay answer: %s", st.spec.node_id, exc)
                    self._replay_failed(st, "garbage")
                    return None
                if seq == END_SEQ:
                    return out
                if out and seq != out[-1][0] + 1:
                    log.warning("node %s: replay skipped from seq %d to %d", st.spec.node_id, out[-1][0], seq)
                    return out
                out.append((seq, frames[-1]))
        finally:
            sock.close(linger=0)

    @contextlib.contextmanager
    def _replaying(self, st: _Stream) -> Generator[None, None, None]:
        """While a replayed history is applied (up to the engine's 10,000 buffered batches, which
        took ~0.14 s of loop at 4 blocks each), the loop runs between slices of it, but nothing
        writes the half-applied map: flushes wait and the unproven-entries clock does not act, so
        the directory goes from the state before to the state after in one write, as when the
        history was applied without yielding. Cancelled (closing), the flag stays: the final flush
        must not write a half-applied history either."""
        st.replaying = True
        cancelled = False
        try:
            yield
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if not cancelled:
                st.replaying = False
                st.dirty.set()

    async def _apply_replayed(self, st: _Stream, seq: int, payload: bytes) -> None:
        """Apply one replayed batch (inside ``_replaying``), yielding to the loop whenever
        ``REPLAY_SLICE_S`` of work ran since the last yield: decisions run between the slices."""
        for _ in self._apply_steps(st, seq, payload):
            if time.perf_counter() >= self._replay_yield_at:
                await self._replay_yield()
        if time.perf_counter() >= self._replay_yield_at:
            await self._replay_yield()

    async def _replay_yield(self) -> None:
        await asyncio.sleep(0)
        self._replay_yield_at = time.perf_counter() + self.REPLAY_SLICE_S

    async def _apply_live(self, st: _Stream, seq: int, payload: bytes) -> None:
        """Apply one live batch, letting the event loop run between slices of ``STEP_BLOCKS``
        blocks: the bridges share the loop with the decisions, and a long prompt's batch (or
        an eviction of thousands of blocks) must not hold a decision up for all of its blocks."""
        for _ in self._apply_steps(st, seq, payload):
            await asyncio.sleep(0)

    def _apply_steps(self, st: _Stream, seq: int, payload: bytes) -> Generator[None, None, None]:
        """Apply a batch, pausing after each slice of ``STEP_BLOCKS`` blocks (see ``_apply_live``)."""
        node = st.spec.node_id
        # a batch we cannot read may have removed blocks: like a gap that replay cannot fill,
        # the node is cleared (routed by load) and rebuilt from what the engine stores next
        if len(payload) > self._max_batch_bytes:  # never decode it: msgpack objects cost ~10x the bytes
            log.warning("node %s: skipping batch seq %d of %d bytes (limit %d); clearing the node", node, seq, len(payload), self._max_batch_bytes)
            self._count_malformed(st)
            self._reset(st, "malformed")
            return
        try:
            batch = yield from decode_batch_steps(payload)  # pauses between slices of its events too
        except KVEventDecodeError as exc:
            log.warning("node %s: skipping malformed batch seq %d: %s; clearing the node", node, seq, exc)
            self._count_malformed(st)
            self._reset(st, "malformed")
            return
        if batch.rejected:
            log.warning("node %s: batch seq %d: dropped %s", node, seq, "; ".join(batch.rejected[:5]))
            REJECTED_EVENTS.labels(node).inc(len(batch.rejected))
            st.rejected += len(batch.rejected)
        step = self.STEP_BLOCKS
        used = 0  # blocks worked since the last pause
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._reset(st, "all_blocks_cleared")
                continue
            n = len(event.block_hashes)
            if used and used + n > step:
                yield
                used = 0
            if isinstance(event, BlockStored) and event.token_ids and Tier.from_medium(event.medium) is Tier.GPU:
                self._learn_block_size(st, event.block_size)
            steps = st.blocks.apply_steps(event, step)
            try:
                while True:
                    next(steps)
                    yield
            except StopIteration as done:
                dropped = done.value
            except BlockMapOverflow as exc:
                log.error("node %s: %s; clearing the node", node, exc)
                self._reset(st, "overflow")
                continue
            used = used + n if n <= step else (n - 1) % step + 1  # its last slice, when it had several
            if dropped is not None:
                reason, count = dropped
                DROPPED_BLOCKS.labels(node, reason).inc(count)
                st.dropped += count
        st.metrics.batches.inc()
        st.metrics.event_lag.observe(max(time.time() - batch.ts, 0.0))
        st.batches += 1
        TRACKED_BLOCKS.labels(node).set(len(st.blocks))
        if st.blocks.pending or st.blocks.cleared:
            st.dirty.set()

    def _reset(self, st: _Stream, reason: str) -> None:
        """The engine's cache was reset (or what happened in a gap is unknowable): clear the node."""
        RESETS.labels(st.spec.node_id, reason).inc()
        st.resets += 1
        st.blocks.reset()
        st.authoritative = True  # the directory is cleared with the map
        st.expected = None
        st.dirty.set()

    def _learn_block_size(self, st: _Stream, size: int) -> None:
        if size == st.engine_block_size:
            return
        st.engine_block_size = size
        ENGINE_BLOCK_SIZE.labels(st.spec.node_id).set(size)
        if size != self._block_size:
            log.error(
                "node %s: engine block size %d differs from the configured block_size %d: none of its blocks can "
                "be keyed; routing it by load only (set block_size: %d, or the engine's --block-size %d)",
                st.spec.node_id, size, self._block_size, size, self._block_size,
            )  # fmt: skip
            self._degrade(st, "block_size", f"engine block size {size}, configured {self._block_size}")

    def _degrade(self, st: _Stream, reason: str, detail: str) -> None:
        """Withhold the node's entries (it is then chosen by load alone) until ``reason`` clears."""
        if reason in st.degraded:
            return
        log.warning("node %s: degraded (%s): its entries are withheld, it is routed by load only", st.spec.node_id, detail)
        st.degraded[reason] = detail
        DEGRADED.labels(st.spec.node_id, reason).set(1)
        st.rewrite_all = True
        st.dirty.set()

    def _recover(self, st: _Stream, reason: str) -> None:
        if st.degraded.pop(reason, None) is None:
            return
        log.info("node %s: %s recovered", st.spec.node_id, reason)
        DEGRADED.labels(st.spec.node_id, reason).set(0)
        st.rewrite_all = True
        st.dirty.set()

    def _replay_failed(self, st: _Stream, reason: str) -> None:
        REPLAY_FAILURES.labels(st.spec.node_id, reason).inc()
        st.replay_failures += 1

    def _count_malformed(self, st: _Stream) -> None:
        MALFORMED.labels(st.spec.node_id).inc()
        st.malformed += 1

    # -- directory path ---------------------------------------------------------------------

    async def _flush_loop(self, st: _Stream) -> None:
        backoff = 0.1
        while True:
            await st.dirty.wait()
            if st.blocks.pending < self._flush_max_keys:
                await asyncio.sleep(self._flush_interval_s)  # let a burst coalesce
            st.dirty.clear()
            try:
                await self._flush_once(st)
                backoff = 0.1
                if st.directory_down:
                    st.directory_down = False
                    log.info("node %s: directory reachable again", st.spec.node_id)
            except Exception as exc:  # DirectoryUnavailable, or a bug / refusal: never stop flushing
                if not isinstance(exc, DirectoryUnavailable):
                    log.exception("node %s: directory write failed", st.spec.node_id)
                self._directory_failed(st, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                st.dirty.set()

    async def _flush_once(self, st: _Stream) -> None:
        node = st.spec.node_id
        if st.replaying:  # half a history applied: written once it is whole (``_replaying`` sets dirty)
            return
        if not st.writer:
            st.blocks.drop_changes()  # another bridge writes this node; we rewrite it if we take over
            return
        if st.degraded:  # entries withheld: the node is routed by load alone until it recovers
            st.blocks.drop_changes()
            if st.rewrite_all:
                await self._directory.replace_node(node, {})
                st.rewrite_all = False
                st.liveness_changed.set()  # registration waits for the rewrite
            return
        if st.rewrite_all:
            st.blocks.drop_changes()  # the snapshot below supersedes them
            snapshot = st.blocks.snapshot()
            if st.authoritative:
                await self._directory.replace_node(node, snapshot)
                self._set_partially_known(st, False)
            else:  # the map lacks the engine's older history: add to what the directory has
                for tier, keys in snapshot.items():
                    for i in range(0, len(keys), self._WRITE_CHUNK):
                        await self._directory.record_stored(node, keys[i : i + self._WRITE_CHUNK], tier)
                self._set_partially_known(st, True)
            st.rewrite_all = False
            st.liveness_changed.set()  # registration waits for the rewrite
            log.info(
                "node %s: directory entries %s (%d keys)",
                node, "replaced" if st.authoritative else "merged", st.blocks.key_count,
            )  # fmt: skip
            return
        writes = st.blocks.take_writes()
        if writes is None:
            return
        try:
            await writes.apply(self._directory, node)
        except BaseException:
            st.rewrite_all = True  # part of this batch may be lost: rewrite the node when back
            raise

    def _directory_failed(self, st: _Stream, exc: Exception) -> None:
        DIRECTORY_ERRORS.labels(st.spec.node_id).inc()
        st.directory_errors += 1
        if not st.directory_down:
            st.directory_down = True
            log.warning("node %s: directory unavailable (%s); will rewrite the node when it is back", st.spec.node_id, exc)
        st.rewrite_all = True
        st.registered = False
        st.blocks.drop_changes()

    async def _hold_lease(self, st: _Stream) -> None:
        """Take or renew the node's writer lease; a bridge that gains it rewrites the node."""
        held = await self._directory.claim_writer(st.spec.node_id, self._owner, self._lease_ttl_s)
        if held == WriterLease.TAKEN and st.writer:  # it lapsed while we stalled: a gateway may have cleared the node
            log.warning("node %s: writer lease had lapsed; taken again, rewriting the node", st.spec.node_id)
            st.rewrite_all = True
            st.dirty.set()
        elif held and not st.writer:
            log.info("node %s: writing its directory entries (writer lease taken)", st.spec.node_id)
            st.rewrite_all = True
            st.dirty.set()
        elif not held and st.writer:
            log.warning("node %s: another bridge holds the writer lease; following", st.spec.node_id)
            st.registered = False
        self._set_writer(st, held)

    def _set_partially_known(self, st: _Stream, partial: bool) -> None:
        if partial and st.unproven_since is None:
            st.unproven_since = time.monotonic()
        elif not partial:
            st.unproven_since = None
        PARTIALLY_KNOWN.labels(st.spec.node_id).set(1 if partial else 0)

    def _expire_unproven(self, st: _Stream) -> None:
        """Entries merged from before the engine's replay window, never proven since, go after
        ``unproven_ttl_s``: the engine may have evicted them while no bridge listened, and their
        removal can never reach us (we cannot map hashes we never saw stored). From then on the
        node holds exactly what this bridge has seen: it may under-report, never over-report."""
        if st.unproven_since is None or time.monotonic() - st.unproven_since < self._unproven_ttl_s:
            return
        log.info(
            "node %s: entries from before the engine's replay window unproven for %.0f s: dropping them, "
            "keeping the %d keys seen since", st.spec.node_id, self._unproven_ttl_s, st.blocks.key_count,
        )  # fmt: skip
        st.authoritative = True
        st.rewrite_all = True
        st.dirty.set()

    def _set_writer(self, st: _Stream, writer: bool) -> None:
        st.writer = writer
        WRITER.labels(st.spec.node_id).set(1 if writer else 0)

    async def _learn_capacity(self, st: _Stream) -> None:
        """No capacity configured: ask the engine until it says, then announce the node with it
        (memory is priced only for nodes whose capacity is known)."""
        while True:
            blocks = await fetch_capacity_blocks(st.spec.address, self._block_size)
            if blocks:
                st.info = replace(st.info, capacity_blocks=blocks)
                log.info("node %s: its engine holds %d blocks of KV cache", st.spec.node_id, blocks)
                return
            await asyncio.sleep(CAPACITY_RETRY_S)

    async def _heartbeat_loop(self, st: _Stream) -> None:
        while True:
            if st.connected:
                try:
                    await self._hold_lease(st)
                    if st.writer and not st.authoritative and not st.replaying:
                        self._expire_unproven(st)
                    # a collected node's liveness is the static fleet's health checks: we cannot
                    # see its socket, so we only write its entries
                    if st.writer and not st.spec.collected:
                        if st.registered:
                            try:
                                await self._directory.heartbeat(st.spec.node_id)
                            except UnknownNode:  # forgotten (e.g. a Redis restart): announce it again
                                st.registered = False
                                st.rewrite_all = True
                                st.dirty.set()
                        # a rewrite first: a node coming back must not go live with what it held
                        # before its restart (the flush wakes us when the rewrite is done)
                        if not st.registered and not st.rewrite_all or st.registered and st.announced != st.info:
                            info = st.info
                            await self._directory.register_node(info)
                            st.registered, st.announced = True, info
                            st.withdraw = False
                except Exception as exc:
                    if not isinstance(exc, DirectoryUnavailable):
                        log.exception("node %s: registration failed", st.spec.node_id)
                    self._directory_failed(st, exc)
                    st.dirty.set()
            elif st.withdraw:
                try:  # dead at once, entries kept: if the socket comes back they are true again
                    await self._directory.retire_node(st.spec.node_id)
                    await self._directory.release_writer(st.spec.node_id, self._owner)
                    st.withdraw = False
                    self._set_writer(st, False)
                    log.info("node %s: engine gone; retired", st.spec.node_id)
                except Exception as exc:  # the heartbeat TTL retires it if we cannot
                    log.warning("node %s: retiring failed (%r); will retry", st.spec.node_id, exc)
            st.liveness_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._heartbeat_interval_s):
                    await st.liveness_changed.wait()


async def _settle(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Wait for cancelled tasks to finish, keeping their errors out of the caller's way."""
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _discard_queued(sock: zmq.asyncio.Socket) -> None:
    while True:
        try:
            await sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
