"""The head of a long fresh prompt is a true prefix of its full tokenization, so routing on the
head's block keys never claims a block the full prompt does not start with."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenizer import PromptTokenizer

WORDS = st.sampled_from(
    ["the", "harbour", "Ünïcödé", "数据", "12345", "3.14", "x", "'s", "...", "!!", "\n", "\n\n", "  ", "\t",
     "can't", "e-mail", "<｜User｜>", "2024-11-29", "über", "🙂", "(a)", "URL:", "http://x.y/z"]
)  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=st.lists(WORDS, min_size=60, max_size=400),
    separators=st.lists(st.sampled_from([" ", "", " ", "\n", " "]), min_size=400, max_size=400),
    fresh=st.integers(40, 300),
    chat=st.booleans(),
)
def test_head_is_a_prefix_of_the_full_tokenization(tok, words, separators, fresh, chat) -> None:
    text = "".join(w + s for w, s in zip(words, separators))
    tok.clear_cache()
    if chat:
        path, body = "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        }  # fmt: skip
    else:
        path, body = "/v1/completions", {"model": "m", "prompt": text}
    head = tok.tokenize_head(path, body, fresh_chars=fresh)
    full = tok.tokenize_body(path, body).token_ids
    if head is None:
        return
    assert len(head.token_ids) < len(full)
    assert list(head.token_ids) == list(full[: len(head.token_ids)])
    assert head.estimated_tokens > len(head.token_ids)


def test_no_head_when_the_prompt_is_cached_short_or_token_ids(tok) -> None:
    doc = " ".join(f"Paragraph {i} says the tide turns at {i % 12} o'clock." for i in range(400))
    body = {"model": "m", "messages": [{"role": "user", "content": doc}]}
    tok.clear_cache()
    head = tok.tokenize_head("/v1/chat/completions", body, fresh_chars=2048)
    assert head is not None and 300 < len(head.token_ids) < 1000  # ~2k characters tokenized, not 20k
    tok.tokenize_body("/v1/chat/completions", body)  # now cached
    assert tok.tokenize_head("/v1/chat/completions", body, fresh_chars=2048) is None
    assert tok.tokenize_head("/v1/completions", {"model": "m", "prompt": "short"}, fresh_chars=2048) is None
    assert tok.tokenize_head("/v1/completions", {"model": "m", "prompt": list(range(5000))}, fresh_chars=10) is None
