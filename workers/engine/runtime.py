"""The real-time driver: runs the pure scheduler on the event loop, one step after another.

A step's modelled duration is slept (times ``time_scale``) between ``schedule`` and
``complete``. Sleeps on a loop are coarse (~1 ms), so the driver keeps a deadline and sleeps to
it: short steps are bunched but the engine's rate stays right on average. When the process falls
behind by more than ``MAX_DEBT_S`` (the machine is busy) the debt is forgiven instead of being
paid back in a burst: the engine then runs slower than scaled real time, which is honest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from workers.engine.kv_cache import CacheEvent
from workers.engine.metrics import EngineMetrics
from workers.engine.scheduler import Scheduler, SimRequest

log = logging.getLogger(__name__)

MAX_DEBT_S = 0.05


class EngineFailed(RuntimeError):
    """The engine loop died; requests in flight cannot complete."""


class RequestStream:
    """What an HTTP handler waits on: how many tokens are out so far, and whether it is over.

    Updates are coalesced: a handler that wakes late sees the latest count, not every step.
    """

    __slots__ = ("request", "generated", "finished", "error", "arrival_wall", "first_token_wall", "_changed")

    def __init__(self, request: SimRequest, arrival_wall: float) -> None:
        self.request = request
        self.generated = 0
        self.finished = False
        self.error: BaseException | None = None
        self.arrival_wall = arrival_wall
        self.first_token_wall: float | None = None
        self._changed = asyncio.Event()

    def _update(self, generated: int, finished: bool, wall: float) -> None:
        if self.first_token_wall is None and generated > 0:
            self.first_token_wall = wall
        self.generated = generated
        self.finished = self.finished or finished
        self._changed.set()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.finished = True
        self._changed.set()

    async def wait_change(self) -> None:
        """Return once there is news since the last call (raises if the engine died)."""
        await self._changed.wait()
        self._changed.clear()
        if self.error is not None:
            raise EngineFailed(str(self.error)) from self.error


class EngineRuntime:
    """Owns the scheduler's loop, the request streams and event publishing."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        time_scale: float,
        metrics: EngineMetrics | None = None,
        publish: Callable[[Sequence[CacheEvent]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.scheduler = scheduler
        self.time_scale = time_scale
        self.metrics = metrics
        self._publish = publish
        self._clock = clock
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None
        # Blocks a pull committed for a request, pinned until the scheduler admits it (and pins
        # them itself): a pulled prefix must not be evicted while its request waits in the queue.
        self._held_for: dict[str, tuple[SimRequest, list[int]]] = {}

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, request: SimRequest, *, arrival_wall: float | None = None) -> RequestStream:
        """Queue a request; ``arrival_wall`` (default now) is when its client asked (TTFT starts there)."""
        if self.failure is not None:
            raise EngineFailed(f"engine loop died: {self.failure!r}")
        stream = RequestStream(request, self._clock() if arrival_wall is None else arrival_wall)
        self.scheduler.add(request)
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """The client is gone: free the request's slot and blocks."""
        self._streams.pop(request_id, None)
        self.scheduler.abort(request_id, self._clock())
        self._release_admitted()

    def hold_until_admitted(self, request: SimRequest, hashes: list[int]) -> None:
        """``hashes`` are pinned for ``request`` (already submitted); unpin once it is admitted or ends."""
        if hashes:
            self._held_for[request.request_id] = (request, hashes)
            self._release_admitted()

    def _release_admitted(self) -> None:
        if not self._held_for:
            return
        now = self._clock()
        for rid in [rid for rid, (r, _) in self._held_for.items() if r.cached_tokens >= 0 or r.finished]:
            _, hashes = self._held_for.pop(rid)
            self.scheduler.cache.unpin(hashes, now)

    def flush_events(self) -> None:
        """Publish the cache's pending events now (a pull changed the cache between steps)."""
        self._emit(self.scheduler.cache.drain_events())

    def now(self) -> float:
        return self._clock()

    def reset_cache(self) -> int:
        """Drop every cached block and publish AllBlocksCleared; raises ``CacheBusy`` while busy."""
        n = self.scheduler.cache.clear()
        self._emit(self.scheduler.cache.drain_events())
        return n

    @property
    def inflight(self) -> int:
        """Requests submitted and not yet finished (waiting or running)."""
        return len(self._streams)

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work()

    def _emit(self, events: Sequence[CacheEvent]) -> None:
        if events and self._publish is not None:
            self._publish(events)

    async def _run(self) -> None:
        s = self.scheduler
        clock = self._clock
        deadline = 0.0
        try:
            while True:
                step = s.schedule(clock()) if s.has_work() else None
                if step is None:
                    self._emit(s.cache.drain_events())
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                now = clock()
                if now - deadline > MAX_DEBT_S:
                    deadline = now
                deadline += step.duration_s * self.time_scale
                delay = deadline - clock()
                await asyncio.sleep(delay if delay > 0 else 0)
                end = clock()
                result = s.complete(step, end)
                self._emit(result.events)
                self._release_admitted()
                for out in result.outputs:
                    stream = self._streams.get(out.request.request_id)
                    if stream is not None:
                        stream._update(out.generated, out.finished, end)
                for r in result.finished:
                    stream = self._streams.pop(r.request_id, None)
                    if stream is None:
                        continue
                    stream._update(stream.generated, True, end)
                    if self.metrics is not None and not r.aborted:
                        if stream.first_token_wall is not None:
                            self.metrics.ttft.observe(stream.first_token_wall - stream.arrival_wall)
                        self.metrics.e2e.observe(end - stream.arrival_wall)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in the model: fail every waiting request loudly
            log.exception("engine loop died")
            self.failure = exc
            for stream in self._streams.values():
                stream._fail(exc)
            self._streams.clear()
            raise
