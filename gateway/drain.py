"""Scale-in without amnesia: drain a node before it goes, so its conversations keep their cache.

``kvgate drain NODE`` (``gateway.drain_cmd``, through the admin API, ``gateway.admin_drain``) and
the simulator's scale-in (``loadtest.sim.elastic``) follow the same steps, with the same planning
code (``distinct_prefixes``, ``plan_copy``):

1. **mark** the node draining in the directory: every gateway replica stops sending it new
   requests within a second (``gateway.elastic.DrainingNodes``; ``decide_round`` leaves it out);
2. **copy** its hottest prefixes — the prompts it served most recently, as the gateway recorded
   them in the directory (``gateway.elastic.HotRecorder``), earlier turns folded into their
   conversation's latest — each to the node the policy would send that prompt to now with the
   draining node gone, by a pull through the transfer agents: a one-token request to the
   target carrying ``x-kv-cache-source-host-port`` / ``x-kv-cache-pull-blocks``. Each copy is
   reserved on its target like a request (its blocks as queued prefill, so the policy's memory
   pricing sees them before the target's KV events do), so the copies spread instead of landing
   on one node;
3. **wait** for the requests in flight on the node to finish (its load in the directory);
4. stop at the **deadline** whatever is left: a drain never holds a pod's termination longer.

The conversations move with their KV: the target's engine reports the copied blocks, so the
directory lists the target as the prefix's holder and the next turn is routed there. Nodes that
leave together (a StatefulSet scaled in by several) drain at about the same time, so a copy's
target may start draining (or be gone) while the copy runs: a copy that failed, or whose target is
draining by the time it is made, is planned again to a node that stays (``MAX_RETARGETS`` times at
most). Each copy is also noted as the target's hot prompt, so a target drained later carries it on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from directory_client.types import Directory, DirectoryUnavailable, DirectoryView, HotPrefix, NodeInfo
from gateway.decision_round import decide_round, routing_request
from gateway.elastic import HOT_KEEP, HOT_TTL_S
from gateway.envoy_config import PULL_BLOCKS_HEADER, PULL_SOURCE_HEADER
from gateway.profile import HardwareProfile
from tokenizer.keys import block_keys

log = logging.getLogger("kvgate.drain")

DEFAULT_DEADLINE_S = 30.0
MAX_PREFIXES = 64  # copies per drain at most (the most recent prompts)
COPY_CONCURRENCY = 4
MAX_RETARGETS = 2  # a copy that failed or whose target started draining is planned again this often at most
LINGER_S = 600.0  # the draining mark outlives the deadline by this much (the pod is gone by then)


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Copy ``blocks`` leading blocks of ``prefix`` from the draining node to ``target``."""

    prefix: HotPrefix
    token_ids: np.ndarray
    target: NodeInfo
    blocks: int
    transfer_s: float  # the modelled time of the pull, over the policy's link
    new_tokens: int = 0  # what the target does not hold yet: the memory the copy takes there


def distinct_prefixes(hot: Iterable[HotPrefix]) -> list[HotPrefix]:
    """Most recent first, without the prompts that start a more recent one already kept (a
    conversation's earlier turns: copying its latest prompt copies them too)."""
    kept: list[HotPrefix] = []
    for h in sorted(hot, key=lambda h: -h.at):
        if not any(k.model == h.model and k.tokens.startswith(h.tokens) for k in kept):
            kept.append(h)
    return kept


def plan_copy(
    policy: Any,  # gateway.policy.Policy
    profile: HardwareProfile,
    prefix: HotPrefix,
    keys: np.ndarray,
    view: DirectoryView,
    *,
    source_id: str,
    draining: frozenset[str],
    seed: int,
    now: float,
    link: str,
    block_size: int,
) -> CopyPlan | None:
    """Where the prompt would be served next with the source gone, if a copy is worth making.

    None when the source no longer holds the prompt, when it or the chosen node cannot move KV
    (no transfer agent), or when the chosen node already holds as much.
    """
    source = next((nv for nv in view.nodes if nv.node.node_id == source_id), None)
    if source is None or source.cached_blocks <= 0 or not source.node.transfer_endpoint:
        return None
    ids = np.frombuffer(prefix.tokens, dtype="<u4")
    request = routing_request(prefix.model, ids, keys, block_size=block_size, seed=seed, request_id="drain")
    rnd = decide_round(policy, request, view, profile, now=now, answer_tokens=1, draining=draining | {source_id})
    target = rnd.decision.node
    if target is None or target.node_id == source_id or not target.transfer_endpoint:
        return None
    held = next((nv.cached_blocks for nv in view.nodes if nv.node.node_id == target.node_id), 0)
    if held >= source.cached_blocks:
        return None
    moved = (source.cached_blocks - held) * block_size
    return CopyPlan(prefix, ids, target, source.cached_blocks, profile.transfer_seconds(moved, link), moved)


def retarget(copied: bool, target_id: str, draining: frozenset[str], attempt: int) -> bool:
    """Plan a copy again, from the source that still holds it: it failed, or its target is
    leaving too; ``MAX_RETARGETS`` times at most (``attempt`` counts from 0)."""
    return attempt < MAX_RETARGETS and (not copied or target_id in draining)


@dataclass
class DrainReport:
    """What one drain did; the admin API answers with it and ``kvgate drain`` prints it."""

    node_id: str
    deadline_s: float
    hot_prefixes: int = 0  # distinct prompts recorded for the node
    copies_planned: int = 0
    copied: int = 0
    copy_failures: int = 0
    copied_blocks: int = 0
    retargeted: int = 0  # copies planned again: the copy failed, or its target started draining too
    inflight_left: int = 0  # requests still in flight on the node when the drain returned
    deadline_reached: bool = False
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.deadline_reached and not self.errors and self.inflight_left == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "complete": self.complete}


async def note_copied(directory: Directory, plan: CopyPlan) -> None:
    """The target now holds the prompt: note it as the target's hot prompt, so that a drain of
    the target later (the next pod of a StatefulSet scaled in one at a time) carries it on."""
    await directory.record_hot(plan.target.node_id, plan.prefix.model, plan.prefix.tokens, keep=HOT_KEEP, ttl_s=HOT_TTL_S)


CopyFn = Callable[[CopyPlan, str], Awaitable[bool]]
"""Runs one copy: ``(plan, source transfer endpoint)`` → did the target get the blocks."""


class Drainer:
    """Drains nodes of a live fleet: the directory's marks and records, the policy's choices, and
    ``copy`` to move each prefix."""

    def __init__(
        self,
        directory: Directory,
        policy: Any,
        profile: HardwareProfile,
        copy: CopyFn,
        *,
        seed_of: Callable[[str], int],
        block_size: int,
        link: str = "tcp",
        on_marked: Callable[[], Awaitable[Any]] | None = None,
        max_prefixes: int = MAX_PREFIXES,
        concurrency: int = COPY_CONCURRENCY,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.1,
    ) -> None:
        self.directory = directory
        self.policy = policy
        self.profile = profile
        self.copy = copy
        self.seed_of = seed_of
        self.block_size = block_size
        self.link = link
        self.on_marked = on_marked
        self.max_prefixes = max_prefixes
        self.concurrency = concurrency
        self.clock = clock
        self.poll_s = poll_s

    async def drain(self, node_id: str, deadline_s: float = DEFAULT_DEADLINE_S) -> DrainReport:
        """Mark, copy, wait; returns by ``deadline_s`` at the latest (plus one directory call)."""
        if not deadline_s > 0:
            raise ValueError(f"the deadline must be > 0 seconds, got {deadline_s!r}")
        start = self.clock()
        report = DrainReport(node_id, deadline_s)
        source = next((n for n in await self.directory.live_nodes() if n.node_id == node_id), None)
        if source is None:
            raise LookupError(f"node {node_id!r} is not live in the directory")
        await self.directory.set_draining(node_id, deadline_s + LINGER_S)
        if self.on_marked is not None:
            await self.on_marked()
        try:
            async with asyncio.timeout(deadline_s):
                await self._copy_all(source, report)
                await self._wait_idle(node_id, report)
        except TimeoutError:
            report.deadline_reached = True
        report.inflight_left = await self._inflight(node_id, report)
        report.elapsed_s = self.clock() - start
        log.info("drained %s: %s", node_id, report.as_dict())
        return report

    async def _copy_all(self, source: NodeInfo, report: DrainReport) -> None:
        hot = distinct_prefixes(await self.directory.hot_prefixes(source.node_id, self.max_prefixes * 4))
        hot = hot[: self.max_prefixes]
        report.hot_prefixes = len(hot)
        slots = asyncio.Semaphore(self.concurrency)

        async def one(prefix: HotPrefix) -> None:
            async with slots:
                await self._copy_one(source, prefix, report)

        await asyncio.gather(*(one(h) for h in hot))

    async def _copy_one(self, source: NodeInfo, prefix: HotPrefix, report: DrainReport) -> None:
        seed = self.seed_of(prefix.model)
        ids = np.frombuffer(prefix.tokens, dtype="<u4")
        keys = np.asarray(block_keys(ids, block_size=self.block_size, seed=seed), dtype=np.uint64)
        landed: CopyPlan | None = None  # the last copy made
        for attempt in range(MAX_RETARGETS + 1):
            if attempt:
                report.retargeted += 1  # failed, or its target is leaving too: the source still holds it
            try:
                view = await self.directory.lookup(keys)
                draining = await self.directory.draining()
            except DirectoryUnavailable as e:
                report.errors.append(f"lookup: {e}")
                break
            plan = plan_copy(
                self.policy, self.profile, prefix, keys, view, source_id=source.node_id, draining=draining,
                seed=seed, now=self.clock(), link=self.link, block_size=self.block_size,
            )  # fmt: skip
            if plan is None:
                break
            if attempt == 0:
                report.copies_planned += 1
            copied = await self._run_copy(plan, source)
            if copied:
                landed = plan
                try:
                    draining = await self.directory.draining()
                except DirectoryUnavailable:
                    break
            else:
                report.copy_failures += 1
            if not retarget(copied, plan.target.node_id, draining, attempt):
                break
        if landed is None:
            return
        report.copied += 1
        report.copied_blocks += landed.blocks
        try:
            await note_copied(self.directory, landed)
        except DirectoryUnavailable as e:  # the copy is made; only a later drain of the target misses it
            log.warning("drain: noting the copy on %s failed: %s", landed.target.node_id, e)

    async def _run_copy(self, plan: CopyPlan, source: NodeInfo) -> bool:
        """One copy, reserved on its target like a request; False when it failed."""
        hold = max(plan.transfer_s * 4, 1.0)
        try:
            reservation = await self.directory.reserve(plan.target.node_id, plan.new_tokens, first_token_s=hold, hold_s=hold)
        except DirectoryUnavailable as e:  # the copy is still worth making; only its pricing misses it
            log.warning("drain: reserving the copy on %s failed: %s", plan.target.node_id, e)
            reservation = None
        try:
            return await self.copy(plan, source.transfer_endpoint)
        except Exception as e:  # one failed copy is one prompt recomputed later, not a failed drain
            log.warning("drain copy to %s failed: %r", plan.target.node_id, e)
            return False
        finally:
            if reservation is not None:
                try:
                    await self.directory.release(reservation)
                except DirectoryUnavailable:  # it ends by itself at its hold
                    pass

    async def _wait_idle(self, node_id: str, report: DrainReport) -> None:
        while await self._inflight(node_id, report) > 0:
            await asyncio.sleep(self.poll_s)

    async def _inflight(self, node_id: str, report: DrainReport) -> int:
        try:
            load = (await self.directory.loads()).get(node_id)
        except DirectoryUnavailable as e:
            report.errors.append(f"loads: {e}")
            return 0
        return 0 if load is None else load.inflight


async def http_copy(plan: CopyPlan, source_endpoint: str, *, timeout_s: float = 10.0) -> bool:
    """One copy through the target's engine: a one-token completion of the prompt that first
    pulls ``plan.blocks`` blocks from the draining node's transfer agent (what a routed request
    with pull headers does). True when the engine answered 200 and did not report a failed pull."""
    import aiohttp  # noqa: PLC0415 (the request path never needs a client session)

    body = {"model": plan.prefix.model, "prompt": plan.token_ids.tolist(), "max_tokens": 1}
    headers = {PULL_SOURCE_HEADER: source_endpoint, PULL_BLOCKS_HEADER: str(plan.blocks)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(f"http://{plan.target.address}/v1/completions", json=body, headers=headers) as resp:
            await resp.read()
            return resp.status == 200 and resp.headers.get("x-kvgate-pull", "ok") in ("ok", "none")
