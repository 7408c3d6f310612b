"""Cut prompt text at added-token occurrences exactly where the HF tokenizer cuts it.

Why this is exact: ``tokenizers`` extracts added tokens *before* anything else — first the
non-normalized ones from the raw text, then the normalized ones from each remaining piece after
normalizing it — and runs the normalizer, pre-tokenizer and model on each remaining piece on its
own (ByteLevel's ``add_prefix_space`` too is applied per piece). Matching is leftmost-longest over
all added tokens of a pass. So if we find the same matches and cut at them, encoding each piece
separately and concatenating equals encoding the whole text (special tokens of the post-processor
aside; the encoder adds those around the result).

We cut only where that argument holds without re-implementing more of the tokenizer:

* at tokens without ``lstrip`` / ``rstrip`` / ``single_word``: those flags move a token's extent
  by surrounding whitespace or reject the match, so flagged tokens stay *inside* a piece, where the
  tokenizer applies its own rules (a piece always starts and ends on a match boundary of the
  whole text, and leftmost-longest matching restarted there finds the same matches);
* at normalized tokens only when the normalizer is the identity (none, or an empty sequence) and
  no non-normalized token is flagged, since otherwise the text they are matched in differs from
  the raw text we scan;
* not at all for a Metaspace pre-tokenizer with ``prepend_scheme: first`` (it prefixes only the
  piece at offset 0, so per-piece encoding would differ).

A self-check at construction compares whole and per-piece encodings on probe strings built from
the vocabulary's added tokens; if they ever differ, cutting is switched off (``enabled`` is False,
``reason`` says why) and callers encode whole texts, which is slower but still exact.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

_MAX_FIND_CHARS = 4  # above this many distinct first characters, scan with the regex instead
_MANY_FIRSTS = 32  # past this many of one first character in a text, find the rest by regex
_MEMO_CHARS = 512  # whole texts up to this long have their cuts kept (``cuts``)
_MEMO_TEXTS = 4096  # ... this many of them at most


@dataclass(frozen=True, slots=True)
class _Added:
    id: int
    special: bool
    flagged: bool  # lstrip, rstrip or single_word


def _trie_pattern(words: list[str]) -> str:
    """A regex matching the longest of ``words`` at a position (prefix-shared, so matching is fast)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = True

    def emit(node: dict[str, Any]) -> str:
        children = sorted(k for k in node if k)
        if not children:
            return ""
        alts = [re.escape(ch) + emit(node[ch]) for ch in children]
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        # A word ending here that is a prefix of a longer one: try the longer first (greedy ?).
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


class _LiteralMatcher:
    """Leftmost-longest, non-overlapping occurrences of a fixed set of strings.

    ``re`` scans ~5 ns per character even for one character class, while ``str.find`` is a memchr;
    so when the words start with few distinct characters we find those and try the anchored
    regex only there (a 32k-character prompt costs tens of microseconds instead of hundreds).
    """

    def __init__(self, words: list[str]) -> None:
        self._regex = re.compile(_trie_pattern(words)) if words else None
        firsts = sorted({w[0] for w in words})
        self._firsts = tuple(firsts) if len(firsts) <= _MAX_FIND_CHARS else None
        # The one or two characters that can follow each first one (None: a one-character word
        # starts with it): a "<" of HTML or code is then passed over without a regex attempt.
        self._next: dict[str, tuple[str, ...] | None] = {}  # what may follow each first character
        self._starts: dict[str, re.Pattern[str]] = {}  # the same test as a regex, run in C
        for c in firsts:
            nexts = None if c in words else tuple(sorted({w[1:3] for w in words if w[0] == c}))
            self._next[c] = nexts
            ahead = "" if nexts is None else "(?=" + "|".join(map(re.escape, nexts)) + ")"
            self._starts[c] = re.compile(re.escape(c) + ahead)

    def find(self, text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int, str]]:
        """``(start, end, matched word)`` of every occurrence within ``text[start:end]``."""
        return self.find_in_spans(text, [(start, len(text) if end is None else end)])[0]

    def find_in_spans(self, text: str, spans: list[tuple[int, int]]) -> list[list[tuple[int, int, str]]]:
        """``find`` in each of ``spans`` (ascending, not overlapping), each matched on its own.

        The candidates are looked for once over all of them: a chat of 200 messages has ~100
        spans between its raw tokens, and a search per span cost more than the matching.
        """
        regex = self._regex
        if regex is None:
            return [[] for _ in spans]
        if self._firsts is None:
            return [[(m.start(), m.end(), m.group()) for m in regex.finditer(text, s, e)] for s, e in spans]
        match = regex.match
        candidates = self._candidates(text, spans[0][0], spans[-1][1]) if spans else []
        k = 0
        out: list[list[tuple[int, int, str]]] = []
        for start, end in spans:
            k = bisect_left(candidates, start, k)
            found: list[tuple[int, int, str]] = []
            pos = start
            while k < len(candidates) and candidates[k] < end:
                i = candidates[k]
                k += 1
                if i < pos:
                    continue  # inside the previous match
                m = match(text, i, end)
                if m is not None:
                    pos = m.end()
                    found.append((i, pos, m.group()))
            out.append(found)
        return out

    def _candidates(self, text: str, start: int, end: int) -> list[int]:
        """Where in ``text[start:end]`` a word may begin, in order.

        ``str.find`` per first character, while they are few; past ``_MANY_FIRSTS`` of one (code,
        markup: a 32k-character HTML page has ~3000 "<") the rest is left to the regex, which
        walks them in C: that page's split takes ~0.1 ms instead of ~1.3.
        """
        assert self._firsts is not None
        find = text.find
        out: list[int] = []
        for c in self._firsts:
            nexts = self._next[c]
            seen = 0
            i = find(c, start, end)
            while i >= 0:
                seen += 1
                if seen > _MANY_FIRSTS:
                    out.extend(m.start() for m in self._starts[c].finditer(text, i, end))
                    break
                if nexts is None or text.startswith(nexts, i + 1, end):
                    out.append(i)
                i = find(c, i + 1, end)
        if len(self._firsts) > 1:
            out.sort()
        return out


def _component_types(config: dict[str, Any]) -> list[dict[str, Any]]:
    """A serialized pre-tokenizer/normalizer and, for a Sequence, its members (flattened)."""
    members = config.get("pretokenizers") or config.get("normalizers")
    if config.get("type") == "Sequence" and isinstance(members, list):
        out: list[dict[str, Any]] = []
        for m in members:
            out.extend(_component_types(m))
        return out
    return [config]


def _serialized(component: Any) -> dict[str, Any] | None:
    if component is None:
        return None
    return json.loads(component.__getstate__())


class AddedTokenSplitter:
    """Splits text into ``str`` pieces to encode and ``int`` added-token IDs to emit as they are."""

    def __init__(self, tokenizer: Tokenizer, *, self_check: bool = True) -> None:
        skip_special = bool(tokenizer.encode_special_tokens)
        raw: dict[str, _Added] = {}
        normalized: dict[str, _Added] = {}
        for token_id, tok in tokenizer.get_added_tokens_decoder().items():
            if not tok.content:
                continue
            entry = _Added(token_id, tok.special, bool(tok.lstrip or tok.rstrip or tok.single_word))
            (normalized if tok.normalized else raw)[tok.content] = entry
        self._raw = raw
        self._normalized = normalized
        self._skip_special = skip_special
        self._short: dict[str, tuple[tuple[int, int, int], ...]] = {}  # short texts' cuts (``cuts``)
        self._raw_matcher = _LiteralMatcher(list(raw))
        self._norm_matcher = _LiteralMatcher(list(normalized))

        norm_cfg = _serialized(tokenizer.normalizer)
        identity_normalizer = norm_cfg is None or all(
            c.get("type") == "Sequence" for c in _component_types(norm_cfg)
        )
        any_raw_flagged = any(t.flagged for t in raw.values())
        self._cut_normalized = bool(normalized) and identity_normalizer and not any_raw_flagged

        self.enabled = True
        self.reason = ""
        pre_cfg = _serialized(tokenizer.pre_tokenizer)
        for comp in _component_types(pre_cfg) if pre_cfg else []:
            if comp.get("type") == "Metaspace" and comp.get("prepend_scheme") == "first":
                self.enabled, self.reason = False, "Metaspace pre-tokenizer with prepend_scheme 'first'"
        if self.enabled and self_check:
            self._self_check(tokenizer)

    def token_utf8_lengths(self) -> dict[int, int]:
        """UTF-8 length of each added token's text, by ID (what ``split`` emits as an int)."""
        return {t.id: len(word.encode("utf-8")) for table in (self._raw, self._normalized) for word, t in table.items()}

    def split(self, text: str) -> list[str | int]:
        """Pieces of ``text`` in order; never an empty string. Disabled: ``[text]``."""
        if not self.enabled:
            return [text] if text else []
        return pieces_between(text, self.cuts(text))

    def cuts(self, text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int, int]]:
        """``(start, end, token id)`` of every cut ``split`` makes in ``text[start:end]``, in order
        (the added tokens it emits as IDs), as if that span were the whole text.

        A short whole text is answered from a memo: the template's text around a chat's messages
        (BOS, a system prompt, the markers and a long message's edges) recurs every turn, and
        cutting it costs ~5 µs in Python where a dict lookup costs a hash of it."""
        if start == 0 and end is None and len(text) <= _MEMO_CHARS:
            found = self._short.get(text)
            if found is None:
                found = tuple(self._cuts(text, 0, len(text)))
                if len(self._short) >= _MEMO_TEXTS:
                    self._short.clear()  # bounded; the recurring texts come back at once
                self._short[text] = found
            return list(found)
        return self._cuts(text, start, len(text) if end is None else end)

    def _cuts(self, text: str, start: int, end: int) -> list[tuple[int, int, int]]:
        kept: list[tuple[int, int, _Added]] = []  # raw tokens to cut at, and what lies between
        gaps: list[tuple[int, int]] = []
        gaps_from = start
        skip_special = self._skip_special
        for s, e, word in self._raw_matcher.find(text, start, end):
            tok = self._raw[word]
            if skip_special and tok.special:
                continue
            gaps.append((gaps_from, s))
            kept.append((s, e, tok))
            gaps_from = e
        gaps.append((gaps_from, end))
        normalized = self._norm_matcher.find_in_spans(text, gaps) if self._cut_normalized else None

        cuts: list[tuple[int, int, int]] = []  # (start, end, token id), in order
        for k in range(len(gaps)):
            if normalized is not None:
                for s, e, word in normalized[k]:
                    tok = self._normalized[word]
                    if not ((skip_special and tok.special) or tok.flagged):
                        cuts.append((s, e, tok.id))
            if k < len(kept):
                s, e, tok = kept[k]
                if not tok.flagged:
                    cuts.append((s, e, tok.id))
        return cuts

    @property
    def first_chars(self) -> frozenset[str]:
        """Every character a match of ``cuts`` can begin with."""
        words = list(self._raw) + (list(self._normalized) if self._cut_normalized else [])
        return frozenset(w[0] for w in words)

    @property
    def longest_token_chars(self) -> int:
        """The length of the longest added token (no match of ``cuts`` is longer)."""
        return max(map(len, [*self._raw, *self._normalized]), default=0)

    def _self_check(self, tokenizer: Tokenizer) -> None:
        """Compare whole vs per-piece encodings on probes mixing added tokens, text and whitespace."""
        added = list(self._raw) + list(self._normalized)
        sample = sorted(added, key=len)[:8] + added[:8] + added[-8:]
        fillers = ["", " ", "  ", "\n", " hello", "hello ", "\n\nworld\n", "x", "日本語 ", " 123"]
        probes = []
        for i, tok in enumerate(sample):
            a, b = fillers[i % len(fillers)], fillers[(i * 3 + 1) % len(fillers)]
            probes.append(f"{a}{tok}{b}{sample[(i + 1) % len(sample)]}{a}")
            probes.append(f"{tok}{b}")
        probes.append("plain text without added tokens")
        for probe in probes:
            whole = tokenizer.encode(probe, add_special_tokens=False).ids
            pieces: list[int] = []
            for piece in self.split(probe):
                if isinstance(piece, int):
                    pieces.append(piece)
                else:
                    pieces.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
            if pieces != whole:
                self.enabled = False
                self.reason = f"per-piece encoding differs from whole encoding on {probe!r}"
                return


def pieces_between(text: str, cuts: list[tuple[int, int, int]]) -> list[str | int]:
    """``text`` as the pieces between ``cuts`` (``(start, end, token id)``, in order) and the cuts'
    token IDs; never an empty string."""
    pieces: list[str | int] = []
    pos = 0
    for start, end, token_id in cuts:
        if start > pos:
            pieces.append(text[pos:start])
        pieces.append(token_id)
        pos = end
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces
