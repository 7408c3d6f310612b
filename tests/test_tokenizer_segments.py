"""Segment-cached encoding equals the tokenizer's whole-text encoding, for DeepSeek's tokenizer
and for small tokenizers that exercise the rules the splitter must respect (added-token
lstrip/rstrip/single_word/normalized flags, ByteLevel add_prefix_space, a Metaspace prefix,
a post-processor that adds BOS/EOS, ``encode_special_tokens``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tokenizer.encoder import SegmentedEncoder
from tokenizer.loading import load_tokenizer
from tokenizer.segments import pieces_between

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "Hello, world! 12345 tokens and more tokens.",
    "def f(x):\n    return x * 2\n\n",
    "日本語のテキストと中文文本 mixed with English",
    "  leading and trailing spaces  ",
]

SYNTH_ADDED = ["<s>", "</s>", "<mask>", "[RS]", "word", "<n>", "<|im_start|>", "<|im_end|>"]
FILLERS = [" ", "  ", "\n", "\t", "\n\n", "word", "words", "a word here", "<", ">", "<s", "s>", "｜", "é", "😀"]


def _train(pre_tokenizer: object, normalizer: object | None = None, decoder: object | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        tok.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def _with_added(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens([AddedToken("<s>", normalized=False), AddedToken("</s>", normalized=False)])
    tok.add_special_tokens([AddedToken("<|im_start|>", normalized=False), AddedToken("<|im_end|>", normalized=False)])
    tok.add_tokens(
        [
            AddedToken("<mask>", lstrip=True, normalized=False),
            AddedToken("[RS]", rstrip=True, normalized=False),
            AddedToken("word", single_word=True, normalized=False),
            AddedToken("<n>", normalized=True),
        ]
    )
    return tok


def bytelevel_prefix_space_bos_eos() -> Tokenizer:
    tok = _with_added(_train(pre_tokenizers.ByteLevel(add_prefix_space=True), decoder=decoders.ByteLevel()))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))]
    )
    return tok


def unflagged_normalized_tokens() -> Tokenizer:
    """Like DeepSeek: identity normalizer, chat markers as normalized non-special tokens."""
    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Sequence([]), decoders.ByteLevel())
    tok.add_special_tokens([AddedToken("<s>", normalized=False), AddedToken("</s>", normalized=False)])
    tok.add_tokens([AddedToken(t, normalized=True) for t in ("<|im_start|>", "<|im_end|>", "<n>", "<|im")])
    return tok


def lowercase_normalizer_metaspace() -> Tokenizer:
    tok = _with_added(_train(pre_tokenizers.Metaspace(prepend_scheme="always"), normalizers.Lowercase()))
    return tok


def metaspace_prepend_first() -> Tokenizer:
    return _with_added(_train(pre_tokenizers.Metaspace(prepend_scheme="first")))


def encode_special_tokens_on() -> Tokenizer:
    tok = bytelevel_prefix_space_bos_eos()
    tok.encode_special_tokens = True
    return tok


def deepseek() -> Tokenizer:
    return load_tokenizer().tokenizer


VARIANTS: dict[str, Callable[[], Tokenizer]] = {
    "deepseek": deepseek,
    "bytelevel-prefix-space-bos-eos": bytelevel_prefix_space_bos_eos,
    "unflagged-normalized": unflagged_normalized_tokens,
    "lowercase-metaspace": lowercase_normalizer_metaspace,
    "metaspace-first": metaspace_prepend_first,
    "encode-special-tokens": encode_special_tokens_on,
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def encoder(request: pytest.FixtureRequest) -> SegmentedEncoder:
    return SegmentedEncoder(VARIANTS[request.param](), cache_bytes=1 << 20)


def _pieces(tok: Tokenizer) -> list[str]:
    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    added = [t for t in added if not t.startswith("<｜place")][:60] + ["<｜place▁holder▁no▁7｜>"]
    return added + SYNTH_ADDED + FILLERS + [t[:-1] for t in added[:10]] + [t[1:] for t in added[:10]]


def texts(tok: Tokenizer) -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(max_size=12), st.sampled_from(_pieces(tok)))
    return st.lists(piece, max_size=12).map("".join)


SEGMENTED = {name: name != "metaspace-first" for name in VARIANTS}
PROBE = "a<s> b <mask> c[RS] d word <n><|im_start|>x<|im_end|>"


@pytest.fixture(scope="module", params=list(VARIANTS))
def named_encoder(request: pytest.FixtureRequest) -> tuple[str, SegmentedEncoder]:
    return request.param, SegmentedEncoder(VARIANTS[request.param](), cache_bytes=1 << 20)


def test_segmentation_is_on_unless_per_piece_encoding_cannot_be_exact(named_encoder: tuple[str, SegmentedEncoder]) -> None:
    name, enc = named_encoder
    assert enc.splitter.enabled is SEGMENTED[name], enc.splitter.reason
    cuts = [p for p in enc.splitter.split(PROBE) if isinstance(p, int)]
    if name in ("bytelevel-prefix-space-bos-eos", "lowercase-metaspace"):
        # Unflagged raw tokens are cut; flagged (<mask>, [RS], word) and normalized (<n>) stay inside pieces.
        names = ["<s>", "<|im_start|>", "<|im_end|>"]
        assert cuts == [enc.tokenizer.token_to_id(t) for t in names]
    if name == "unflagged-normalized":
        names = ["<s>", "<n>", "<|im_start|>", "<|im_end|>"]
        assert cuts == [enc.tokenizer.token_to_id(t) for t in names]
    if name in ("metaspace-first", "encode-special-tokens"):
        assert cuts == []  # disabled, or every matching token is special and must stay text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cached_encoding_equals_whole_encoding(encoder: SegmentedEncoder, data: st.DataObject) -> None:
    tok = encoder.tokenizer
    text = data.draw(texts(tok))
    for special in (False, True):
        whole = tok.encode(text, add_special_tokens=special).ids
        assert encoder.encode(text, add_special_tokens=special).tolist() == whole  # cold (or partly warm)
        assert encoder.encode(text, add_special_tokens=special).tolist() == whole  # warm
    assert encoder.splitter.split(text) == reference_split(encoder.splitter, text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_markup_dense_text_splits_exactly(encoder: SegmentedEncoder, data: st.DataObject) -> None:
    """Code and markup put a first character of the added tokens ("<") everywhere: past a few
    dozen the splitter finds candidates with a regex instead of a loop. Same result required."""
    tok = encoder.tokenizer
    markup = st.sampled_from(["<b>", "</b>", "<div>", "a < b", "<<", "<", "<|", "<｜", "｜", "\n"])
    piece = st.one_of(markup, markup, st.sampled_from(_pieces(tok)))
    text = data.draw(st.lists(piece, min_size=80, max_size=160).map("".join))
    assert text.count("<") > 32  # the regex path runs
    whole = tok.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text, add_special_tokens=False).tolist() == whole
    # A missed cut would still encode exactly (the tokenizer finds the token inside the piece),
    # so check the matches themselves: the same as one leftmost-longest regex scan finds.
    for matcher in (encoder.splitter._raw_matcher, encoder.splitter._norm_matcher):
        if matcher._regex is not None:
            scan = [(m.start(), m.end(), m.group()) for m in matcher._regex.finditer(text)]
            assert matcher.find(text) == scan
    assert encoder.splitter.split(text) == reference_split(encoder.splitter, text)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc<", min_size=1, max_size=300),
    fractions=st.lists(st.floats(0, 1), max_size=12),
    words=st.sampled_from([["ab", "abc", "bc", "c<"], ["<a", "<ab", "b"], ["a", "ab", "<", "<<c"]]),
)
def test_matches_in_spans_equal_a_scan_of_each_span(text: str, fractions: list[float], words: list[str]) -> None:
    """Candidates are found once for all spans, yet each span is matched on its own: a word may
    not run past its span's end (into the raw token the gap stops at). With many first
    characters the regex path runs too."""
    from tokenizer.segments import _LiteralMatcher

    bounds = sorted({round(f * len(text)) for f in fractions} | {0, len(text)})
    spans = [(a, b) for a, b in zip(bounds, bounds[1:])][::2]  # every other one: gaps between tokens
    matcher = _LiteralMatcher(words)
    expected = [[(m.start(), m.end(), m.group()) for m in matcher._regex.finditer(text, a, b)] for a, b in spans]
    assert matcher.find_in_spans(text, spans) == expected


def reference_split(splitter, text: str) -> list[str | int]:
    """The splitter's rule spelled out with plain regex scans: raw tokens over the whole text,
    then normalized ones in each gap between kept raw tokens, each gap on its own."""
    if not splitter.enabled:
        return [text] if text else []

    def scan(matcher, start: int, end: int) -> list[tuple[int, int, str]]:
        if matcher._regex is None:
            return []
        return [(m.start(), m.end(), m.group()) for m in matcher._regex.finditer(text, start, end)]

    cuts, gap_from = [], 0

    def cut_gap(start: int, end: int) -> None:
        if not splitter._cut_normalized:
            return
        for s, e, word in scan(splitter._norm_matcher, start, end):
            tok = splitter._normalized[word]
            if not ((splitter._skip_special and tok.special) or tok.flagged):
                cuts.append((s, e, tok.id))

    for s, e, word in scan(splitter._raw_matcher, 0, len(text)):
        tok = splitter._raw[word]
        if splitter._skip_special and tok.special:
            continue
        cut_gap(gap_from, s)
        if not tok.flagged:
            cuts.append((s, e, tok.id))
        gap_from = e
    cut_gap(gap_from, len(text))
    return pieces_between(text, cuts)


def test_deepseek_splits_at_chat_markers_and_keeps_user_text_whole() -> None:
    enc = SegmentedEncoder(deepseek(), cache_bytes=1 << 20)
    tok = enc.tokenizer
    user = tok.token_to_id("<｜User｜>")
    text = "<｜begin▁of▁sentence｜>sys<｜User｜>hello <think> x<｜Assistant｜>"
    assert enc.splitter.split(text) == [0, "sys", user, "hello ", tok.token_to_id("<think>"), " x", user + 1]


def test_warm_cache_serves_history_and_encodes_only_the_new_turn() -> None:
    enc = SegmentedEncoder(deepseek(), cache_bytes=1 << 20)
    turn1 = "<｜begin▁of▁sentence｜>be brief<｜User｜>first question<｜Assistant｜>"
    turn2 = turn1 + "first answer<｜end▁of▁sentence｜><｜User｜>second question<｜Assistant｜>"
    enc.encode(turn1, add_special_tokens=False)
    hits0, misses0, _ = enc.cache.stats
    plan = enc.plan(turn2, add_special_tokens=False)
    assert plan.missing == ["first answer", "second question"]
    assert enc.complete(plan).tolist() == enc.tokenizer.encode(turn2, add_special_tokens=False).ids
    hits1, misses1, _ = enc.cache.stats
    assert (hits1 - hits0, misses1 - misses0) == (2, 2)


def test_post_processor_wrap_is_detected() -> None:
    enc = SegmentedEncoder(bytelevel_prefix_space_bos_eos(), cache_bytes=1 << 20)
    assert enc.encode("", add_special_tokens=True).tolist() == enc.tokenizer.encode("", add_special_tokens=True).ids
    ids = enc.encode("hello", add_special_tokens=True).tolist()
    assert ids[0] == enc.tokenizer.token_to_id("<s>") and ids[-1] == enc.tokenizer.token_to_id("</s>")


def test_results_are_uint32_and_read_only() -> None:
    enc = SegmentedEncoder(deepseek(), cache_bytes=1 << 20)
    ids = enc.encode("some text<｜User｜>more", add_special_tokens=False)
    assert ids.dtype.name == "uint32" and ids.ndim == 1
    with pytest.raises(ValueError):
        ids[0] = 1


def _naive_leftmost_longest(words: list[str], text: str) -> list[tuple[int, int, str]]:
    out, i = [], 0
    while i < len(text):
        hits = [w for w in words if text.startswith(w, i)]
        if hits:
            w = max(hits, key=len)
            out.append((i, i + len(w), w))
            i += len(w)
        else:
            i += 1
    return out


@settings(max_examples=300)
@given(
    words=st.lists(st.text(alphabet="abc<>｜", min_size=1, max_size=4), min_size=1, max_size=8, unique=True),
    text=st.text(alphabet="abc<>｜ x", max_size=40),
    many_firsts=st.booleans(),
)
def test_literal_matcher_is_leftmost_longest(words: list[str], text: str, many_firsts: bool) -> None:
    from tokenizer.segments import _LiteralMatcher

    if many_firsts:  # more distinct first characters than the str.find path handles: regex scan
        words = words + ["1", "2", "3", "4", "5"]
    assert _LiteralMatcher(words).find(text) == _naive_leftmost_longest(words, text)


def test_short_texts_cuts_from_the_memo_equal_a_fresh_cut() -> None:
    """``cuts`` keeps short whole texts' cuts: each answer equals the cut of a splitter with an
    empty memo, and changing an answer changes no later one."""
    splitter = load_and_split()
    texts = ["<｜begin▁of▁sentence｜>You are brief.<｜User｜>", "<｜end▁of▁", "sentence｜>", "<｜end▁of▁sentence｜>" * 3, "x" * 512, "x" * 513]
    for text in texts * 2:
        first = splitter.cuts(text)
        first.append((0, 0, 0))
        splitter_fresh = load_and_split()
        assert splitter.cuts(text) == splitter_fresh.cuts(text) == splitter_fresh._cuts(text, 0, len(text))
    assert all(t in splitter._short for t in texts[:5]) and texts[5] not in splitter._short  # 513 characters: not kept
    assert splitter.cuts("<｜User｜>") == [(0, len("<｜User｜>"), splitter.cuts("<｜User｜>")[0][2])]


def load_and_split():
    from tokenizer.segments import AddedTokenSplitter

    return AddedTokenSplitter(load_tokenizer(None).tokenizer)
