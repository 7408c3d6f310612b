"""Synthetic multi-turn chat: each conversation opens with a long document, then asks in turns.

Turn 1 sends a system prompt, the document (4,000–8,000 tokens of generated prose, measured with
the real tokenizer) and a question. Every later turn appends the assistant's *actual* answer from
the previous response and a new question, after a think time: the prompt grows by a few hundred
tokens a turn, and everything before it is the previous turn's prompt plus reply — exactly the
traffic where the node holding that history answers in milliseconds and any other node has to
prefill the whole history again. Conversations arrive as a Poisson process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest.workloads.base import RequestSpec, Workload, poisson_starts
from loadtest.workloads.prose import ProseGenerator

SYSTEM_PROMPT = "You are a careful analyst. Answer questions about the document the user shares, citing figures."
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class ChatSession:
    """One conversation: a document, one question per turn, think times, reply budget."""

    session_id: str
    start_s: float
    document: str
    questions: tuple[str, ...]
    pauses: tuple[float, ...]  # pauses[i] precedes turn i+2
    model: str
    max_tokens: int

    @property
    def turns(self) -> int:
        return len(self.questions)

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
        if len(replies) < turn - 1:
            raise ValueError(f"turn {turn} needs the replies of the {turn - 1} turns before it")
        msgs = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{self.document}\n\n{self.questions[0]}"},
        ]
        for i in range(1, turn):
            msgs.append({"role": "assistant", "content": replies[i - 1]})
            msgs.append({"role": "user", "content": self.questions[i]})
        return msgs

    def request(self, turn: int, replies: Sequence[str]) -> RequestSpec:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(turn, replies),
            "max_tokens": self.max_tokens,
        }
        return RequestSpec(self.session_id, turn, CHAT_PATH, body)

    def think_s(self, turn: int) -> float:
        return self.pauses[turn - 2]


def chat_workload(
    *,
    conversations: int,
    turns: int,
    count_tokens: Callable[[str], int],
    model: str,
    rate_per_s: float = 1.0,
    doc_tokens: tuple[int, int] = (4000, 8000),
    think_s: tuple[float, float] = (1.0, 3.0),
    max_tokens: int = 96,
    seed: int = 0,
) -> Workload:
    """``conversations`` chats of ``turns`` turns, arriving at ``rate_per_s`` (Poisson).

    Document lengths are uniform in ``doc_tokens``, think times uniform in ``think_s``; every draw
    comes from ``seed``, so the same arguments give the same traffic.
    """
    if conversations < 1 or turns < 1:
        raise ValueError("need at least one conversation of at least one turn")
    lo, hi = doc_tokens
    if not 0 < lo <= hi:
        raise ValueError("doc_tokens must be (low, high) with 0 < low <= high")
    rng = np.random.default_rng(seed)
    starts = poisson_starts(conversations, rate_per_s, rng)
    sessions = []
    for c in range(conversations):
        gen = ProseGenerator(seed * 1_000_003 + c)
        target = int(rng.integers(lo, hi + 1))
        doc = gen.document(target, count_tokens)
        questions = tuple(gen.question() for _ in range(turns))
        pauses = tuple(float(x) for x in rng.uniform(think_s[0], think_s[1], size=max(turns - 1, 0)))
        sessions.append(ChatSession(f"chat-{c:04d}", starts[c], doc, questions, pauses, model, max_tokens))
    desc = (
        f"{conversations} chats x {turns} turns, {lo}-{hi}-token documents, "
        f"{rate_per_s:g} new chats/s, think {think_s[0]:g}-{think_s[1]:g} s, max_tokens {max_tokens}"
    )
    return Workload("chat", desc, tuple(sessions), model)
