"""One measured request, the same shape whether it ran on real processes or in the simulator."""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.workloads.base import RequestSpec


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; ``sent_at`` is from the start of the run."""

    spec: RequestSpec
    sent_at: float
    ttft_s: float | None = None  # first streamed chunk (None: no token came back)
    e2e_s: float | None = None
    status: int = 0  # HTTP status (200 in the simulator)
    error: str | None = None
    node: str = ""  # x-kvgate-node of the answering engine
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prefix hit reported by the engine (local + pulled)
    pulled_tokens: int = 0  # of those, fetched from another node before prefill
    output_tokens: int = 0  # every answer's (``usage.completion_tokens``: n answers, n times one's)
    reply: str = ""
    seen_tokens: int = 0  # prefix an earlier request of the run had already sent (filled after the run)
    engine_ttft_s: float | None = None  # the engine's part of the TTFT (simulated engines' debug header)
    engine_inflight: int | None = None  # requests the engine held when this one arrived (same)
    split: bool = False  # prefilled on a prefill node, decoded here (disaggregated; its prompt's KV counts as pulled)

    @property
    def answers(self) -> int:
        """Answers the request asked for (``n``), decoded side by side."""
        n = self.spec.body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1

    @property
    def tpot_s(self) -> float | None:
        """Time per output token of an answer after its first (None with fewer than two tokens)."""
        per_answer = self.output_tokens // self.answers
        if self.ttft_s is None or self.e2e_s is None or per_answer < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (per_answer - 1)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def turn(self) -> int:
        return self.spec.turn
