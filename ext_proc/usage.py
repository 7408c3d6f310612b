"""What the engine says it served from cache, read from the responses ext_proc sees.

vLLM (with ``--enable-prompt-tokens-details``) reports ``usage.prompt_tokens_details.cached_tokens``
at the **end** of every answer: the last object of a JSON body, the last ``data:`` chunk of a
stream that asked for ``stream_options.include_usage``. So the response body is never buffered:
each chunk passes through a window that keeps only its last ``TAIL_BYTES`` bytes, and the figures
are read from that tail when the answer ends. The keys are matched with their closing quotes, so
the same words inside generated text (escaped as ``\\"cached_tokens\\"``) never match; an answer
whose tail holds no usage (streams without ``include_usage``, errors) records nothing.

Reading bodies costs a gRPC message per response chunk (and Envoy waits for each answer), so
only a sample of requests is observed (``usage_sample``; see ``ExtProcService``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import metrics

if TYPE_CHECKING:
    from gateway.core import RouteResult

TAIL_BYTES = 4096  # vLLM's usage object is ~150 bytes; a stream's final chunks ~400

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int


class UsageTail:
    """The last ``TAIL_BYTES`` bytes of a response body, fed chunk by chunk."""

    __slots__ = ("_tail", "fed")

    def __init__(self) -> None:
        self._tail = b""
        self.fed = False  # some of the body was seen

    def feed(self, chunk: bytes) -> None:
        self.fed = True
        if len(chunk) >= TAIL_BYTES:
            self._tail = chunk[-TAIL_BYTES:]
        else:
            self._tail = (self._tail + chunk)[-TAIL_BYTES:]

    def usage(self) -> Usage | None:
        """The last usage the body reported, or None (no ``cached_tokens`` in its tail)."""
        cached = _last(_CACHED, self._tail)
        if cached is None:
            return None
        prompt = _last(_PROMPT, self._tail)
        return Usage(prompt_tokens=prompt or 0, cached_tokens=cached)


def _last(pattern: re.Pattern[bytes], text: bytes) -> int | None:
    match = None
    for match in pattern.finditer(text):
        pass
    return None if match is None else int(match.group(1))


def record_usage(result: RouteResult | None, tail: UsageTail) -> bool:
    """Count a routed answer's cached tokens beside kvgate's prediction for its node; False if
    it reported none (nothing is counted)."""
    if result is None or result.kind != "routed" or result.decision is None or result.decision.node is None:
        return False
    usage = tail.usage()
    if usage is None:
        metrics.USAGE_UNREAD.inc()
        return False
    metrics.CACHE_LOOP.observe(result.decision.node.node_id, result.decision.expected_cached_tokens, usage.cached_tokens)
    return True
