"""Which part of each prompt had been sent before: the yardstick for redundant prefill.

A request's *seen* prefix is the longest run of its leading full blocks that some earlier
request of the same run had sent as its prompt. Prefill of seen tokens is redundant: the fleet
had computed them once already, and a perfect shared cache would have served them. We count
prompts only (not replies): the client knows prompts exactly, while a reply's blocks are known
only to the engine — so "redundant" is, if anything, under-counted.

The seen prefix is capped like an engine's hit (``(prompt_tokens - 1) // block_size`` blocks: the
last token is always computed), so ``seen - cached`` compares like with like.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from loadtest.records import RequestRecord
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed


class SeenBlocks:
    """The set of block keys sent so far in a run."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def observe(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` seen before this call; then remember all of ``keys``."""
        seen = self._seen
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        seen.update(keys)
        return n


def hit_cap_blocks(prompt_tokens: int, block_size: int) -> int:
    """Most blocks an engine can report as cached for a prompt (it always computes the last token)."""
    return max(prompt_tokens - 1, 0) // block_size


def fill_seen_tokens(records: Iterable[RequestRecord], tokenizer: PromptTokenizer, *, block_size: int) -> None:
    """Set ``seen_tokens`` on records (taken in send order) from their prompts' block keys."""
    seen = SeenBlocks()
    for rec in sorted(records, key=lambda r: r.sent_at):
        spec = rec.spec
        if spec.prompt_ids is not None:
            ids = spec.prompt_ids
            model = spec.body["model"]
        else:
            tp = tokenizer.tokenize_body(spec.path, spec.body)
            ids, model = tp.token_ids, tp.model
        keys = block_keys(ids, block_size=block_size, seed=namespace_seed(model))
        blocks = min(seen.observe(keys), hit_cap_blocks(len(ids), block_size))
        rec.seen_tokens = blocks * block_size
        if not rec.prompt_tokens and rec.ok:
            rec.prompt_tokens = len(ids)
