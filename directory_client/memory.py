"""The in-process directory: the reference model every other backend is tested against, and the
embedded default for a single gateway replica.

Plain dicts, no locks (one event loop owns it, and no method awaits in the middle of a change),
time read from an injected clock so tests and the simulator can drive it. The semantics are
exactly the Redis backends' (same stride rule, same tier bitmasks, same expiry rules); where the
two could differ (clock source) the difference is noted.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

from directory_client.hot import check_hot, hot_prefix
from directory_client.sampling import KeySampler, check_keys
from directory_client.types import (
    MAX_ARRIVALS_PER_NODE,
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

# fastest tier held, by tier bitmask (bit 0 GPU, bit 1 CPU, bit 2 STORAGE)
FASTEST_TIER: tuple[int, ...] = (0, 0, 1, 0, 2, 0, 1, 0)
TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.STORAGE)
ALL_TIERS_MASK = 0b111
_IDLE = NodeLoad()
RUN = 32  # sampled keys a remembered run covers
_MAX_RUNS = 1 << 16  # remembered runs per node (a set of ints, ~4 MB at most)
MAX_SESSIONS = 200_000  # past it the oldest records go first (a bound on memory, not a TTL)


class _Node:
    """One node's registration and blocks (lives until deregistered or forgotten)."""

    __slots__ = ("info", "alive_until", "keep_until", "blocks", "bridged", "runs")

    def __init__(self) -> None:
        self.info: NodeInfo | None = None
        self.alive_until = float("-inf")
        self.keep_until = float("-inf")
        self.blocks: dict[int, int] = {}  # key -> tier bitmask
        self.bridged = False  # a writer-lease holder wrote its entries (outlives the lease, not the node)
        # Every RUN-th sampled key of a prompt that a lookup found held in GPU memory together with
        # every sampled key before it (a chained key stands for its whole prefix). A continuing
        # chat's next lookup skips those runs instead of testing its history key by key (~300 µs
        # at 128k tokens). Adding blocks or tiers keeps that true; anything removed forgets them.
        self.runs: set[int] = set()

    def forget_runs(self) -> None:
        self.runs = set()


class _Load:
    """Reservations on one node, each ending at its own time and settling its prefill at another.

    ``reservations`` maps a token to (end time, prefill still counted: 0 once its first token is
    due, requests it counts: a request generating n answers counts n, context tokens its decode
    steps read: counted in ``context`` while it lasts); tuples, not objects, so thousands held do
    not burden the garbage collector. Two heaps
    of (time, token) with lazy deletion: a released reservation's entries stay until their time
    or until garbage outnumbers the live entries, when the heaps are rebuilt.
    """

    __slots__ = ("reservations", "ends", "settles", "inflight", "prefill", "due_at", "context")

    def __init__(self) -> None:
        self.reservations: dict[str, tuple[float, int, int, int]] = {}
        self.ends: list[tuple[float, str]] = []
        self.settles: list[tuple[float, str]] = []
        self.inflight = 0
        self.prefill = 0
        self.due_at = 0.0  # latest first-token time of any prefill reserved (a bound: releases keep it)
        self.context = 0

    def add(self, token: str, prefill: int, settle_at: float, end_at: float, requests: int = 1, context: int = 0) -> None:
        self.reservations[token] = (end_at, prefill, requests, context)
        heapq.heappush(self.ends, (end_at, token))
        if prefill:
            heapq.heappush(self.settles, (settle_at, token))
            if settle_at > self.due_at:
                self.due_at = settle_at
        self.inflight += requests
        self.prefill += prefill
        self.context += context

    def remove(self, token: str) -> None:
        entry = self.reservations.pop(token, None)
        if entry is None:
            return
        self.inflight -= entry[2]
        self.prefill -= entry[1]
        self.context -= entry[3]
        if len(self.ends) > 2 * len(self.reservations) + 64:  # mostly released entries: rebuild
            self.ends = [(entry[0], t) for t, entry in self.reservations.items()]
            heapq.heapify(self.ends)
            self.settles = [e for e in self.settles if e[1] in self.reservations]
            heapq.heapify(self.settles)

    def expire(self, now: float) -> None:
        settles, ends, res = self.settles, self.ends, self.reservations
        while settles and settles[0][0] <= now:
            token = heapq.heappop(settles)[1]
            entry = res.get(token)
            if entry is not None and entry[1]:
                self.prefill -= entry[1]
                res[token] = (entry[0], 0, entry[2], entry[3])
        while ends and ends[0][0] <= now:
            entry = res.pop(heapq.heappop(ends)[1], None)  # tokens are unique: this is its end
            if entry is not None:
                self.inflight -= entry[2]
                self.prefill -= entry[1]
                self.context -= entry[3]

    def view(self, now: float) -> NodeLoad:
        if not self.inflight:
            return _IDLE
        return NodeLoad(self.inflight, self.prefill, max(self.due_at - now, 0.0)) if self.prefill else NodeLoad(self.inflight)


class _Chunks:
    """A lookup's keys as lists of Python ints, made a chunk at a time and shared by the nodes:
    a scan stops at a node's first missing block, usually long before the end of a long prompt,
    and skips the runs a node is remembered to hold."""

    SIZE = 256

    __slots__ = ("_keys", "_made", "_marks")

    def __init__(self, keys: Sequence[int]) -> None:
        self._keys = keys
        self._made: dict[int, list[int]] = {}  # chunk index -> its keys, listed when first scanned
        self._marks: list[int] | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def marks(self) -> list[int]:
        """Every ``RUN``-th key (the last of each run of ``RUN``), listed once per lookup."""
        if self._marks is None:
            part = self._keys[RUN - 1 :: RUN]
            self._marks = part.tolist() if hasattr(part, "tolist") else list(part)
        return self._marks

    def get(self, c: int) -> list[int]:
        made = self._made.get(c)
        if made is None:
            part = self._keys[c * self.SIZE : (c + 1) * self.SIZE]
            made = self._made[c] = part.tolist() if hasattr(part, "tolist") else list(part)
        return made


def _held(blocks: dict[int, int], runs: set[int], chunks: _Chunks) -> tuple[int, int]:
    """How many of the prompt's sampled keys a node holds from the start, and the slowest tier
    among them; the runs of ``RUN`` keys it is remembered to hold in GPU memory are skipped, and
    those found so now are remembered."""
    marks = chunks.marks() if runs else []
    vouched = 0
    while vouched < len(marks) and marks[vouched] in runs:
        vouched += 1
    held = vouched * RUN
    worst = 0
    on_gpu = -1  # keys held before the first one not in GPU memory (-1: all of them so far)
    size, n = _Chunks.SIZE, len(chunks)
    while held < n:
        c, off = divmod(held, size)
        chunk = chunks.get(c)
        for k in chunk[off:] if off else chunk:
            mask = blocks.get(k)
            if mask is None:
                break
            t = FASTEST_TIER[mask]
            if t > worst:
                if on_gpu < 0:
                    on_gpu = held
                worst = t
            held += 1
        else:
            continue
        break
    runs_now = (held if on_gpu < 0 else on_gpu) // RUN
    if runs_now > vouched:
        if len(runs) >= _MAX_RUNS:
            runs.clear()
            vouched = 0
        runs.update(chunks.marks()[vouched:runs_now])
    return held, worst


class InProcessDirectory:
    """``Directory`` held in this process's memory (one gateway replica; tests' model)."""

    in_process = True  # every operation completes without awaiting I/O

    def __init__(
        self,
        *,
        heartbeat_ttl_s: float = 10.0,
        index_stride: int = 1,
        max_request_s: float = 600.0,
        dead_node_retention_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_durations(heartbeat_ttl_s, 1.0, max_request_s, dead_node_retention_s)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.max_request_s = max_request_s
        self.dead_node_retention_s = dead_node_retention_s
        self.sampler = KeySampler(index_stride)
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._loads: dict[str, _Load] = {}
        self._tokens = itertools.count(1)
        self._writers: dict[str, tuple[str, float]] = {}  # node -> (owner, lease end)
        self._sessions: dict[str, tuple[str, float]] = {}  # session -> (node_id, expires at), oldest first
        self._hot: dict[str, tuple[dict[bytes, float], float]] = {}  # node -> (member -> served at, expires at)
        self._draining: dict[str, float] = {}  # node -> until
        self._arrivals: dict[str, dict[str, tuple[float, int, float]]] = {}  # node -> id -> (lands, blocks, until)

    @property
    def index_stride(self) -> int:
        return self.sampler.stride

    # -- nodes ---------------------------------------------------------------------------------

    def _state(self, node_id: str, now: float) -> _Node | None:
        """A node's state, forgetting it first if it stayed dead past the retention."""
        st = self._nodes.get(node_id)
        if st is not None and st.keep_until <= now:
            del self._nodes[node_id]
            return None
        return st

    def _touch(self, st: _Node, now: float) -> None:
        st.keep_until = max(st.keep_until, now + self.heartbeat_ttl_s + self.dead_node_retention_s)

    async def register_node(self, node: NodeInfo) -> None:
        check_node(node)
        now = self._clock()
        st = self._state(node.node_id, now)
        if st is None:
            st = self._nodes[node.node_id] = _Node()
        st.info = node
        st.alive_until = now + self.heartbeat_ttl_s
        self._touch(st, now)

    async def heartbeat(self, node_id: str) -> None:
        check_node_id(node_id)
        now = self._clock()
        st = self._state(node_id, now)
        if st is None or st.info is None:
            raise UnknownNode(f"node {node_id!r} is not registered")
        st.alive_until = now + self.heartbeat_ttl_s
        self._touch(st, now)

    async def deregister_node(self, node_id: str) -> None:
        check_node_id(node_id)
        self._nodes.pop(node_id, None)
        self._loads.pop(node_id, None)
        self._arrivals.pop(node_id, None)

    def _live(self, now: float) -> list[tuple[str, _Node]]:
        live = [(nid, st) for nid, st in self._nodes.items() if st.info is not None and st.alive_until > now]
        live.sort(key=lambda item: item[0])
        return live

    async def live_nodes(self) -> list[NodeInfo]:
        return [st.info for _, st in self._live(self._clock()) if st.info is not None]

    # -- blocks --------------------------------------------------------------------------------

    async def record_stored(self, node_id: str, keys: Sequence[BlockKey], tier: Tier = Tier.GPU) -> None:
        check_node_id(node_id)
        check_tier(tier, optional=False)
        check_keys(keys)
        now = self._clock()
        st = self._state(node_id, now)
        if st is None:
            st = self._nodes[node_id] = _Node()
        bit = 1 << int(tier)
        blocks = st.blocks
        get = blocks.get
        for k in self.sampler.select(keys):
            blocks[k] = get(k, 0) | bit
        self._touch(st, now)

    async def record_removed(self, node_id: str, keys: Sequence[BlockKey], tier: Tier | None = None) -> None:
        check_node_id(node_id)
        check_tier(tier, optional=True)
        check_keys(keys)
        st = self._state(node_id, self._clock())
        if st is None:
            return
        keep = ALL_TIERS_MASK & ~(ALL_TIERS_MASK if tier is None else 1 << int(tier))
        blocks = st.blocks
        for k in self.sampler.select(keys):
            mask = blocks.get(k)
            if mask is None:
                continue
            if st.runs:
                st.forget_runs()
            mask &= keep
            if mask:
                blocks[k] = mask
            else:
                del blocks[k]

    async def clear_node(self, node_id: str) -> None:
        check_node_id(node_id)
        st = self._state(node_id, self._clock())
        if st is not None:
            st.blocks.clear()
            st.forget_runs()

    # -- one writer per node -------------------------------------------------------------------

    async def claim_writer(self, node_id: str, owner: str, ttl_s: float) -> WriterLease:
        check_node_id(node_id)
        if not owner or ttl_s <= 0:
            raise ValueError("claim_writer needs an owner and a positive ttl")
        now = self._clock()
        held = self._writers.get(node_id)
        if held is not None and held[1] > now and held[0] != owner:
            return WriterLease.HELD_BY_OTHER
        self._writers[node_id] = (owner, now + ttl_s)
        st = self._state(node_id, now)
        if st is None:  # noted before the node registers, kept as long as an unknown node's entries
            st = self._nodes[node_id] = _Node()
            self._touch(st, now)
        st.bridged = True
        return WriterLease.RENEWED if held is not None and held[1] > now else WriterLease.TAKEN

    async def writer(self, node_id: str) -> str | None:
        check_node_id(node_id)
        held = self._writers.get(node_id)
        return held[0] if held is not None and held[1] > self._clock() else None

    async def clear_if_unwritten(self, node_id: str) -> bool:
        if await self.writer(node_id) is not None:
            return False
        st = self._state(node_id, self._clock())
        if st is None or not st.bridged:
            return False
        st.blocks.clear()
        st.forget_runs()
        st.bridged = False
        return True

    async def release_writer(self, node_id: str, owner: str) -> None:
        check_node_id(node_id)
        held = self._writers.get(node_id)
        if held is not None and held[0] == owner:
            del self._writers[node_id]

    async def replace_node(self, node_id: str, blocks: Mapping[Tier, Sequence[BlockKey]]) -> None:
        check_node_id(node_id)
        fresh: dict[int, int] = {}
        for tier, keys in blocks.items():
            check_tier(tier, optional=False)
            check_keys(keys)
            bit = 1 << int(tier)
            for k in self.sampler.select(keys):
                fresh[k] = fresh.get(k, 0) | bit
        now = self._clock()
        st = self._state(node_id, now)
        if st is None:
            st = self._nodes[node_id] = _Node()
        st.blocks = fresh
        st.forget_runs()
        self._touch(st, now)

    async def retire_node(self, node_id: str) -> None:
        check_node_id(node_id)
        now = self._clock()
        st = self._state(node_id, now)
        if st is not None:
            st.alive_until = min(st.alive_until, now)

    # -- lookup --------------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[BlockKey], session: str = "") -> DirectoryView:
        now = self._clock()
        kept, positions = self.sampler.select_array(keys)
        chunks = _Chunks(kept)
        views = []
        stride, loads, blocks_for = self.sampler.stride, self._loads, KeySampler.blocks_for
        for nid, st in self._live(now):
            blocks = st.blocks
            held, worst = _held(blocks, st.runs, chunks) if blocks else (0, 0)  # a cold node is not scanned
            load = loads.get(nid)
            if load is not None:
                load.expire(now)
            assert st.info is not None
            views.append(
                NodeView(
                    st.info,
                    blocks_for(held, positions),
                    TIERS[worst],
                    _IDLE if load is None else load.view(now),
                    len(blocks) * stride,
                    self._arrivals_at(nid, now) if nid in self._arrivals else (),
                    0 if load is None or not load.inflight else load.context,
                )
            )
        session_node = (self._session_node(session, now) or "") if session else ""
        return DirectoryView(tuple(views), KeySampler.blocks_for(len(kept), positions), session_node)

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
        if arrival is not None:
            arrival = check_arrival(arrival, self.max_request_s)
        now = self._clock()
        load = self._loads.get(node_id)
        if load is None:
            load = self._loads[node_id] = _Load()
        load.expire(now)
        if if_inflight_at_most is not None and load.inflight > if_inflight_at_most:
            raise ReservationConflict(node_id, if_inflight_at_most)
        token = f"m{next(self._tokens)}|{prefill_tokens}"
        load.add(token, prefill_tokens, now + settle_s, now + end_s, requests, context_tokens)
        if arrival is None:
            return Reservation(node_id, requests, prefill_tokens, token)
        self._add_arrival(node_id, arrival, now)
        return Reservation(node_id, requests, prefill_tokens, token, arrival_recorded=True, arrival_id=arrival.arrival_id)

    def _add_arrival(self, node_id: str, arrival: SplitArrival, now: float) -> None:
        """Keep the node's ``MAX_ARRIVALS_PER_NODE`` arrivals that end last (the Redis script's rule)."""
        held = self._arrivals.setdefault(node_id, {})
        for aid in [a for a, (_, _, until) in held.items() if until <= now]:
            del held[aid]
        held[arrival.arrival_id] = (now + arrival.arrives_s, arrival.blocks, now + arrival.until_s)
        if len(held) > MAX_ARRIVALS_PER_NODE:
            for aid, _ in sorted(held.items(), key=lambda kv: kv[1][2])[: len(held) - MAX_ARRIVALS_PER_NODE]:
                del held[aid]

    def _arrivals_at(self, node_id: str, now: float) -> tuple[SplitArrival, ...]:
        """The node's arrivals not yet done, soonest end first, times from ``now``; the rest dropped."""
        held = self._arrivals[node_id]
        for aid in [a for a, (_, _, until) in held.items() if until <= now]:
            del held[aid]
        if not held:
            del self._arrivals[node_id]
            return ()
        rows = sorted(held.items(), key=lambda kv: kv[1][2])
        return tuple(SplitArrival(aid, at - now, blocks, until - now) for aid, (at, blocks, until) in rows)

    async def release(self, reservation: Reservation) -> None:
        check_reservation(reservation)
        load = self._loads.get(reservation.node_id)
        if load is not None:
            load.remove(reservation.token)
        held = self._arrivals.get(reservation.node_id)
        if held and reservation.arrival_id:  # a released split has answered
            held.pop(reservation.arrival_id, None)

    async def loads(self) -> dict[str, NodeLoad]:
        now = self._clock()
        out = {}
        for nid, _ in self._live(now):
            load = self._loads.get(nid)
            if load is not None:
                load.expire(now)
            out[nid] = _IDLE if load is None else load.view(now)
        return out

    # -- sessions ------------------------------------------------------------------------------

    async def session_node(self, session: str) -> str | None:
        return self._session_node(session, self._clock())

    def _session_node(self, session: str, now: float) -> str | None:
        entry = self._sessions.get(session)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._sessions[session]
            return None
        return entry[0]

    async def record_session(self, session: str, node_id: str, ttl_s: float) -> None:
        check_node_id(node_id)
        self._sessions.pop(session, None)  # re-inserted last: the dict stays in expiry order
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        self._sessions[session] = (node_id, self._clock() + ttl_s)

    # -- elastic fleets ------------------------------------------------------------------------

    async def record_hot(self, node_id: str, model: str, tokens: bytes, *, keep: int, ttl_s: float) -> None:
        check_node_id(node_id)
        member = check_hot(model, tokens, keep, ttl_s)
        now = self._clock()
        served, _ = self._hot.get(node_id, ({}, 0.0))
        served.pop(member, None)
        served[member] = now  # insertion order = service order
        while len(served) > keep:
            del served[next(iter(served))]
        self._hot[node_id] = (served, now + ttl_s)

    async def hot_prefixes(self, node_id: str, limit: int) -> list[HotPrefix]:
        check_node_id(node_id)
        served, until = self._hot.get(node_id, ({}, 0.0))
        if until <= self._clock():
            self._hot.pop(node_id, None)
            return []
        out = [hot_prefix(m, at) for m, at in reversed(served.items())]
        return [h for h in out if h is not None][: max(limit, 0)]

    async def set_draining(self, node_id: str, ttl_s: float) -> None:
        check_node_id(node_id)
        if ttl_s > 0:
            self._draining[node_id] = self._clock() + ttl_s
        else:
            self._draining.pop(node_id, None)

    async def draining(self) -> frozenset[str]:
        now = self._clock()
        return frozenset(n for n, until in self._draining.items() if until > now)

    async def aclose(self) -> None:
        """Nothing to release; present for the protocol."""
