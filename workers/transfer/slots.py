"""One registered buffer of fixed-size slots: where a node keeps the bytes of the blocks it holds.

A slot is an index into one contiguous buffer, registered once with the transfer backend, so a
peer can read any slot with a one-sided read at ``address(slot)``. Slots are in one of three
states:

* **free**;
* **stored** — holds the payload of one cached block (``slot_of(hash)``), readable by peers;
* **reserved** — set aside for a pull in flight: bytes are being written into it by a read, so it
  must not be handed out again until that read has *returned* (even after a timeout: a read that
  is still running may write into it late). ``adopt`` turns it into a stored slot once its bytes
  are verified; ``release`` frees it.

The table follows the engine's cache (stored on ``BlockStored``, freed on ``BlockRemoved``) but
never decides anything itself: eviction is the cache's business, and a block being read by a
peer is kept by pinning it in the cache (the agent's lease), so its slot is never reused mid-read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from workers.transfer.payload import fill_slot, slot_bytes


class SlotTable:
    """Slots of ``slot_bytes(payload_bytes)`` bytes in one zero-initialised buffer.

    The buffer is allocated with ``np.zeros`` (calloc): pages are only backed by memory once a
    slot is written, so a large table costs what is cached, not what could be.
    """

    __slots__ = ("payload_bytes", "slot_size", "capacity", "buffer", "checksum_key", "_free", "_by_hash", "_reserved")

    def __init__(self, capacity: int, payload_bytes: int, *, checksum_key: bytes) -> None:
        """``checksum_key``: keys each stored block's MAC (``PeerAuth.checksum_key``)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.payload_bytes = payload_bytes
        self.slot_size = slot_bytes(payload_bytes)
        self.capacity = capacity
        self.checksum_key = checksum_key
        self.buffer = np.zeros(capacity * self.slot_size, dtype=np.uint8)
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low slots first
        self._by_hash: dict[int, int] = {}
        self._reserved: set[int] = set()

    # -- queries ---------------------------------------------------------------------------------

    @property
    def base_address(self) -> int:
        return int(self.buffer.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def stored_slots(self) -> int:
        return len(self._by_hash)

    def address(self, slot: int) -> int:
        """Virtual address of ``slot`` in this process (what a peer reads from)."""
        return self.base_address + slot * self.slot_size

    def view(self, slot: int) -> np.ndarray:
        off = slot * self.slot_size
        return self.buffer[off : off + self.slot_size]

    def slot_of(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    # -- following the cache ---------------------------------------------------------------------

    def store(self, block_hash: int) -> int | None:
        """Give a newly cached block a slot with its payload; None when every slot is taken.

        A block that already has a slot (pulled and adopted before the cache stored it) keeps it.
        """
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            return slot
        if not self._free:
            return None
        slot = self._free.pop()
        fill_slot(self.view(slot), block_hash, self.checksum_key)
        self._by_hash[block_hash] = slot
        return slot

    def remove(self, block_hash: int) -> None:
        """The cache evicted ``block_hash``: its slot is free again (unknown hashes are ignored)."""
        slot = self._by_hash.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def remove_all(self) -> None:
        """The cache was cleared: every stored slot is free (reserved slots stay reserved)."""
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()

    # -- pulls -----------------------------------------------------------------------------------

    def reserve(self, n: int) -> list[int] | None:
        """Set ``n`` free slots aside for a pull; None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        self._reserved.update(slots)
        return slots

    def adopt(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Reserved slots whose bytes were verified become the stored copies of ``(hash, slot)``.

        If a hash got a slot meanwhile (the node computed that block itself), the pulled slot is
        freed instead: one slot per block.
        """
        for block_hash, slot in pairs:
            self._reserved.remove(slot)
            if block_hash in self._by_hash:
                self._free.append(slot)
            else:
                self._by_hash[block_hash] = slot

    def release(self, slots: Sequence[int]) -> None:
        """Reserved slots not used after all (failed or abandoned pull)."""
        for slot in slots:
            self._reserved.remove(slot)
            self._free.append(slot)
