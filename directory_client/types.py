"""The directory's contract: small frozen values cross the boundary, never backend replies."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from directory_client.frozen import fast_frozen_init
from tokenizer.keys import BlockKey


class Tier(enum.IntEnum):
    """Where a node keeps a block. Lower is faster; a CPU-tier hit is worth less than a GPU one.

    Engines name media differently (vLLM GPU/CPU/STORAGE; SGLang GPU/CPU_PINNED/DISK/EXTERNAL);
    ``Tier.from_medium`` folds them onto these three.
    """

    GPU = 0
    CPU = 1
    STORAGE = 2

    @classmethod
    def from_medium(cls, medium: str | None) -> "Tier":
        m = (medium or "GPU").upper()
        if m in ("GPU", "CUDA", "HBM"):
            return cls.GPU
        if m in ("CPU", "CPU_PINNED", "DRAM"):
            return cls.CPU
        return cls.STORAGE


class DirectoryUnavailable(Exception):
    """The directory backend cannot be reached or answered an error: callers fail open."""


class WriterLease(enum.IntEnum):
    """What ``claim_writer`` found: another bridge holds the lease, the caller renewed its own, or
    it took a free one (the entries may have been cleared while nobody held it: rewrite them)."""

    HELD_BY_OTHER = 0
    RENEWED = 1
    TAKEN = 2


class ReservationConflict(Exception):
    """A compare-and-reserve found more requests in flight on the node than the caller saw:
    another replica took it meanwhile. Nothing was reserved; decide again on a fresh view."""

    def __init__(self, node_id: str, seen_inflight: int | None) -> None:
        super().__init__(f"node {node_id} has more than {seen_inflight} requests in flight now")
        self.node_id = node_id


class UnknownNode(LookupError):
    """A heartbeat for a node that is not registered (never, deregistered, or forgotten after
    its dead-node retention): the caller should ``register_node`` again."""


NodeRole = Literal["prefill", "decode", "both"]
ROLES: tuple[NodeRole, ...] = ("prefill", "decode", "both")
"""What a node serves in a disaggregated fleet: ``prefill`` computes prompts and hands their KV to
a decode node (never routed a whole request), ``decode`` receives KV and generates, ``both`` does
either and is the only role of an aggregated fleet."""


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A serving node as registered by its bridge (or by static config)."""

    node_id: str
    address: str  # "ip:port" of the OpenAI-compatible server; what Envoy routes to
    transfer_endpoint: str = ""  # "ip:port" of the KV transfer agent; "" = cannot serve pulls
    capacity_blocks: int = 0  # KV cache size in blocks (0 = unknown)
    model: str = ""
    role: NodeRole = "both"


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class NodeLoad:
    """Load every gateway replica sees for a node: in-flight requests and their queued prefill."""

    inflight: int = 0
    prefill_tokens: int = 0
    # Seconds from the lookup until the last queued prompt's estimated first token (inf: unknown).
    # The queued prefill counts whole until then although most of it is done by then, so the cost
    # model waits on it no longer than this. A time, not part of the load's identity.
    prefill_due_s: float = field(default=float("inf"), compare=False)


MAX_ARRIVALS_PER_NODE = 64
"""Split arrivals the directory keeps per decode node (those ending last): a bound on what a
lookup reads and returns, whatever replicas write."""


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class SplitArrival:
    """A split request's KV on its way to (or answering on) a decode node, as one gateway replica
    recorded it so that every replica's decisions see it (``gateway.policy.arrivals``).

    Times are seconds from the call that carries it (the reserve that writes it, the lookup that
    reads it), so replicas with different clocks agree; the directory drops it at ``until_s``."""

    arrival_id: str  # unique per split: a replica recognises its own
    arrives_s: float  # until its KV lands on the node (negative once landed)
    blocks: int  # KV blocks it brings
    until_s: float  # until its answer is estimated done


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class NodeView:
    """One live node as seen by one lookup: its longest cached prefix of the asked keys, its load."""

    node: NodeInfo
    cached_blocks: int  # length of the longest prefix of the asked keys held (in engine blocks)
    tier: Tier  # slowest tier within that prefix (GPU when cached_blocks == 0)
    load: NodeLoad
    total_blocks: int = 0  # every block the node holds, any prompt (estimated: indexed keys × stride)
    arrivals: tuple[SplitArrival, ...] = ()  # splits any replica sent here, not yet done (decode nodes)
    # KV tokens each decode step there reads for the requests served whole that any replica's
    # reservation counted (``reserve(context_tokens=...)``), until released or ended
    answering_tokens: int = 0


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class DirectoryView:
    """Answer to ``Directory.lookup``: every live node, in a stable order (by node_id)."""

    nodes: tuple[NodeView, ...]
    answerable_blocks: int = -1
    """The longest prefix of the asked keys this lookup could report (with a stride, the block
    after the last sampled key); a node reporting it may hold more of the prompt. -1: unknown."""
    session_node: str = ""
    """The node the asked session was last routed to ("" when none was asked or recorded)."""
    pull_sources: tuple[NodeView, ...] = ()
    """Nodes that take no new request but whose blocks may still be pulled (draining ones: their
    cache lives until they stop). Filled by ``gateway.decision_round``, never by a lookup."""

    def best(self) -> NodeView | None:
        return max(self.nodes, key=lambda n: n.cached_blocks, default=None)


@fast_frozen_init
@dataclass(frozen=True, slots=True)
class Reservation:
    """Load taken on a node by one routed request; give it back with ``Directory.release``."""

    node_id: str
    requests: int = 1  # what it counts in flight: a request generating n answers counts n
    prefill_tokens: int = 0
    token: str = field(default="")  # backend-specific handle (e.g. for expiry of leaked reservations)
    # the split arrival passed to ``reserve`` is in the directory (False: none, or not allowed to write it)
    arrival_recorded: bool = field(default=False, compare=False)
    arrival_id: str = field(default="", compare=False)  # that arrival's id: ``release`` removes it


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """A prompt a node served recently, as the gateway recorded it: what a drain copies first.

    ``tokens`` are the prompt's token IDs over its full blocks, little-endian uint32 (prompts
    with a ``cache_salt`` are never recorded: their KV is their tenant's alone)."""

    model: str
    tokens: bytes
    at: float  # when it was last served (the recorder's clock, seconds)

    @property
    def token_count(self) -> int:
        return len(self.tokens) // 4


@runtime_checkable
class Directory(Protocol):
    """One async interface over the in-process, Redis and Redis Cluster backends.

    Semantics: an entry means "node N held block K in tier M"; entries of nodes
    whose heartbeat expired are never returned; lookups stop at the first missing block; writes
    are idempotent. Every method raises ``DirectoryUnavailable`` (and nothing else) when the
    backend is down.

    ``in_process``: True when operations never wait on I/O (the in-process backend), so callers
    need not guard them with a timeout (a guard costs ~5 µs a call on the request path).
    """

    in_process: bool

    async def register_node(self, node: NodeInfo) -> None: ...
    async def heartbeat(self, node_id: str) -> None: ...
    async def deregister_node(self, node_id: str) -> None: ...
    async def live_nodes(self) -> list[NodeInfo]: ...

    async def record_stored(self, node_id: str, keys: Sequence[BlockKey], tier: Tier = Tier.GPU) -> None: ...
    async def record_removed(self, node_id: str, keys: Sequence[BlockKey], tier: Tier | None = None) -> None: ...
    async def clear_node(self, node_id: str) -> None: ...

    # one KV-event bridge writes a node's entries at a time (several gateway replicas may follow
    # the same engine): it holds a lease, the others follow and take over when it lapses
    async def claim_writer(self, node_id: str, owner: str, ttl_s: float) -> WriterLease:
        """Take or renew the node's writer lease for ``ttl_s`` (falsy while another owner holds it)."""
        ...
    async def release_writer(self, node_id: str, owner: str) -> None: ...
    async def writer(self, node_id: str) -> str | None:
        """Who holds the node's writer lease now (None: no bridge writes its entries)."""
        ...
    async def clear_if_unwritten(self, node_id: str) -> bool:
        """Clear the node's entries if a bridge wrote them and none holds its writer lease now, in
        one step with that check (a bridge that has just taken the lease is never wiped); True if
        cleared. Whoever asks first after the lapse clears (and only once); entries no bridge ever
        wrote are left alone."""
        ...
    async def replace_node(self, node_id: str, blocks: Mapping[Tier, Sequence[BlockKey]]) -> None:
        """The node's entries become exactly ``blocks`` (per tier), in one step for lookups."""
        ...
    async def retire_node(self, node_id: str) -> None:
        """Stop returning the node at once but keep its entries for the retention: a bridge that
        lost its engine's socket brings them back whole by registering again."""
        ...

    async def lookup(self, keys: Sequence[BlockKey], session: str = "") -> DirectoryView:
        """Every live node's cached prefix of ``keys`` and its load; with ``session`` (an opaque
        key) also the node that session was last routed to, read in the same round trip."""
        ...

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
        """Count one request in flight on the node and ``prefill_tokens`` as its queued prefill.

        ``first_token_s``: the prefill stops counting that long from now (the request stays in
        flight), with no further call. ``hold_s``: the reservation ends by itself that long from
        now (default and ceiling: the backend's ``max_request_s``), for callers that never see
        the response end; ``release`` ends it earlier. ``if_inflight_at_most``: compare-and-reserve,
        raising ``ReservationConflict`` when the node has more in flight now. ``arrival``: the
        request is a split whose KV is on its way to this node; recorded in the same step (nothing
        if the reserve conflicts), returned in every lookup's ``NodeView.arrivals`` until its
        ``until_s``, at most ``MAX_ARRIVALS_PER_NODE`` per node, until a ``release`` (the split
        has answered) removes it. ``requests``: how many it counts in flight (a request generating
        n answers decodes n sequences in the node's batch), given back together.
        ``context_tokens``: the KV each of its decode steps reads (a request served whole on a
        decode node of a disaggregated fleet), added to the node's ``NodeView.answering_tokens``
        while the reservation lasts.
        """
        ...
    async def release(self, reservation: Reservation) -> None: ...
    async def loads(self) -> dict[str, NodeLoad]: ...

    async def session_node(self, session: str) -> str | None:
        """The node a conversation (``session``: an opaque key) was last routed to, if recorded
        less than its TTL ago."""
        ...
    async def record_session(self, session: str, node_id: str, ttl_s: float) -> None: ...

    # elastic fleets (gateway.drain): what a node served lately, and which nodes are draining
    async def record_hot(self, node_id: str, model: str, tokens: bytes, *, keep: int, ttl_s: float) -> None:
        """Note that the node just served this prompt; the node keeps its ``keep`` most recent."""
        ...
    async def hot_prefixes(self, node_id: str, limit: int) -> list[HotPrefix]:
        """The node's most recently served prompts, newest first."""
        ...
    async def set_draining(self, node_id: str, ttl_s: float) -> None:
        """Take no new requests to the node for ``ttl_s`` (0: it takes them again)."""
        ...
    async def draining(self) -> frozenset[str]: ...

    async def aclose(self) -> None: ...
