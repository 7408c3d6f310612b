"""The whole-prompt tokenization that follows a head decision: bounded, counted, and never in the
way of other requests (the attack: 12 fresh ~400 kB prompts answered fast, then seconds of CPU
queued on the request path's executor; a normal request went 7 → 1,112 ms and failed open).

In process, with the real tokenizer, policy and in-process directory; both worker kinds."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from directory_client import InProcessDirectory, NodeInfo
from gateway.background_tokenize import BackgroundTokenizer
from gateway.core import RoutingCore, RoutingLimits
from gateway.metrics import REGISTRY
from gateway.policy import make_policy
from gateway.profile import load_profile
from tokenizer import PromptTokenizer

MODEL = "backlog-model"
CHAT = "/v1/chat/completions"
QUEUE = 3


def long_chat(n: int) -> dict:
    """A fresh ~400 kB chat (~100k tokens), distinct per ``n``."""
    doc = " ".join(f"Conv {n} entry {i} moves {i * 37 % 991} crates to dock {i % 9} at {i * 7 % 60} past." for i in range(5000))
    return {"model": MODEL, "messages": [{"role": "user", "content": doc}], "max_tokens": 8}


def normal_chat() -> dict:
    """~1.5k tokens never seen: below the head threshold, so tokenized whole on the request path,
    and long enough that its encode goes to the request path's executor."""
    doc = " ".join(f"Memo line {i} about harbour {i * 13 % 97}." for i in range(700))
    return {"model": MODEL, "messages": [{"role": "user", "content": doc[:7000]}], "max_tokens": 8}


def counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("kvgate_background_tokenize_total", {"outcome": outcome}) or 0.0


def cached(tok: PromptTokenizer, chat: dict) -> bool:
    """Whether this replica has the chat's whole text tokenized (its next turn would find it)."""
    return tok.tokenize_head(CHAT, chat, fresh_chars=8192) is None


@pytest.mark.parametrize("worker", ["process", "thread"])
async def test_a_backlog_of_fresh_prompts_is_bounded_counted_and_never_delays_a_request(worker: str) -> None:
    tok = PromptTokenizer()
    directory = InProcessDirectory(index_stride=1)
    for i in (1, 2):
        await directory.register_node(NodeInfo(f"n{i}", f"127.0.0.1:{9000 + i}"))
    background = BackgroundTokenizer(tok, worker=worker, max_pending=QUEUE)
    core = RoutingCore(
        tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
        RoutingLimits(models=frozenset([MODEL])), background=background,
    )
    chats = [long_chat(n) for n in range(12)]
    before = {o: counted(o) for o in ("queued", "dropped", "done")}
    # a process-wide gauge: an earlier test whose loop closed with prompts queued left them counted
    pending_before = REGISTRY.get_sample_value("kvgate_background_tokenize_pending") or 0
    try:
        # the attacker's burst: every one is answered on its head
        results = await asyncio.gather(*(core.route(CHAT, json.dumps(c).encode()) for c in chats))
        assert [r.kind for r in results] == ["routed"] * 12
        # a normal request right after it is routed, not failed open, and does not wait for the
        # backlog: when it is answered, none of the long prompts has been tokenized yet
        normal = await core.route(CHAT, json.dumps(normal_chat()).encode())
        assert normal.kind == "routed", normal.reason
        assert sum(cached(tok, c) for c in chats) == 0
        # what the operator sees: at most QUEUE accepted, the rest dropped and counted
        queued = counted("queued") - before["queued"]
        assert queued == QUEUE
        assert counted("dropped") - before["dropped"] == 12 - QUEUE
        deadline = time.monotonic() + 60
        while counted("done") - before["done"] < queued and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        # the accepted ones were tokenized in the background and their next turn finds them cached
        assert counted("done") - before["done"] == queued
        assert sum(cached(tok, c) for c in chats) == queued
        assert REGISTRY.get_sample_value("kvgate_background_tokenize_pending") == pending_before
        for r in (*results, normal):
            await core.release(r)
    finally:
        background.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling class")
@pytest.mark.parametrize("worker", ["process", "thread"])
async def test_the_background_worker_yields_the_cpu_to_everything_else(worker: str) -> None:
    """Nice 19 still takes a share of a core from a kvgate run under ``nice`` and waits out the
    scheduler's wakeup granularity: the worker process is in SCHED_IDLE, which any normal thread
    preempts at once. A worker thread only at nice 19: idle-class, it could be preempted holding
    the GIL the event loop needs and not run again while the machine is busy."""
    tok = PromptTokenizer()
    background = BackgroundTokenizer(tok, worker=worker, max_pending=1)
    done = counted("done")
    try:
        assert background.submit(tok.prepare(CHAT, long_chat(99)))
        deadline = time.monotonic() + 60
        while counted("done") == done and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert counted("done") == done + 1
        executor = background._executor
        if worker == "process":
            ids = list(executor._processes)  # type: ignore[union-attr]
        else:
            ids = [t.native_id for t in executor._threads]  # type: ignore[union-attr]
        assert ids
        for tid in ids:
            assert os.getpriority(os.PRIO_PROCESS, tid) == 19
            policy = os.SCHED_IDLE if worker == "process" else os.SCHED_OTHER
            assert os.sched_getscheduler(tid) == policy
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the event loop's own thread is untouched
    finally:
        background.close()
