"""Scale events in a simulated fleet: nodes join and leave on the virtual clock, drained or not.

``--scale "300:+4,600:-4"`` adds 4 nodes at virtual second 300 and removes 4 at 600 (the highest
ordinals, as a StatefulSet scales in). A node that joins registers in the directory and is routed
to from the next decision on (the policy's warm-up, ``gateway.policy.warmup``, decides how fast).

A node that leaves without a drain is deregistered at once: no new request reaches it, the
requests it is running finish, and its cache is gone with it. With a drain it runs the steps of
``gateway.drain`` with that module's planning code: marked draining in the directory, its hot
prefixes (the gateway's records in the directory) copied to the nodes the policy picks for
them, each copy taking the modelled transfer time over the pull link (``COPY_LANES`` at once,
reserved on its target like a request), then deregistered once the copies are done and its
requests finished, or at the deadline, whichever comes first. What the simulation does not
model: requests still running at the deadline are allowed to finish (a real pod would be killed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gateway.drain import (
    COPY_CONCURRENCY, DEFAULT_DEADLINE_S, LINGER_S, MAX_PREFIXES, CopyPlan, distinct_prefixes, note_copied,
    plan_copy, retarget,
)
from gateway.elastic import HOT_KEEP, HOT_TTL_S, HotBudget, budgeted_hot_tokens
from gateway.types import RoutingRequest
from loadtest.sim.sync import run_now
from tokenizer.keys import block_keys
from workers.engine.scheduler import SimRequest

if TYPE_CHECKING:
    from loadtest.sim.node import SimNode
    from loadtest.sim.simulator import Simulator

_EVENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*:\s*([+-]\d+)\s*$")
VARIANTS = ("drain", "nowarm")


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    at_s: float
    delta: int  # nodes added (> 0) or removed (< 0)


def parse_scale(text: str | None) -> tuple[ScaleEvent, ...]:
    """``"300:+4,600:-4"`` → events in time order; ``ValueError`` saying what is wrong."""
    if not text:
        return ()
    events = []
    for part in text.split(","):
        m = _EVENT.match(part)
        if m is None or int(m.group(2)) == 0:
            raise ValueError(f"--scale entry {part.strip()!r} is not SECONDS:+N or SECONDS:-N (e.g. 300:+4,600:-4)")
        events.append(ScaleEvent(float(m.group(1)), int(m.group(2))))
    return tuple(sorted(events, key=lambda e: e.at_s))


def split_variant(name: str) -> tuple[str, bool, bool]:
    """``kvgate+drain+nowarm`` → (``kvgate``, drain, warm-up): one run can compare variants."""
    base, *flags = name.split("+")
    unknown = [f for f in flags if f not in VARIANTS]
    if unknown:
        raise ValueError(f"policy {name!r}: unknown variant {', '.join(unknown)} (variants: +{', +'.join(VARIANTS)})")
    return base, "drain" in flags, "nowarm" not in flags


@dataclass
class Membership:
    """When each node was part of the fleet (virtual seconds), for the per-minute figures."""

    joined: dict[str, float] = field(default_factory=dict)
    left: dict[str, float] = field(default_factory=dict)
    added_at: dict[float, list[str]] = field(default_factory=dict)  # scale-out time -> nodes added
    removed_at: dict[float, list[str]] = field(default_factory=dict)


class Elastic:
    """Applies scale events to a ``Simulator`` (which calls ``start``, ``record``, ``node_idle``)."""

    def __init__(self, sim: Simulator, events: tuple[ScaleEvent, ...], *, drain: bool,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:  # fmt: skip
        self.sim = sim
        self.events = events
        self.drain = drain
        self.deadline_s = deadline_s
        self.members = Membership(joined={n.node_id: 0.0 for n in sim.nodes})
        self.leaving: dict[str, float] = {}  # node_id -> deadline, while draining
        self.copies_pending: dict[str, int] = {}
        self.lanes: dict[str, list[float]] = {}  # draining node -> when each of its copy lanes is free
        self.copies = {"planned": 0, "done": 0, "skipped": 0, "blocks": 0, "retargeted": 0}
        self.hot_budget = HotBudget()  # the gateway's sampling of hot-prefix notes

    def start(self) -> None:
        for e in self.events:
            self.sim.schedule(e.at_s, lambda e=e: self._apply(e))

    def record(self, request: RoutingRequest, ids: np.ndarray, node_id: str, model: str) -> None:
        """What ``RoutingCore`` records for each routed prompt (only when drains read it)."""
        if self.drain:
            tokens = budgeted_hot_tokens(self.hot_budget, node_id, request, ids, self.sim.now)
            if tokens is not None:
                run_now(self.sim.directory.record_hot(node_id, model, tokens, keep=HOT_KEEP, ttl_s=HOT_TTL_S))

    def draining(self) -> frozenset[str]:
        return run_now(self.sim.directory.draining()) if self.leaving else frozenset()

    # -- events ------------------------------------------------------------------------------

    def _apply(self, e: ScaleEvent) -> None:
        now = self.sim.now
        if e.delta > 0:
            added = [self.sim.add_node().node_id for _ in range(e.delta)]
            for nid in added:
                self.members.joined[nid] = now
            self.members.added_at[now] = added
            return
        live = [n for n in self.sim.nodes if n.node_id not in self.leaving]
        going = sorted(live, key=lambda n: int(n.node_id[1:]))[e.delta:][: len(live) - 1]  # highest ordinals; one stays
        self.members.removed_at[now] = [n.node_id for n in going]
        for node in going:
            if self.drain:
                self._drain(node)
            else:
                self._remove(node)

    def _remove(self, node: SimNode) -> None:
        self.leaving.pop(node.node_id, None)
        self.members.left[node.node_id] = self.sim.now
        self.sim.remove_node(node)

    def _drain(self, node: SimNode) -> None:
        sim, now = self.sim, self.sim.now
        self.leaving[node.node_id] = now + self.deadline_s
        run_now(sim.directory.set_draining(node.node_id, self.deadline_s + LINGER_S))
        sim.schedule(now + self.deadline_s, lambda: self._deadline(node))
        hot = distinct_prefixes(run_now(sim.directory.hot_prefixes(node.node_id, MAX_PREFIXES * 4)))[:MAX_PREFIXES]
        self.lanes[node.node_id] = [now] * COPY_CONCURRENCY
        self.copies_pending[node.node_id] = 0
        for prefix in hot:
            plan = self._plan(node, prefix)
            if plan is None or not self._schedule(node, plan, attempt=0):
                self.copies["skipped"] += 1
                continue
            self.copies["planned"] += 1
        self.node_idle(node)

    def _plan(self, node: SimNode, prefix) -> CopyPlan | None:  # type: ignore[no-untyped-def]
        sim = self.sim
        ids = np.frombuffer(prefix.tokens, dtype="<u4")
        keys = np.asarray(block_keys(ids, block_size=sim.bs, seed=sim.key_seed), dtype=np.uint64)
        return plan_copy(
            sim.policy, sim.profile, prefix, keys, run_now(sim.directory.lookup(keys)), source_id=node.node_id,
            draining=self.draining(), seed=sim.key_seed, now=sim.now, link=sim.cfg.pull_link or "tcp", block_size=sim.bs,
        )  # fmt: skip

    def _schedule(self, node: SimNode, plan: CopyPlan, attempt: int) -> bool:
        """Queue the copy on the least busy of the drain's lanes; False when it would end after the deadline."""
        sim, now, lanes = self.sim, self.sim.now, self.lanes[node.node_id]
        lane = min(range(len(lanes)), key=lanes.__getitem__)
        end = max(lanes[lane], now) + plan.transfer_s
        if end > self.leaving.get(node.node_id, float("-inf")):  # past its deadline, or gone
            return False
        lanes[lane] = end
        hold = run_now(sim.directory.reserve(plan.target.node_id, plan.new_tokens, first_token_s=end - now,
                                             hold_s=end - now + 1e-3))  # fmt: skip
        self.copies_pending[node.node_id] += 1
        sim.schedule(end, lambda: self._copied(node, plan, hold, attempt))
        return True

    def _copied(self, source: SimNode, plan: CopyPlan, hold, attempt: int) -> None:  # type: ignore[no-untyped-def]
        sim = self.sim
        run_now(sim.directory.release(hold))
        self.copies_pending[source.node_id] -= 1
        target = sim.by_id[plan.target.node_id]
        req = SimRequest.create("drain-copy", plan.token_ids, sim.sampler.reply(plan.token_ids, 1, ignore_eos=True),
                                block_size=sim.bs, root_hash=sim.root, key_seed=sim.key_seed, arrival=sim.now)  # fmt: skip
        upto = source.cached_blocks(req, plan.blocks)  # what the source still holds
        if upto <= 0:
            self.node_idle(source)
            return
        added = 0
        if target in sim.nodes:  # else it left meanwhile: the copy failed
            added, events = target.insert_prefix(req, upto, sim.now)
            sim.feed(target, events)
        if retarget(target in sim.nodes, plan.target.node_id, self.draining(), attempt):
            again = self._plan(source, plan.prefix)
            if again is not None and self._schedule(source, again, attempt + 1):
                self.copies["retargeted"] += 1
                self.node_idle(source)
                return
        if target in sim.nodes:
            self.copies["done"] += 1
            self.copies["blocks"] += added
            run_now(note_copied(sim.directory, plan))
        self.node_idle(source)

    def _deadline(self, node: SimNode) -> None:
        if node.node_id in self.leaving:
            self._remove(node)

    def node_idle(self, node: SimNode) -> None:
        """A draining node leaves once its copies are done and it runs nothing."""
        if (node.node_id in self.leaving and not self.copies_pending.get(node.node_id)
                and not node.scheduler.has_work() and node.step is None):  # fmt: skip
            self._remove(node)
