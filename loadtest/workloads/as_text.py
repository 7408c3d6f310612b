"""A token-ID stream workload (``memchat``, ``agentic``) sent as chat text, so a peer that routes on
text only (sglang-router answers token-ID prompts with 422) runs the same sessions as every policy.

Each token ID becomes one vocabulary word that the tokenizer encodes as exactly one token after a
space (every word is checked when the vocabulary is built), so ``n`` IDs are ``n`` tokens of text
and equal segments are equal text: sessions share exactly the prefixes they share as IDs. Turn
``k`` is sent to ``/v1/chat/completions`` as messages — the shared segments (a system prompt) as
the system message, then the session's own tokens of each turn as one user message (the task, then
each tool output or new question) — so the chat template puts its special tokens between them,
where a real conversation is cut, and where the gateway's tokenizer caches pieces. Each message
adds the template's few tokens (the shipped one: one a user message, plus BOS and the generation prompt), and a turn's generation
prompt is not part of the next turn's prefix, as in any chat. What differs from the ID version is
the work of text itself: every router and engine that reads the prompt has to tokenize it, which
is what serving text costs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.workloads.base import RequestSpec, Workload
from loadtest.workloads.memory_bound import SEGMENT_TOKENS, StreamSession, stream_tokens
from tokenizer import PromptTokenizer

CHAT_PATH = "/v1/chat/completions"
_WORD = re.compile(r"Ġ[a-z]{3,9}")  # byte-level BPE: Ġ is the leading space


def one_token_words(tokenizer: PromptTokenizer) -> tuple[str, ...]:
    """Lower-case words that encode, after a space, as exactly one token — in vocabulary order."""
    hf = tokenizer.hf_tokenizer
    candidates = sorted(t[1:] for t in hf.get_vocab() if _WORD.fullmatch(t))
    encoded = hf.encode_batch([" " + w for w in candidates], add_special_tokens=False)
    words = tuple(w for w, e in zip(candidates, encoded, strict=True) if len(e.ids) == 1)
    if len(words) < 1000:
        raise ValueError(f"the tokenizer has only {len(words)} one-token words: cannot render IDs as text")
    return words


@dataclass(frozen=True)
class TextSession:
    """A ``StreamSession`` whose turns are chat messages of one-token words."""

    inner: StreamSession
    words: tuple[str, ...]

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    @property
    def start_s(self) -> float:
        return self.inner.start_s

    @property
    def turns(self) -> int:
        return self.inner.turns

    def think_s(self, turn: int) -> float:
        return self.inner.think_s(turn)

    def _text(self, ids: np.ndarray) -> str:
        words = self.words
        n = len(words)
        return "".join([" " + words[i % n] for i in ids.tolist()])

    def request(self, turn: int, replies: Sequence[str]) -> RequestSpec:
        s = self.inner
        if not 1 <= turn <= s.turns:
            raise ValueError(f"turn {turn} out of 1..{s.turns}")
        ids = stream_tokens(s.segments, s.lengths[turn - 1])
        shared = min(s.shared_segments * SEGMENT_TOKENS, s.lengths[0])
        cuts = [shared, *s.lengths[:turn]]
        messages = [{"role": "system", "content": self._text(ids[:shared])}] if shared else []
        messages += [{"role": "user", "content": self._text(ids[a:b])} for a, b in zip(cuts, cuts[1:]) if b > a]
        body = {"model": s.model, "max_tokens": s.max_tokens, "ignore_eos": True, "messages": messages}
        return RequestSpec(s.session_id, turn, CHAT_PATH, body)


def as_text(workload: Workload, tokenizer: PromptTokenizer) -> Workload:
    """``workload`` (stream sessions of token IDs) with every prompt sent as chat text."""
    if not workload.token_id_prompts:
        return workload
    words = one_token_words(tokenizer)
    sessions = []
    for s in workload.sessions:
        if not isinstance(s, StreamSession):
            raise ValueError(f"{workload.name}: only stream workloads (memchat, agentic) can be sent as text")
        sessions.append(TextSession(s, words))
    return Workload(workload.name, workload.description + "; sent as chat text", tuple(sessions), workload.model)
