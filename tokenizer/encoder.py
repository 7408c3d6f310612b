"""Text → token IDs with a per-segment cache, so a multi-turn chat encodes only its new turn.

A prompt is cut at added-token occurrences (``segments.AddedTokenSplitter``); each text piece's
IDs come from a byte-bounded LRU or, on a miss, from ``Tokenizer.encode_batch_fast`` on all the
missing pieces at once. We call the batch API even for one piece: it releases the GIL (plain
``encode`` holds it, measured: a spinning thread drops to a tenth of its speed) and it skips the
offset bookkeeping (~20% faster). Special tokens of the post-processor (e.g. Llama's BOS) are not
part of any piece: they are detected once as a fixed prefix/suffix and put around the result; a
post-processor that does something else makes ``add_special_tokens=True`` encode whole texts.

The work is split in two steps — ``plan`` (cheap: split + cache lookups) and ``complete`` (encode
what is missing) — so the async caller can run only the second step in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from tokenizer.chunked import ChunkSplitter
from tokenizer.errors import InvalidPrompt
from tokenizer.lru import ByteBoundedLRU
from tokenizer.segments import AddedTokenSplitter

_EMPTY = np.zeros(0, dtype=np.uint32)
_EMPTY.setflags(write=False)


def _frozen(ids: list[int]) -> np.ndarray:
    arr = np.array(ids, dtype=np.uint32)
    arr.setflags(write=False)  # cached arrays are shared between requests
    return arr


@dataclass(slots=True)
class EncodePlan:
    """A split text: resolved parts, the text pieces still to encode, and the special-token wrap."""

    parts: list[np.ndarray | str]  # str = a missing piece, replaced by its IDs in ``complete``
    missing: list[str]  # distinct missing pieces, in first-seen order
    whole_text: str | None = None  # set when the post-processor cannot be expressed as a wrap
    wrap: bool = False
    text_bytes: int = -1  # UTF-8 length of the split text, summed over its pieces (-1: not split)

    @property
    def missing_chars(self) -> int:
        return sum(map(len, self.missing)) + (len(self.whole_text) if self.whole_text is not None else 0)


class SegmentedEncoder:
    """Cached, exact text encoding for one tokenizer; safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, *, cache_bytes: int, chunk_memo_bytes: int = 64 << 20) -> None:
        self.tokenizer = tokenizer
        self.cache = ByteBoundedLRU(cache_bytes)
        self.splitter = AddedTokenSplitter(tokenizer)
        self.chunks = ChunkSplitter(self.splitter, memo_bytes=chunk_memo_bytes)
        self._batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self._token_arrays: dict[int, np.ndarray] = {}
        self._token_bytes = self.splitter.token_utf8_lengths()
        self._prefix, self._suffix = self._special_wrap()

    def _special_wrap(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The post-processor's added IDs as (prefix, suffix), or (None, None) if it is not a wrap."""
        wraps: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for probe in ("a", "hello world"):
            inner = self.tokenizer.encode(probe, add_special_tokens=False).ids
            outer = self.tokenizer.encode(probe, add_special_tokens=True).ids
            n = len(inner)
            spots = [i for i in range(len(outer) - n + 1) if outer[i : i + n] == inner]
            if len(spots) != 1:
                return None, None
            wraps.add((tuple(outer[: spots[0]]), tuple(outer[spots[0] + n :])))
        if len(wraps) != 1:
            return None, None
        prefix, suffix = wraps.pop()
        if self.tokenizer.encode("", add_special_tokens=True).ids != list(prefix + suffix):
            return None, None
        return _frozen(list(prefix)), _frozen(list(suffix))

    def _token_array(self, token_id: int) -> np.ndarray:
        arr = self._token_arrays.get(token_id)
        if arr is None:
            arr = self._token_arrays[token_id] = _frozen([token_id])
        return arr

    def plan(self, text: str, *, add_special_tokens: bool) -> EncodePlan:
        """Split and look up; no tokenization happens here."""
        return self.plan_chunks([text], add_special_tokens=add_special_tokens)

    def plan_chunks(self, chunks: list[str], *, add_special_tokens: bool) -> EncodePlan:
        """``plan`` of ``"".join(chunks)``, whose long chunks are cut without joining them
        (``chunked``): a template's output chunks, for one."""
        if add_special_tokens and self._prefix is None:
            return EncodePlan([], [], whole_text="".join(chunks))
        pieces, origins = self.chunks.split_known(chunks)
        known = {i: ids for i, (layout, span) in origins.items() if (ids := layout.ids.get(span)) is not None}
        texts = [p for i, p in enumerate(pieces) if isinstance(p, str) and i not in known]
        found = iter(self.cache.get_many(texts))
        if known:
            self.cache.count_hits(len(known))
        parts: list[np.ndarray | str] = []
        missing: dict[str, None] = {}
        size = 0  # UTF-8 bytes, from the pieces: the text itself is often UCS-2 (the template's
        # special tokens) and encoding it whole to measure it cost ~1 ms at 128k tokens
        token_bytes = self._token_bytes
        for i, piece in enumerate(pieces):
            if isinstance(piece, int):
                parts.append(self._token_array(piece))
                size += token_bytes[piece]
                continue
            size += len(piece) if piece.isascii() else len(piece.encode("utf-8", "surrogatepass"))
            ids = known.get(i)
            if ids is None:
                ids = next(found)
                if ids is not None and i in origins:  # kept with the chunk: no lookup next time
                    layout, span = origins[i]
                    layout.ids[span] = ids
            if ids is None:
                missing[piece] = None
                parts.append(piece)
            else:
                parts.append(ids)
        return EncodePlan(parts, list(missing), wrap=add_special_tokens, text_bytes=size)

    def _encode_batch(self, texts: list[str], *, add_special_tokens: bool) -> list:
        try:
            return self._batch(texts, add_special_tokens=add_special_tokens)
        except TypeError as exc:  # the only str the Rust side refuses: one with lone surrogates
            raise InvalidPrompt("prompt text is not valid Unicode (it contains a lone surrogate)") from exc

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """Encode texts without special tokens, uncached. GIL released while encoding."""
        if not texts:
            return []
        return [_frozen(e.ids) for e in self._encode_batch(texts, add_special_tokens=False)]

    def encode_pieces(self, texts: list[str]) -> list[np.ndarray]:
        """Encode texts without special tokens and cache them."""
        arrays = self.encode_texts(texts)
        self.cache.put_many(zip(texts, arrays))
        return arrays

    def complete(self, plan: EncodePlan) -> np.ndarray:
        """Encode what ``plan`` misses and assemble the IDs (uint32, 1-D, read-only)."""
        if plan.whole_text is not None:
            return _frozen(self._encode_batch([plan.whole_text], add_special_tokens=True)[0].ids)
        if plan.missing:
            fresh = dict(zip(plan.missing, self.encode_pieces(plan.missing)))
            parts = [fresh[p] if isinstance(p, str) else p for p in plan.parts]
        else:
            parts = plan.parts  # type: ignore[assignment]
        if plan.wrap:
            parts = [self._prefix, *parts, self._suffix]  # type: ignore[list-item]
        if not parts:
            return _EMPTY
        if len(parts) == 1:
            return parts[0]  # type: ignore[return-value]
        out = np.concatenate(parts)  # type: ignore[arg-type]
        out.setflags(write=False)
        return out

    def head(self, plan: EncodePlan, *, fresh_chars: int, margin_tokens: int = 32) -> np.ndarray | None:
        """Token IDs of a leading part of the text that the full encoding is sure to start with,
        tokenizing at most ~``fresh_chars`` characters that are not cached (None: not possible).

        The first missing piece is cut just before a space and encoded without caching; only the
        last pre-token or two of a cut text can differ from the whole (pre-tokenizer regexes look
        at most one character ahead, BPE merges stay inside pre-tokens), and ``margin_tokens``
        more are dropped for good measure. A property test checks the prefix relation.
        """
        if plan.whole_text is not None:
            return None
        parts: list[np.ndarray] = [self._prefix] if plan.wrap and self._prefix is not None else []
        for part in plan.parts:
            if not isinstance(part, str):
                parts.append(part)
                continue
            cut = part.rfind(" ", 0, fresh_chars)
            while cut > 0 and part[cut - 1].isspace():  # cut after a word, never inside whitespace
                cut -= 1
            if cut <= 0:
                return None
            ids = self._encode_batch([part[:cut]], add_special_tokens=False)[0].ids
            if len(ids) <= margin_tokens:
                return None
            parts.append(_frozen(ids[:-margin_tokens]))
            out = np.concatenate(parts) if len(parts) > 1 else parts[0]
            out.setflags(write=False)
            return out
        return None  # nothing missing: the caller encodes in full, cheaply

    def encode(self, text: str, *, add_special_tokens: bool) -> np.ndarray:
        return self.complete(self.plan(text, add_special_tokens=add_special_tokens))
