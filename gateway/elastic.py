"""What the request path does for an elastic fleet: remember what each node served lately (a drain
copies it first), and keep draining nodes out of new decisions.

Both stay off the request's latency: the hot-prefix write is a task the answer does not wait for,
and the draining set is read from the directory at most every ``refresh_s`` by a task while
decisions use the last answer. A directory that cannot answer costs a drain its freshest
figures, never a request (fail open: the last known set stays, and an error only counts).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from directory_client.hot import MAX_HOT_TOKENS
from directory_client.types import Directory, DirectoryUnavailable
from gateway import metrics
from gateway.types import RoutingRequest

HOT_KEEP = 128  # prompts remembered per node
HOT_TTL_S = 3600.0  # a node that served nothing for this long has nothing hot
DRAINING_REFRESH_S = 1.0
HOT_BYTES_PER_S = 1 << 20  # hot-prefix notes written per node and second, at most (the burst is the same)


class HotBudget:
    """Bounds the bytes of hot-prefix notes per node: a node serving many long prompts has its
    notes sampled (a drain copies the prompts it sees, most recent first) rather than writing
    every prompt to the directory (a 32k-token prompt is 128 KiB)."""

    def __init__(self, bytes_per_s: float = HOT_BYTES_PER_S) -> None:
        self.bytes_per_s = float(bytes_per_s)
        self._level: dict[str, tuple[float, float]] = {}  # node -> (bytes left, at)

    def allow(self, node_id: str, nbytes: int, now: float) -> bool:
        left, at = self._level.get(node_id, (self.bytes_per_s, now))
        left = min(self.bytes_per_s, left + self.bytes_per_s * max(now - at, 0.0))
        if nbytes > left:
            self._level[node_id] = (left, now)
            return False
        self._level[node_id] = (left - nbytes, now)
        return True


def hot_token_count(request: RoutingRequest) -> int:
    """How many tokens of a routed prompt a hot-prefix note keeps: its full blocks, at most
    ``MAX_HOT_TOKENS``; 0 for a prompt with a ``cache_salt`` (its KV is its tenant's and a drain
    cannot rebuild the salted hashes) or shorter than a block (nothing worth copying)."""
    if request.salted or request.total_blocks <= 0:
        return 0
    return min(request.total_blocks * request.block_size, MAX_HOT_TOKENS // request.block_size * request.block_size)


def hot_tokens(request: RoutingRequest, token_ids: np.ndarray) -> bytes | None:
    """The bytes recorded for a routed prompt (``hot_token_count`` tokens, little-endian uint32);
    None when nothing is worth recording."""
    n = hot_token_count(request)
    return np.ascontiguousarray(token_ids[:n], dtype="<u4").tobytes() if n else None


def budgeted_hot_tokens(
    budget: HotBudget, node_id: str, request: RoutingRequest, token_ids: np.ndarray, now: float
) -> bytes | None:
    """``hot_tokens`` when the node's note budget allows them, else None; the bytes are built only
    then (a skipped note costs the request path nothing but the check)."""
    n = hot_token_count(request)
    if not n:
        return None
    if not budget.allow(node_id, 4 * n, now):
        metrics.HOT_NOTES_SKIPPED.inc()
        return None
    return hot_tokens(request, token_ids)


class HotRecorder:
    """Records each routed prompt on its node, off the request path, at most ``max_pending`` at once."""

    def __init__(self, directory: Directory, *, keep: int = HOT_KEEP, ttl_s: float = HOT_TTL_S, max_pending: int = 64) -> None:
        self.directory = directory
        self.keep = keep
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self.budget = HotBudget()
        self._tasks: set[asyncio.Task] = set()

    def record(self, node_id: str, model: str, request: RoutingRequest, token_ids: np.ndarray) -> None:
        if len(self._tasks) >= self.max_pending:
            return  # a slow directory drops hot-prefix notes, never delays requests
        tokens = budgeted_hot_tokens(self.budget, node_id, request, token_ids, time.monotonic())
        if tokens is None:
            return

        async def write() -> None:
            try:
                await self.directory.record_hot(node_id, model, tokens, keep=self.keep, ttl_s=self.ttl_s)
            except DirectoryUnavailable:
                metrics.DIRECTORY_ERRORS.labels("record_hot").inc()

        task = asyncio.get_running_loop().create_task(write())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class DrainingNodes:
    """The directory's draining set as decisions see it: at most ``refresh_s`` old."""

    def __init__(
        self, directory: Directory, *, refresh_s: float = DRAINING_REFRESH_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.directory = directory
        self.refresh_s = refresh_s
        self.clock = clock
        self._nodes: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._task: asyncio.Task | None = None

    def current(self) -> frozenset[str]:
        """The last set read; starts a refresh when it is older than ``refresh_s``."""
        now = self.clock()
        if now - self._read_at >= self.refresh_s and self._task is None:
            self._read_at = now
            self._task = asyncio.get_running_loop().create_task(self._refresh())
        return self._nodes

    async def refresh(self) -> frozenset[str]:
        """Read the set now (a drain calls this right after marking its node)."""
        try:
            self._nodes = await self.directory.draining()
        except DirectoryUnavailable:
            metrics.DIRECTORY_ERRORS.labels("draining").inc()
        return self._nodes

    async def _refresh(self) -> None:
        try:
            await self.refresh()
        finally:
            self._task = None
