"""The background tokenizer's worker process is held stopped while requests are in flight and
continued once none are: even in the idle scheduling class its encoding raised other requests'
p99 on a 2-vCPU virtual machine. Stopping it must never cost a request anything, never outlive
the gateway (close, interpreter exit, a killed parent) and never lose the cache fill when idle.

In process, with the real tokenizer, policy and in-process directory; the worker's state read
from ``/proc`` (Linux)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from directory_client import InProcessDirectory, NodeInfo
from gateway.background_tokenize import BackgroundTokenizer
from gateway.core import RoutingCore, RoutingLimits
from gateway.metrics import REGISTRY
from gateway.policy import make_policy
from gateway.profile import load_profile
from tests.test_background_tokenize import CHAT, MODEL, cached, counted, long_chat, normal_chat
from tokenizer import PromptTokenizer

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def state(pid: int) -> str:
    """``T``: stopped; ``R``/``S``/``D``: running or waiting; ``Z``/``X`` or gone: ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


async def stops(pid: int) -> None:
    """A stop signal takes effect when the target next runs, not when ``kill`` returns."""
    await until(lambda: state(pid) == "T", f"worker {pid} stops")


def gone(pid: int) -> bool:
    return state(pid) in ("gone", "Z", "X")


async def until(condition, what: str, deadline_s: float = 60.0) -> None:
    """Wait for ``condition()`` (a deadline against hangs, not a speed claim)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


class GatedDirectory(InProcessDirectory):
    """A directory whose lookups wait for ``gate`` while it is closed: a request held in flight."""

    def __init__(self) -> None:
        super().__init__(index_stride=1)
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0

    async def lookup(self, keys, session: str = ""):
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        return await super().lookup(keys, session)


async def make_core(background: BackgroundTokenizer, tok: PromptTokenizer) -> tuple[RoutingCore, GatedDirectory]:
    directory = GatedDirectory()
    for i in (1, 2):
        await directory.register_node(NodeInfo(f"n{i}", f"127.0.0.1:{9100 + i}"))
    core = RoutingCore(
        tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
        RoutingLimits(models=frozenset([MODEL]), lookup_timeout_s=120.0), background=background,
    )
    return core, directory


def worker_pid(background: BackgroundTokenizer) -> int:
    pids = list(background._executor._processes)  # type: ignore[union-attr]
    assert len(pids) == 1
    return pids[0]


async def started(background: BackgroundTokenizer) -> int:
    """The worker's pid once it may be stopped: it has asked to die with its parent (until then a
    stopped worker could outlive a killed gateway, so it runs while it starts up)."""
    await until(lambda: background._pausable is not None and background._pausable.value == 1, "the worker starts")
    return worker_pid(background)


async def test_the_worker_is_stopped_while_a_request_is_in_flight_and_fills_the_cache_once_idle() -> None:
    tok = PromptTokenizer()
    background = BackgroundTokenizer(tok, max_pending=2, resume_after_s=0.01)
    core, directory = await make_core(background, tok)
    chat = long_chat(301)
    done = counted("done")
    try:
        directory.gate.clear()  # the long prompt's own request stays in flight
        first = asyncio.create_task(core.route(CHAT, json.dumps(chat).encode()))
        await until(lambda: directory.waiting == 1, "the long prompt reaches its lookup")
        directory.gate.set()
        assert (await first).kind == "routed"  # answered on its head, its whole text handed over
        pid = await started(background)

        directory.gate.clear()
        other = asyncio.create_task(core.route(CHAT, json.dumps(normal_chat()).encode()))
        await until(lambda: directory.waiting == 1, "another request is in flight")
        await stops(pid)  # stopped for as long as the request is in flight
        assert background.pause.stopped
        await asyncio.sleep(0.3)
        assert state(pid) == "T"  # the resume timer does not run while a request is in flight
        assert not cached(tok, chat)
        directory.gate.set()
        assert (await other).kind == "routed"

        # idle: continued, and the conversation's next turn finds the whole prompt cached
        await until(lambda: counted("done") > done, "the background fill completes once idle")
        assert cached(tok, chat)
        assert state(pid) != "T"
        assert not background.pause.stopped
    finally:
        directory.gate.set()
        background.close()


async def test_a_stopped_worker_never_blocks_a_request() -> None:
    """Prompts handed to a stopped worker wait in the executor's queues and pipes (hundreds of kB
    each, more than a pipe holds); requests go on being answered meanwhile."""
    tok = PromptTokenizer()
    background = BackgroundTokenizer(tok, max_pending=4, resume_after_s=0.01)
    core, directory = await make_core(background, tok)
    chats = [long_chat(310 + n) for n in range(6)]
    try:
        with background.busy():  # a request in flight throughout
            results = [await core.route(CHAT, json.dumps(chats[0]).encode())]
            pid = await started(background)
            for c in chats[1:]:  # each arrival stops the worker; the first finds it starting up
                results.append(await asyncio.wait_for(core.route(CHAT, json.dumps(c).encode()), 60))
            await stops(pid)
            normal = await asyncio.wait_for(core.route(CHAT, json.dumps(normal_chat()).encode()), 60)
            assert [r.kind for r in (*results, normal)] == ["routed"] * 7
            assert background._pending == 4  # held, not lost: the rest dropped and counted as before
            assert state(pid) == "T"
        await until(lambda: background._pending == 0, "the held prompts are encoded once idle")
        assert sum(cached(tok, c) for c in chats) == 4
    finally:
        background.close()


async def test_close_never_leaves_the_worker_stopped() -> None:
    tok = PromptTokenizer()
    background = BackgroundTokenizer(tok, max_pending=1)
    try:
        with background.busy():
            assert background.submit(tok.prepare(CHAT, long_chat(320)))
            pid = await started(background)
            with background.busy():  # another request arrives
                pass
            await stops(pid)
            background.close()  # shutting down while a request is still in flight
            assert state(pid) != "T"
            await until(lambda: gone(pid), "the worker exits after close")
        with background.busy():  # a request after close stops nothing (and starts nothing)
            assert not background.pause.stopped
    finally:
        background.close()


async def test_a_worker_killed_while_stopped_is_replaced_and_paused_in_turn() -> None:
    tok = PromptTokenizer()
    background = BackgroundTokenizer(tok, max_pending=1, resume_after_s=0.01)
    failed, done = counted("failed"), counted("done")
    try:
        with background.busy():
            assert background.submit(tok.prepare(CHAT, long_chat(330)))
            pid = await started(background)
            with background.busy():
                pass
            await stops(pid)
            os.kill(pid, signal.SIGKILL)
            await until(lambda: counted("failed") > failed, "the crash is counted")
            assert not background.pause.stopped  # nothing left to continue
            assert background.submit(tok.prepare(CHAT, long_chat(331)))  # a new worker
            new = await started(background)
            assert new != pid
            with background.busy():
                pass
            await stops(new)  # stopped too: a request is still in flight
        await until(lambda: counted("done") > done, "the new worker fills the cache once idle")
        assert cached(tok, long_chat(331))
    finally:
        background.close()


async def test_a_thread_worker_is_never_paused() -> None:
    tok = PromptTokenizer()
    background = BackgroundTokenizer(tok, worker="thread", max_pending=1)
    done = counted("done")
    try:
        with background.busy():
            assert background.submit(tok.prepare(CHAT, long_chat(340)))
            assert not background.pause.stopped
            await until(lambda: counted("done") > done, "a thread worker runs even with a request in flight")
    finally:
        background.close()


CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    from gateway.background_tokenize import BackgroundTokenizer
    from tests.test_background_tokenize import CHAT, long_chat
    from tokenizer import PromptTokenizer

    async def main(mode):
        tok = PromptTokenizer()
        background = BackgroundTokenizer(tok, max_pending=1, resume_after_s=3600)  # still stopped at the end
        with background.busy():
            background.submit(tok.prepare(CHAT, long_chat(350)))
            while background._pausable.value != 1:  # starting up: not stopped yet
                await asyncio.sleep(0.01)
            with background.busy():  # another request: stops it
                pass
            pid = list(background._executor._processes)[0]
            print(pid, flush=True)
            if mode == "hang":
                await asyncio.sleep(3600)  # killed by the test, the worker stopped

    if __name__ == "__main__":
        asyncio.run(main(sys.argv[1]))  # "exit": returns with the worker stopped, never closed
""")


def run_child(mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True, env=env)


async def test_an_interpreter_exiting_with_the_worker_stopped_does_not_hang() -> None:
    """``concurrent.futures`` joins its workers at exit; a stopped one would never answer."""
    proc = run_child("exit")
    try:
        pid = int(proc.stdout.readline())  # type: ignore[union-attr]
        await until(lambda: proc.poll() is not None, "the interpreter exits")
        assert proc.returncode == 0
        await until(lambda: gone(pid), "its worker ends with it")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_parent_killed_with_the_worker_stopped_takes_the_worker_with_it() -> None:
    """SIGKILL runs no exit hook and a stopped worker never reads its closed pipe: without the
    parent-death signal it would stay stopped (holding its tokenizer) forever."""
    proc = run_child("hang")
    try:
        pid = int(proc.stdout.readline())  # type: ignore[union-attr]
        await until(lambda: state(pid) == "T", "the worker is stopped")
        proc.kill()
        proc.wait()
        await until(lambda: gone(pid), "the stopped worker ends with its parent")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
