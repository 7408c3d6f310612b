"""JSON decoding of a chat body that repeats a body seen before, without decoding the repeat.

A continuing chat resends its whole history each turn: at 128k tokens that is ~460 kB of JSON
whose decoding (~0.1 ms, msgspec) was most of what a decision's cost grows with. The body of
the next turn begins with the bytes of the previous one up to the end of one of its messages.
``BodyMemo`` keeps recent long bodies with where each of their messages ends and the messages
already decoded; a body that starts with the very bytes of a kept one up to a message's end
(checked with ``bytes.startswith``: a memcmp, ~5 µs for 460 kB) takes those decoded messages and
decodes only the rest.

Why this is exact: JSON is context-free, and after a message's closing brace the parser's state
is fixed: inside the top-level object, inside its ``messages`` array, after an element. So the
rest of the body decodes the same after ``{"messages":[0`` (the decoded prefix stood in by one
placeholder element) as after the prefix. The top-level fields before ``messages`` were decoded
once from the prefix's own bytes (``<prefix up to the array>0}``), so duplicate keys resolve as
in a whole decode (last one wins, first one's place); a ``messages`` key repeated in the rest
(it would replace the array) is seen by where its value lies, and such a body, like any body the
rest of which fails to decode, is decoded whole, so its errors read as before. Property tests
compare every answer with a whole decode.

The kept bodies are found by xxh3 of the 2 kB before their 64th, 128th, 256th... kB (the ladder's
rungs): a body is looked up at the longest rung it may share with a kept one, so chats sharing a
long system prompt are told apart by the history after it (a key only finds candidates: the
comparison decides). The memo is bounded by bytes (LRU): a kept body is charged its bytes, their
text decoded, and an upper bound of the objects its messages decode to (``_charges``). Used from
the event loop only (not thread-safe).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgspec
import numpy as np
import xxhash

MIN_BYTES = 64 << 10  # shorter bodies are decoded whole (a hit costs ~10 µs of bookkeeping: less only past ~50 kB)
LADDER_TOP = 64 << 20  # the longest rung
BUCKET = 8  # kept bodies filed under one rung key (the most recent ones)
MAX_COMPARES = 3  # message ends tried with a full comparison per kept body
MAX_GUARDS = 64  # message ends tried at all per kept body, the last ones (a continuation shares nearly all)
MAX_MESSAGES = 1 << 16  # bodies with more messages are decoded whole (no chat has them; bounds held lists)
_GUARD = 32  # bytes before a message's end compared first (most wrong ends differ there)
RUNG_WINDOW = 2048  # bytes before a rung that file a body under it (hashing all of them cost ~25 µs at 128k)
_OPEN = b'{"messages":[0'
_FEW = 8  # message ranges counted, or items located, one by one; more at once (numpy)
_SCAN = 4096  # bytes of a non-ASCII range scanned by a regex for its widest character; more by numpy
_ASTRAL = re.compile(rb"[\xf0-\xff]|\\u[dD][89abAB]")  # a 4-byte UTF-8 lead or a high surrogate's escape
_WIDE = re.compile(rb"[\xc4-\xef]|\\u(?!00)")  # a lead byte past U+00FF or an escape not below U+0100
_ARRAY_AT = len(b'{"messages":')  # where the array of a decoded stand-in must lie

_decode = msgspec.json.Decoder().decode
_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_raw_items = msgspec.json.Decoder(list[msgspec.Raw]).decode


def _address(buffer: Any) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def rung_keys(body: bytes, *, lowest: int = MIN_BYTES, seed: int = 0) -> list[tuple[int, int]]:
    """The body's (rung, key) pairs, longest rung first: rungs double from ``lowest`` up to
    ``LADDER_TOP``; each key hashes the ``RUNG_WINDOW`` bytes before its rung, chained from the key of
    the rung below (the lowest from ``seed``). A body that continues another shares its rungs' keys
    up to where it goes on, so a lookup by them finds the bodies it may continue."""
    view = memoryview(body)
    out = []
    key = seed
    rung = lowest
    while rung <= min(len(body), LADDER_TOP):
        key = xxhash.xxh3_64_intdigest(view[rung - RUNG_WINDOW : rung], seed=key)
        out.append((rung, key))
        rung *= 2
    return out[::-1]


@dataclass(slots=True)
class _Kept:
    """A decoded chat body: its bytes, and once asked for, where its messages end and what they
    and the top-level fields before them decode to (``ends`` None: not worked out yet;
    empty: unusable, e.g. ``messages`` is not an array)."""

    data: bytes
    keys: list[tuple[int, int]]  # the rungs it is filed under
    ends: list[int] | None = None
    messages: list[Any] | None = None
    head: dict[str, Any] | None = None  # fields before the array, ``messages`` among them
    weights: list[int] | None = None  # bytes charged for the decoded values up to each message's end
    cost: int = 0  # bytes charged for it in all (``_cost``)


class BodyMemo:
    """``decode`` equals ``msgspec.json.decode`` of the body; long chat bodies that repeat a kept
    one up to a message's end decode only what follows."""

    def __init__(self, *, max_bytes: int = 64 << 20) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # id -> body, least recent first
        self._index: dict[tuple[int, int], list[int]] = {}  # (rung, its key: ``_keys``) -> ids, oldest first
        self._bytes = 0
        self._next_id = 0
        self.hits = 0
        self.misses = 0
        self.reused_bytes = 0  # bytes of bodies taken from the memo, not decoded

    def decode(self, body: bytes) -> Any:
        """The body's JSON value; raises what ``msgspec.json.decode`` raises."""
        if len(body) < MIN_BYTES or not self.max_bytes:
            return _decode(body)
        hashes = rung_keys(body)
        best: tuple[int, int, int] | None = None  # (bytes reused, kept id, message index)
        tried: set[int] = set()
        for rung, key in hashes:
            for kept_id in reversed(list(self._index.get((rung, key), ()))):
                kept = self._kept.get(kept_id)  # None: dropped while working out another one
                if kept is None or kept_id in tried:
                    continue
                tried.add(kept_id)
                found = self._longest(kept, body)
                if found is not None and (best is None or found[0] > best[0]):
                    best = (found[0], kept_id, found[1])
                    if best[0] >= rung - RUNG_WINDOW:  # past this rung's window: what it was filed for
                        break
            if best is not None and best[0] >= rung - RUNG_WINDOW:  # no shorter rung will do better
                break
        if best is not None and best[1] in self._kept:
            # made recent first: keeping the continued body may evict the least recent, this one too
            self._kept.move_to_end(best[1])
            value = self._decode_rest(self._kept[best[1]], best[2], body, hashes)
            if value is not None:
                self.hits += 1
                return value
        value = _decode(body)
        self.misses += 1
        messages = value.get("messages") if isinstance(value, dict) else None
        if isinstance(messages, list) and len(messages) <= MAX_MESSAGES:
            self._keep(_Kept(body, hashes))
        return value

    def clear(self) -> None:
        self._kept.clear()
        self._index.clear()
        self._bytes = 0

    # -- a kept body continued

    def _longest(self, kept: _Kept, body: bytes) -> tuple[int, int] | None:
        """The longest prefix of ``body`` that is ``kept``'s up to the end of its message *k*, as
        (its length, k); None: none long enough."""
        if kept.ends is None:
            _work_out(kept)
            self._charge(kept)
        ends = kept.ends
        assert ends is not None
        data = kept.data
        view = memoryview(data)
        compares = 0
        for k in range(len(ends) - 1, max(len(ends) - MAX_GUARDS, 0) - 1, -1):
            end = ends[k]
            if end < MIN_BYTES // 2 or compares >= MAX_COMPARES:
                return None
            if end > len(body) or body[end - _GUARD : end] != data[end - _GUARD : end]:
                continue
            compares += 1
            if body.startswith(view[:end]):
                return end, k
        return None

    def _decode_rest(self, kept: _Kept, k: int, body: bytes, hashes: list[tuple[int, int]]) -> dict[str, Any] | None:
        assert kept.ends is not None and kept.messages is not None and kept.head is not None
        cut = kept.ends[k]
        stand_in = _OPEN + body[cut:]
        try:
            fields = _raw_fields(stand_in)
            array = fields.pop("messages")
            if _address(array) - _address(stand_in) != _ARRAY_AT:
                return None  # a later "messages" replaced the array: decode whole
            items = _raw_items(array)
            if k + len(items) > MAX_MESSAGES:
                return None
            base = _address(stand_in) - cut + len(_OPEN)  # address of body[0], seen through stand_in
            new = _decode(array)[1:]  # one decode of the array, not one per message
            new_ends = _ends(body, items[1:], base)
            tail = {name: _decode(raw) for name, raw in fields.items()}
        except (msgspec.DecodeError, RecursionError, _Misplaced):
            return None  # decoded whole: the client is told that decode's error, if any
        self.reused_bytes += cut
        messages = kept.messages[: k + 1] + new
        value = dict(kept.head)
        value["messages"] = messages
        value.update(tail)
        assert kept.weights is not None
        weights = kept.weights[: k + 1]
        if new_ends:
            weights += list(accumulate(_charges(body, [cut, *new_ends]), initial=weights[-1]))[1:]
        self._keep(_Kept(body, hashes, kept.ends[: k + 1] + new_ends, messages, kept.head, weights))
        return value

    # -- bookkeeping

    def _keep(self, kept: _Kept) -> None:
        kept.cost = _cost(kept)
        if kept.cost > self.max_bytes:
            return
        kept_id = self._next_id
        self._next_id += 1
        self._kept[kept_id] = kept
        self._bytes += kept.cost
        for key in kept.keys:
            bucket = self._index.setdefault(key, [])
            bucket.append(kept_id)
            if len(bucket) > BUCKET:
                del bucket[0]  # no longer found there; the byte bound evicts it
        self._shrink()

    def _charge(self, kept: _Kept) -> None:
        """Charge a kept body anew (its messages were decoded since), then keep to the bound."""
        cost = _cost(kept)
        self._bytes += cost - kept.cost
        kept.cost = cost
        self._shrink()

    def _shrink(self) -> None:
        while self._bytes > self.max_bytes and self._kept:
            self._drop(next(iter(self._kept)))

    def _drop(self, kept_id: int) -> None:
        kept = self._kept.pop(kept_id, None)
        if kept is None:
            return
        self._bytes -= kept.cost
        for key in kept.keys:
            bucket = self._index.get(key)
            if bucket is not None and kept_id in bucket:  # a short list
                bucket.remove(kept_id)
                if not bucket:
                    del self._index[key]


def _work_out(kept: _Kept) -> None:
    """Where the kept body's messages end, their values, and the fields before the array."""
    kept.ends = []
    data = kept.data
    try:
        array = _raw_fields(data)["messages"]
        at = _address(array) - _address(data)
        items = _raw_items(array)
        if not items:
            return
        if len(items) > MAX_MESSAGES:
            return
        head = _decode(data[:at] + b"0}")
        messages = _decode(array)
        ends = _ends(data, items, _address(data))
    except (msgspec.DecodeError, KeyError, RecursionError, _Misplaced):  # not an array, or nothing to keep
        return
    weights = list(accumulate(_charges(data, [0, at, *ends])))  # the head's first
    kept.ends, kept.messages, kept.head, kept.weights = ends, messages, head, weights[1:]


def _charges(data: bytes, bounds: list[int]) -> list[int]:
    """Upper bounds of the bytes the values decoded from each ``data[bounds[i]:bounds[i + 1]]``
    take: every object, array and element (an object's 256 and an element's 64 bytes cover
    CPython's dict, list, small string and int), found by counting ``{``, ``[`` and ``,`` (those
    inside strings only add to the bound), and its text at the widest character any string in it
    may hold: Python keeps a string at 1, 2 or 4 bytes a character by its widest one, and no
    character takes less than a byte of JSON. Wide: a UTF-8 lead byte past U+00FF or a ``\\u``
    escape not ``\\u00``; astral: a 4-byte lead or a high surrogate's escape.
    A few ranges (a hit's new messages) are counted one by one (numpy's calls cost more than
    that), many with a few vectorised passes over the bytes, no Python per message."""
    if len(bounds) > _FEW + 1:
        return _charges_at_once(data, bounds)
    out = []
    for start, end in zip(bounds, bounds[1:]):
        part = data[start:end]
        if part.isascii() and b"\\u" not in part:
            width = 1
        elif len(part) <= _SCAN:
            width = 4 if _ASTRAL.search(part) else 2 if _WIDE.search(part) else 1
        else:
            return _charges_at_once(data, bounds)
        out.append(256 * part.count(b"{") + 64 * (part.count(b"[") + part.count(b",")) + width * len(part))
    return out


def _charges_at_once(data: bytes, bounds: list[int]) -> list[int]:
    """``_charges`` in a few vectorised passes over the bytes."""
    lo = bounds[0]
    raw = np.frombuffer(data, dtype=np.uint8)[lo : bounds[-1]]
    cuts = np.asarray(bounds, dtype=np.int64) - lo

    def in_each(positions: np.ndarray) -> np.ndarray:  # how many of the sorted positions lie in each range
        return np.diff(np.searchsorted(positions, cuts))

    objects = in_each(np.flatnonzero(raw == 0x7B))
    elements = in_each(np.flatnonzero((raw == 0x5B) | (raw == 0x2C)))
    slashes = np.flatnonzero(raw == 0x5C)
    slashes = slashes[slashes + 3 < len(raw)]
    escapes = slashes[raw[slashes + 1] == 0x75]  # backslash u
    first, second = raw[escapes + 2], raw[escapes + 3]
    wide_escapes = escapes[(first != 0x30) | (second != 0x30)]
    astral_escapes = escapes[((first | 0x20) == 0x64) & np.isin(second | 0x20, (0x38, 0x39, 0x61, 0x62))]  # \ud8-\udb
    wide = in_each(np.union1d(np.flatnonzero((raw >= 0xC4) & (raw < 0xF0)), wide_escapes))
    astral = in_each(np.union1d(np.flatnonzero(raw >= 0xF0), astral_escapes))
    width = np.where(astral > 0, 4, np.where(wide > 0, 2, 1))
    return (256 * objects + 64 * elements + width * np.diff(cuts)).tolist()


def _cost(kept: _Kept) -> int:
    """Bytes a kept body is charged: its bytes and, once its messages are decoded, what they
    decode to (``_charges``); before, as much again (its text, at most as long, held while worked
    out). Later turns share the decoded messages, so a chat is charged more than it holds."""
    decoded = kept.weights[-1] if kept.weights else len(kept.data)
    return len(kept.data) + decoded


class _Misplaced(Exception):
    """A raw value does not lie where its address says (never seen: msgspec slices its input)."""


def _ends(data: bytes, items: list[msgspec.Raw], base: int) -> list[int]:
    """Where each item ends in ``data``, whose first byte is at ``base``: checked to be its bytes.

    The first item is found by its address, the separator by the second's; that the items joined
    by it are the bytes from the first on (one memcmp) proves every separator is that one (a
    separator is whitespace and a comma, an item starts with neither), so the ends are a running
    sum of the lengths. Items spaced unevenly are located one by one, if few."""
    if len(items) <= _FEW:
        return _ends_one_by_one(data, items, base)
    start = _address(items[0]) - base
    first = len(items[0])
    if start < 0 or not data.startswith(memoryview(items[0]), start):
        raise _Misplaced
    gap = _address(items[1]) - base - start - first
    if gap < 1:
        raise _Misplaced
    separator = data[start + first : start + first + gap]
    if data.startswith(separator.join(items), start):  # bytes.join takes any buffer
        lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
        return (np.cumsum(lengths + gap) + (start - gap)).tolist()
    if len(items) > MAX_GUARDS:
        raise _Misplaced
    return _ends_one_by_one(data, items, base)


def _ends_one_by_one(data: bytes, items: list[msgspec.Raw], base: int) -> list[int]:
    ends = []
    for item in items:
        start = _address(item) - base
        end = start + len(item)
        if start < 0 or end > len(data) or not data.startswith(memoryview(item), start):  # a memcmp
            raise _Misplaced
        ends.append(end)
    return ends
