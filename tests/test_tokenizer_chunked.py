"""A prompt cut chunk by chunk (``tokenizer.chunked``) is cut exactly as its joined text is, for
DeepSeek's tokenizer and the small tokenizers of ``test_tokenizer_segments``; and a continuing
chat's long history is cut once, then reused while its text is the very same."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_tokenizer_segments import VARIANTS, _pieces
from tokenizer import PromptTokenizer
from tokenizer.chunked import ChunkSplitter
from tokenizer.encoder import SegmentedEncoder

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module", params=list(VARIANTS))
def encoder(request: pytest.FixtureRequest) -> SegmentedEncoder:
    return SegmentedEncoder(VARIANTS[request.param](), cache_bytes=1 << 20)


def chunk_lists(encoder: SegmentedEncoder) -> st.SearchStrategy[list[str]]:
    """Chunks of 0 to ~300 characters: added tokens, their halves, "<", "｜", non-ASCII and words,
    so added tokens land inside chunks, across their edges and near a long chunk's ends."""
    piece = st.one_of(st.sampled_from(_pieces(encoder.tokenizer)), st.text(max_size=6), st.sampled_from(["lorem ipsum " * 4, " dolor sit amet, ", "日本語"]))
    chunk = st.lists(piece, max_size=30).map("".join)
    return st.lists(chunk, max_size=6)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_chunked_split_equals_split_of_the_joined_text(encoder: SegmentedEncoder, data: st.DataObject) -> None:
    chunks = data.draw(chunk_lists(encoder))
    text = "".join(chunks)
    expected = encoder.splitter.split(text)
    chunked = ChunkSplitter(encoder.splitter, long_chars=data.draw(st.integers(1, 64)))
    for _ in range(3):  # unseen, seen once (now kept), kept (reused)
        assert chunked.split(chunks) == expected
    if encoder.splitter.enabled:  # and the IDs, kept with the chunks from the third time on
        whole = encoder.tokenizer.encode(text, add_special_tokens=False).ids
        encoder.chunks = chunked
        for _ in range(3):
            assert encoder.complete(encoder.plan_chunks(chunks, add_special_tokens=False)).tolist() == whole


def test_a_long_chunk_is_cut_on_its_own_and_its_cut_reused() -> None:
    enc = SegmentedEncoder(VARIANTS["deepseek"](), cache_bytes=1 << 20)
    chunked = ChunkSplitter(enc.splitter, long_chars=64)
    history = "<｜User｜>" + "shipments left port 7 on time. " * 300
    chunks = ["<｜begin▁of▁sentence｜>", "You are careful.", history, "<｜Assistant｜>ok<｜end▁of▁sentence｜>"]
    expected = enc.splitter.split("".join(chunks))
    for _ in range(4):
        assert chunked.split([*chunks[:3], chunks[3] + "<｜User｜>next?"]) == [*expected, *enc.splitter.split("<｜User｜>next?")]
    assert chunked.misses == 2 and chunked.hits == 2  # kept from its second sighting, reused after
    pieces = chunked.split(chunks)
    again = chunked.split(["<｜begin▁of▁sentence｜>", "You are careful.", "".join(list(history)), chunks[3]])
    content = history[len("<｜User｜>") :]
    assert pieces == again
    assert pieces[pieces.index(content)] is again[again.index(content)]  # sliced out once, then kept


def test_an_edited_chunk_with_the_same_length_head_middle_and_tail_is_cut_afresh() -> None:
    enc = SegmentedEncoder(VARIANTS["deepseek"](), cache_bytes=1 << 20)
    chunked = ChunkSplitter(enc.splitter, long_chars=64)
    marker = "<｜end▁of▁sentence｜>"
    before = "<｜User｜>" + "a" * 3000 + "x" * len(marker) + "b" * 3000
    edited = "<｜User｜>" + "a" * 3000 + marker + "b" * 3000  # same length and fingerprint windows
    for _ in range(3):
        assert chunked.split([before]) == enc.splitter.split(before)
    assert chunked.split([edited]) == enc.splitter.split(edited)
    assert enc.tokenizer.token_to_id(marker) in chunked.split([edited])


def test_chunks_whose_ends_are_dense_with_added_tokens_join_their_neighbours() -> None:
    """No boundary near a chunk's end (added tokens and "<" every few characters): it is cut with
    the text around it, as a whole, and nothing is kept for it."""
    enc = SegmentedEncoder(VARIANTS["deepseek"](), cache_bytes=1 << 20)
    chunked = ChunkSplitter(enc.splitter, long_chars=64)
    dense = "<b>" * 40 + "<｜User｜>" + "plain words " * 50 + "<｜Assistant｜><" * 20
    chunks = ["<｜begin▁of▁sentence｜>", dense, "<｜", "User｜>tail"]
    for _ in range(3):
        assert chunked.split(chunks) == enc.splitter.split("".join(chunks))
    assert chunked.hits == 0


@pytest.fixture(scope="module")
def pt() -> PromptTokenizer:
    return PromptTokenizer()


def _chat(history: str, turn: int, *, edited: str = "") -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a careful analyst."},
            {"role": "user", "content": history + edited},
            {"role": "assistant", "content": "Most shipments left on time."},
            {"role": "user", "content": f"Question {turn}: which port shipped most?"},
        ],
    }


def _engine_ids(pt: PromptTokenizer, body: dict) -> list[int]:
    prompt = pt.parse(CHAT, body).prompt
    text, special = pt.prompt_text(prompt)
    return pt.hf_tokenizer.encode(text, add_special_tokens=special).ids


@pytest.mark.parametrize(
    "history",
    [
        "Shipment 4 left port 9 on time. " * 400,
        "<｜end▁of▁sentence｜>content that quotes chat markers <｜User｜> inside it. " * 200 + "<｜Assistant｜>",
        "Überseehafen, 港口, émission ➜ Δ — port 9 " * 300,
        "<div class='a'>markup < and > everywhere</div>\n" * 200,
    ],
    ids=["ascii", "special-tokens-in-content", "non-ascii", "markup"],
)
def test_continuing_chat_token_ids_equal_the_engines_turn_after_turn(pt: PromptTokenizer, history: str) -> None:
    hits = pt._encoder.chunks.hits
    for turn in range(4):
        body = _chat(history, turn)
        assert pt.tokenize_body(CHAT, body).token_ids.tolist() == _engine_ids(pt, body)
    # same history, different tail; then the history edited in place
    tail = _chat(history, 9) | {"messages": [*_chat(history, 9)["messages"], {"role": "assistant", "content": "<｜User｜>"}]}
    assert pt.tokenize_body(CHAT, tail).token_ids.tolist() == _engine_ids(pt, tail)
    edited = _chat(history[: len(history) // 2] + "<｜User｜>" + history[len(history) // 2 + 8 :], 5)
    assert pt.tokenize_body(CHAT, edited).token_ids.tolist() == _engine_ids(pt, edited)
    if history.startswith("Shipment"):
        assert pt._encoder.chunks.hits > hits  # the history's cut was reused


def test_prompt_size_limit_counts_every_chunk(pt: PromptTokenizer) -> None:
    from tokenizer.errors import PromptTooLarge

    body = _chat("é" * 5000, 1)
    size = len(pt.render_chat(body["messages"]).encode())
    pt.prepare(CHAT, body, max_text_bytes=size)
    with pytest.raises(PromptTooLarge):
        pt.prepare(CHAT, body, max_text_bytes=size - 1)


def test_a_kept_chunks_token_ids_are_kept_with_it() -> None:
    """A continuing chat's history piece is found by its chunk, without hashing it for the
    segment cache: emptied, the cache misses only what is not kept with a chunk."""
    enc = SegmentedEncoder(VARIANTS["deepseek"](), cache_bytes=1 << 20)
    history = "<｜User｜>" + "Überseehafen shipments left port 7 on time. " * 300
    chunks = ["<｜begin▁of▁sentence｜>", history, "<｜Assistant｜>"]
    whole = enc.tokenizer.encode("".join(chunks), add_special_tokens=False).ids
    for _ in range(4):  # encoded, kept from its second sighting, its IDs kept on the third
        assert enc.complete(enc.plan_chunks(chunks, add_special_tokens=False)).tolist() == whole
    enc.cache.clear()
    hits = enc.cache.stats.hits
    plan = enc.plan_chunks(chunks, add_special_tokens=False)
    assert plan.missing == [] and enc.complete(plan).tolist() == whole
    assert enc.cache.stats.hits == hits + 1  # still counted as found (the metric)
    edited = [chunks[0], history.replace("port 7", "port 8", 1), chunks[2]]
    plan = enc.plan_chunks(edited, add_special_tokens=False)  # another text: not found by the chunk
    assert len(plan.missing) == 1
    assert enc.complete(plan).tolist() == enc.tokenizer.encode("".join(edited), add_special_tokens=False).ids


def test_clearing_the_cache_forgets_kept_chunks_too(pt: PromptTokenizer) -> None:
    body = _chat("Shipment 5 left port 2 on time. " * 400, 1)
    for _ in range(4):
        pt.tokenize_body(CHAT, body)
    pt.clear_cache()
    assert len(pt.missing_pieces(pt.prepare(CHAT, body))) >= 1


@pytest.mark.parametrize(("setting", "kept"), [("0", False), ("1MiB", True)])
def test_the_configured_chunk_memo_bound_is_the_serving_tokenizers(setting: str, kept: bool) -> None:
    """``tokenizer.chunk_memo_bytes`` reaches the tokenizer ``kvgate serve`` builds: 0 keeps no
    chunk (every turn cuts the history again), 1 MiB keeps a chat's history and no more."""
    from gateway.config import load_config
    from gateway.serve_cmd import tokenizer_from_config

    cfg = load_config(tokenizer={"chunk_memo_bytes": setting})
    pt = tokenizer_from_config(cfg)
    history = "Shipment 5 left port 2 on time. " * 400
    for turn in range(4):
        body = _chat(history, turn)
        assert pt.tokenize_body(CHAT, body).token_ids.tolist() == _engine_ids(pt, body)
    chunks = pt._encoder.chunks
    assert (chunks.hits > 0) is kept and chunks.misses >= 2
    assert chunks._bytes <= (1 << 20 if kept else 0)
    for turn in range(40):  # many long chats, each met twice: the bound holds
        body = _chat(f"Chat {turn}: " + "Shipment 5 left port 2 on time. " * 2000, turn)
        pt.tokenize_body(CHAT, body)
        pt.tokenize_body(CHAT, body)
    assert 0 < chunks._bytes <= 1 << 20 if kept else chunks._bytes == 0


def test_a_long_chunk_is_charged_once_kept_and_its_charge_given_back_on_eviction() -> None:
    """A chunk met once is not costed (its UTF-8 length is a pass over a fresh prompt on the
    request path); a kept chunk carries its charge, and evicting it gives back exactly that."""
    from tokenizer.chunked import _cost

    enc = SegmentedEncoder(VARIANTS["deepseek"](), cache_bytes=1 << 20)
    texts = ["<｜User｜>" + f"Überseehafen {i}: shipments left port 7 on time. " * 200 for i in range(3)]
    bound = _cost(texts[0], 2) + _cost(texts[1], 2) + 1024  # room for two of them
    chunked = ChunkSplitter(enc.splitter, memo_bytes=bound)
    first = chunked._layout(texts[0])
    assert first is not None and first.cost == 0 and chunked._bytes == 0  # met once: not kept, not costed
    for text in texts:  # kept from the second sighting; the third evicts the first
        chunked._layout(text)
        kept = chunked._layout(text)
        assert kept is not None and kept.cost == _cost(text, len(kept.cuts))
    assert len(chunked._memo) == 2
    assert chunked._bytes == sum(layout.cost for layout in chunked._memo.values()) <= bound
