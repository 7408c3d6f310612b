"""How many answer tokens a request is assumed to generate, for the load it is charged.

A request's load is held for its estimated service (for ext_authz, which never sees the
response end, until that estimate runs out), and the estimate grows with the answer's token
budget. The budget is the client's to set, so it is never taken at face value: an engine stops
at the context length, so at most the context left after the prompt counts, and a configured
ceiling bounds it for everyone (``limits.max_answer_tokens``). Without the clamps twenty requests
asking for 10^12 tokens made a prefix owner look saturated for ten minutes.
"""

from __future__ import annotations


def answer_budget(req: dict, prompt_tokens: int, *, context_tokens: int, ceiling: int, default: int) -> int:
    """The answer tokens to model for ``req``: its ``max_completion_tokens``/``max_tokens`` (else
    ``default``), at most the context left after ``prompt_tokens`` and at most ``ceiling``; >= 1."""
    budget = req.get("max_completion_tokens") or req.get("max_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        budget = default
    return max(1, min(budget, context_tokens - prompt_tokens, ceiling))
