"""JSON decoding of a ``/v1/completions`` body whose prompt is a long array of token IDs, without
building a Python int for each ID, and without parsing again the IDs of a body seen before.

At 128k tokens such a prompt is ~0.9 MB of digits: a whole ``msgspec`` decode builds a list of
128k ints (~2.5–4 ms here) that the tokenizer then copies into an array (~1 ms). Here the array's
bytes are read by numpy instead (``_parse``): the separators are found in one pass, every byte is
accounted for by counts (digits, commas, the spaces after them), and each number is read from the
8 bytes before its end in a few uint64 operations. What this accepts is exactly a JSON array of
decimal integers below 10**8 (no sign, fraction, exponent or leading zero; ``,`` followed by the
same number of spaces each time, no other whitespace); anything else, a valid body of another
shape included, is declined (``decode`` returns None) and decoded whole by the caller, so every
error reads as before.

The rest of the body is decoded by msgspec with the array stood in by ``[0]``: JSON is
context-free, so once the array's inside is known to be a valid list of numbers, the body is
valid iff the stand-in is, and decodes the same but for the array. That the array found is the
top-level ``prompt`` (not one inside a string or a nested object, nor one a later ``prompt`` key
replaces) is checked by where msgspec finds the stand-in's ``prompt`` value.

A resent, growing token-ID prompt (an agent that sends its whole history each turn) starts with
the bytes of a kept body up to the end of one of its tokens: ``TokenMemo`` keeps recent long
bodies with their IDs and where every ``STRIDE``-th token ends, finds the kept body sharing the
longest byte prefix (``bytes.startswith``: a memcmp, ~15 µs for 0.9 MB), takes its IDs up to the
last such end before the first differing byte and parses only the rest. Kept bodies are found by
xxh3 of the 2 kB before their 32nd, 64th, 128th… kB (a key only names candidates: the byte
comparison decides). Bounded by bytes (LRU): a kept body is charged its bytes, its IDs, its ends
and ``OVERHEAD``. At most ``MAX_COMPARES`` kept bodies are compared per body, so a miss costs at
most that many memcmps of the body beside the parse. Used from the event loop only.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash

MIN_BYTES = 32 << 10  # shorter bodies (~5k tokens) are decoded whole: numpy's calls cost more than msgspec's below
LADDER_TOP = 64 << 20
STRIDE = 16  # a kept body's IDs are reused up to the end of a token whose index + 1 is a multiple of this
BUCKET = 8  # kept bodies filed under one rung key (the most recent ones)
MAX_COMPARES = 3  # kept bodies compared with a body, at most
MAX_SPACES = 4  # spaces after each comma accepted (json.dumps puts one)
OVERHEAD = 1024  # bytes charged a kept body beyond its arrays (its objects, index entries, head)
_WINDOW = 2048
_CHUNK = 64 << 10  # bytes compared at a time while looking for the first difference
_PROMPT = re.compile(rb'"prompt"[ \t\n\r]*:[ \t\n\r]*\[')
_OPEN = b'{"prompt":[0'
_ARRAY_AT = len(b'{"prompt":')
_ZEROS = np.uint64(0x3030303030303030)
_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
_PAIRS = np.uint64(0x000000FF000000FF)

_decode = msgspec.json.Decoder().decode
_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def _address(buffer: Any) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def _parse(body: bytes, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``body[start:stop]`` as ``number (, spaces number)*``: the numbers (uint32) and where each
    ends (exclusive, in ``body``); None when it is anything else."""
    length = stop - start
    if length <= 0:
        return None
    seg = np.frombuffer(body, dtype=np.uint8, count=length, offset=start)
    commas = np.flatnonzero(seg == 44)
    spaces_after = 0
    if len(commas):
        first = int(commas[0]) + 1
        while spaces_after <= MAX_SPACES and first + spaces_after < length and seg[first + spaces_after] == 32:
            spaces_after += 1
        if spaces_after > MAX_SPACES:
            return None
    spaces = int(np.count_nonzero(seg == 32))
    digits = int(np.count_nonzero((seg - np.uint8(48)) < 10))  # wraps below '0'
    if digits + len(commas) + spaces != length or spaces != spaces_after * len(commas):
        return None  # a byte that is none of these, or a space elsewhere
    starts = np.empty(len(commas) + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = commas + (1 + spaces_after)
    ends = np.empty(len(commas) + 1, dtype=np.int64)
    ends[:-1] = commas
    ends[-1] = length
    if len(commas) and commas[-1] + spaces_after >= length:
        return None
    for j in range(1, spaces_after + 1):  # with the counts: no space lies elsewhere
        if not (seg[commas + j] == 32).all():
            return None
    lengths = ends - starts
    if lengths.min() < 1 or lengths.max() > 8:
        return None  # an empty element, or a number of 9+ digits (no vocabulary has 10**8 IDs)
    if (seg[starts[lengths > 1]] == 48).any():
        return None  # a leading zero: not JSON
    ends += start
    if ends[0] < 8:
        return None
    # the 8 bytes before each end as one little-endian word: its number's digits in the top bytes
    words = np.ndarray(shape=(len(body) - 7,), dtype="<u8", buffer=body, strides=(1,))[ends - 8]
    mask = _ONES << ((8 - lengths) * 8).astype(np.uint64)
    v = (words & mask) - (_ZEROS & mask)  # digit values; the bytes before the number are zeros
    v = v * np.uint64(10) + (v >> np.uint64(8))
    v = ((v & _PAIRS) * np.uint64(100 + (1000000 << 32)) + ((v >> np.uint64(16)) & _PAIRS) * np.uint64(1 + (10000 << 32))) >> np.uint64(32)
    return v.astype(np.uint32), ends


def _rungs(body: bytes) -> list[tuple[int, int]]:
    """The body's (rung, key) pairs, longest rung first; each key hashes the window before its
    rung, chained from the key of the rung below."""
    view = memoryview(body)
    out = []
    key = 0
    rung = MIN_BYTES
    while rung <= min(len(body), LADDER_TOP):
        key = xxhash.xxh3_64_intdigest(view[rung - _WINDOW : rung], seed=key)
        out.append((rung, key))
        rung *= 2
    return out[::-1]


@dataclass(slots=True)
class _Kept:
    """A decoded token-ID body: its bytes, the fields before its array (decoded), its IDs and
    where every ``STRIDE``-th token ends."""

    data: bytes
    keys: list[tuple[int, int]]
    head: dict[str, Any]
    ids: np.ndarray
    cuts: np.ndarray  # int64: the end of tokens STRIDE-1, 2*STRIDE-1, ...
    cost: int = 0


def _first_difference(body: bytes, data: bytes, limit: int) -> int:
    """The first index below ``limit`` where ``body`` and ``data`` differ (``limit`` if none):
    memcmps of ``_CHUNK`` bytes, then numpy within the chunk that differs."""
    view = memoryview(data)
    pos = 0
    while pos < limit:
        end = min(pos + _CHUNK, limit)
        if not body.startswith(view[pos:end], pos):
            a = np.frombuffer(body, dtype=np.uint8, count=min(end, len(body)) - pos, offset=pos)
            b = np.frombuffer(data, dtype=np.uint8, count=len(a), offset=pos)
            differ = np.flatnonzero(a != b)
            return pos + int(differ[0]) if len(differ) else pos + len(a)
        pos = end
    return limit


class TokenMemo:
    """``decode`` returns ``msgspec.json.decode(body)`` with a flat token-ID ``prompt`` as a
    read-only uint32 array, or None (decode the body whole): not such a body, or not one this
    reads exactly (see the module's docstring)."""

    def __init__(self, *, max_bytes: int = 64 << 20) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._index: dict[tuple[int, int], list[int]] = {}
        self._bytes = 0
        self._next_id = 0
        self.hits = 0
        self.misses = 0
        self.declined = 0
        self.reused_tokens = 0
        self.compared_bytes = 0  # bytes memcmp'd against kept bodies, in all (bounded per body)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def decode(self, body: bytes) -> dict[str, Any] | None:
        if len(body) < MIN_BYTES:
            return None
        found = _PROMPT.search(body)
        if found is None:
            return None
        keys = _rungs(body) if self.max_bytes else []
        value = self._continue(body, keys) if self._kept else None
        if value is not None:
            self.hits += 1
            return value
        value = self._fresh(body, found.end() - 1, keys)
        if value is None:
            self.declined += 1
        else:
            self.misses += 1
        return value

    def clear(self) -> None:
        self._kept.clear()
        self._index.clear()
        self._bytes = 0

    # -- a body read without the memo

    def _fresh(self, body: bytes, at: int, keys: list[tuple[int, int]]) -> dict[str, Any] | None:
        close = body.find(b"]", at)
        if close < 0:
            return None
        parsed = _parse(body, at + 1, close)
        if parsed is None:
            return None
        ids, ends = parsed
        stand_in = body[: at + 1] + b"0" + body[close:]
        try:
            fields = _raw_fields(stand_in)
            array = fields.get("prompt")
            if array is None or _address(array) - _address(stand_in) != at or bytes(array) != b"[0]":
                return None  # not the top-level prompt, or a later one replaces it
            value = {name: ids if name == "prompt" else _decode(raw) for name, raw in fields.items()}
            head = _decode(body[:at] + b"0}") if keys else {}
        except (msgspec.DecodeError, RecursionError):
            return None
        ids.setflags(write=False)
        value["prompt"] = ids
        if keys:
            self._keep(_Kept(body, keys, head, ids, ends[STRIDE - 1 :: STRIDE].copy()))
        return value

    # -- a kept body continued

    def _continue(self, body: bytes, keys: list[tuple[int, int]]) -> dict[str, Any] | None:
        best: tuple[int, int, int] | None = None  # (tokens reused, bytes reused, kept id)
        compares = 0
        tried: set[int] = set()
        for rung, key in keys:
            for kept_id in reversed(self._index.get((rung, key), ())):
                kept = self._kept.get(kept_id)
                if kept is None or kept_id in tried or compares >= MAX_COMPARES:
                    continue
                tried.add(kept_id)
                compares += 1
                limit = min(len(body), int(kept.cuts[-1]) + 1) if len(kept.cuts) else 0
                differ = _first_difference(body, kept.data, limit)
                self.compared_bytes += differ
                i = int(np.searchsorted(kept.cuts, differ, side="right")) - 1
                if i >= 0 and kept.cuts[i] == differ and differ < len(body) and 48 <= body[differ] <= 57:
                    i -= 1  # the token goes on in this body: the one before is the last shared
                if i >= 0 and (best is None or (i + 1) * STRIDE > best[0]):
                    best = ((i + 1) * STRIDE, int(kept.cuts[i]), kept_id)
                    if best[1] >= rung - _WINDOW:
                        break  # what this rung was filed for is reused: no other body does much better
            if compares >= MAX_COMPARES or (best is not None and best[1] >= rung - _WINDOW):
                break  # what this rung was filed for is reused: no shorter rung does better
        if best is None:
            return None
        kept = self._kept[best[2]]
        self._kept.move_to_end(best[2])
        return self._rest(kept, best[0], body, keys)

    def _rest(self, kept: _Kept, tokens: int, body: bytes, keys: list[tuple[int, int]]) -> dict[str, Any] | None:
        cut = int(kept.cuts[tokens // STRIDE - 1])  # body[:cut] is kept.data[:cut]
        close = body.find(b"]", cut)
        if close < 0:
            return None
        parsed = _parse(body, cut - 1, close)  # from the shared token's last digit: a number, then the new ones
        if parsed is None:
            return None
        new_ids, new_ends = parsed
        stand_in = _OPEN + body[close:]
        try:
            fields = _raw_fields(stand_in)
            array = fields.pop("prompt")
            if _address(array) - _address(stand_in) != _ARRAY_AT:
                return None  # a later "prompt" replaced the array
            tail = {name: _decode(raw) for name, raw in fields.items()}
        except (msgspec.DecodeError, RecursionError, KeyError):
            return None
        ids = np.concatenate((kept.ids[:tokens], new_ids[1:]))
        ids.setflags(write=False)
        value = dict(kept.head)
        value["prompt"] = ids
        value.update(tail)
        self.reused_tokens += tokens
        cuts = np.concatenate((kept.cuts[: tokens // STRIDE], new_ends[STRIDE::STRIDE]))
        self._keep(_Kept(body, keys, kept.head, ids, cuts))
        return value

    # -- bookkeeping

    def _keep(self, kept: _Kept) -> None:
        if not kept.keys or not len(kept.cuts):
            return
        kept.cost = len(kept.data) + kept.ids.nbytes + kept.cuts.nbytes + OVERHEAD
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
                del bucket[0]
        while self._bytes > self.max_bytes and self._kept:
            self._drop(next(iter(self._kept)))

    def _drop(self, kept_id: int) -> None:
        kept = self._kept.pop(kept_id, None)
        if kept is None:
            return
        self._bytes -= kept.cost
        for key in kept.keys:
            bucket = self._index.get(key)
            if bucket is not None and kept_id in bucket:
                bucket.remove(kept_id)
                if not bucket:
                    del self._index[key]
