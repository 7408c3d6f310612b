"""How long one engine step takes on the profiled hardware: the timing model, nothing else.

A step runs every scheduled token through the model once. Its cost has three parts:

* **one pass over the weights** — a floor of ``decode_step_base_s`` (memory-bound: even one token
  must read every weight), or the linear FLOPs of all tokens in the step at
  ``prefill_tokens_per_s`` when that is larger (compute-bound). Prefill chunks and decode tokens
  share that pass, so decodes piggy-backed on a prefill step are almost free, as on a GPU.
* **attention** — prefill costs ``prefill_attention_s_per_token2`` per (new token, context token)
  pair (causal: a chunk of ``n`` after ``c`` computed tokens has ``n·(c + n/2)`` pairs); decode
  costs ``decode_step_per_context_token_s`` per KV token read.
* **fixed costs** — ``prefill_overhead_s`` when the step has a prefill, and
  ``decode_step_per_seq_s`` per extra sequence decoded (sampling, bookkeeping).

For a lone prefill this equals ``HardwareProfile.prefill_seconds`` whenever the prompt is long
enough to be compute-bound (above ~150 tokens on the shipped profiles); for a pure decode batch it
equals ``HardwareProfile.decode_step_seconds`` until the batch turns compute-bound.
"""

from __future__ import annotations

from gateway.profile import HardwareProfile


def step_seconds(
    profile: HardwareProfile,
    *,
    prefill_tokens: int,
    prefill_pairs: float,
    decode_seqs: int,
    decode_context_tokens: int,
) -> float:
    """Duration of one step computing ``prefill_tokens`` prompt tokens and ``decode_seqs`` decodes."""
    if prefill_tokens <= 0 and decode_seqs <= 0:
        return 0.0
    linear = (prefill_tokens + decode_seqs) / profile.prefill_tokens_per_s
    t = max(profile.decode_step_base_s, linear)
    if prefill_tokens > 0:
        t += profile.prefill_overhead_s + profile.prefill_attention_s_per_token2 * prefill_pairs
    if decode_seqs > 0:
        t += profile.decode_step_per_seq_s * (decode_seqs - 1)
        t += profile.decode_step_per_context_token_s * decode_context_tokens
    return t


def prefill_pairs(new_tokens: int, computed_before: int) -> float:
    """Causal attention pairs of a prefill chunk of ``new_tokens`` after ``computed_before`` tokens."""
    return new_tokens * (computed_before + new_tokens / 2)
