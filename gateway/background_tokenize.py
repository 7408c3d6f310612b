"""Whole-prompt tokenization after a head decision: off the request path, bounded, counted.

A long fresh prompt is routed on its head (``RoutingCore._route_by_head``); its whole text is
tokenized afterwards only so that the conversation's next turn finds it in the segment cache.
That work is optional and must never delay a request, so it runs in one worker of its own at the
lowest CPU priority (a process in Linux's idle scheduling class, a thread at nice 19) — never on
the event loop nor on the executor the request path's own long encodes use — and at most
``max_pending`` prompts wait or run. A prompt arriving when that many are pending is dropped and
counted (``kvgate_background_tokenize_total{outcome}``): its next turn is tokenized on the request
path, as if this cache fill did not exist.

``worker="process"`` (default) encodes in a child process that loads the same ``tokenizer.json``
and sends the token IDs back; the event loop only puts them in the cache. ``"thread"`` encodes in
one thread of this process: no second copy of the tokenizer (~230 MB), but converting the IDs to
arrays holds the GIL the loop needs, and ``tokenizers`` may run the encode on its own thread pool,
which the thread's priority does not reach. ``kvgate bench overhead --prompt-tokens
--background-worker`` measures both (see ``README.md``).

The worker process is also held stopped while requests are in flight (``gateway.worker_pause``;
``RoutingCore.route`` runs inside ``busy()``): even in the idle class its encoding raised other
requests' p99 by several ms on a 2-vCPU virtual machine. It encodes when the gateway is idle; a
gateway never idle for ``resume_after_s`` keeps the queued prompts waiting and drops (and counts)
the ones beyond ``max_pending``, as above. A thread cannot be stopped: ``"thread"`` does not pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import threading
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Literal

import numpy as np

from gateway import metrics
from gateway.worker_pause import CAN_PAUSE, WorkerPause
from tokenizer import PreparedPrompt, PromptTokenizer

log = logging.getLogger("kvgate.background_tokenize")
Worker = Literal["process", "thread"]
NICE = 19  # runs only on CPU that nothing else of the same user wants

_child_tokenizer: PromptTokenizer | None = None  # in the worker process only


def _lower_priority(*, idle: bool = False) -> None:
    """Nice the calling thread to 19 (Linux: each thread has its own nice value and policy, and
    threads it starts inherit them); ``idle``: put it in the idle scheduling class as well.

    Nice 19 alone still takes 15/36 of the CPU a nice-15 thread gets (a kvgate run under ``nice``
    meets it nearly as an equal), and a thread of the event loop or Envoy waking on its core waits
    out the scheduler's wakeup granularity. ``SCHED_IDLE`` (no privilege needed) is preempted as
    soon as any normal thread wants the core — so only the worker *process* uses it: a thread of
    this process may be preempted holding the GIL, and on a saturated machine an idle-class thread
    may not run again for long, with the event loop waiting for the GIL meanwhile.
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
    except (AttributeError, OSError):  # no per-thread priority here: run at the normal one
        pass
    if idle:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):  # not Linux: nice 19 is what there is
            pass


def _die_with_parent(parent: int) -> bool:
    """Linux: be killed when the process that started this one ends — even while stopped by
    ``WorkerPause``, when a closing pipe would not reach it (nothing would ever continue it).
    False where that cannot be asked for: such a worker is never stopped."""
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL)) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() != parent:  # the parent ended before the request took hold
        os._exit(0)
    return True


def _start_child(source: str, parent: int, pausable: ctypes.c_byte) -> None:
    global _child_tokenizer
    if _die_with_parent(parent):
        pausable.value = 1  # from now on the parent may stop this process
    _lower_priority(idle=True)
    # encode on this niced thread, not on a pool of tokenizers' own (created at normal priority)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _child_tokenizer = PromptTokenizer(source, cache_bytes=0)


def _encode_in_child(texts: list[str]) -> list[np.ndarray]:
    assert _child_tokenizer is not None
    return _child_tokenizer.encode_pieces_uncached(texts)


class BackgroundTokenizer:
    """Fills ``tokenizer``'s cache with prompts' missing pieces, at most ``max_pending`` at a time."""

    def __init__(
        self, tokenizer: PromptTokenizer, *, worker: Worker = "process", max_pending: int = 4,
        pause_while_busy: bool = True, resume_after_s: float = 0.02,
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.tokenizer = tokenizer
        self.worker = worker
        self.max_pending = max_pending
        self.pause_while_busy = pause_while_busy and CAN_PAUSE
        self.pause = WorkerPause(resume_after_s, has_work=lambda: self._pending > 0)
        self._pending = 0
        self._executor: Executor | None = None  # started on first use
        self._pausable: ctypes.c_byte | None = None  # the worker process's flag: set once it dies with this process

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """A request is in flight for the block's duration: the worker process is held stopped."""
        return self.pause.request() if self.pause_while_busy else contextlib.nullcontext()

    def submit(self, prepared: PreparedPrompt) -> bool:
        """Queue the prompt's missing pieces; False if the queue was full (dropped, counted)."""
        texts = self.tokenizer.missing_pieces(prepared)
        if not texts:
            return True
        if self._pending >= self.max_pending:
            metrics.BACKGROUND_TOKENIZE.labels("dropped").inc()
            return False
        loop = asyncio.get_running_loop()
        try:
            future = self._start().submit(self._encode_fn(), texts)
        except Exception as e:  # no worker process can start here: the request is answered anyway
            metrics.BACKGROUND_TOKENIZE.labels("failed").inc()
            self.close()
            if self.worker == "process":
                log.warning("no background tokenization process could start (%s); using a thread instead", e)
                self.worker = "thread"
            return False
        self._pending += 1
        if self.pause_while_busy and self._pausable is not None:
            flag = self._pausable
            for pid in getattr(self._executor, "_processes", None) or ():  # spawned by its first submit
                self.pause.watch(pid, ready=lambda: flag.value == 1)
        metrics.BACKGROUND_TOKENIZE.labels("queued").inc()
        metrics.BACKGROUND_TOKENIZE_PENDING.inc()
        future.add_done_callback(lambda f: _call_soon(loop, self._finish, texts, f))
        return True

    def close(self) -> None:
        """Stop the worker; what is still queued is dropped (it was only a cache fill)."""
        self.pause.release()  # a stopped worker would never read the executor's request to exit
        self._pausable = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _start(self) -> Executor:
        if self._executor is None:
            if self.worker == "process":
                spawn = multiprocessing.get_context("spawn")  # never fork a process running gRPC
                self._pausable = spawn.RawValue("b", 0)  # no lock: the worker may be stopped at any instruction
                self._executor = ProcessPoolExecutor(
                    1, mp_context=spawn, initializer=_start_child,
                    initargs=(str(self.tokenizer.source_path), os.getpid(), self._pausable),
                )
            else:
                self._executor = ThreadPoolExecutor(1, "kvgate-background-tokenize", initializer=_lower_priority)
        return self._executor

    def _encode_fn(self):
        return _encode_in_child if self.worker == "process" else self.tokenizer.encode_pieces_uncached

    def _finish(self, texts: list[str], future: Future) -> None:
        """On the event loop: cache what came back, count the outcome."""
        self._pending -= 1
        metrics.BACKGROUND_TOKENIZE_PENDING.dec()
        if future.cancelled():
            metrics.BACKGROUND_TOKENIZE.labels("failed").inc()
            return
        error = future.exception()
        if error is not None:
            metrics.BACKGROUND_TOKENIZE.labels("failed").inc()
            log.warning("background tokenization failed: %s", error)  # e.g. a lone surrogate, a dead worker
            if self._executor is not None and getattr(self._executor, "_broken", False):
                self.close()  # a dead worker process: the next prompt starts a new one
            return
        self.tokenizer.remember(texts, future.result())
        metrics.BACKGROUND_TOKENIZE.labels("done").inc()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed meanwhile (shutdown): nothing left to fill
        pass
