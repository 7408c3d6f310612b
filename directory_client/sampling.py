"""Index granularity: which block keys the directory keeps, and how answers map back to blocks.

Callers (the bridge, the gateway) always pass *every* block key and always get answers in engine
blocks; the directory alone decides what to index. With ``stride`` k it keeps only keys whose
value is divisible by k. Chained keys are uniform 64-bit hashes, so that keeps ~1/k of the
blocks, and it needs no position: ``record_stored`` is given keys without their place in the
prompt (an event batch may start mid-prompt), yet writer and reader pick the same keys.

A lookup then counts the leading *sampled* keys a node holds; if it holds the first m of them,
the node's cached prefix is reported as ``position(m-th sampled key) + 1`` blocks — a lower
bound, short of the truth by less than the gap to the next sampled key (k on average). Prompts
shorter than a few strides may contain no sampled key at all and report 0 everywhere.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from tokenizer.keys import BlockKey

MAX_KEY = (1 << 64) - 1


def check_stride(stride: int) -> int:
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"index_stride must be a positive integer, got {stride!r}")
    return stride


def check_keys(keys: Sequence[BlockKey]) -> None:
    """Reject keys that are not unsigned 64-bit integers, before anything is written."""
    for k in keys:
        if not isinstance(k, int) or k < 0 or k > MAX_KEY:
            raise ValueError(f"block key {k!r} is not an integer in [0, 2**64)")


class KeySampler:
    """The stride rule, shared by every backend so they index (and answer) identically."""

    __slots__ = ("stride", "_divisor", "_low_bits")

    def __init__(self, stride: int) -> None:
        self.stride = check_stride(stride)
        self._divisor = np.uint64(stride)
        # a power-of-two stride keeps the keys whose low bits are zero: a mask, not a 64-bit
        # division per key (~3 µs less for the 500 keys of an 8k-token prompt)
        self._low_bits = np.uint64(stride - 1) if stride & (stride - 1) == 0 else None

    def select(self, keys: Sequence[BlockKey]) -> list[int]:
        """The keys the directory keeps, in order (what writes store or remove)."""
        s = self.stride
        if s == 1:
            return list(keys)
        return [k for k in keys if k % s == 0]

    def select_positions(self, keys: Sequence[BlockKey] | np.ndarray) -> tuple[list[int], list[int] | None]:
        """Kept keys and their positions in ``keys`` (None means "all kept, position = index").

        A uint64 array (what the gateway passes) is sampled vectorised: a Python loop over 500
        keys of 64 bits costs ~30 µs a lookup, the array ~5 µs.
        """
        s = self.stride
        if isinstance(keys, np.ndarray):
            if s == 1:
                return keys.tolist(), None
            if self._low_bits is not None and keys.dtype == np.uint64:
                picked = ((keys & self._low_bits) == 0).nonzero()[0]
            else:
                picked = np.flatnonzero(keys % self._divisor == 0)
            return keys[picked].tolist(), picked.tolist()
        if s == 1:
            return list(keys), None
        positions = [i for i, k in enumerate(keys) if not k % s]
        return [keys[i] for i in positions], positions

    def select_array(
        self, keys: Sequence[BlockKey] | np.ndarray
    ) -> tuple[np.ndarray | list[int], np.ndarray | list[int] | None]:
        """``select_positions``, but a uint64 array stays an array: a lookup of a 128k-token prompt
        (8000 keys) then packs them in one vectorised step, or lists them a chunk at a time up to
        the first block a node misses, instead of building 8000 Python ints per request."""
        if isinstance(keys, np.ndarray) and keys.dtype == np.uint64:
            if self.stride == 1:
                return keys, None
            # kept keys and positions stay arrays too: listing both cost ~50 µs at 128k tokens
            # (stride 4), while a lookup reads only the keys up to a node's first miss and one position
            if self._low_bits is not None:
                picked = ((keys & self._low_bits) == 0).nonzero()[0]
            else:
                picked = np.flatnonzero(keys % self._divisor == 0)
            return keys[picked], picked
        return self.select_positions(keys)

    @staticmethod
    def blocks_for(held: int, positions: Sequence[int] | np.ndarray | None) -> int:
        """Engine blocks covered when a node holds the first ``held`` sampled keys."""
        if held <= 0:
            return 0
        return held if positions is None else int(positions[held - 1]) + 1


def pack_keys(keys: Sequence[int] | np.ndarray) -> bytes:
    """Keys as one blob of 8-byte big-endian words: one Redis argument however many keys."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64:
        return keys.astype(">u8").tobytes()
    try:
        return struct.pack(f">{len(keys)}Q", *keys)
    except struct.error as e:
        raise ValueError(f"block keys must be integers in [0, 2**64): {e}") from None

DEFAULT_INDEX_STRIDE = 4
"""See README.md (index granularity) for the measurements behind this default."""
