"""Workloads whose working set outgrows the fleet's KV memory: where *which* prefixes a router
keeps, not only where it sends a request, decides the hit rate.

Both are token-ID prompts (no tokenizer, so a run of tens of thousands of long requests stays
cheap), built as *streams*: a session's text is a sequence of 512-token segments (shared ones
first, then its own), and turn ``k`` sends the stream's first ``lengths[k-1]`` tokens. Each turn's
prompt therefore extends the previous one token for token, and sessions sharing a segment share
its tokens, exactly as the engine's prefix cache sees a conversation or a common system prompt.
Every draw comes from ``seed``.

- ``memchat``: many long conversations alive at once. Each opens with a document, every turn adds
  a reply and a question, and people think for a long time between turns (exponential, mean
  ``think_mean_s``), some coming back only after several minutes (``revisit_frac`` of pauses,
  uniform in ``revisit_s``). Sized so the conversations alive together hold 2-4× a 16-node
  fleet's KV memory at the defaults (``live_tokens_peak`` in the description says how much).
- ``agentic``: agents running tool loops behind a few long system prompts, picked by Zipf
  popularity: one hot prompt shared by most agents, a tail of rare ones; each agent then takes
  many short steps (a tool's output and the next action) a few seconds apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.workloads.base import RequestSpec, Workload, poisson_starts

SEGMENT_TOKENS = 512
COMPLETIONS_PATH = "/v1/completions"
TOKEN_LOW, TOKEN_HIGH = 1_000, 100_000  # ordinary vocabulary ids
_OFFSETS = np.arange(SEGMENT_TOKENS, dtype=np.uint64)


def stream_tokens(segments: Sequence[int], n: int) -> np.ndarray:
    """The first ``n`` token IDs of a stream of segments: a splitmix64 hash of (segment, position),
    so equal segments give equal tokens wherever they appear."""
    need = -(-n // SEGMENT_TOKENS)
    segs = np.asarray(segments[:need], dtype=np.uint64)
    z = ((segs[:, None] << np.uint64(10)) + _OFFSETS).ravel()[:n] + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z % np.uint64(TOKEN_HIGH - TOKEN_LOW) + np.uint64(TOKEN_LOW)).astype(np.uint32)


@dataclass(frozen=True)
class StreamSession:
    """A session whose turn ``k`` is the first ``lengths[k-1]`` tokens of its segment stream."""

    session_id: str
    start_s: float
    segments: tuple[int, ...]  # shared segments first, then the session's own
    lengths: tuple[int, ...]  # prompt tokens of each turn, increasing
    pauses: tuple[float, ...]  # pauses[i] precedes turn i+2
    model: str
    max_tokens: int
    shared_segments: int = 0  # how many of ``segments`` other sessions share (a system prompt)
    answers: int = 1  # ``n`` of every turn: answers generated side by side

    @property
    def turns(self) -> int:
        return len(self.lengths)

    def request(self, turn: int, replies: Sequence[str]) -> RequestSpec:
        if not 1 <= turn <= self.turns:
            raise ValueError(f"turn {turn} out of 1..{self.turns}")
        ids = stream_tokens(self.segments, self.lengths[turn - 1])
        body: dict[str, object] = {"model": self.model, "max_tokens": self.max_tokens, "ignore_eos": True}
        if self.answers > 1:
            body["n"] = self.answers
        return RequestSpec(self.session_id, turn, COMPLETIONS_PATH, body, ids)

    def think_s(self, turn: int) -> float:
        return self.pauses[turn - 2]


class _Segments:
    """Hands out fresh segment ids."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


def _stream(shared: tuple[int, ...], lengths: list[int], ids: _Segments) -> tuple[int, ...]:
    own = max(-(-lengths[-1] // SEGMENT_TOKENS) - len(shared), 0)
    return shared + ids.take(own)


def live_tokens_peak(sessions: Sequence[StreamSession], *, turn_s: float = 1.0) -> int:
    """Most prompt tokens held by sessions alive at once (shared segments once), counting each
    turn as ``turn_s`` long: the KV memory the fleet needs to keep every live session cached."""
    events: list[tuple[float, int, StreamSession]] = []
    for s in sessions:
        end = s.start_s + sum(s.pauses) + s.turns * turn_s
        events += [(s.start_s, 1, s), (end, -1, s)]
    events.sort(key=lambda e: (e[0], e[1]))
    holders: dict[int, int] = {}  # segment -> live sessions holding it
    peak = 0
    for _, kind, s in events:
        for seg in s.segments[: -(-s.lengths[-1] // SEGMENT_TOKENS)]:
            count = holders.get(seg, 0) + kind
            if count:
                holders[seg] = count
            else:
                del holders[seg]
        peak = max(peak, len(holders))
    return peak * SEGMENT_TOKENS


def memchat_workload(
    *,
    conversations: int = 3000,
    rate_per_s: float = 2.0,
    turns: tuple[int, int] = (4, 12),
    doc_tokens: tuple[int, int] = (2000, 12000),
    turn_tokens: tuple[int, int] = (200, 800),
    system_tokens: int = 1024,
    think_mean_s: float = 60.0,
    revisit_frac: float = 0.2,
    revisit_s: tuple[float, float] = (180.0, 600.0),
    max_tokens: int = 256,
    model: str = "kvgate-sim",
    seed: int = 0,
) -> Workload:
    """Long conversations behind one common system prompt, many alive at once (module docstring)."""
    if conversations < 1 or not 1 <= turns[0] <= turns[1]:
        raise ValueError("need at least one conversation and 1 <= turns low <= high")
    if not 0 <= revisit_frac <= 1 or think_mean_s <= 0:
        raise ValueError("revisit_frac must be in [0, 1] and think_mean_s positive")
    rng = np.random.default_rng(seed)
    ids = _Segments()
    system = ids.take(-(-system_tokens // SEGMENT_TOKENS))
    starts = poisson_starts(conversations, rate_per_s, rng)
    sessions = []
    for c in range(conversations):
        n_turns = int(rng.integers(turns[0], turns[1] + 1))
        first = len(system) * SEGMENT_TOKENS + int(rng.integers(doc_tokens[0], doc_tokens[1] + 1))
        steps = rng.integers(turn_tokens[0], turn_tokens[1] + 1, size=n_turns - 1)
        lengths = [first, *(first + np.cumsum(steps)).tolist()]
        pauses = rng.exponential(think_mean_s, size=n_turns - 1)
        revisit = rng.random(n_turns - 1) < revisit_frac
        pauses[revisit] = rng.uniform(revisit_s[0], revisit_s[1], size=int(revisit.sum()))
        sessions.append(StreamSession(
            f"memchat-{c:05d}", starts[c], _stream(system, lengths, ids), tuple(int(x) for x in lengths),
            tuple(float(p) for p in pauses), model, max_tokens, len(system),
        ))
    peak = live_tokens_peak(sessions)
    desc = (
        f"{conversations} chats x {turns[0]}-{turns[1]} turns, {doc_tokens[0]}-{doc_tokens[1]}-token documents, "
        f"+{turn_tokens[0]}-{turn_tokens[1]} tokens a turn, {rate_per_s:g} new chats/s, think exp(mean "
        f"{think_mean_s:g} s), {revisit_frac:.0%} revisits after {revisit_s[0]:g}-{revisit_s[1]:g} s; "
        f"live_tokens_peak {peak:,}"
    )
    return Workload("memchat", desc, tuple(sessions), model, token_id_prompts=True)


def agentic_workload(
    *,
    agents: int = 2000,
    rate_per_s: float = 2.0,
    prompts: int = 8,
    zipf_s: float = 1.2,
    prompt_tokens: tuple[int, int] = (6000, 16000),
    task_tokens: tuple[int, int] = (200, 2000),
    steps: tuple[int, int] = (5, 20),
    step_tokens: tuple[int, int] = (50, 400),
    tool_s: tuple[float, float] = (0.5, 8.0),
    max_tokens: int = 128,
    model: str = "kvgate-sim",
    seed: int = 0,
) -> Workload:
    """Tool-loop agents behind ``prompts`` long system prompts of Zipf(``zipf_s``) popularity."""
    if agents < 1 or prompts < 1 or not 1 <= steps[0] <= steps[1]:
        raise ValueError("need at least one agent, one prompt, and 1 <= steps low <= high")
    rng = np.random.default_rng(seed)
    ids = _Segments()
    sizes = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=prompts)
    # a system prompt is whole segments, so the agents' own text starts on a segment of its own
    system = [ids.take(-(-int(n) // SEGMENT_TOKENS)) for n in sizes]
    weights = 1.0 / np.arange(1, prompts + 1) ** zipf_s
    picks = rng.choice(prompts, size=agents, p=weights / weights.sum())
    starts = poisson_starts(agents, rate_per_s, rng)
    sessions = []
    for a in range(agents):
        shared = system[int(picks[a])]
        n_steps = int(rng.integers(steps[0], steps[1] + 1))
        first = len(shared) * SEGMENT_TOKENS + int(rng.integers(task_tokens[0], task_tokens[1] + 1))
        grow = rng.integers(step_tokens[0], step_tokens[1] + 1, size=n_steps - 1)
        lengths = [first, *(first + np.cumsum(grow)).tolist()]
        pauses = rng.uniform(tool_s[0], tool_s[1], size=n_steps - 1)
        sessions.append(StreamSession(
            f"agent-{a:05d}", starts[a], _stream(shared, lengths, ids), tuple(int(x) for x in lengths),
            tuple(float(p) for p in pauses), model, max_tokens, len(shared),
        ))
    share = np.bincount(picks, minlength=prompts) / agents
    desc = (
        f"{agents} agents x {steps[0]}-{steps[1]} steps behind {prompts} system prompts of "
        f"{prompt_tokens[0]}-{prompt_tokens[1]} tokens (Zipf {zipf_s:g}: top prompt {share.max():.0%} of agents), "
        f"+{step_tokens[0]}-{step_tokens[1]} tokens a step, tools {tool_s[0]:g}-{tool_s[1]:g} s, "
        f"{rate_per_s:g} new agents/s; live_tokens_peak {live_tokens_peak(sessions):,}"
    )
    return Workload("agentic", desc, tuple(sessions), model, token_id_prompts=True)
