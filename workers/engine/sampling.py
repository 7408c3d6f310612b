"""Deterministic "generation": the same prompt always gets the same reply, as real text.

The reply's token IDs are drawn from a seeded generator whose seed is a hash of the prompt's
token IDs, so a multi-turn conversation replays identically on any node (and a reply to the same
prompt with a larger ``max_tokens`` extends the shorter one). The IDs come from a pool of common
English words that are each *one* token with their leading space: decoding them gives readable
text, and re-tokenizing that text in the next turn gives back the same IDs, as a real model's
reply usually does — so a follow-up turn can hit the blocks the reply was decoded into.

A reply also has a natural length (where the model would emit end-of-sequence), drawn from the
same seed in ``[min_natural, max_natural]``: ``finish_reason`` is "stop" when the reply ends
before ``max_tokens`` (unless ``ignore_eos``), "length" otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

_WORDS = """
the of and to in is that it for on with as was at by be this from or are an not have but had
they his she her which you one all were we there been has when who will more if no out so said
what up its about into than them can only other new some could time these two may then do first
any like now my such make over our even most made after also did many before must through back
years where much your way well down should because each just those people how too little state
good very world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take
three place small found part again general city house system point water model cache token block
node fleet prefix route engine request reply answer question memory speed light river mountain
garden window music story market school paper number river table color summer winter morning
""".split()


@dataclass(frozen=True, slots=True)
class Reply:
    """The tokens a request will generate and why it stops."""

    token_ids: np.ndarray  # uint32, len <= max_tokens
    finish_reason: str  # "stop" | "length"


class ReplySampler:
    """Seeded reply tokens from a pool of single-token words (see module doc)."""

    __slots__ = ("pool", "min_natural", "max_natural")

    def __init__(self, pool: Sequence[int] | np.ndarray, *, min_natural: int = 64, max_natural: int = 1024) -> None:
        arr = np.unique(np.asarray(pool, dtype=np.uint32))
        if arr.size < 8:
            raise ValueError("the reply word pool needs at least 8 single-token words")
        if not 1 <= min_natural <= max_natural:
            raise ValueError("need 1 <= min_natural <= max_natural")
        self.pool = arr
        self.min_natural = min_natural
        self.max_natural = max_natural

    @classmethod
    def from_encoder(cls, encode: Callable[[str], Sequence[int]], **kw: int) -> ReplySampler:
        """Pool = the words of a fixed list that the tokenizer encodes as one token (with a leading space)."""
        pool = [ids[0] for w in _WORDS if len(ids := list(encode(" " + w))) == 1]
        return cls(pool, **kw)

    def reply(self, prompt_ids: np.ndarray, max_tokens: int, *, ignore_eos: bool = False, min_tokens: int = 0) -> Reply:
        """The reply to ``prompt_ids``: at most ``max_tokens`` tokens, at least ``min_tokens``."""
        seed = xxhash.xxh3_64_intdigest(np.ascontiguousarray(prompt_ids, dtype="<u4").tobytes())
        rng = np.random.Generator(np.random.PCG64(seed))
        natural = int(rng.integers(self.min_natural, self.max_natural + 1))
        n = max_tokens if ignore_eos else min(max_tokens, max(natural, min_tokens))
        # Draws are sequential, so a longer max_tokens extends a shorter reply instead of changing it.
        ids = self.pool[rng.integers(0, self.pool.size, size=n)]
        reason = "length" if n >= max_tokens else "stop"
        return Reply(ids.astype(np.uint32, copy=False), reason)
