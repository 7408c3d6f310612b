"""Hold a helper process stopped while requests are in flight, continue it once they are not.

The background tokenizer's worker process runs in Linux's idle scheduling class, yet while it
encodes (a core's worth for a second or more per long prompt) other requests' p99 rose by a few ms
on a 2-vCPU virtual machine. The idle class yields the CPU, not the cache and memory bandwidth both
vCPUs share: an idle-class process streaming memory or encoding on the other vCPU raised 1k chats'
p99 by ~1–2 ms with nothing else running, a pure spin loop less. So the worker is stopped
(``SIGSTOP``) from the moment a request reaches the routing core and continued (``SIGCONT``) only
once no request has been in flight for ``resume_after_s`` — long enough to cover a request's way on
through Envoy after its decision and the next one's arrival. A stopped worker blocks nothing on the
request path: work handed to it waits in the executor's queues and pipes, whose feeding threads are
not the event loop; its results come back when it runs again.

Why signals, not a flag the worker polls: the encode is one call into ``tokenizers`` (Rust) that
cannot be interrupted from Python; stopping it is the only way to pause mid-prompt.

Never left stopped: ``release`` continues it (called before its executor shuts down, whose joining
would otherwise wait forever on a stopped child), and so does the interpreter's exit (registered to
run before ``concurrent.futures`` joins its workers). A parent killed outright runs neither: a
process is stopped only once ``ready()`` says it will die with its parent (the background worker
sets Linux's parent-death signal first thing). Signals go through a pidfd where there is one, so
a pid reused after the worker died is never signalled.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CAN_PAUSE = hasattr(signal, "SIGSTOP") and hasattr(signal, "SIGCONT")
_live: weakref.WeakSet[WorkerPause] = weakref.WeakSet()


@dataclass(slots=True)
class _Target:
    pidfd: int | None  # None: signalled by pid (no pidfd here)
    ready: Callable[[], bool]  # stopping it is safe (it dies with its parent from then on)
    stopped: bool = False


class WorkerPause:
    """Stops the watched processes while ``request()`` blocks are open and ``has_work()`` says
    they have something to do; continues them ``resume_after_s`` after the last block closed.
    Call from one event loop's thread only."""

    def __init__(self, resume_after_s: float, has_work: Callable[[], bool] = lambda: True) -> None:
        if resume_after_s < 0:
            raise ValueError("resume_after_s must be >= 0")
        self.resume_after_s = resume_after_s
        self.has_work = has_work
        self._targets: dict[int, _Target] = {}
        self._in_flight = 0
        self._timer: asyncio.TimerHandle | None = None
        _live.add(self)

    @property
    def stopped(self) -> bool:
        return any(t.stopped for t in self._targets.values())

    def watch(self, pid: int, ready: Callable[[], bool]) -> None:
        """Take this process in hand (a new worker), stoppable once ``ready()``: until then it may
        not outlive its parent if stopped, and runs (it is starting up) even with requests in flight."""
        if pid not in self._targets:
            try:
                fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
            except OSError:  # already gone: its executor reports it broken
                return
            self._targets[pid] = _Target(fd, ready)
        self.poke()

    def poke(self) -> None:
        """Work was handed over, or a request arrived: stop what can be, if a request is in flight."""
        if self._in_flight and self.has_work():
            for pid, target in list(self._targets.items()):
                if not target.stopped and target.ready():
                    target.stopped = self._signal(pid, signal.SIGSTOP)

    @contextmanager
    def request(self) -> Iterator[None]:
        """One request in flight for the block's duration."""
        self._in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            if self._targets:
                self.poke()
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight and self.stopped:
                self._schedule_resume()

    def release(self) -> None:
        """Continue the processes and forget them (their executor is shutting down)."""
        self._resume()
        for target in self._targets.values():
            if target.pidfd is not None:
                os.close(target.pidfd)
        self._targets.clear()

    def _schedule_resume(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to wait on: continue now rather than risk staying stopped
            self._resume()
            return
        self._timer = loop.call_later(self.resume_after_s, self._resume_if_idle)

    def _resume_if_idle(self) -> None:
        self._timer = None
        if not self._in_flight:
            self._resume()

    def _resume(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for pid, target in list(self._targets.items()):
            if target.stopped:
                self._signal(pid, signal.SIGCONT)
                target.stopped = False

    def _signal(self, pid: int, sig: int) -> bool:
        """Whether it was sent; a process that ended is forgotten (its executor reports it)."""
        target = self._targets[pid]
        try:
            if target.pidfd is not None:
                signal.pidfd_send_signal(target.pidfd, sig)
            else:
                os.kill(pid, sig)
            return True
        except ProcessLookupError:
            if target.pidfd is not None:
                os.close(target.pidfd)
            del self._targets[pid]
        except OSError:
            pass
        return False


def _continue_all() -> None:
    for pause in list(_live):
        pause.release()


# run before concurrent.futures joins its workers at exit (that list runs last-registered first)
if hasattr(threading, "_register_atexit"):
    import concurrent.futures.process  # noqa: F401  (registers its own exit hook first)

    threading._register_atexit(_continue_all)  # type: ignore[attr-defined]
