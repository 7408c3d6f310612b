"""What a cached block's bytes look like in a transfer slot, and how a receiver checks them.

The simulated engine has no real KV, so each cached block gets a real, scaled-down stand-in:
``payload_bytes`` bytes drawn from a generator seeded by the block's *engine hash*. Any node can
therefore regenerate what a block must contain, and a slot carries a 16-byte trailer so a
receiver can check it without regenerating anything::

    slot = payload (payload_bytes) | block hash (8, little-endian) | MAC(payload) (8, little-endian)

MAC is a keyed BLAKE2b (8 bytes) under the fleet's checksum key (``PeerAuth.checksum_key``, from
the transfer secret). ``verify_slot`` checks both: the hash says the slot still holds the block
that was asked for (not a slot reused by another block), the MAC says the bytes arrived intact
and were written by a node holding the secret (an unkeyed checksum let any peer forge blocks).
A block is used only after both hold.
"""

from __future__ import annotations

import hashlib

import numpy as np

TRAILER_BYTES = 16
_U64 = 0xFFFFFFFFFFFFFFFF


class BlockCorrupt(ValueError):
    """A slot's bytes are not the block that was asked for (wrong block or damaged bytes)."""


def slot_bytes(payload_bytes: int) -> int:
    """Bytes one slot takes: the payload and its trailer."""
    if payload_bytes <= 0:
        raise ValueError(f"payload_bytes must be positive, got {payload_bytes}")
    return payload_bytes + TRAILER_BYTES


def block_payload(block_hash: int, payload_bytes: int) -> bytes:
    """The deterministic stand-in for one block's KV (the same on every node)."""
    return np.random.Generator(np.random.PCG64(block_hash & _U64)).bytes(payload_bytes)


def _mac(payload, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, key=key, digest_size=8).digest(), "little")


def fill_slot(slot: np.ndarray, block_hash: int, key: bytes) -> None:
    """Write ``block_hash``'s payload and trailer (MAC under ``key``) into ``slot`` (a uint8 view)."""
    n = len(slot) - TRAILER_BYTES
    payload = block_payload(block_hash, n)
    slot[:n] = np.frombuffer(payload, dtype=np.uint8)
    slot[n : n + 8] = np.frombuffer((block_hash & _U64).to_bytes(8, "little"), dtype=np.uint8)
    slot[n + 8 :] = np.frombuffer(_mac(payload, key).to_bytes(8, "little"), dtype=np.uint8)


def verify_slot(slot: np.ndarray, block_hash: int, key: bytes) -> None:
    """Raise ``BlockCorrupt`` unless ``slot`` holds ``block_hash``'s block, intact, MAC'd under ``key``."""
    n = len(slot) - TRAILER_BYTES
    held = int.from_bytes(slot[n : n + 8].tobytes(), "little")
    if held != block_hash & _U64:
        raise BlockCorrupt(f"slot holds block {held:#018x}, expected {block_hash & _U64:#018x}")
    stored = int.from_bytes(slot[n + 8 :].tobytes(), "little")
    actual = _mac(slot[:n], key)
    if stored != actual:
        raise BlockCorrupt(f"block {block_hash & _U64:#018x}: checksum {actual:#018x} != {stored:#018x}")
