"""Batched timers of the request path: callbacks run once, in order, never before their time,
late by less than the granularity, and many requests share one loop timer."""

from __future__ import annotations

import asyncio

import pytest

from gateway.deadlines import Deadlines


async def test_callbacks_run_in_due_order_within_the_granularity() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(granularity_s=0.01)
    ran: list[tuple[str, float]] = []
    start = loop.time()
    for name, delay in (("late", 0.05), ("early", 0.01), ("middle", 0.03), ("now", 0.0)):
        deadlines.call_later(delay, lambda name=name, delay=delay: ran.append((name, loop.time() - start - delay)))
    await asyncio.sleep(0.12)
    assert [name for name, _ in ran] == ["now", "early", "middle", "late"]
    # never before the time asked (allowing the loop's clock tick), and at most ~a granule after it
    assert all(-0.0015 <= lateness < 0.01 + 0.02 for _, lateness in ran), ran
    assert len(deadlines) == 0


async def test_a_cancelled_callback_never_runs_and_others_still_do() -> None:
    deadlines = Deadlines(granularity_s=0.005)
    ran: list[str] = []
    keep = deadlines.call_later(0.01, lambda: ran.append("keep"))
    drop = deadlines.call_later(0.01, lambda: ran.append("drop"))
    drop.cancel()
    await asyncio.sleep(0.05)
    assert ran == ["keep"] and not keep.cancelled


async def test_requests_due_close_together_share_one_loop_timer(monkeypatch) -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    real_call_at = loop.call_at
    def call_at(when, callback, *args, **kw):
        if callback == deadlines._fire:
            armed.append(when)
        return real_call_at(when, callback, *args, **kw)

    deadlines = Deadlines(granularity_s=0.02)
    monkeypatch.setattr(loop, "call_at", call_at)
    ran = []
    for i in range(50):  # 50 requests in the same 20 ms granule
        deadlines.call_later(0.001, lambda i=i: ran.append(i))
    await asyncio.sleep(0.06)
    assert ran == list(range(50))
    assert len(armed) == 1  # one wake-up for all of them


async def test_a_failing_callback_does_not_strand_the_rest() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        deadlines = Deadlines(granularity_s=0.005)
        ran: list[str] = []
        deadlines.call_later(0.0, lambda: 1 / 0)
        deadlines.call_later(0.0, lambda: ran.append("after"))
        await asyncio.sleep(0.03)
        assert ran == ["after"]
        assert isinstance(errors[0]["exception"], ZeroDivisionError)
    finally:
        loop.set_exception_handler(None)


def test_granularity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Deadlines(granularity_s=0)
