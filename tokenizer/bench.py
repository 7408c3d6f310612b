"""Measure what tokenization costs on the request path: ``python -m tokenizer.bench``.

Prints medians of: single-thread encoding of 1k/8k/32k-token texts (``encode`` vs the GIL-free
``encode_batch_fast``), whether each call releases the GIL, and the per-request cost of a warm
8k-token multi-turn chat (validate + render + split + cache lookups + block keys), which is what
every turn of a long conversation pays once its history is cached.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
from collections.abc import Callable

from tokenizer.keys import block_keys, namespace_seed
from tokenizer.prompt_tokenizer import PromptTokenizer


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _word_pool(pt: PromptTokenizer, rng: random.Random) -> list[str]:
    """Whole-word vocabulary entries, so synthetic text tokenizes like prose (~1 token a word)."""
    words = []
    for token_id in rng.sample(range(1000, 100_000), 20_000):
        text = pt.decode([token_id])
        if len(text) > 2 and text[0] == " " and text[1:].isalpha():
            words.append(text)
    return words


def _text(pt: PromptTokenizer, words: list[str], rng: random.Random, tokens: int) -> str:
    """Prose-like text of exactly ``tokens`` tokens."""
    text = "".join(rng.choice(words) + ("." if rng.random() < 0.08 else "") for _ in range(int(tokens * 1.2)))
    ids = pt.hf_tokenizer.encode(text, add_special_tokens=False).ids[:tokens]
    return pt.decode(ids)


def _spin_ratio(fn: Callable[[], object]) -> float:
    """How fast a Python thread runs while ``fn`` runs, relative to idle (≈1: GIL released)."""
    stop = False
    count = 0

    def spin() -> None:
        nonlocal count
        while not stop:
            count += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    c0, t0 = count, time.perf_counter()
    time.sleep(0.1)
    idle = (count - c0) / (time.perf_counter() - t0)
    c0, t0 = count, time.perf_counter()
    fn()
    busy = (count - c0) / (time.perf_counter() - t0)
    stop = True
    thread.join()
    return busy / idle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenizer.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=None, help="tokenizer directory or tokenizer.json (default: DeepSeek)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    rng = random.Random(7)

    t0 = time.perf_counter()
    pt = PromptTokenizer(args.source)
    print(f"load + init: {(time.perf_counter() - t0) * 1e3:.0f} ms  (segmented: {pt.segmented}, vocab {pt.vocab_size})")
    words = _word_pool(pt, rng)
    raw = pt.hf_tokenizer

    print("\nsingle-thread encode, uncached (median ms):")
    print(f"  {'tokens':>7}  {'encode':>8}  {'encode_batch_fast':>17}  {'encode_text, cold cache':>23}")
    for n in (1_000, 8_000, 32_000):
        text = _text(pt, words, rng, n)
        enc = _median_ms(lambda: raw.encode(text, add_special_tokens=False), args.repeat)
        fast = _median_ms(lambda: raw.encode_batch_fast([text], add_special_tokens=False), args.repeat)
        fresh = _median_ms(lambda: (pt.clear_cache(), pt.encode_text(text, add_special_tokens=True)), args.repeat)
        print(f"  {n:>7}  {enc:>8.2f}  {fast:>17.2f}  {fresh:>23.2f}")
    text32 = _text(pt, words, rng, 32_000)
    print("\nother threads' speed while encoding 32k tokens (1.0 = GIL released):")
    print(f"  encode: {_spin_ratio(lambda: raw.encode(text32, add_special_tokens=False)):.2f}   "
          f"encode_batch_fast: {_spin_ratio(lambda: raw.encode_batch_fast([text32], add_special_tokens=False)):.2f}")

    # A 16-turn chat of ~8k tokens; the last user turn is new, the rest were seen last turn.
    messages: list[dict[str, str]] = [{"role": "system", "content": _text(pt, words, rng, 400)}]
    for _ in range(8):
        messages.append({"role": "user", "content": _text(pt, words, rng, 300)})
        messages.append({"role": "assistant", "content": _text(pt, words, rng, 600)})
    body = {"model": "bench-model", "messages": messages}
    path = "/v1/chat/completions"
    pt.tokenize_body(path, body)  # warm: this is the history of the next turn
    seed = namespace_seed("bench-model")
    n_tokens = len(pt.tokenize_body(path, body).token_ids)

    def warm_request() -> None:
        prompt = pt.tokenize_body(path, body)
        block_keys(prompt.token_ids, block_size=args.block_size, seed=seed)

    rendered = pt.render_chat(messages)
    ids = pt.encode_text(rendered, add_special_tokens=False)
    print(f"\ncached multi-turn chat ({len(messages)} messages, {n_tokens} tokens), median µs:")
    print(f"  tokenize_body + block_keys : {_median_ms(warm_request, args.repeat * 20) * 1e3:8.1f}")
    print(f"    render chat template     : {_median_ms(lambda: pt.render_chat(messages), args.repeat * 20) * 1e3:8.1f}")
    print(f"    split at added tokens    : {_median_ms(lambda: pt.split_segments(rendered), args.repeat * 20) * 1e3:8.1f}")
    print(f"    encode_text (all hits)   : {_median_ms(lambda: pt.encode_text(rendered, add_special_tokens=False), args.repeat * 20) * 1e3:8.1f}")
    print(f"    block_keys               : {_median_ms(lambda: block_keys(ids, block_size=args.block_size, seed=seed), args.repeat * 20) * 1e3:8.1f}")
    uncached = _median_ms(lambda: raw.encode(rendered, add_special_tokens=False), args.repeat)
    print(f"  (whole-prompt encode without the cache: {uncached * 1e3:.0f} µs)")

    async def next_turns() -> list[float]:
        times = []
        for _ in range(7):  # each adds a fresh 300-token user turn to the cached history
            turn = dict(body, messages=[*messages, {"role": "user", "content": _text(pt, words, rng, 300)}])
            t0 = time.perf_counter()
            await pt.tokenize_body_async(path, turn)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    print(f"  next turn (history cached + 300 new tokens): {statistics.median(asyncio.run(next_turns())):.2f} ms")
    hits, misses, size = pt.cache_stats
    print(f"\nsegment cache: {hits} hits, {misses} misses, {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
