"""Memory an attacker can make kvgate hold: the token cache is bounded by what it really costs.

The attack (issue 15, item 6): prompts made of many short pieces split by added tokens. Each piece
becomes one cache entry; counted as its text plus 4 bytes a token, 6 such 1 MiB prompts were
accounted as 5.7 MiB while the process grew by 216 MiB. What the attacker gets now: the cache
stays within its configured bytes in RSS, not just on paper (the entries it evicts are freed).
"""

from __future__ import annotations

import gc
import os

from tokenizer import PromptTokenizer

PAGE = os.sysconf("SC_PAGE_SIZE")
CACHE_BYTES = 4 << 20
PROMPT_CHARS = 512 << 10
ADDED = "<｜place▁holder▁no▁0｜>"  # an added token: the splitter cuts the text at each one


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def short_pieces_prompt(seed: int, size: int) -> str:
    """About ``size`` characters of distinct 6-character pieces, each between two added tokens."""
    parts, n, i = [], 0, 0
    while n < size:
        piece = f"{seed:x}{i:05x}"
        parts.append(piece)
        n += len(piece) + len(ADDED)
        i += 1
    return ADDED.join(parts)


def test_short_pieces_cost_the_cache_its_bytes_in_rss() -> None:
    tok = PromptTokenizer(cache_bytes=CACHE_BYTES)
    # Warm-up with one prompt of the same shape: the allocator keeps a prompt's working set (~15
    # MiB here, with or without a cache), so what grows after it is what the cache keeps.
    tok.tokenize_body("/v1/completions", {"model": "m", "prompt": short_pieces_prompt(99, PROMPT_CHARS)})
    gc.collect()
    before = rss()
    for seed in range(6):
        tok.tokenize_body("/v1/completions", {"model": "m", "prompt": short_pieces_prompt(seed, PROMPT_CHARS)})
    gc.collect()
    grown = rss() - before
    stats = tok.cache_stats
    print(f"\n6 x 512 KiB short-piece prompts: RSS +{grown / 2**20:.1f} MiB, cache accounts "
          f"{stats.bytes / 2**20:.1f} MiB in {stats.entries} entries (bound {CACHE_BYTES / 2**20:.0f} MiB)")
    assert stats.bytes <= CACHE_BYTES
    # What stays after the attack is the cache (its bound) plus allocator slack, not 38x its bound.
    assert grown <= 2 * CACHE_BYTES + (6 << 20), f"RSS grew {grown / 2**20:.1f} MiB for an {CACHE_BYTES >> 20} MiB cache"
