"""PromptTokenizer: request bodies → the engine's token IDs, chat templates, errors, async offload."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenizer import InvalidPrompt, PromptTokenizer, TokenizedPrompt
from tokenizer.chat_template import DEFAULT_TEMPLATE_PATH
from tokenizer.loading import default_tokenizer_path

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def pt() -> PromptTokenizer:
    return PromptTokenizer(cache_bytes=8 << 20)


def whole(pt: PromptTokenizer, text: str, special: bool) -> list[int]:
    return pt.hf_tokenizer.encode(text, add_special_tokens=special).ids


# -- the default chat template --------------------------------------------------------------


def test_default_template_renders_deepseek_chat_form(pt: PromptTokenizer) -> None:
    assert pt.template.origin.startswith("default")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather?"},
    ]
    expected = f"{BOS}Be brief.\n\nUse metric units.{USER}Hi{ASSISTANT}Hello!{EOS}{USER}Weather?{ASSISTANT}"
    assert pt.render_chat(messages) == expected
    assert pt.render_chat(messages, add_generation_prompt=False) == expected[: -len(ASSISTANT)]


def test_default_template_outputs_each_content_as_the_string_it_was_given(pt: PromptTokenizer) -> None:
    """A long content is a chunk of its own, the very object of the body (not copied behind its
    marker): the chunk memo then knows it by identity."""
    user, answer, tool = "u" * 5000, "a" * 5000, "t" * 5000
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}, {"role": "tool", "content": tool}]
    chunks = pt.template.render_chunks(messages)
    assert all(any(c is text for c in chunks) for text in (user, answer, tool))
    assert "".join(chunks) == f"{BOS}{USER}{user}{ASSISTANT}{answer}{EOS}<｜tool▁output▁begin｜>{tool}<｜tool▁output▁end｜>{ASSISTANT}"


def test_content_parts_null_and_tool_messages(pt: PromptTokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    rendered = pt.render_chat(messages)
    calls = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert rendered == f"{BOS}{USER}a\nb{ASSISTANT}{calls}{EOS}<｜tool▁output▁begin｜>42<｜tool▁output▁end｜>{ASSISTANT}"
    assert messages[1]["content"] is None  # the caller's body is not modified


def test_unknown_role_is_refused_by_the_template(pt: PromptTokenizer) -> None:
    with pytest.raises(InvalidPrompt, match="unsupported message role 'narrator'"):
        pt.render_chat([{"role": "narrator", "content": "x"}])


# -- property: tokenize_body == whole-prompt encoding --------------------------------------

SPECIAL_TEXT = [BOS, EOS, USER, ASSISTANT, "<think>", "</think>", "<｜User", "｜>", "<|EOT|>", "｜DSML｜", "<dsml:"]
piece = st.one_of(
    st.text(max_size=15),
    st.sampled_from(SPECIAL_TEXT + [" ", "\n", "\n\n", "  ", "\t", "日本語", "😀", "é"]),
)
contents = st.lists(piece, max_size=6).map("".join)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "user"]), "content": contents})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=8))
def test_chat_tokenization_equals_encoding_the_rendered_prompt(pt: PromptTokenizer, messages: list[dict[str, str]]) -> None:
    body = {"model": "m", "messages": messages}
    expected = whole(pt, pt.render_chat(messages), special=False)
    first = pt.tokenize_body(CHAT, body)
    assert first.token_ids.tolist() == expected
    assert pt.tokenize_body(CHAT, body).token_ids.tolist() == expected  # warm cache
    # every turn of the growing conversation, as a client would send it
    for n in range(1, len(messages)):
        prefix = messages[:n]
        assert pt.tokenize_body(CHAT, {"model": "m", "messages": prefix}).token_ids.tolist() == whole(
            pt, pt.render_chat(prefix), special=False
        )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=contents.filter(bool))
def test_completion_text_equals_encoding_with_special_tokens(pt: PromptTokenizer, text: str) -> None:
    for _ in range(2):  # cold, then warm
        got = pt.tokenize_body(COMPLETIONS, {"model": "m", "prompt": text})
        assert got.token_ids.tolist() == whole(pt, text, special=True)
    no_special = pt.tokenize_body(COMPLETIONS, {"model": "m", "prompt": text, "add_special_tokens": False})
    assert no_special.token_ids.tolist() == whole(pt, text, special=False)


def test_multi_turn_chat_encodes_only_the_new_turn(pt: PromptTokenizer) -> None:
    history = [{"role": "system", "content": "sys " * 50}, {"role": "user", "content": "question one " * 40}]
    pt.tokenize_body(CHAT, {"model": "m", "messages": history})
    hits0, misses0, _ = pt.cache_stats
    history += [{"role": "assistant", "content": "answer " * 40}, {"role": "user", "content": "question two"}]
    out = pt.tokenize_body(CHAT, {"model": "m", "messages": history})
    hits1, misses1, _ = pt.cache_stats
    assert out.token_ids.tolist() == whole(pt, pt.render_chat(history), special=False)
    assert (hits1 - hits0, misses1 - misses0) == (2, 2)


# -- bodies -----------------------------------------------------------------------------------


def test_result_type_model_and_salt(pt: PromptTokenizer) -> None:
    out = pt.tokenize_body(CHAT, {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "t1"})
    assert isinstance(out, TokenizedPrompt)
    assert (out.model, out.cache_salt, out.lora) == ("llama", "t1", None)
    assert out.token_ids.dtype == np.uint32 and out.token_ids.ndim == 1
    assert pt.decode(out.token_ids) == f"{BOS}{USER}hi{ASSISTANT}"


def test_token_id_prompts_pass_through(pt: PromptTokenizer) -> None:
    ids = [0, 5, 128803, pt.vocab_size - 1]
    assert pt.tokenize_body(COMPLETIONS, {"model": "m", "prompt": ids}).token_ids.tolist() == ids
    batch = pt.tokenize_body(COMPLETIONS, {"model": "m", "prompt": [ids, [1, 2]]})
    assert batch.token_ids.tolist() == ids  # a batch routes by its first prompt


def test_text_batch_routes_by_first_prompt(pt: PromptTokenizer) -> None:
    out = pt.tokenize_body(COMPLETIONS, {"model": "m", "prompt": ["first prompt", "second"]})
    assert out.token_ids.tolist() == whole(pt, "first prompt", special=True)


def test_path_query_string_and_trailing_slash_are_ignored(pt: PromptTokenizer) -> None:
    body = {"model": "m", "prompt": "x"}
    assert pt.tokenize_body(COMPLETIONS + "/?stream=1", body).token_ids.tolist() == whole(pt, "x", special=True)


def test_chat_body_options(pt: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}]
    cont_flags = {"continue_final_message": True, "add_generation_prompt": False}
    cont = pt.tokenize_body(CHAT, {"model": "m", "messages": messages, **cont_flags})
    assert pt.decode(cont.token_ids) == f"{BOS}{USER}Say hi{ASSISTANT}Hi th"
    parts = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": "Hi th"}]}]
    assert pt.tokenize_body(CHAT, {"model": "m", "messages": parts, **cont_flags}).token_ids.tolist() == cont.token_ids.tolist()
    no_gen = pt.tokenize_body(CHAT, {"model": "m", "messages": messages[:1], "add_generation_prompt": False})
    assert pt.decode(no_gen.token_ids) == f"{BOS}{USER}Say hi"


BAD_BODIES: list[tuple[str, Any, str]] = [
    (CHAT, [], "must be a JSON object"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}]}, "'model' is a required property"),
    (CHAT, {"model": 3, "messages": [{"role": "user", "content": "x"}]}, "'model' must be a string"),
    (CHAT, {"model": "m"}, "'messages' is a required property"),
    (CHAT, {"model": "m", "messages": []}, "'messages' must be a non-empty array"),
    (CHAT, {"model": "m", "messages": "hi"}, "'messages' must be a non-empty array"),
    (CHAT, {"model": "m", "messages": ["hi"]}, r"messages\[0\] must be an object"),
    (CHAT, {"model": "m", "messages": [{"content": "x"}]}, r"messages\[0\].role"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, r"messages\[0\].content must be"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, r"content\[0\].text"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": ["x"]}]}, r"content\[0\] must be an object"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, "must be a boolean"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
    # add_generation_prompt defaults to true: vLLM refuses continue_final_message alone (HTTP 400)
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "cannot both be true"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, r"'tools'\[0\].function.name"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, r"'tools'\[0\].type"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "must be an object"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_salt": 1}, "'cache_salt'"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, "'cache_salt'"),
    (COMPLETIONS, {"model": "m"}, "'prompt' is a required property"),
    (COMPLETIONS, {"model": "m", "prompt": ""}, "must not be empty"),
    (COMPLETIONS, {"model": "m", "prompt": []}, "must not be empty"),
    (COMPLETIONS, {"model": "m", "prompt": 12}, "'prompt' must be a string"),
    (COMPLETIONS, {"model": "m", "prompt": [1, True, 3]}, r"'prompt'\[1\] must be an integer token ID, got True"),
    (COMPLETIONS, {"model": "m", "prompt": [1, 2.0]}, r"'prompt'\[1\] must be an integer"),
    (COMPLETIONS, {"model": "m", "prompt": [1, -1]}, r"'prompt'\[1\] is not a valid token ID: -1"),
    (COMPLETIONS, {"model": "m", "prompt": [129280]}, r"not a valid token ID: 129280 \(vocabulary size 129280\)"),
    (COMPLETIONS, {"model": "m", "prompt": [2**70]}, "not a valid token ID"),
    (COMPLETIONS, {"model": "m", "prompt": [[1], "x"]}, r"'prompt'\[1\] must be a token ID array"),
    (COMPLETIONS, {"model": "m", "prompt": [[1, 2, 999999]]}, r"'prompt'\[0\]\[2\] is not a valid token ID"),
    (COMPLETIONS, {"model": "m", "prompt": "a\ud800b"}, "lone surrogate"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "x\udfff"}]}, "lone surrogate"),
    ("/v1/embeddings", {"model": "m", "input": "x"}, "unsupported path '/v1/embeddings'"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD_BODIES)
async def test_bad_bodies_get_clear_400_errors(pt: PromptTokenizer, path: str, body: Any, message: str) -> None:
    snapshot = json.dumps(body)
    with pytest.raises(InvalidPrompt, match=message) as info:
        pt.tokenize_body(path, body)
    assert info.value.status == 400
    with pytest.raises(InvalidPrompt, match=message):
        await pt.tokenize_body_async(path, body)
    assert json.dumps(body) == snapshot  # the body is left as it was


# -- loading and template precedence ------------------------------------------------------


def _tokenizer_dir(tmp_path: Path, config: dict[str, Any] | None, template_file: str | None = None) -> Path:
    (tmp_path / "tokenizer.json").symlink_to(default_tokenizer_path())
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    return tmp_path


def test_template_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    """transformers (and so vLLM) take chat_template.jinja over the config's key: kvgate must too,
    or every chat of such a model is keyed on a prompt the engine never sees."""
    config = {"bos_token": {"content": BOS}, "eos_token": EOS, "chat_template": "IGNORED"}
    pt = PromptTokenizer(_tokenizer_dir(tmp_path, config, "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"))
    assert pt.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == f"{BOS}[a][b]"


def test_named_template_list_uses_default(tmp_path: Path) -> None:
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]}
    pt = PromptTokenizer(_tokenizer_dir(tmp_path, config))
    assert pt.render_chat([{"role": "user", "content": "a"}]) == "D1"


def test_template_file_beside_tokenizer_then_configured_override(tmp_path: Path) -> None:
    directory = _tokenizer_dir(tmp_path, {"eos_token": EOS}, "F{{ eos_token }}")
    assert PromptTokenizer(directory).render_chat([{"role": "user", "content": "a"}]) == f"F{EOS}"
    override = tmp_path / "mine.jinja"
    override.write_text("O{{ messages[0]['content'] }}{% if add_generation_prompt %}!{% endif %}")
    assert PromptTokenizer(directory, chat_template=override).render_chat([{"role": "user", "content": "a"}]) == "Oa!"
    assert PromptTokenizer(directory, chat_template=str(override)).render_chat([{"role": "user", "content": "z"}]) == "Oz!"
    inline = "I{{ messages|length }}"
    assert PromptTokenizer(directory, chat_template=inline).render_chat([{"role": "user", "content": "a"}]) == "I1"


def test_tokenizer_json_path_finds_its_config(tmp_path: Path) -> None:
    directory = _tokenizer_dir(tmp_path, {"chat_template": "C"})
    assert PromptTokenizer(directory / "tokenizer.json").render_chat([{"role": "user", "content": "a"}]) == "C"


def test_template_helpers_like_transformers(tmp_path: Path) -> None:
    template = "{{ messages[0]['content'] | tojson }}{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
    pt = PromptTokenizer(_tokenizer_dir(tmp_path, {"chat_template": template}))
    assert pt.render_chat([{"role": "user", "content": "é"}]) == '"é"'
    with pytest.raises(InvalidPrompt, match="only one message"):
        pt.tokenize_body(CHAT, {"model": "m", "messages": [{"role": "user", "content": "a"}] * 2})


def test_sandbox_refuses_unsafe_templates(tmp_path: Path) -> None:
    pt = PromptTokenizer(_tokenizer_dir(tmp_path, {"chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(InvalidPrompt):
        pt.render_chat([{"role": "user", "content": "a"}])


def test_bad_sources_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        PromptTokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        PromptTokenizer(tmp_path)
    with pytest.raises(ValueError, match="does not compile"):
        PromptTokenizer(chat_template="{% for %}")
    with pytest.raises(FileNotFoundError, match="chat template"):
        PromptTokenizer(chat_template="no-such-template.jinja")


def test_default_template_file_is_shipped() -> None:
    assert DEFAULT_TEMPLATE_PATH.is_file()


# -- async: long fresh work leaves the event loop ------------------------------------------


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        self.submitted += 1
        return super().submit(*args, **kwargs)


async def test_async_offloads_long_fresh_text_and_keeps_the_loop_running() -> None:
    executor = CountingExecutor()
    pt = PromptTokenizer(offload_tokens=256, executor=executor)
    long_text = " ".join(f"word{i} and some more prose" for i in range(6000))  # ~40k tokens, fresh
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    out = await pt.tokenize_body_async(COMPLETIONS, {"model": "m", "prompt": long_text})
    during = ticks - before
    task.cancel()
    executor.shutdown()
    assert out.token_ids.tolist() == whole(pt, long_text, special=True)
    assert executor.submitted == 1
    assert during > 1  # the loop ran other tasks while the text was encoded

    # warm or short work stays inline
    await pt.tokenize_body_async(COMPLETIONS, {"model": "m", "prompt": long_text})
    await pt.tokenize_body_async(COMPLETIONS, {"model": "m", "prompt": "short fresh text"})
    assert executor.submitted == 1


async def test_async_and_sync_agree_on_chats(pt: PromptTokenizer) -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "s " * 3000}, {"role": "user", "content": "q"}]}
    sync_ids = pt.tokenize_body(CHAT, body).token_ids
    pt.clear_cache()
    assert (await pt.tokenize_body_async(CHAT, body)).token_ids.tolist() == sync_ids.tolist()


async def test_concurrent_async_calls_share_the_cache_safely(pt: PromptTokenizer) -> None:
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": f"shared prefix {j % 3} " * 200}, {"role": "user", "content": str(j)}]}
        for j in range(12)
    ]
    results = await asyncio.gather(*(pt.tokenize_body_async(CHAT, b) for b in bodies))
    for body, out in zip(bodies, results):
        assert out.token_ids.tolist() == whole(pt, pt.render_chat(body["messages"]), special=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-3, 129283), st.booleans(), st.floats(allow_nan=False), st.integers(2**31, 2**70)),
                min_size=1, max_size=40))
def test_token_id_arrays_take_exactly_the_valid_ids(ids: list) -> None:
    """The one-pass conversion accepts a list exactly when every element is an int in the
    vocabulary (no bools, floats or out-of-range values), and then keeps every ID."""
    from tokenizer.openai_body import token_ids_array

    valid = all(type(v) is int and 0 <= v < 129280 for v in ids)
    try:
        arr = token_ids_array(ids, vocab_size=129280, where="'prompt'")
    except InvalidPrompt as e:
        assert not valid, e
        bad = next(i for i, v in enumerate(ids) if not (type(v) is int and 0 <= v < 129280))
        assert f"'prompt'[{bad}]" in str(e)  # the first bad element is the one named
    else:
        assert valid and arr.dtype == np.uint32 and arr.tolist() == ids
