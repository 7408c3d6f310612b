"""What a workload is: sessions that start at fixed times and ask one or more requests in turn.

A session is stateless and deterministic: ``request(turn, replies)`` builds turn ``turn`` from the
replies the earlier turns actually got (a multi-turn chat appends the assistant's real answer), so
the replay client and the simulator can drive the same session and a run can be repeated.
Arrivals are open-loop across sessions (each starts at ``start_s`` whatever the fleet does) and
closed within one (turn k+1 is sent ``think_s(k+1)`` after turn k's answer ended), which is how
people chat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: its path and body, plus what a report groups it by.

    ``prompt_ids`` is set for token-ID prompts: the client puts it in ``body["prompt"]`` as a list
    when it sends, the simulator uses the array directly (no JSON round trip of 100k ints).
    """

    session_id: str
    turn: int  # 1-based position in its session
    path: str
    body: dict[str, Any]
    prompt_ids: np.ndarray | None = field(default=None, compare=False)

    def wire_body(self) -> dict[str, Any]:
        """The body as sent on the wire (token IDs inlined)."""
        if self.prompt_ids is None:
            return self.body
        return {**self.body, "prompt": self.prompt_ids.tolist()}


class Session(Protocol):
    """One conversation (or one lone request)."""

    session_id: str
    start_s: float  # offset of the first request from the start of the run
    turns: int

    def request(self, turn: int, replies: Sequence[str]) -> RequestSpec:
        """Turn ``turn`` (1-based), given the reply texts of turns ``1 .. turn-1``."""
        ...

    def think_s(self, turn: int) -> float:
        """Pause between the end of turn ``turn-1`` and the start of turn ``turn`` (turn >= 2)."""
        ...


@dataclass(frozen=True)
class Workload:
    """Sessions sorted by start time, with a name and a one-line description for reports."""

    name: str
    description: str
    sessions: tuple[Session, ...]
    model: str
    token_id_prompts: bool = False  # prompts are token IDs (peers that take text only cannot run it)

    def __post_init__(self) -> None:
        starts = [s.start_s for s in self.sessions]
        if starts != sorted(starts):
            raise ValueError("sessions must be sorted by start time")

    @property
    def max_requests(self) -> int:
        return sum(s.turns for s in self.sessions)

    @property
    def span_s(self) -> float:
        """Time from the first session's start to the last one's (think times not included)."""
        return self.sessions[-1].start_s - self.sessions[0].start_s if self.sessions else 0.0


def poisson_starts(n: int, rate_per_s: float, rng: np.random.Generator) -> list[float]:
    """``n`` arrival times of a Poisson process of ``rate_per_s``, the first at 0."""
    if rate_per_s <= 0:
        raise ValueError("arrival rate must be positive")
    gaps = rng.exponential(1.0 / rate_per_s, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def stream_fields() -> dict[str, Any]:
    """What the client adds to every body: streaming with usage (TTFT = first chunk)."""
    return {"stream": True, "stream_options": {"include_usage": True}}
