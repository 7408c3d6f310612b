"""Slot bytes and the slot table: what a receiver can check, and that slots are never lost."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.transfer.backend import ReadOp, coalesce
from workers.transfer.payload import BlockCorrupt, block_payload, fill_slot, slot_bytes, verify_slot
from workers.transfer.slots import SlotTable
from tests.support.transfer import KEY


def test_payload_is_deterministic_per_hash_and_differs_between_hashes() -> None:
    assert block_payload(42, 256) == block_payload(42, 256)
    assert block_payload(42, 256) != block_payload(43, 256)
    assert len(block_payload(2**64 - 1, 100)) == 100


def test_a_filled_slot_verifies_and_any_flipped_byte_is_caught() -> None:
    slot = np.zeros(slot_bytes(512), dtype=np.uint8)
    fill_slot(slot, 0xDEADBEEF, KEY)
    verify_slot(slot, 0xDEADBEEF, KEY)
    assert slot[:512].tobytes() == block_payload(0xDEADBEEF, 512)
    for pos in (0, 255, 511, 512 + 9):  # payload bytes and the stored checksum
        bad = slot.copy()
        bad[pos] ^= 0x01
        with pytest.raises(BlockCorrupt):
            verify_slot(bad, 0xDEADBEEF, KEY)


def test_a_block_written_without_the_fleets_key_is_rejected() -> None:
    """Issue 15, item 1: the trailer was an unkeyed checksum, so any peer could serve forged bytes
    that verified. A peer without the secret now gets its blocks refused (the pull fails
    ``checksum``, the request recomputes)."""
    slot = np.zeros(slot_bytes(256), dtype=np.uint8)
    fill_slot(slot, 0xFEED, b"not-the-fleet-key-0123456789abcd")
    with pytest.raises(BlockCorrupt, match="checksum"):
        verify_slot(slot, 0xFEED, KEY)


def test_a_slot_holding_another_block_is_rejected() -> None:
    slot = np.zeros(slot_bytes(64), dtype=np.uint8)
    fill_slot(slot, 7, KEY)
    with pytest.raises(BlockCorrupt, match="expected"):
        verify_slot(slot, 8, KEY)


def test_payload_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        slot_bytes(0)
    with pytest.raises(ValueError):
        SlotTable(0, 64, checksum_key=KEY)


def test_store_remove_and_the_stored_bytes() -> None:
    t = SlotTable(2, 64, checksum_key=KEY)
    a = t.store(1)
    assert a is not None and t.store(1) == a  # idempotent
    verify_slot(t.view(a), 1, KEY)
    assert t.address(a) == t.base_address + a * t.slot_size
    b = t.store(2)
    assert t.store(3) is None  # full: the block simply has no servable copy
    t.remove(1)
    t.remove(99)  # unknown: ignored
    assert t.store(3) == a
    verify_slot(t.view(a), 3, KEY)
    assert t.slot_of(2) == b and 1 not in t


def test_pull_slots_are_reserved_then_adopted_or_released() -> None:
    t = SlotTable(4, 64, checksum_key=KEY)
    t.store(10)
    slots = t.reserve(3)
    assert slots is not None and t.free_slots == 0
    assert t.reserve(1) is None and t.store(11) is None
    t.remove_all()  # a cache clear does not free slots a read may be writing into
    assert t.free_slots == 1
    t.store(20)
    t.adopt([(20, slots[0]), (21, slots[1])])  # 20 already has a slot: the pulled one is freed
    assert t.slot_of(21) == slots[1] and t.slot_of(20) != slots[0]
    t.release([slots[2]])
    assert t.free_slots == 2
    with pytest.raises(KeyError):
        t.release([slots[2]])  # not reserved any more


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "reserve", "adopt", "release"]), st.integers(0, 6)), max_size=60))
def test_slots_are_conserved(ops) -> None:
    """Every slot is exactly one of free, stored or reserved, whatever the sequence of calls."""
    t = SlotTable(5, 16, checksum_key=KEY)
    reserved: list[int] = []
    for op, x in ops:
        if op == "store":
            t.store(x)
        elif op == "remove":
            t.remove(x)
        elif op == "reserve":
            got = t.reserve(x % 3)
            reserved += got or []
        elif op == "adopt" and reserved:
            t.adopt([(x + 100, reserved.pop())])
        elif op == "release" and reserved:
            t.release([reserved.pop()])
        assert t.free_slots + t.stored_slots + len(reserved) == t.capacity
        assert len(set(t._by_hash.values())) == t.stored_slots


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    ops = [ReadOp(0, 100, 10), ReadOp(10, 110, 10), ReadOp(20, 500, 10), ReadOp(40, 510, 10), ReadOp(50, 520, 5)]
    assert coalesce(ops) == [ReadOp(0, 100, 20), ReadOp(20, 500, 10), ReadOp(40, 510, 15)]
    assert coalesce([]) == []
