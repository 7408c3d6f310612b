"""A transfer agent without an engine: holds a synthetic chain of blocks and serves them.

For the throughput benchmark, for tests that need an owner in another process, and for checking
a fleet's transport by hand (``python -m workers.transfer serve``, then pull from another host).
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from workers.transfer.slots import SlotTable


def synthetic_chain(n: int, seed: int = 0) -> list[int]:
    """``n`` chained 64-bit block hashes, the same on every host for the same ``seed``."""
    out: list[int] = []
    h = seed
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(i.to_bytes(8, "little"), seed=h)
        out.append(h)
    return out


class StaticHolder:
    """Holds a fixed set of blocks (all stored in ``slots``); pins are counted, nothing is evicted."""

    def __init__(self, slots: SlotTable, hashes: Sequence[int]) -> None:
        for h in hashes:
            if slots.store(h) is None:
                raise ValueError(f"{len(hashes)} blocks do not fit in {slots.capacity} slots")
        self._held = set(hashes)
        self.pins: dict[int, int] = {}

    def hold(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        for h in hashes[:n]:
            self.pins[h] = self.pins.get(h, 0) + 1
        return n

    def unhold(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            left = self.pins[h] - 1
            if left:
                self.pins[h] = left
            else:
                del self.pins[h]

    @property
    def pinned(self) -> int:
        return sum(self.pins.values())
