"""The ``mixed`` workload: the traffic where disaggregated prefill/decode is supposed to pay.

Three kinds of session arrive together (open loop, Poisson), in proportions ``shares``:

- **documents**: one long uncached prompt (``doc_tokens``) asking a short answer (``doc_answer``):
  summaries, extraction. Their prefills are what stall the decodes of everyone on the node;
- **writers**: a short prompt (``gen_prompt``) asking a long answer (``gen_answer``): the decodes
  that suffer when a long prefill lands in their batch;
- **chats**: multi-turn conversations behind one shared system prompt, each turn extending the
  last one token for token (``chat_*``), people thinking ``chat_think_s`` between turns: the
  requests whose prefix is cached on the node that served them last, and which should stay whole.

A share of the sessions of every kind (``multi_share``, 10% by default) asks for several answers
at once on every turn (``n`` from ``multi_answers``: drafts to choose from, best-of-n sampling,
self-consistency votes): the engine computes the prompt once and decodes ``n`` sequences side by
side. Those draws come from a generator of their own, so ``multi_share=0`` gives the very
sessions of a workload without them.

Prompts are token-ID streams (``memory_bound.stream_tokens``): no tokenizer, the same sessions in
``simulate`` and ``replay``. Every draw comes from ``seed``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from loadtest.workloads.base import Workload, poisson_starts
from loadtest.workloads.memory_bound import SEGMENT_TOKENS, StreamSession, _Segments, _stream

KINDS = ("doc", "gen", "chat")


def mixed_workload(
    *,
    sessions: int = 400,
    rate_per_s: float = 6.0,
    shares: tuple[float, float, float] = (0.3, 0.4, 0.3),
    doc_tokens: tuple[int, int] = (8000, 24000),
    doc_answer: tuple[int, int] = (8, 64),
    gen_prompt: tuple[int, int] = (100, 600),
    gen_answer: tuple[int, int] = (400, 1500),
    chat_system_tokens: int = 1024,
    chat_turns: tuple[int, int] = (3, 6),
    chat_first: tuple[int, int] = (300, 2000),
    chat_turn_tokens: tuple[int, int] = (100, 500),
    chat_answer: tuple[int, int] = (100, 300),
    chat_think_s: tuple[float, float] = (1.0, 5.0),
    multi_share: float = 0.1,
    multi_answers: tuple[int, int] = (2, 4),
    model: str = "kvgate-sim",
    seed: int = 0,
) -> Workload:
    """Documents, writers and chats mixed (module docstring); ``sessions`` of them in all."""
    if sessions < 1 or rate_per_s <= 0:
        raise ValueError("need at least one session and a positive rate")
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError(f"shares are three non-negative weights (documents, writers, chats), got {shares!r}")
    for name, (low, high) in {"doc_tokens": doc_tokens, "doc_answer": doc_answer, "gen_prompt": gen_prompt,
                              "gen_answer": gen_answer, "chat_turns": chat_turns, "chat_first": chat_first,
                              "chat_turn_tokens": chat_turn_tokens, "chat_answer": chat_answer}.items():
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be 1 <= low <= high, got ({low}, {high})")
    if not 0 <= multi_share <= 1:
        raise ValueError(f"multi_share is a fraction of sessions in [0, 1], got {multi_share!r}")
    if not 2 <= multi_answers[0] <= multi_answers[1]:
        raise ValueError(f"multi_answers must be 2 <= low <= high, got {multi_answers!r}")
    rng = np.random.default_rng(seed)
    ids = _Segments()
    system = ids.take(-(-chat_system_tokens // SEGMENT_TOKENS))
    weights = np.asarray(shares, dtype=float)
    kinds = rng.choice(len(KINDS), size=sessions, p=weights / weights.sum())
    starts = poisson_starts(sessions, rate_per_s, rng)

    def draw(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    out = []
    for i, k in enumerate(kinds):
        kind = KINDS[int(k)]
        if kind == "chat":
            turns = draw(chat_turns)
            first = len(system) * SEGMENT_TOKENS + draw(chat_first)
            lengths = [first, *(first + np.cumsum(rng.integers(chat_turn_tokens[0], chat_turn_tokens[1] + 1, size=turns - 1))).tolist()]
            segments = _stream(system, lengths, ids)
            pauses = tuple(float(p) for p in rng.uniform(chat_think_s[0], chat_think_s[1], size=turns - 1))
            answer = draw(chat_answer)
        else:
            lengths = [draw(doc_tokens if kind == "doc" else gen_prompt)]
            segments = _stream((), lengths, ids)
            pauses = ()
            answer = draw(doc_answer if kind == "doc" else gen_answer)
        out.append(StreamSession(f"{kind}-{i:05d}", starts[i], segments, tuple(int(x) for x in lengths),
                                 pauses, model, answer))
    multi = np.random.default_rng([seed, 1])  # apart: the sessions above are the same without it
    asks = multi.random(sessions) < multi_share
    answers = multi.integers(multi_answers[0], multi_answers[1] + 1, size=sessions)
    out = [replace(s, answers=int(answers[i])) if asks[i] else s for i, s in enumerate(out)]
    counts = np.bincount(kinds, minlength=3)
    desc = (
        f"{sessions} sessions at {rate_per_s:g}/s: {counts[0]} documents of {doc_tokens[0]}-{doc_tokens[1]} tokens "
        f"answered in {doc_answer[0]}-{doc_answer[1]}, {counts[1]} writers of {gen_prompt[0]}-{gen_prompt[1]} tokens "
        f"answered in {gen_answer[0]}-{gen_answer[1]}, {counts[2]} chats of {chat_turns[0]}-{chat_turns[1]} turns "
        f"({chat_answer[0]}-{chat_answer[1]}-token answers, think {chat_think_s[0]:g}-{chat_think_s[1]:g} s)"
        + (f"; {int(asks.sum())} of them asking n={multi_answers[0]}-{multi_answers[1]} answers" if asks.any() else "")
    )
    return Workload("mixed", desc, tuple(out), model, token_id_prompts=True)
