"""Discrete-event simulation of a fleet behind one routing policy: no processes, no sleeping.

What runs is production code: the gateway's policy and decision round (``now`` = virtual time), the
engines' ``PrefixCache`` + ``Scheduler`` (one ``SimNode`` each), the reply sampler and request
validation of the simulated engine, the tokenizer and block keys of the gateway. The simulator
owns only the clock and the event queue:

- a session's turn *arrives* → the request is tokenized and looked up, then decided and its load
  reserved by the gateway's own decision round (``gateway.decision_round``, the one
  ``RoutingCore`` runs: the prefill stops counting at the estimated first token, the rest at the
  request's end), and handed to the chosen node (after the transfer time when it pulls);
- a node runs one scheduler step at a time; a step's *end* applies it (``Scheduler.complete``),
  records first tokens and finished requests, releases their load, feeds the cache events to the
  directory, and schedules the session's next turn after its think time. A batch that only
  decodes runs as one event until a request finishes or needs or fills a block (the scheduler's
  decode runs), cut short when a request is handed to the node meanwhile: what one event per step
  would give, with far fewer events (``SimConfig.decode_run_steps=1`` is that reference).

The directory view (``view="directory"``, the default) comes from the real ``InProcessDirectory``
on the virtual clock, fed by the bridge's event translation (``feed.py``) and with the gateway's
index stride, so the policy sees what ``kvgate serve`` would see. ``view="engines"`` builds it
from the engines' caches directly by the same rules (longest cached prefix per node, loads from
the directory's reservations) without the stride sampling: exact, and faster on huge traces.

Two ceilings route to the least loaded node and give it the request's prefix at no cost before
it runs: ``oracle``, an infinite shared cache (every block any node computed before is a hit),
and ``oracle_pool``, one LRU memory of the fleet's total capacity (``pool.py``): the right
ceiling when memory binds.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from directory_client.memory import InProcessDirectory
from directory_client.sampling import DEFAULT_INDEX_STRIDE
from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Reservation, Tier
from gateway.decision_round import Round, answer_budget, decide_round, end_round, routing_request
from gateway.profile import HardwareProfile
from gateway.types import PrefillPlan
from loadtest.accounting import SeenBlocks, hit_cap_blocks
from loadtest.policies import ORACLE, ORACLE_POOL, sim_policy
from loadtest.records import RequestRecord
from loadtest.sim.elastic import Elastic, ScaleEvent
from loadtest.sim.feed import DirectoryFeed
from loadtest.sim.node import SimNode
from loadtest.sim.pool import PooledMemory
from loadtest.sim.sync import run_now
from loadtest.workloads.base import RequestSpec, Session, Workload
from tokenizer import PromptTokenizer
from tokenizer.keys import namespace_seed
from workers.engine.kv_cache import BlocksStored, CacheEvent, root_hash
from workers.engine.openai_api import APIError, generation_options
from workers.engine.sampling import ReplySampler
from workers.engine.scheduler import SimRequest

ARRIVE, SUBMIT, STEP_END, CALL = 0, 1, 2, 3
FOREVER_S = 1e12  # heartbeat TTL: simulated nodes never miss a heartbeat


@dataclass
class SimConfig:
    policy: str
    nodes: int
    profile: HardwareProfile
    capacity_blocks: int | None = None  # None: the profile's
    view: str = "directory"  # or "engines"
    pull_link: str | None = None  # None: nodes have no transfer agents (as in replay); "tcp"/"rdma"
    max_requests: int | None = None
    duration_s: float = float("inf")  # no arrival after this (virtual seconds)
    default_max_tokens: int = 16
    roles: tuple[int, int] | None = None  # (prefill, decode) node counts; None: every node both
    scale: tuple[ScaleEvent, ...] = ()  # nodes joining and leaving (``loadtest.sim.elastic``)
    drain: bool = False  # leaving nodes are drained first
    policy_options: dict[str, Any] = field(default_factory=dict)
    decode_run_steps: int = 1 << 20  # decode steps one event may apply (1: one event per engine step)


@dataclass(slots=True)
class _Ctx:
    """One request in flight: its record, engine request, reservation, session state."""

    session: Session
    replies: list[str]
    record: RequestRecord
    sim: SimRequest
    node: SimNode
    arrival: float
    reservation: Reservation | None
    pulled_blocks: int = 0
    decode: _Ctx | None = None  # a split request's prefill: the decode that follows it
    round: Round | None = None  # the gateway's decision round: its ledger entries end with the request


@dataclass
class SimResult:
    records: list[RequestRecord]
    wall_s: float  # virtual seconds from the first arrival to the last finish
    busy_s: dict[str, float]
    decision_s: list[float]  # real CPU seconds of lookup + decide per request
    cpu_s: float  # real seconds the simulation took
    extra: dict[str, Any] = field(default_factory=dict)


class Simulator:
    def __init__(self, workload: Workload, config: SimConfig, tokenizer: PromptTokenizer | None) -> None:
        if config.view not in ("directory", "engines"):
            raise ValueError("view must be 'directory' or 'engines'")
        self.workload = workload
        self.cfg = config
        self.profile = p = config.profile
        self.bs = p.block_size
        self.tokenizer = tokenizer
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        capacity = config.capacity_blocks or p.kv_capacity_blocks
        self.max_model_len = min(p.max_model_len, capacity * self.bs)
        transfer = config.pull_link is not None
        if config.roles is not None and (sum(config.roles) != config.nodes or min(config.roles) < 1):
            raise ValueError(f"roles {config.roles[0]}:{config.roles[1]} must be at least one of each and add up to {config.nodes} nodes")
        role = (lambda i: "prefill" if i < config.roles[0] else "decode") if config.roles else (lambda i: "both")  # type: ignore[index]

        def build(i: int) -> SimNode:
            return SimNode.build(
                NodeInfo(f"n{i + 1}", f"10.0.{i // 250}.{i % 250 + 1}:8000",
                         transfer_endpoint=f"10.0.{i // 250}.{i % 250 + 1}:9100" if transfer else "",
                         capacity_blocks=capacity, model=workload.model, role=role(i)),
                p, capacity,
            )

        self._build_node = build
        self.nodes = [build(i) for i in range(config.nodes)]  # the live fleet (scale events change it)
        self.by_id = {n.node_id: n for n in self.nodes}  # every node that ever served
        self.directory = InProcessDirectory(
            heartbeat_ttl_s=FOREVER_S, index_stride=DEFAULT_INDEX_STRIDE, max_request_s=FOREVER_S,
            dead_node_retention_s=FOREVER_S, clock=lambda: self.now,
        )
        for n in self.nodes:
            run_now(self.directory.register_node(n.info))
        self.feeds = {n.node_id: DirectoryFeed(n.node_id, self.directory, model=workload.model, block_size=self.bs)
                      for n in self.nodes}
        self.oracle = config.policy in (ORACLE, ORACLE_POOL)
        # the oracle's cache: every block any node computed (unbounded), or the fleet-sized pool
        self.pool = PooledMemory(capacity * config.nodes) if config.policy == ORACLE_POOL else None
        self.policy = sim_policy(config.policy, config.pull_link, config.policy_options)
        self.seen_hashes: set[int] = set()  # every engine block computed anywhere (the oracle's cache)
        encode = (lambda s: tokenizer.encode_text(s, add_special_tokens=False)) if tokenizer else None
        self.sampler = ReplySampler.from_encoder(encode) if encode else ReplySampler(np.arange(1000, 1400))
        self.root = root_hash()
        self.key_seed = namespace_seed(workload.model)
        self.records: list[RequestRecord] = []
        self.decision_s: list[float] = []
        self.sent = 0
        self.prompt_seen = SeenBlocks()
        self.last_finish = 0.0
        self._pending: dict[str, _Ctx] = {}  # request_id -> context, while on a node
        self.on_round: Callable[[RequestSpec, Round], None] | None = None  # sees each round before its reservation
        self.elastic = Elastic(self, config.scale, drain=config.drain) if config.scale else None

    # -- the fleet changes (``loadtest.sim.elastic``) ---------------------------------------------

    def add_node(self) -> SimNode:
        node = self._build_node(len(self.by_id))
        self.nodes.append(node)
        self.by_id[node.node_id] = node
        run_now(self.directory.register_node(node.info))
        self.feeds[node.node_id] = DirectoryFeed(node.node_id, self.directory, model=self.workload.model, block_size=self.bs)
        return node

    def remove_node(self, node: SimNode) -> None:
        """The node gets no new request; what it runs finishes; its cache leaves with it."""
        self.nodes.remove(node)
        run_now(self.directory.deregister_node(node.node_id))

    def schedule(self, t: float, call: Callable[[], None]) -> None:
        self._push(t, CALL, call)

    def feed(self, node: SimNode, events: list[CacheEvent]) -> None:
        self._events(node, events)

    # -- queue -------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self, on_request: Callable[[], None] | None = None) -> SimResult:
        t_cpu = time.perf_counter()
        for s in self.workload.sessions:
            if s.start_s <= self.cfg.duration_s:
                self._push(s.start_s, ARRIVE, (s, 1, []))
        if self.elastic is not None:
            self.elastic.start()
        heap = self._heap
        while heap:
            t, seq, kind, payload = heapq.heappop(heap)
            self.now = t
            if kind == STEP_END:
                if payload.step_seq == seq:  # else a decode run was cut: its end moved
                    self._step_end(payload, on_request)
            elif kind == ARRIVE:
                self._arrive(*payload, on_request=on_request)
            elif kind == CALL:
                payload()
            else:
                self._submit(*payload)
        first = min((r.sent_at for r in self.records), default=0.0)
        return SimResult(
            sorted(self.records, key=lambda r: r.sent_at),
            max(self.last_finish - first, 0.0),
            {n.node_id: n.scheduler.counters.busy_s for n in self.by_id.values()},
            self.decision_s,
            time.perf_counter() - t_cpu,
            {"preemptions": sum(n.scheduler.counters.preemptions for n in self.by_id.values())},
        )

    # -- a turn arrives at the gateway -------------------------------------------------------

    def _prompt_ids(self, spec) -> tuple[np.ndarray, str]:  # type: ignore[no-untyped-def]
        if spec.prompt_ids is not None:
            return spec.prompt_ids, spec.body["model"]
        if self.tokenizer is None:
            raise ValueError("this workload has text prompts: the simulator needs the tokenizer")
        tp = self.tokenizer.tokenize_body(spec.path, spec.body)
        return tp.token_ids, tp.model

    def _arrive(self, session: Session, turn: int, replies: list[str], on_request) -> None:  # type: ignore[no-untyped-def]
        cfg, now, bs = self.cfg, self.now, self.bs
        if now > cfg.duration_s or (cfg.max_requests is not None and self.sent >= cfg.max_requests):
            return
        self.sent += 1
        spec = session.request(turn, replies)
        rec = RequestRecord(spec, now)
        ids, model = self._prompt_ids(spec)
        n = len(ids)
        rec.prompt_tokens = n
        prompt_blocks = n // bs
        try:
            opts = generation_options(
                spec.body, chat=spec.path.endswith("chat/completions"), prompt_tokens=n,
                max_model_len=self.max_model_len, default_max_tokens=cfg.default_max_tokens,
            )
        except APIError as e:
            rec.status, rec.error = e.status, e.message
            self.records.append(rec)
            if on_request:
                on_request()
            return
        reply = self.sampler.reply(ids, opts.max_tokens, ignore_eos=opts.ignore_eos, min_tokens=opts.min_tokens)
        sim = SimRequest.create(
            f"{spec.session_id}/{turn}", ids, reply, block_size=bs, root_hash=self.root, key_seed=self.key_seed, arrival=now,
            answers=opts.answers,
        )  # fmt: skip
        cap = hit_cap_blocks(n, bs)
        rec.seen_tokens = min(self.prompt_seen.observe(sim.keys[:prompt_blocks]), cap) * bs

        t0 = time.perf_counter()
        keys = sim.keys[:prompt_blocks]
        view = self._view(sim, keys)
        request = routing_request(model, ids, keys, block_size=bs, seed=self.key_seed, request_id=sim.request_id)
        draining = self.elastic.draining() if self.elastic is not None else frozenset()
        tokens, answers = answer_budget(spec.body)
        rnd = decide_round(self.policy, request, view, self.profile, now=now, answer_tokens=tokens, answers=answers,
                           draining=draining)  # fmt: skip
        self.decision_s.append(time.perf_counter() - t0)
        decision = rnd.decision
        assert decision.node is not None, "the simulated fleet always has live nodes"
        if self.on_round is not None:
            self.on_round(spec, rnd)
        node = self.by_id[decision.node.node_id]
        if self.elastic is not None:
            self.elastic.record(request, ids, node.node_id, model)
        # one gateway replica: what the policy shares with others (split arrivals, answers' contexts) is left out
        reservation = run_now(self.directory.reserve(node.node_id, rnd.prefill_tokens, first_token_s=rnd.ttft_s,
                                                     requests=rnd.answers))  # fmt: skip
        ctx = _Ctx(session, replies, rec, sim, node, now, reservation, round=rnd)
        if decision.prefill is not None:
            self._prefill_first(ctx, decision.prefill, ids)
            return

        if self.oracle:
            if self.pool is not None:
                seen = self.pool.hit(sim.hashes[:cap])
            else:
                seen = 0
                for h in sim.hashes[:cap]:
                    if h not in self.seen_hashes:
                        break
                    seen += 1
            if seen:
                _, events = node.insert_prefix(sim, seen, now)
                self._events(node, events)
        elif decision.pull is not None:
            src = self.by_id[decision.pull.source_node_id]
            upto = min(decision.pull.blocks, cap, src.cached_blocks(sim, cap))
            local = node.cached_blocks(sim, upto)
            if upto > local:
                assert cfg.pull_link is not None
                delay = self.profile.transfer_seconds((upto - local) * bs, cfg.pull_link)
                ctx.pulled_blocks = upto
                self._push(now + delay, SUBMIT, (ctx,))
                return
        self._submit(ctx)

    def _prefill_first(self, decode: _Ctx, plan: PrefillPlan, ids: np.ndarray) -> None:
        """A split request: its prompt runs on the prefill node (one token, discarded, as with
        ``max_tokens: 1``); the decode starts when the prompt's KV has crossed the link."""
        node = self.by_id[plan.node_id]
        decode.record.split = True
        reply = self.sampler.reply(ids, 1, ignore_eos=True, min_tokens=1)
        sim = SimRequest.create(f"{decode.sim.request_id}/prefill", ids, reply, block_size=self.bs, root_hash=self.root,
                                key_seed=self.key_seed, arrival=self.now)
        hold = run_now(self.directory.reserve(node.node_id, plan.prefill_tokens, first_token_s=plan.ready_s, hold_s=plan.ready_s))
        self._submit(_Ctx(decode.session, decode.replies, decode.record, sim, node, self.now, hold, decode=decode))

    def _hand_over(self, prefill: _Ctx) -> None:
        """The prefill is done: its KV reaches the decode node after the modelled transfer."""
        decode = prefill.decode
        assert decode is not None
        blocks = hit_cap_blocks(decode.sim.num_prompt, self.bs)
        decode.pulled_blocks = blocks
        link = getattr(self.policy, "link", "tcp")
        self._push(self.now + self.profile.transfer_seconds(decode.sim.num_prompt, link), SUBMIT, (decode,))

    def _view(self, sim: SimRequest, keys: np.ndarray) -> DirectoryView:
        if self.cfg.view == "directory":
            return run_now(self.directory.lookup(keys))
        loads = run_now(self.directory.loads())
        hashes = sim.hashes[: len(keys)]
        idle = NodeLoad()
        return DirectoryView(tuple(
            NodeView(n.info, n.cache.match(hashes), Tier.GPU, loads.get(n.node_id, idle), len(n.cache))
            for n in self.nodes
        ))

    # -- the node side -----------------------------------------------------------------------

    def _submit(self, ctx: _Ctx) -> None:
        node, now = ctx.node, self.now
        if ctx.pulled_blocks:
            added, events = node.insert_prefix(ctx.sim, ctx.pulled_blocks, now)
            self._events(node, events)
            ctx.pulled_blocks = added
        node.scheduler.add(ctx.sim)
        self._pending[ctx.sim.request_id] = ctx
        if node.step is None:
            self._start_step(node)
        elif node.step.cut(now):  # admitted after the step in progress, not after the whole run
            self._push_step_end(node, node.step.started_at + node.step.duration_s)

    def _start_step(self, node: SimNode) -> None:
        step = node.scheduler.schedule(self.now, max_steps=self.cfg.decode_run_steps)
        node.step = step
        if step is not None:
            self._push_step_end(node, self.now + step.duration_s)

    def _push_step_end(self, node: SimNode, t: float) -> None:
        self._push(t, STEP_END, node)
        node.step_seq = self._seq

    def _events(self, node: SimNode, events: list[CacheEvent]) -> None:
        if not events:
            return
        if self.oracle:
            for ev in events:
                if isinstance(ev, BlocksStored):
                    if self.pool is not None:
                        self.pool.store(ev.block_hashes)
                    else:
                        self.seen_hashes.update(ev.block_hashes)
        if self.cfg.view == "directory":
            self.feeds[node.node_id].apply(events)

    def _step_end(self, node: SimNode, on_request) -> None:  # type: ignore[no-untyped-def]
        """Apply the node's step; while its next step ends before anything else happens, run that
        one at once too (what popping it from the queue next would do, without the queue)."""
        pending, heap = self._pending, self._heap
        while True:
            now = self.now
            step = node.step
            assert step is not None
            result = node.scheduler.complete(step, now)
            self._events(node, result.events)
            for out in result.outputs:
                if out.generated == 1:
                    ctx = pending[out.request.request_id]
                    if ctx.decode is None:  # a split request's first token is the decode node's
                        ctx.record.ttft_s = now - ctx.arrival
            for r in result.finished:
                ctx = pending.pop(r.request_id)
                self._finish(ctx, now, on_request)
            node.step = None
            if not node.scheduler.has_work():
                if self.elastic is not None:
                    self.elastic.node_idle(node)
                return
            step = node.step = node.scheduler.schedule(now, max_steps=self.cfg.decode_run_steps)
            if step is None:
                return
            end = now + step.duration_s
            if heap and heap[0][0] <= end:  # something else comes first (or ties, and was queued first)
                self._push_step_end(node, end)
                return
            self.now = end

    def _finish(self, ctx: _Ctx, now: float, on_request) -> None:  # type: ignore[no-untyped-def]
        if ctx.decode is not None:
            self._hand_over(ctx)  # its reservation ends by itself at the estimate
            return
        r, rec = ctx.sim, ctx.record
        rec.status = 200
        rec.e2e_s = now - ctx.arrival
        rec.node = ctx.node.node_id
        rec.cached_tokens = max(r.cached_tokens, 0)
        rec.pulled_tokens = min(ctx.pulled_blocks * self.bs, rec.cached_tokens)
        rec.output_tokens = r.generated * r.answers
        if ctx.reservation is not None:
            run_now(self.directory.release(ctx.reservation))
        if ctx.round is not None:  # as RoutingCore.release: answered, no later decision prices it
            end_round(self.policy, ctx.round)
        self.records.append(rec)
        self.last_finish = max(self.last_finish, now)
        if on_request:
            on_request()
        s = ctx.session
        turn = rec.turn
        if turn < s.turns:
            text = self.tokenizer.decode(r.tokens[r.num_prompt : r.num_prompt + r.generated]) if self.tokenizer else ""
            rec.reply = text
            self._push(now + s.think_s(turn + 1), ARRIVE, (s, turn + 1, [*ctx.replies, text]))
