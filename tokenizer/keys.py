"""Chained block keys: the one function the gateway and the KV-event bridge both call.

A prompt's token IDs are cut into *full* blocks of ``block_size`` tokens; a trailing partial
block has no key (engines cache full blocks only, so a "hit" is always a whole block).
Block *i*'s key is ``xxh3_64(seed=key(i-1), data=block_i as little-endian uint32)``, and block 0
is seeded with the namespace seed (model, LoRA adapter, cache salt). Because each key depends on
every token before it, equal keys mean equal prefixes, and a lookup can stop at the first miss.

We key blocks from token IDs instead of reproducing the engine's own hash (vLLM hashes with
pickled sha256 and a per-process seed, SGLang differently): the engine's KV events carry the
token IDs, so both sides can compute the same key without knowing the engine's algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockKey = NewType("BlockKey", int)
"""Unsigned 64-bit chained key of one full block."""

_SEED_SALT = b"kvgate/v1"


def namespace_seed(model: str, *, lora: str | None = None, cache_salt: str | None = None) -> int:
    """Seed of block 0: prefixes of different models, adapters or salts never share keys."""
    parts = [_SEED_SALT, model.encode(), (lora or "").encode(), (cache_salt or "").encode()]
    return xxhash.xxh3_64_intdigest(b"\x00".join(parts))


def block_keys(
    token_ids: Sequence[int] | np.ndarray, *, block_size: int, seed: int, parent: int | None = None
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``.

    ``parent`` continues a chain: the keys of ``a + b`` equal ``block_keys(a) + block_keys(b,
    parent=last key of a)`` when ``len(a)`` is a multiple of ``block_size``. Token IDs must fit
    in uint32 (every real vocabulary does); out-of-range IDs raise ``ValueError``.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    n_full = len(arr) // block_size
    if n_full == 0:
        return []
    if arr.dtype != np.dtype("<u4"):
        if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token IDs must be integers in [0, 2**32)")
        arr = arr.astype("<u4")
    data = arr[: n_full * block_size].tobytes()
    stride = block_size * 4
    digest = xxhash.xxh3_64_intdigest
    key = seed if parent is None else parent
    out: list[BlockKey] = []
    append = out.append
    for start in range(0, len(data), stride):
        key = digest(data[start : start + stride], seed=key)
        append(BlockKey(key))
    return out
