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

from directory_client.types import Directory, DirectoryUnavailable
from gateway import metrics
from gateway.types import RoutingRequest

HOT_KEEP = 128  # prompts remembered per node
HOT_TTL_S = 3600.0  # a node that served nothing for this long has nothing hot
DRAINING_REFRESH_S = 1.0


def hot_tokens(request: RoutingRequest, token_ids: np.ndarray) -> bytes | None:
    """The bytes recorded for a routed prompt: its full blocks' token IDs, little-endian uint32.

    None for a prompt with a ``cache_salt`` (its KV is its tenant's and a drain cannot rebuild
    the salted hashes) or shorter than a block (nothing worth copying).
    """
    if request.salted or request.total_blocks <= 0:
        return None
    return np.ascontiguousarray(token_ids[: request.total_blocks * request.block_size], dtype="<u4").tobytes()


class HotRecorder:
    """Records each routed prompt on its node, off the request path, at most ``max_pending`` at once."""

    def __init__(self, directory: Directory, *, keep: int = HOT_KEEP, ttl_s: float = HOT_TTL_S, max_pending: int = 64) -> None:
        self.directory = directory
        self.keep = keep
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self._tasks: set[asyncio.Task] = set()

    def record(self, node_id: str, model: str, tokens: bytes | None) -> None:
        if tokens is None or len(self._tasks) >= self.max_pending:
            return  # a slow directory drops hot-prefix notes, never delays requests

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
