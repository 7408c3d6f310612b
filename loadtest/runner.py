"""Drive a workload against one URL: sessions start on schedule, turns follow their answers.

Open loop across sessions (a slow fleet does not slow the arrivals down), closed within one.
Bounded twice: at most ``max_requests`` are sent, and none is sent after ``duration_s`` (requests
in flight then finish, each within ``timeout_s``). A rich progress bar counts finished requests.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.client import send
from loadtest.records import RequestRecord
from loadtest.workloads.base import Session, Workload


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    wall_s: float  # first send to last answer


class _Budget:
    """Shared request budget and send deadline."""

    def __init__(self, max_requests: int, deadline: float) -> None:
        self.left = max_requests
        self.deadline = deadline

    def take(self) -> bool:
        if self.left <= 0 or time.perf_counter() > self.deadline:
            return False
        self.left -= 1
        return True


async def _run_session(
    http: aiohttp.ClientSession,
    url: str,
    s: Session,
    t0: float,
    budget: _Budget,
    timeout_s: float,
    out: list[RequestRecord],
    on_done,  # type: ignore[no-untyped-def]
) -> None:
    delay = t0 + s.start_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    replies: list[str] = []
    for turn in range(1, s.turns + 1):
        if turn > 1:
            await asyncio.sleep(s.think_s(turn))
        if not budget.take():
            return
        spec = s.request(turn, replies)
        rec = await send(http, url, spec, sent_at=time.perf_counter() - t0, timeout_s=timeout_s)
        out.append(rec)
        on_done()
        if not rec.ok:
            return  # a conversation whose turn failed cannot continue with a real answer
        replies.append(rec.reply)


async def run_workload(
    workload: Workload,
    base_url: str,
    *,
    max_requests: int | None = None,
    duration_s: float = 600.0,
    timeout_s: float = 120.0,
    label: str = "",
    show_progress: bool = True,
) -> RunResult:
    """Replay ``workload`` against ``base_url`` (e.g. ``http://127.0.0.1:8080``)."""
    cap = workload.max_requests if max_requests is None else min(max_requests, workload.max_requests)
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    progress = Progress(
        TextColumn(f"[bold]{label or workload.name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        disable=not show_progress, transient=False,
    )
    task = progress.add_task("requests", total=cap)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        with progress:
            t0 = time.perf_counter()
            budget = _Budget(cap, t0 + duration_s)
            jobs = [
                _run_session(http, base_url, s, t0, budget, timeout_s, records, lambda: progress.advance(task))
                for s in workload.sessions
                if s.start_s <= duration_s
            ]
            await asyncio.gather(*jobs)
            wall = time.perf_counter() - t0
    records.sort(key=lambda r: r.sent_at)
    return RunResult(records, wall)
