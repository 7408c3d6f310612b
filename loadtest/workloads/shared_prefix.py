"""Shared-prefix groups: G groups of P prompts, each group behind one long common system prompt.

The shape of multi-tenant serving (llm-d's "KV-cache wins" runs: many tenants, each with a
several-thousand-token system prompt): requests of one group share everything but a short
question, so one node holding the group's prefix serves them all from cache — until the group is
hot enough that its owner saturates, which is where a cost model has to spread it. Requests of
all groups are shuffled together and arrive as one Poisson process; each is a one-turn session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.workloads.base import RequestSpec, Workload, poisson_starts
from loadtest.workloads.chat import CHAT_PATH
from loadtest.workloads.prose import ProseGenerator


@dataclass(frozen=True)
class PromptSession:
    """One request: the group's system prompt and this prompt's own question."""

    session_id: str
    start_s: float
    group: int
    system: str
    question: str
    model: str
    max_tokens: int
    turns: int = 1

    def request(self, turn: int, replies: Sequence[str]) -> RequestSpec:
        if turn != 1:
            raise ValueError("a shared-prefix prompt has one turn")
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": self.system}, {"role": "user", "content": self.question}],
            "max_tokens": self.max_tokens,
        }
        return RequestSpec(self.session_id, 1, CHAT_PATH, body)

    def think_s(self, turn: int) -> float:
        raise ValueError("a shared-prefix prompt has one turn")


def shared_prefix_workload(
    *,
    groups: int,
    prompts_per_group: int,
    count_tokens: Callable[[str], int],
    model: str,
    prefix_tokens: int = 6000,
    rate_per_s: float = 4.0,
    max_tokens: int = 64,
    seed: int = 0,
) -> Workload:
    """``groups`` x ``prompts_per_group`` one-turn requests over per-group prefixes of ``prefix_tokens``."""
    if groups < 1 or prompts_per_group < 1:
        raise ValueError("need at least one group with at least one prompt")
    rng = np.random.default_rng(seed)
    systems = [
        "You are the assistant of tenant "
        f"{g}. Policy handbook follows.\n\n" + ProseGenerator(seed * 7919 + g).document(prefix_tokens, count_tokens)
        for g in range(groups)
    ]
    order = [(g, p) for g in range(groups) for p in range(prompts_per_group)]
    perm = rng.permutation(len(order))
    starts = poisson_starts(len(order), rate_per_s, rng)
    sessions = []
    for i, j in enumerate(perm):
        g, p = order[int(j)]
        ask = ProseGenerator(seed * 104_729 + g * 1009 + p)
        question = f"Ticket {g}-{p}: {ask.sentence()} {ask.question()}"
        sessions.append(PromptSession(f"g{g:03d}-p{p:04d}", starts[i], g, systems[g], question, model, max_tokens))
    desc = (
        f"{groups} groups x {prompts_per_group} prompts over {prefix_tokens}-token shared prefixes, "
        f"{rate_per_s:g} req/s, max_tokens {max_tokens}"
    )
    return Workload("shared_prefix", desc, tuple(sessions), model)
