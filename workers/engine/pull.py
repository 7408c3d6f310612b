"""Honouring the gateway's pull instruction: fetch a request's missing prefix before its prefill.

When the gateway decides "pull then prefill" it sends this node ``x-kv-cache-source-host-port``
(the owner's transfer agent) and ``x-kv-cache-pull-blocks`` (how many leading blocks of the
prompt the owner holds). Before the request reaches the scheduler, ``PullCoordinator.prepare``:

1. pins the prefix this node already holds and reserves cache blocks for the rest (evicting
   LRU leaves if needed, like any admission) — a pull that does not fit is skipped;
2. pulls the missing blocks' real, scaled-down bytes through the transfer agent (one-sided
   reads into reserved slots, every block verified);
3. waits out the *modelled* transfer time of the full-size KV (``profile.transfer_seconds`` over
   ``--transfer-link``, times ``--time-scale``) minus the time the real pull took — the request
   cannot start prefill before its KV would have arrived;
4. commits the blocks into the prefix cache (``BlockStored`` is published) and submits the
   request, keeping the pulled prefix pinned until the scheduler admits it; the admission then
   finds the blocks cached and reports them in ``cached_tokens``.

The scheduler stays pure: it only ever sees blocks that are already cached. Any failure (bad
header, owner gone, refused, timeout, corrupt bytes, no room) undoes steps 1–2, is counted in
``kvgate_engine_pull_failures_total{reason}``, and the request is served by recomputing: a
failed pull never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.profile import HardwareProfile
from workers.engine.kv_cache import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent, PrefixCache
from workers.engine.runtime import EngineRuntime, RequestStream
from workers.engine.scheduler import SimRequest
from workers.transfer import PulledBlocks, SlotTable, TransferAgent, TransferError
from workers.transfer.agent import transfer_counters

log = logging.getLogger(__name__)

LINKS = ("rdma", "tcp")


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """What ``prepare`` did for one request (``x-kvgate-pull`` / ``x-kvgate-pulled-blocks``)."""

    status: str  # "absent" (no instruction), "none" (nothing was missing), "ok", "failed"
    blocks: int = 0  # blocks pulled and committed
    reason: str = ""  # failure reason
    held: int = 0  # leading blocks pinned for the request until it is admitted (after "ok")


NO_INSTRUCTION = PullOutcome("absent")
NOTHING_MISSING = PullOutcome("none")


@dataclass(slots=True)
class PullCounters:
    """Monotonic counters for /metrics."""

    ok: int = 0
    failed: int = 0
    none: int = 0
    blocks: int = 0
    bytes: int = 0
    modelled_s: float = 0.0
    wall_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str) -> PullOutcome:
        self.failed += 1
        self.failures[reason] = self.failures.get(reason, 0) + 1
        return PullOutcome("failed", 0, reason)


class CacheHolder:
    """The agent's view of the engine's prefix cache: a lease pins blocks like a running request."""

    def __init__(self, cache: PrefixCache, runtime: EngineRuntime) -> None:
        self._cache = cache
        self._runtime = runtime

    def hold(self, hashes: Sequence[int]) -> int:
        n = self._cache.match(hashes)
        self._cache.pin(hashes[:n], self._runtime.now())
        return n

    def unhold(self, hashes: Sequence[int]) -> None:
        self._cache.unpin(hashes, self._runtime.now())


def follow_cache(slots: SlotTable, events: Sequence[CacheEvent]) -> None:
    """Keep the slot table equal to the cache: a slot per stored block, freed on eviction."""
    for ev in events:
        if isinstance(ev, BlocksStored):
            for h in ev.block_hashes:
                if slots.store(h) is None:
                    log.warning("no free transfer slot for block %#x: peers cannot pull it", h)
        elif isinstance(ev, BlocksRemoved):
            for h in ev.block_hashes:
                slots.remove(h)
        elif isinstance(ev, CacheCleared):
            slots.remove_all()


def parse_pull_headers(source: str | None, blocks: str | None) -> tuple[str, int] | None:
    """``(owner endpoint, blocks)`` from the two headers; None if absent; ValueError if malformed."""
    if not source and not blocks:
        return None
    if not source or not blocks:
        raise ValueError("pull needs both x-kv-cache-source-host-port and x-kv-cache-pull-blocks")
    host, sep, port = source.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"x-kv-cache-source-host-port {source!r} is not host:port")
    try:
        n = int(blocks)
    except ValueError:
        raise ValueError(f"x-kv-cache-pull-blocks {blocks!r} is not an integer") from None
    if n < 0:
        raise ValueError(f"x-kv-cache-pull-blocks {blocks!r} is negative")
    return source.strip(), n


class PullCoordinator:
    """Runs steps 1–4 of the module doc for each request that carries pull headers."""

    def __init__(
        self,
        agent: TransferAgent | None,
        runtime: EngineRuntime,
        profile: HardwareProfile,
        *,
        link: str,
        time_scale: float,
        timeout_s: float,
    ) -> None:
        if link not in profile.links_gbps:
            raise ValueError(f"transfer link {link!r} is not in profile {profile.name!r} ({sorted(profile.links_gbps)})")
        self.agent = agent
        self.runtime = runtime
        self.cache = runtime.scheduler.cache
        self.profile = profile
        self.link = link
        self.time_scale = time_scale
        self.timeout_s = timeout_s
        self.counters = PullCounters()
        self.inflight = 0

    def modelled_seconds(self, tokens: int) -> float:
        """Time the full-size KV of ``tokens`` takes over the modelled link (hardware seconds)."""
        return self.profile.transfer_seconds(tokens, self.link)

    async def prepare(self, sim: SimRequest, source: str | None, blocks: str | None) -> PullOutcome:
        """Pull what ``sim`` lacks of the owner's prefix and commit it; never raises for a failed pull."""
        try:
            parsed = parse_pull_headers(source, blocks)
        except ValueError as e:
            log.warning("ignoring pull instruction for %s: %s", sim.request_id, e)
            return self.counters.fail("bad_header")
        if parsed is None:
            return NO_INSTRUCTION
        owner, asked = parsed
        if self.agent is None:
            log.warning("pull asked for %s but this worker has no transfer agent (--transfer-port)", sim.request_id)
            return self.counters.fail("no_agent")
        bs = self.cache.block_size
        # The engine always recomputes the prompt's last token, so a block holding it is never a hit.
        n = min(asked, max(sim.num_prompt - 1, 0) // bs, len(sim.hashes))
        hashes = sim.hashes[:n]
        have = self.cache.match(hashes)
        if n - have <= 0:
            self.counters.none += 1
            return NOTHING_MISSING
        self.inflight += 1
        try:
            return await self._pull(sim, owner, hashes, have)
        finally:
            self.inflight -= 1

    async def _pull(self, sim: SimRequest, owner: str, hashes: list[int], have: int) -> PullOutcome:
        assert self.agent is not None
        cache, runtime, bs = self.cache, self.runtime, self.cache.block_size
        local = hashes[:have]
        cache.pin(local, runtime.now())
        reserved = len(hashes) - have
        if not cache.reserve(reserved):
            cache.unpin(local, runtime.now())
            return self.counters.fail("no_space")
        runtime.flush_events()  # evictions made room: free their slots before reserving ours
        pulled: PulledBlocks | None = None
        committed = False
        t0 = time.perf_counter()
        try:
            pulled = await self.agent.pull(owner, hashes, have, timeout_s=self.timeout_s)
            m = have + len(pulled.hashes)
            cache.release_private(reserved - len(pulled.hashes))
            reserved = len(pulled.hashes)
            if not pulled.hashes:
                self.counters.none += 1
                return NOTHING_MISSING
            modelled = self.modelled_seconds(len(pulled.hashes) * bs)
            wait = modelled * self.time_scale - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            cache.commit(
                list(pulled.hashes), sim.keys[have:m], local[-1] if local else None,
                sim.tokens[have * bs : m * bs], have, runtime.now(), lora=sim.lora, cache_salt=sim.cache_salt,
            )
            self.agent.adopt(pulled)  # before the flush: the pulled bytes become the blocks' slots
            committed = True
            runtime.flush_events()  # BlockStored for the pulled blocks: the directory learns of the copy
            self.counters.ok += 1
            self.counters.blocks += len(pulled.hashes)
            self.counters.bytes += pulled.bytes
            self.counters.modelled_s += modelled
            self.counters.wall_s += pulled.wall_s
            return PullOutcome("ok", len(pulled.hashes), held=m)
        except TransferError as e:
            log.warning("pull of %d blocks from %s failed (%s): %s; recomputing", len(hashes) - have, owner, e.reason, e)
            return self.counters.fail(e.reason)
        finally:
            if not committed:
                if pulled is not None and pulled.hashes:
                    self.agent.discard(pulled)
                cache.release_private(reserved)
                cache.unpin(local, runtime.now())

    def submit(self, sim: SimRequest, outcome: PullOutcome, arrival_wall: float) -> RequestStream:
        """Hand the request to the runtime; a pulled prefix stays pinned until it is admitted."""
        stream = self.runtime.submit(sim, arrival_wall=arrival_wall)
        if outcome.status == "ok":
            self.runtime.hold_until_admitted(sim, sim.hashes[: outcome.held])
        return stream


class PullCollector(Collector):
    """``kvgate_engine_pull*`` and ``kvgate_transfer_*`` metrics, read at scrape time."""

    def __init__(self, pulls: PullCoordinator, model: str) -> None:
        self._p = pulls
        self._model = model

    def collect(self) -> Iterator[Metric]:
        p, c, m = self._p, self._p.counters, self._model
        results = CounterMetricFamily(
            "kvgate_engine_pulls", "Requests with pull instructions, by result (none: nothing was missing).",
            labels=["model_name", "result"],
        )
        for result, n in (("ok", c.ok), ("failed", c.failed), ("none", c.none)):
            results.add_metric([m, result], n)
        yield results
        failures = CounterMetricFamily(
            "kvgate_engine_pull_failures", "Failed pulls (the request recomputed), by reason.", labels=["model_name", "reason"]
        )
        for reason, n in sorted(c.failures.items()):
            failures.add_metric([m, reason], n)
        yield failures
        for name, doc, value in (
            ("kvgate_engine_pulled_blocks", "Blocks pulled from peers and committed to the cache.", c.blocks),
            ("kvgate_engine_pulled_bytes", "Real (scaled-down) payload bytes pulled and verified.", c.bytes),
            ("kvgate_engine_pull_modelled_seconds", "Modelled transfer time of the full-size KV pulled.", c.modelled_s),
            ("kvgate_engine_pull_wall_seconds", "Wall time of the real pulls (lease, read, verify).", c.wall_s),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([m], value)
            yield counter
        inflight = GaugeMetricFamily("kvgate_engine_pulls_inflight", "Pulls in progress.", labels=["model_name"])
        inflight.add_metric([m], p.inflight)
        yield inflight
        if p.agent is not None:
            for name, doc, value in transfer_counters(p.agent.stats):
                counter = CounterMetricFamily(name, doc, labels=["model_name"])
                counter.add_metric([m], value)
                yield counter
