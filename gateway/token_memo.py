"""JSON decoding of a ``/v1/completions`` body whose prompt is a long array of token IDs that
repeats a body seen before, without parsing the repeat.

An agent resending its growing token-ID history each turn sends ~0.9 MB of digits at 128k
tokens; a whole ``msgspec`` decode builds a list of 128k ints (~3 ms here) that the tokenizer
then copies into an array (~0.5 ms). The next turn's body begins with the bytes of the previous
one up to the end of one of its tokens. ``TokenMemo`` keeps recent long token-ID bodies with
their IDs (uint32) and where every ``STRIDE``-th token ends; a body that starts with the very
bytes of a kept one up to such an end (``bytes.startswith``: a memcmp, ~15 µs for 0.9 MB) takes
those IDs and parses only the rest (``_parse``, numpy).

What ``_parse`` accepts is exactly ``number (, spaces number)*``: decimal integers below 10**8
(no sign, fraction, exponent or leading zero), a comma and the same number of spaces between
them. The rest of the body (the fields before the array and after it, from this body's bytes)
is decoded by msgspec with the array stood in by ``[0``, before the new IDs are parsed: JSON is
context-free, so once the new IDs are known to be valid, the body is valid iff the stand-in is,
and decodes the same but for the array; that a later ``prompt`` key does not replace the array
is checked by where msgspec finds the stand-in's ``prompt``. A body that continues a kept one but
is anything else (broken, or valid of another shape) is declined (``decode`` answers None) and
decoded whole once by the caller, so every error reads as before and no body is read twice.
A body seen the first time is decoded whole by msgspec (a numpy parse of the whole array was
measured slower: ~4.7 ms against ~3.2 ms at 128k); its IDs are validated as ``parse_request``
validates a list, and handed on as a read-only uint32 array, so they are converted once.

Kept bodies are found by xxh3 of the 2 kB before their 32nd, 64th, 128th… kB, chained from an
xxh3 of the bytes before their prompt array (a key only names candidates: the byte comparison
decides), so tenants whose bodies differ only in a field before the prompt are filed apart. Where a kept body's tokens end is worked out when it is
first a candidate (one numpy pass over its array), and carried over to the bodies continuing it.
Bounded by bytes (LRU): a kept body is charged its bytes, its IDs, its ends and ``OVERHEAD``,
and holds nothing else (no decoded field: ``[{},{},…]`` decodes to ~20x its bytes). Per
body, at most ``MAX_COMPARES`` kept ones are compared, each no longer than twice the body, so a
client cannot make a body cost more than a few passes over its own length beside its decode.
Used from the event loop only (not thread-safe).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash

from gateway.body_memo import RUNG_WINDOW, rung_keys  # the same ladder of rungs as chat bodies'
from tokenizer.errors import InvalidPrompt
from tokenizer.openai_body import token_ids_array

MIN_BYTES = 32 << 10  # shorter bodies (~5k tokens) are decoded whole: numpy's calls cost more than msgspec's below
STRIDE = 16  # a kept body's IDs are reused up to the end of a token whose index + 1 is a multiple of this
BUCKET = 8  # kept bodies filed under one rung key (the most recent ones)
MAX_COMPARES = 3  # kept bodies compared with a body, at most
MAX_LONGER = 2  # kept bodies longer than this many times a body are not worked out for it
MAX_SPACES = 4  # spaces after each comma accepted (json.dumps puts one)
OVERHEAD = 1024  # bytes charged a kept body beyond its arrays (its objects, index entries, head)
_CHUNK = 64 << 10  # bytes compared at a time while looking for the first difference
_PROMPT = re.compile(rb'"prompt"[ \t\n\r]*:[ \t\n\r]*\[')
_FEW_BYTES = 4096
_FEW_IDS = re.compile(rb"(?:0|[1-9][0-9]{0,7})(?:[ \t\n\r]*,[ \t\n\r]*(?:0|[1-9][0-9]{0,7}))*")  # JSON's own grammar
_NUMBER = re.compile(rb"[0-9]+")
_ZEROS = np.uint64(0x3030303030303030)
_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
_PAIRS = np.uint64(0x000000FF000000FF)

_decode = msgspec.json.Decoder().decode
_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def _address(buffer: Any) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def _parse(body: bytes, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``body[start:stop]`` as ``number (, spaces number)*``: the numbers (uint32) and where each
    ends (exclusive, in ``body``); None when it is anything else. A few bytes are read by a regex
    (numpy's ~25 calls cost ~60 µs however short the input), more in a few numpy passes."""
    length = stop - start
    if length <= 0:
        return None
    if length <= _FEW_BYTES:
        if _FEW_IDS.fullmatch(body, start, stop) is None:
            return None
        found = list(_NUMBER.finditer(body, start, stop))
        return (np.array([int(m.group()) for m in found], dtype=np.uint32),
                np.array([m.end() for m in found], dtype=np.int64))
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


def _rungs(body: bytes, at: int) -> list[tuple[int, int]]:
    """The body's (rung, key) pairs, longest rung first, chained from the hash of the body's bytes
    up to its first prompt array (``at``): bodies alike but for a field before the prompt (tenants
    with one layout) are filed apart, so a body's few compares go to bodies it may continue."""
    return rung_keys(body, lowest=MIN_BYTES, seed=xxhash.xxh3_64_intdigest(memoryview(body)[:at]))


@dataclass(slots=True)
class _Store:
    """IDs shared by the kept bodies of one growing prompt: each holds a read-only view of its
    first tokens; a body that goes on where the longest one ends writes past ``used`` (its views
    never change) instead of copying them all (a 512 kB copy cost ~50–270 µs in fresh pages)."""

    arr: np.ndarray  # uint32; read-only for a body decoded whole (it is the array handed on)
    used: int


@dataclass(slots=True)
class _Kept:
    """A decoded token-ID body: its bytes and IDs; once worked out, where its array opens and
    where every ``STRIDE``-th token ends (``cuts`` None: not yet; empty: unusable). Nothing decoded
    beside the IDs is kept (fields decode to many times their bytes: ``{}`` is a 64-byte dict), so
    what a kept body holds is what it is charged."""

    data: bytes
    keys: list[tuple[int, int]]
    ids: np.ndarray
    store: _Store
    at: int = -1  # the index of its prompt array's ``[``
    cuts: np.ndarray | None = None  # int64: the end of tokens STRIDE-1, 2*STRIDE-1, ...
    cost: int = 0


_NONE = np.zeros(0, dtype=np.int64)
_DECLINED = object()  # a body that continues a kept one but is not what _rest reads


def _as_ids(prompt: Any) -> np.ndarray | None:
    """A decoded flat token-ID prompt as a read-only uint32 array, validated as ``parse_request``
    validates a list (the vocabulary aside: it checks that on the array); None: anything else."""
    if type(prompt) is not list or not prompt or type(prompt[0]) is not int:
        return None
    try:
        ids = token_ids_array(prompt, vocab_size=1 << 32, where="'prompt'")
    except InvalidPrompt:
        return None  # the list stays: parse_request words the error
    ids.setflags(write=False)
    return ids


def _extend(kept: _Kept, tokens: int, new: np.ndarray) -> _Store:
    """A store whose first ``tokens + len(new)`` IDs are ``kept``'s first ``tokens`` and ``new``:
    ``kept``'s own when what it holds past ``tokens`` is ``new``'s beginning (a prompt going on
    where its last body ended) and there is room; else a copy with room to grow."""
    store, end = kept.store, tokens + len(new)
    overlap = min(store.used, end) - tokens
    if store.arr.flags.writeable and end <= len(store.arr) and np.array_equal(store.arr[tokens : tokens + overlap], new[:overlap]):
        if end > store.used:
            store.arr[store.used : end] = new[overlap:]
            store.used = end
        return store
    arr = np.empty(end + max(end // 4, 4096), dtype=np.uint32)
    arr[:tokens] = kept.ids[:tokens]
    arr[tokens:end] = new
    return _Store(arr, end)


def _work_out(kept: _Kept) -> None:
    """Where the kept body's array lies and where its tokens end."""
    kept.cuts = _NONE
    data = kept.data
    found = _PROMPT.search(data)
    if found is None:
        return
    at = found.end() - 1
    close = data.find(b"]", at)
    if close < 0:
        return
    stand_in = data[: at + 1] + b"0" + data[close:]
    try:
        array = _raw_fields(stand_in).get("prompt")
        if array is None or _address(array) - _address(stand_in) != at or bytes(array) != b"[0]":
            return  # the first prompt array is not the one decoded (nested, or replaced)
    except (msgspec.DecodeError, RecursionError):
        return
    commas = np.flatnonzero(np.frombuffer(data, dtype=np.uint8, count=close - at - 1, offset=at + 1) == 44)
    if len(commas) != len(kept.ids) - 1:
        return
    kept.at = at
    kept.cuts = commas[STRIDE - 1 :: STRIDE] + (at + 1)


def _first_difference(body: bytes, data: bytes, limit: int) -> int:
    """The first index below ``limit`` where ``body`` and ``data`` differ (``limit`` if none):
    memcmps of ``_CHUNK`` bytes, then numpy within the chunk that differs."""
    view = memoryview(data)
    pos = 0
    while pos < limit:
        end = min(pos + _CHUNK, limit)
        if not body.startswith(view[pos:end], pos):
            while end - pos > 64:  # halve the chunk that differs: memcmps, no copies
                mid = (pos + end) // 2
                if body.startswith(view[pos:mid], pos):
                    pos = mid
                else:
                    end = mid
            while pos < end and pos < len(body) and body[pos] == data[pos]:
                pos += 1
            return pos
        pos = end
    return limit


class TokenMemo:
    """``decode`` equals ``msgspec.json.decode`` of a long body with a ``prompt`` array, a flat
    token-ID prompt handed on as a read-only uint32 array; such bodies that repeat a kept one up
    to a token's end parse only what follows."""

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
        self.worked_out_bytes = 0  # bytes of kept bodies scanned for their token ends, in all
        self.reused_tokens = 0
        self.compared_bytes = 0  # bytes memcmp'd against kept bodies, in all (bounded per body)
        self.declined = 0  # bodies that continued a kept one but were then declined (broken, or of another shape)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def decode(self, body: bytes) -> Any:
        """The body's JSON value, a flat token-ID prompt as a read-only uint32 array; raises what
        ``msgspec.json.decode`` raises. None: not a long token-ID body (decode it as any other)."""
        found = _PROMPT.search(body) if len(body) >= MIN_BYTES else None
        if found is None:
            return None
        keys = _rungs(body, found.end() - 1) if self.max_bytes else []
        if self._kept:
            value = self._continue(body, keys)
            if value is _DECLINED:
                self.declined += 1
                return None  # it continues a kept body but is not what _rest reads: decoded whole once, by the caller
            if value is not None:
                self.hits += 1
                return value
        value = _decode(body)
        self.misses += 1
        ids = _as_ids(value.get("prompt")) if isinstance(value, dict) else None
        if ids is not None:
            value["prompt"] = ids
            if keys:
                self._keep(_Kept(body, keys, ids, _Store(ids, len(ids))))
        return value

    def clear(self) -> None:
        self._kept.clear()
        self._index.clear()
        self._bytes = 0

    # -- a kept body continued

    def _continue(self, body: bytes, keys: list[tuple[int, int]]) -> Any:
        """The body's value when it continues a kept body; None: it continues none; ``_DECLINED``:
        it continues one but is not what ``_rest`` reads (the caller decodes it whole, once)."""
        best: tuple[int, int, int] | None = None  # (tokens reused, bytes reused, kept id)
        compares = 0
        tried: set[int] = set()
        for rung, key in keys:
            for kept_id in reversed(self._index.get((rung, key), ())):
                kept = self._kept.get(kept_id)
                if kept is None or kept_id in tried or compares >= MAX_COMPARES:
                    continue
                tried.add(kept_id)
                if kept.cuts is None:
                    if len(kept.data) > MAX_LONGER * len(body):
                        continue
                    _work_out(kept)
                    self.worked_out_bytes += len(kept.data)
                assert kept.cuts is not None
                if not len(kept.cuts):
                    continue
                compares += 1
                limit = min(len(body), int(kept.cuts[-1]) + 1)
                differ = _first_difference(body, kept.data, limit)
                self.compared_bytes += differ
                i = int(np.searchsorted(kept.cuts, differ, side="right")) - 1
                if i >= 0 and kept.cuts[i] == differ and differ < len(body) and 48 <= body[differ] <= 57:
                    i -= 1  # the token goes on in this body: the one before is the last shared
                if i >= 0 and (best is None or (i + 1) * STRIDE > best[0]):
                    best = ((i + 1) * STRIDE, int(kept.cuts[i]), kept_id)
                    if best[1] >= rung - RUNG_WINDOW:
                        break  # what this rung was filed for is reused: no other body does much better
            if compares >= MAX_COMPARES or (best is not None and best[1] >= rung - RUNG_WINDOW):
                break  # what this rung was filed for is reused: no shorter rung does better
        if best is None:
            return None
        kept = self._kept[best[2]]
        self._kept.move_to_end(best[2])
        return self._rest(kept, best[0], body, keys)

    def _rest(self, kept: _Kept, tokens: int, body: bytes, keys: list[tuple[int, int]]) -> Any:
        """The body's value from ``kept``'s first ``tokens`` IDs and its own new ones; the fields
        around the array are decoded first (from this body's bytes: a few, as a rule), so a body
        broken there is declined before its new IDs are parsed."""
        assert kept.cuts is not None and kept.at >= 0
        at = kept.at  # body[:cut] is kept.data[:cut], and at < cut
        cut = int(kept.cuts[tokens // STRIDE - 1])
        close = body.find(b"]", cut)
        if close < 0:
            return _DECLINED
        stand_in = body[: at + 1] + b"0" + body[close:]
        try:
            fields = _raw_fields(stand_in)
            array = fields.get("prompt")
            if array is None or _address(array) - _address(stand_in) != at:
                return _DECLINED  # a later "prompt" replaced the array
            value = {name: _decode(raw) for name, raw in fields.items()}
        except (msgspec.DecodeError, RecursionError):
            return _DECLINED
        parsed = _parse(body, cut - 1, close)  # from the shared token's last digit: a number, then the new ones
        if parsed is None:
            return _DECLINED
        new_ids, new_ends = parsed
        store = _extend(kept, tokens, new_ids[1:])
        ids = store.arr[: tokens + len(new_ids) - 1]
        ids.setflags(write=False)
        value["prompt"] = ids
        self.reused_tokens += tokens
        cuts = np.concatenate((kept.cuts[: tokens // STRIDE], new_ends[STRIDE::STRIDE]))
        self._keep(_Kept(body, keys, ids, store, at, cuts))
        return value

    # -- bookkeeping

    def _keep(self, kept: _Kept) -> None:
        if not kept.keys or len(kept.ids) < STRIDE:
            return
        # its store whole (shared by a growing prompt's bodies: charged to each), its cuts worked out or not
        kept.cost = len(kept.data) + kept.store.arr.nbytes + 8 * (len(kept.ids) // STRIDE) + OVERHEAD
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
