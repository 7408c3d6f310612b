"""Block keys (DESIGN.md §3): chained xxh3_64 over full blocks of little-endian uint32 token IDs."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer.keys import block_keys, namespace_seed

BS = 16
SEED = namespace_seed("test-model")
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def test_matches_xxhash_on_little_endian_uint32_bytes() -> None:
    tokens = [1, 2, 0x01020304, 2**32 - 1] * 4 + [7] * 16
    first = struct.pack("<16I", *tokens[:16])
    second = struct.pack("<16I", *tokens[16:32])
    assert first[8:12] == bytes([4, 3, 2, 1])  # little-endian, as the contract says
    k0 = xxhash.xxh3_64_intdigest(first, seed=SEED)
    k1 = xxhash.xxh3_64_intdigest(second, seed=k0)
    assert block_keys(tokens, block_size=BS, seed=SEED) == [k0, k1]


def test_accepts_lists_and_any_integer_dtype_alike() -> None:
    tokens = list(range(100, 148))
    expected = block_keys(tokens, block_size=BS, seed=SEED)
    assert len(expected) == 3
    for dtype in (np.uint32, np.int64, np.uint16, np.int32, ">u4"):
        assert block_keys(np.array(tokens, dtype=dtype), block_size=BS, seed=SEED) == expected


def test_partial_trailing_block_has_no_key() -> None:
    assert block_keys(list(range(15)), block_size=BS, seed=SEED) == []
    assert block_keys([], block_size=BS, seed=SEED) == []
    full = block_keys(list(range(32)), block_size=BS, seed=SEED)
    assert block_keys(list(range(47)), block_size=BS, seed=SEED) == full


@given(a_blocks=st.integers(0, 6), a_seed=st.integers(0, 2**32), b=token_lists)
def test_chain_property(a_blocks: int, a_seed: int, b: list[int]) -> None:
    rng = np.random.default_rng(a_seed)
    a = rng.integers(0, 2**32, size=a_blocks * BS, dtype=np.uint64).tolist()
    whole = block_keys(a + b, block_size=BS, seed=SEED)
    head = block_keys(a, block_size=BS, seed=SEED)
    parent = head[-1] if head else None
    assert whole == head + block_keys(b, block_size=BS, seed=SEED, parent=parent)


@settings(max_examples=200)
@given(prefix=token_lists, x=token_lists, y=token_lists)
def test_shared_prefix_iff_shared_leading_keys(prefix: list[int], x: list[int], y: list[int]) -> None:
    a, b = prefix + x, prefix + y
    ka, kb = block_keys(a, block_size=BS, seed=SEED), block_keys(b, block_size=BS, seed=SEED)
    common_tokens = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    common_keys = next((i for i, (p, q) in enumerate(zip(ka, kb)) if p != q), min(len(ka), len(kb)))
    # Exactly the full blocks inside the common token prefix have equal keys (no 64-bit collisions).
    assert common_keys == min(common_tokens // BS, len(ka), len(kb))


def test_seed_separates_models_adapters_and_salts() -> None:
    seeds = {
        namespace_seed("m"),
        namespace_seed("m2"),
        namespace_seed("m", lora="adapter"),
        namespace_seed("m", cache_salt="tenant-a"),
        namespace_seed("m", cache_salt="tenant-b"),
        namespace_seed("m", lora="adapter", cache_salt="tenant-a"),
    }
    assert len(seeds) == 6
    tokens = list(range(64))
    assert len({tuple(block_keys(tokens, block_size=BS, seed=s)) for s in seeds}) == 6
    assert namespace_seed("m", lora=None, cache_salt=None) == namespace_seed("m")


def test_block_size_changes_keys() -> None:
    tokens = list(range(64))
    assert block_keys(tokens, block_size=16, seed=SEED)[:1] != block_keys(tokens, block_size=32, seed=SEED)[:1]


@pytest.mark.parametrize(
    "bad",
    [[-1] * 16, [2**32] * 16, [0.5] * 16, np.full(16, -3, dtype=np.int64), np.zeros(16, dtype=np.float32)],
)
def test_invalid_token_ids_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="token IDs"):
        block_keys(bad, block_size=BS, seed=SEED)  # type: ignore[arg-type]


def test_invalid_shapes_and_block_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        block_keys(np.zeros((2, 16), dtype=np.uint32), block_size=BS, seed=SEED)
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2, 3], block_size=0, seed=SEED)


# --- PrefixKeyCache: the gateway's cached keying must equal block_keys exactly -------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tokenizer.keys import PrefixKeyCache  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(
    base=st.lists(st.integers(0, 2**32 - 1), max_size=400),
    extensions=st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=120), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 4, 16]),
    segment_blocks=st.sampled_from([1, 2, 5, 16]),
    seed=st.integers(0, 2**64 - 1),
)
def test_prefix_key_cache_equals_block_keys(base, extensions, block_size, segment_blocks, seed):
    """A growing conversation, keyed turn after turn through one cache, gives exactly block_keys."""
    cache = PrefixKeyCache(segment_blocks=segment_blocks, max_segments=64)
    prompt = list(base)
    for ext in extensions:
        prompt += ext
        cached = cache.block_keys(prompt, block_size=block_size, seed=seed)
        assert cached.dtype == np.uint64 and cached.tolist() == block_keys(prompt, block_size=block_size, seed=seed)
        # the same prompt under another seed must not reuse this chain's segments
        other = seed ^ 1
        assert cache.block_keys(prompt, block_size=block_size, seed=other).tolist() == block_keys(
            prompt, block_size=block_size, seed=other
        )


def test_prefix_key_cache_reuses_the_history_of_a_chat():
    cache = PrefixKeyCache(segment_blocks=8, max_segments=1000)
    history = list(range(16 * 64))  # 64 blocks = 8 segments
    cache.block_keys(history, block_size=16, seed=7)
    assert (cache.hits, cache.misses) == (0, 8)
    cache.block_keys(history + list(range(500, 700)), block_size=16, seed=7)
    assert cache.hits == 8  # the history's segments were found, not re-keyed
    cache.block_keys([1] + history[1:], block_size=16, seed=7)  # a different first token
    assert cache.hits == 8  # nothing after a changed token is reused


def test_a_fresh_prompt_is_keyed_without_a_lookup_a_piece_and_its_siblings_still_hit():
    """After its first keyed piece a fresh prompt's pieces are not looked up one eighth at a time
    (2 groups: at most the first segment's 8 eighths, 16 segments, 2 groups keyed, not 256
    eighths); the segments of a group keyed at once are kept, so a prompt that diverges inside
    it finds those before the divergence."""
    rng = np.random.default_rng(3)
    history = rng.integers(0, 2**32, 16 * 2048, dtype=np.uint64).astype(np.uint32)
    cache = PrefixKeyCache(segment_blocks=64, max_segments=4096, group=16)
    assert cache.block_keys(history, block_size=16, seed=9).tolist() == block_keys(history, block_size=16, seed=9)
    assert cache.misses <= 8 + 16 + 2 and cache.hits == 0
    sibling = np.concatenate([history[: 16 * 1500], rng.integers(0, 2**32, 16 * 300, dtype=np.uint64).astype(np.uint32)])
    assert cache.block_keys(sibling, block_size=16, seed=9).tolist() == block_keys(sibling, block_size=16, seed=9)
    assert cache.hits >= 1 + 7  # group 0, then segments 16-22 of group 1 (blocks 1024-1471)


def test_prefix_key_cache_is_bounded():
    cache = PrefixKeyCache(segment_blocks=1, max_segments=10)
    cache.block_keys(list(range(16 * 50)), block_size=16, seed=1)
    assert len(cache._segments) == 10
