"""Cut a rendered prompt given as the template's output chunks, without joining the long ones.

A continuing chat's rendered prompt is mostly its history: a few long chunks (a message's content,
often with the template's special token glued on, e.g. ``'<｜User｜>' + content``) between short
ones. Joining them into one text and cutting that at added tokens costs passes over the whole
history per request (at 128k tokens ~0.1 ms, most of it Python copying an ASCII content out of a
text that the template's non-ASCII special tokens made two bytes a character). Here each long
chunk is cut on its own, and the cut of a long chunk met before (the same text, checked for
equality at memory speed; kept from its second sighting, so one-off prompts do not evict it) is
reused with the pieces already sliced out of it and their token IDs.

Why this is exact: ``AddedTokenSplitter`` matches added tokens left to right, leftmost-longest,
and a match is at most ``L`` characters long (the longest added token). Call a position *p* of
the text a *boundary* when no match can begin in the ``L - 1`` characters before it (no character
there is one an added token starts with). No match spans a boundary, and matching restarted at a
boundary finds what matching the whole text finds from there. A long chunk is cut on its own
between the first boundary inside it (``a``) and the last (``b``); what lies before ``a`` and
after ``b`` joins the short text around it, which is cut as a whole. A chunk with no such
boundaries joins its neighbours. Property tests compare the result with ``split`` of the joined
text, chunk boundaries inside and around added tokens included.
"""

from __future__ import annotations

import sys
import threading
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from tokenizer.segments import AddedTokenSplitter

_Cut = tuple[int, int, int]  # (start, end, token id)

LONG_CHUNK_CHARS = 1024
"""Chunks at least this long are cut on their own; a prompt with none is joined and cut as before.
At 4,096 a 1k-token chat's history message (~3.5k characters) was joined and scanned again every
turn (~15 µs of a ~210 µs decision); kept with its cut it costs a lookup and a memcmp."""

_FINGERPRINT = 32  # characters of a chunk's head, middle and tail the memo is keyed by
_MAX_FIRSTS = 8  # more distinct first characters than this: boundaries are not looked for
_SEEN_KEYS = 8192  # fingerprints of long chunks remembered, so the memo keeps only chunks met twice
_MAX_WALK = 16  # candidates stepped over looking for a boundary near a chunk's end


@dataclass(slots=True)
class _Layout:
    """How one long chunk is cut: its own cuts between its boundaries ``a`` and ``b``, and the
    pieces already sliced out of it (by span) and their token IDs, so that a chunk seen again is
    neither sliced nor looked up in the segment cache again."""

    text: str
    a: int
    b: int
    cuts: list[_Cut]
    slices: dict[tuple[int, int], str] = field(default_factory=dict)
    ids: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # token IDs of those, once known
    cost: int = 0  # bytes charged to the memo while kept (``_cost``), fixed when kept


Origin = tuple[_Layout, tuple[int, int]]
"""Where a piece was sliced from: a kept long chunk and the span, under which its IDs can be kept."""


class ChunkSplitter:
    """``AddedTokenSplitter.split`` of a text given as chunks, with a byte-bounded memo of long
    chunks' cuts. Thread-safe (the memo's bookkeeping is under a lock)."""

    def __init__(self, splitter: AddedTokenSplitter, *, memo_bytes: int = 64 << 20, long_chars: int = LONG_CHUNK_CHARS) -> None:
        if memo_bytes < 0 or long_chars < 1:
            raise ValueError("memo_bytes must be >= 0 and long_chars >= 1")
        self.splitter = splitter
        self.long_chars = long_chars
        firsts = splitter.first_chars
        self._firsts = tuple(sorted(firsts)) if len(firsts) <= _MAX_FIRSTS else None
        self._reach = max(splitter.longest_token_chars - 1, 0)  # characters a match extends past its start
        self._memo: OrderedDict[tuple[int, str], _Layout] = OrderedDict()
        self._seen: OrderedDict[tuple[int, str], None] = OrderedDict()  # fingerprints met lately
        self._memo_bytes = memo_bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def split(self, chunks: list[str]) -> list[str | int]:
        """Pieces of ``"".join(chunks)``: exactly ``splitter.split`` of it."""
        return self.split_known(chunks)[0]

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._seen.clear()
            self._bytes = 0

    def split_known(self, chunks: list[str]) -> tuple[list[str | int], dict[int, Origin]]:
        """``split``, and for the pieces sliced out of a kept chunk (by index) where they came
        from: their token IDs can be kept there (``Origin``)."""
        splitter = self.splitter
        if not splitter.enabled or not self._firsts or not any(len(c) >= self.long_chars for c in chunks):
            return splitter.split("".join(chunks)), {}
        cuts: list[_Cut] = []
        layouts: dict[int, _Layout] = {}  # chunk index -> its layout
        group: list[str] = []  # short text since the last boundary, cut as a whole
        group_at = 0  # where that text begins in the whole
        at = 0  # where the current chunk begins
        for i, chunk in enumerate(chunks):
            layout = self._layout(chunk) if len(chunk) >= self.long_chars else None
            if layout is None:
                group.append(chunk)
            else:
                layouts[i] = layout
                group.append(chunk[: layout.a])
                cuts.extend(_shifted(splitter.cuts("".join(group)), group_at))
                cuts.extend(_shifted(layout.cuts, at))
                group, group_at = [chunk[layout.b :]], at + layout.b
            at += len(chunk)
        cuts.extend(_shifted(splitter.cuts("".join(group)), group_at))
        return _Pieces(chunks, layouts).between(cuts, at)

    def _layout(self, chunk: str) -> _Layout | None:
        """The chunk's boundaries and cuts, from the memo when this very text was seen before."""
        n = len(chunk)
        mid = n // 2
        key = (n, chunk[:_FINGERPRINT] + chunk[mid : mid + _FINGERPRINT] + chunk[-_FINGERPRINT:])
        with self._lock:
            layout = self._memo.get(key)
            if layout is not None:
                self._memo.move_to_end(key)
        if layout is not None and layout.text == chunk:  # the same object, or equal text: a memcmp
            self.hits += 1
            # Keep the latest of equal texts: a chat's next turn brings this very object when its
            # body's history was not decoded again (gateway.body_memo), and is then not compared.
            layout.text = chunk
            return layout
        self.misses += 1
        bounds = self._boundaries(chunk)
        if bounds is None:
            return None
        a, b = bounds
        layout = _Layout(chunk, a, b, self.splitter.cuts(chunk, a, b))
        with self._lock:  # kept from its second sighting on: a prompt seen once would only evict
            seen = key in self._seen
            self._seen[key] = None
            self._seen.move_to_end(key)
            if len(self._seen) > _SEEN_KEYS:
                self._seen.popitem(last=False)
        if not seen or not self._memo_bytes:
            return layout  # not costed: measuring a non-ASCII chunk's UTF-8 is a pass over it (~0.5 ms at 128k tokens)
        layout.cost = _cost(chunk, len(layout.cuts))
        if layout.cost <= self._memo_bytes:
            with self._lock:
                old = self._memo.pop(key, None)
                if old is not None:
                    self._bytes -= old.cost
                self._memo[key] = layout
                self._bytes += layout.cost
                while self._bytes > self._memo_bytes:
                    _, dropped = self._memo.popitem(last=False)
                    self._bytes -= dropped.cost
        return layout

    def _next(self, text: str, start: int) -> int:
        """The first position at or after ``start`` where a match may begin (-1: none)."""
        found = [i for i in (text.find(c, start) for c in self._firsts) if i >= 0]  # type: ignore[union-attr]
        return min(found) if found else -1

    def _prev(self, text: str, end: int) -> int:
        """The last position before ``end`` where a match may begin (-1: none)."""
        return max(text.rfind(c, 0, end) for c in self._firsts)  # type: ignore[union-attr]

    def _boundaries(self, chunk: str) -> tuple[int, int] | None:
        """The first and last boundary inside ``chunk`` (positions whose ``reach`` characters
        before lie in the chunk and begin no match), or None when there are none apart."""
        reach, n = self._reach, len(chunk)
        a = -1
        p = self._next(chunk, 0)
        if p < 0 or p >= reach:
            a = reach
        else:
            for _ in range(_MAX_WALK):
                q = self._next(chunk, p + 1)
                if q < 0 or q > p + reach:  # the reach after p is clear: a boundary right after it
                    a = p + reach + 1
                    break
                p = q
        b = -1
        p = self._prev(chunk, n)
        if p < n - reach:
            b = n
        else:
            for _ in range(_MAX_WALK):
                q = self._prev(chunk, p)
                if q < p - reach and p >= reach:  # the reach before p is clear: p is a boundary
                    b = p
                    break
                if q < 0:
                    break
                p = q
        if a < 0 or b < 0 or a > b or b > n:
            return None
        return a, b


def _shifted(cuts: list[_Cut], by: int) -> list[_Cut]:
    return [(s + by, e + by, t) for s, e, t in cuts] if by else cuts


_PIECE_BYTES = 256  # a slice's and an ID array's object headers and their dict entries, per cut


def _cost(chunk: str, cuts: int) -> int:
    """Bytes a kept chunk may hold at most: its text, the pieces sliced out of it (no wider than
    the text), and their token IDs (four bytes a token, a token at least one UTF-8 byte: emoji
    take several tokens a character). Charged in full when kept, so the bound holds in memory."""
    utf8 = len(chunk) if chunk.isascii() else len(chunk.encode("utf-8", "surrogatepass"))
    return 2 * sys.getsizeof(chunk) + 4 * utf8 + (cuts + 1) * _PIECE_BYTES


class _Pieces:
    """Text pieces between cuts, taken from the chunks: a piece inside one long chunk is sliced
    once and kept in its layout; a piece across chunks is joined."""

    def __init__(self, chunks: list[str], layouts: dict[int, _Layout]) -> None:
        self.chunks = chunks
        self.layouts = layouts
        self.starts = [0, *accumulate(map(len, chunks))]
        self.origins: dict[int, Origin] = {}  # piece index -> the kept chunk it was sliced from

    def between(self, cuts: list[_Cut], length: int) -> tuple[list[str | int], dict[int, Origin]]:
        pieces: list[str | int] = []
        pos = 0
        for start, end, token_id in cuts:
            if start > pos:
                pieces.append(self.text(pos, start, len(pieces)))
            pieces.append(token_id)
            pos = end
        if pos < length:
            pieces.append(self.text(pos, length, len(pieces)))
        return pieces, self.origins

    def text(self, start: int, end: int, index: int) -> str:
        """The text of ``[start, end)``, which will be piece ``index``."""
        starts, chunks = self.starts, self.chunks
        i = bisect_right(starts, start) - 1  # the chunk holding ``start`` (never an empty one)
        lo = start - starts[i]
        if end <= starts[i + 1]:
            chunk = chunks[i]
            hi = end - starts[i]
            whole = lo == 0 and hi == len(chunk)
            layout = self.layouts.get(i)
            if layout is None:
                return chunk if whole else chunk[lo:hi]
            piece = layout.text if whole else layout.slices.get((lo, hi))  # the kept text: equal
            if piece is None:
                piece = layout.slices[(lo, hi)] = chunk[lo:hi]
            self.origins[index] = (layout, (lo, hi))
            return piece
        parts = [chunks[i][lo:]]
        j = i + 1
        while starts[j + 1] < end:
            parts.append(chunks[j])
            j += 1
        parts.append(chunks[j][: end - starts[j]])
        return "".join(parts)
