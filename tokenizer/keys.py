"""Chained block keys: the one function the gateway and the KV-event bridge both call.

A prompt's token IDs are cut into *full* blocks of ``block_size`` tokens; a trailing partial
block has no key (engines cache full blocks only, so a "hit" is always a whole block).
Block *i*'s key is ``xxh3_64(seed=key(i-1), data=block_i as little-endian uint32)``, and block 0
is seeded with the namespace seed (model, LoRA adapter, cache salt). Because each key depends on
every token before it, equal keys mean equal prefixes, and a lookup can stop at the first miss.

The namespace rule, the same on both sides: ``model`` is the *base* model the engine serves,
``lora`` the adapter's served name (vLLM's ``lora_name``; None for the base model), ``cache_salt``
the request's salt (vLLM's ``cache_salt``; None or empty = unsalted). The gateway sees only the
body's ``model`` and ``cache_salt`` and maps an adapter's name to its base with ``request_seed``;
the bridge sees the base model (its configuration), ``lora_name`` and the salt in block 0's
``extra_keys`` and calls ``namespace_seed`` directly. Salted and unsalted twins, and two salts,
never share a key, so a prompt can only ever hit blocks stored under its own salt.

We key blocks from token IDs instead of reproducing the engine's own hash (vLLM hashes with
pickled sha256 and a per-process seed, SGLang differently): the engine's KV events carry the
token IDs, so both sides can compute the same key without knowing the engine's algorithm.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import NewType, cast

import numpy as np
import xxhash

BlockKey = NewType("BlockKey", int)
"""Unsigned 64-bit chained key of one full block."""

_SEED_SALT = b"kvgate/v1"


def namespace_seed(model: str, *, lora: str | None = None, cache_salt: str | None = None) -> int:
    """Seed of block 0: prefixes of different models, adapters or salts never share keys."""
    parts = [_SEED_SALT, model.encode(), (lora or "").encode(), (cache_salt or "").encode()]
    return xxhash.xxh3_64_intdigest(b"\x00".join(parts))


def request_seed(model: str, *, cache_salt: str | None = None, adapters: Mapping[str, str] | None = None) -> int:
    """Seed of block 0 for a request whose body names ``model``: when ``model`` is a LoRA adapter
    (a key of ``adapters``, adapter name → base model) the namespace is (base, adapter, salt),
    exactly as the bridge keys that adapter's blocks from the engine's ``lora_name``."""
    base = adapters.get(model) if adapters else None
    if base is None:
        return namespace_seed(model, cache_salt=cache_salt)
    return namespace_seed(base, lora=model, cache_salt=cache_salt)


def block_keys(
    token_ids: Sequence[int] | np.ndarray, *, block_size: int, seed: int, parent: int | None = None
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``.

    ``parent`` continues a chain: the keys of ``a + b`` equal ``block_keys(a) + block_keys(b,
    parent=last key of a)`` when ``len(a)`` is a multiple of ``block_size``. Token IDs must fit
    in uint32 (every real vocabulary does); out-of-range IDs raise ``ValueError``.
    """
    arr = _as_u32(token_ids, block_size)
    n_full = len(arr) // block_size
    return _chain(arr[: n_full * block_size].tobytes(), block_size * 4, seed if parent is None else parent)


_U32_LITTLE = array("I").itemsize == 4 and sys.byteorder == "little"  # array("I") is then "<u4" as is


def _as_u32(token_ids: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """Token IDs as a little-endian uint32 array, validated (IDs outside uint32 raise ValueError)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if type(token_ids) is list and _U32_LITTLE:
        # the KV-event bridge's case (a decoded list per stored block run): array's C loop checks
        # the range as it copies, ~5x faster than asarray + min + max + astype on short lists
        try:
            return np.frombuffer(array("I", token_ids), dtype="<u4")
        except (OverflowError, TypeError):
            raise ValueError("token IDs must be integers in [0, 2**32)") from None
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    if arr.dtype != np.dtype("<u4"):
        if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token IDs must be integers in [0, 2**32)")
        arr = arr.astype("<u4")
    return arr


def _chain(data: bytes | memoryview, stride: int, parent: int) -> list[BlockKey]:
    """Chained keys of ``data`` cut into ``stride``-byte blocks (the hot loop: one C call a block)."""
    digest = xxhash.xxh3_64_intdigest
    key = parent
    out: list[int] = []
    append = out.append
    for start in range(0, len(data), stride):
        key = digest(data[start : start + stride], key)  # seed positionally, no BlockKey() call: ~40% of the loop
        append(key)
    return cast("list[BlockKey]", out)


class PrefixKeyCache:
    """Block keys of prompts whose beginning was keyed before, without hashing that beginning again.

    A multi-turn chat resends its whole history each turn; keying 512 blocks one Python call at
    a time costs ~100 µs a request, most of it for blocks keyed last turn already. This cache cuts
    the prompt into segments of ``segment_blocks`` blocks and remembers each segment's keys under
    (key of the block before it, block size, xxh3-64 of its tokens): the previous key stands for
    the whole prefix before the segment, exactly as in the chain itself, so a segment is found
    only after the very same prefix.

    Segments come in three sizes, each looked up before the next smaller one: groups of ``group``
    segments (a 128k-token chat is ~7 group lookups and a few segment lookups, not 125), the
    segments, and eighths of a segment for what is left (a 1k-token chat: 7 lookups and at most 7
    blocks keyed one by one, not 62). A piece missed is keyed from the next smaller size's pieces,
    which are found or keyed in turn; once one is keyed, the rest of the prompt is new too and is
    keyed a piece at a time without lookups (a fresh 128k-token prompt: ~1.5 ms, not ~6).

    Results always equal ``block_keys`` (a property test checks it). Memory is bounded by
    ``max_segments`` (LRU) per size, ``max_segments // group`` for groups: about ``8 *
    segment_blocks + 120`` bytes a segment (~20 MB by default), as much again for the groups, and
    a quarter of it for the eighths. Not thread-safe: the gateway calls it from its event loop only.
    """

    __slots__ = ("segment_blocks", "max_segments", "group", "_levels", "hits", "misses")

    def __init__(self, *, segment_blocks: int = 64, max_segments: int = 32768, group: int = 16) -> None:
        if segment_blocks <= 0 or max_segments <= 0 or group <= 1:
            raise ValueError("segment_blocks and max_segments must be positive, group above 1")
        self.segment_blocks = segment_blocks
        self.max_segments = max_segments
        self.group = group
        sizes = [(segment_blocks * group, max(max_segments // group, 1)), (segment_blocks, max_segments)]
        if segment_blocks % 8 == 0 and segment_blocks > 8:
            sizes.append((segment_blocks // 8, max_segments))
        # (blocks a piece, most pieces kept, the pieces: (parent key, stride, xxh3 of tokens) -> keys)
        self._levels: list[tuple[int, int, OrderedDict[tuple[int, int, int], array]]] = [
            (blocks, most, OrderedDict()) for blocks, most in sizes
        ]
        self.hits = 0
        self.misses = 0

    @property
    def _segments(self) -> OrderedDict[tuple[int, int, int], array]:
        """The pieces of ``segment_blocks`` blocks."""
        return self._levels[1][2]

    def block_keys(self, token_ids: Sequence[int] | np.ndarray, *, block_size: int, seed: int) -> np.ndarray:
        """``block_keys`` as a read-only uint64 array (the directory samples and packs it vectorised)."""
        arr = _as_u32(token_ids, block_size)
        n_full = len(arr) // block_size
        data = memoryview(np.ascontiguousarray(arr[: n_full * block_size])).cast("B")  # no copy
        stride = block_size * 4
        out = array("Q")
        parent = seed
        pos = 0
        fresh = False
        for level, (blocks, _, _) in enumerate(self._levels):
            size = blocks * stride
            while pos + size <= len(data):
                keys, fresh = self._piece(level, data, pos, parent, stride, fresh)
                out.extend(keys)
                parent = keys[-1]
                pos += size
        if pos < len(data):
            out.extend(_chain(data[pos:], stride, parent))
        keys_out = np.frombuffer(out, dtype=np.uint64) if out else np.zeros(0, dtype=np.uint64)
        keys_out.setflags(write=False)
        return keys_out

    def _piece(self, level: int, data: memoryview, pos: int, parent: int, stride: int, fresh: bool) -> tuple[array, bool]:
        """Keys of the level's piece at ``pos``, chained from ``parent``: found, or keyed and kept;
        and whether anything was keyed.

        Once a piece is keyed, what follows it was never seen either (every later piece's parent
        key chains through it): ``fresh`` pieces are not looked up, and their keys come from one
        ``_chain`` call rather than from sub-pieces. Their sub-pieces are kept too, except at the
        finest size (a later prompt that diverges inside the piece keys at most a segment anew)."""
        blocks, most, pieces = self._levels[level]
        size = blocks * stride
        chunk = data[pos : pos + size]
        ident = (parent, stride, xxhash.xxh3_64_intdigest(chunk))
        cached = None if fresh else pieces.get(ident)
        if cached is not None:
            self.hits += 1
            pieces.move_to_end(ident)
            return cached, False
        if fresh or level + 1 == len(self._levels):
            self.misses += 1
            cached = array("Q", _chain(chunk, stride, parent))
            if fresh and level + 2 < len(self._levels):
                self._keep_parts(level + 1, chunk, cached, parent, stride)
        else:
            cached = array("Q")
            sub = self._levels[level + 1][0] * stride
            for start in range(pos, pos + size, sub):
                keys, fresh = self._piece(level + 1, data, start, parent, stride, fresh)
                cached.extend(keys)
                parent = keys[-1]
            self._put(pieces, most, ident, cached)
            return cached, fresh  # every part found (this piece had been dropped): look on
        self._put(pieces, most, ident, cached)
        return cached, True

    def _keep_parts(self, level: int, chunk: memoryview, keys: array, parent: int, stride: int) -> None:
        """Keep the pieces of ``level`` that a keyed ``chunk`` (with its ``keys``) is made of."""
        blocks, most, pieces = self._levels[level]
        size = blocks * stride
        for i, start in enumerate(range(0, len(chunk), size)):
            ident = (parent, stride, xxhash.xxh3_64_intdigest(chunk[start : start + size]))
            part = keys[i * blocks : (i + 1) * blocks]
            self._put(pieces, most, ident, part)
            parent = part[-1]

    @staticmethod
    def _put(pieces: OrderedDict[tuple[int, int, int], array], most: int, ident: tuple[int, int, int], keys: array) -> None:
        pieces[ident] = keys
        if len(pieces) > most:
            pieces.popitem(last=False)
