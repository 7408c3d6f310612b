"""What kvgate expects of a routed request, in the form clients, the decision log and traces share.

Two figures: the prompt tokens the chosen node is expected to serve from cache (held there, or
pulled before prefill) and the cost model's estimate of the time to first token there. They are
computed once, here, so the opt-in response headers (``prediction.response_headers``), the
decision log (``/debug/decisions``) and the decision's span always carry the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.core import RouteResult

EXPECTED_CACHED_TOKENS_HEADER = "x-kvgate-expected-cached-tokens"
ESTIMATED_TTFT_HEADER = "x-kvgate-estimated-ttft-ms"


@dataclass(frozen=True, slots=True)
class Prediction:
    expected_cached_tokens: int
    estimated_ttft_ms: int

    def headers(self) -> tuple[tuple[str, str], ...]:
        return (
            (EXPECTED_CACHED_TOKENS_HEADER, str(self.expected_cached_tokens)),
            (ESTIMATED_TTFT_HEADER, str(self.estimated_ttft_ms)),
        )


def predict(result: RouteResult) -> Prediction | None:
    """The figures of a routed request; None for one kvgate did not route (rejected, failed open)."""
    if result.kind != "routed" or result.decision is None:
        return None
    return Prediction(result.decision.expected_cached_tokens, round(result.ttft_s * 1000))
