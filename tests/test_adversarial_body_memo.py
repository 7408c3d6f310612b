"""Adversarial checks of the body memo (``gateway.body_memo``) and of the default template's change
that came with it (a message's content output on its own).

Ground truth is always a whole ``msgspec.json.decode`` of the same bytes (values, key order,
errors), and for the template main's version of it rendered on the same messages. The attacks:
bodies that share bytes with a kept one but continue it in every way JSON allows (escapes for
plain characters, surrogate pairs, numbers spelled differently, duplicate keys, parts lists,
tool calls, cut points anywhere, invalid UTF-8 after the shared bytes, truncation), another
client priming the memo, interleaved chats, and the memo's own cost: time on the event loop and
memory held, against what it is charged.
"""

from __future__ import annotations

import gc
import json
import subprocess
import time
import tracemalloc
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.body_memo import MIN_BYTES, BodyMemo
from tokenizer import PromptTokenizer
from tokenizer.chat_template import ChatTemplate

CHAT = "/v1/chat/completions"
LONG = "".join(f"line {i}: the harbour tide, caf\u00e9, \u65e5\u672c, \U0001f600 and a \"quote\".\n" for i in range(2200))
assert len(json.dumps(LONG).encode()) > 2 * MIN_BYTES


def _whole(body: bytes) -> tuple[str, object]:
    try:
        return "ok", msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        return "error", str(e)
    except RecursionError:
        return "recursion", None


def _memo(memo: BodyMemo, body: bytes) -> tuple[str, object]:
    try:
        return "ok", memo.decode(body)
    except msgspec.DecodeError as e:
        return "error", str(e)
    except RecursionError:
        return "recursion", None


def _same(memo: BodyMemo, body: bytes) -> None:
    want, got = _whole(body), _memo(memo, body)
    assert got == want
    if want[0] == "ok" and isinstance(want[1], dict):
        assert list(got[1]) == list(want[1])  # type: ignore[arg-type]
        if isinstance(want[1].get("messages"), list):  # type: ignore[union-attr]
            for g, w in zip(got[1]["messages"], want[1]["messages"]):  # type: ignore[index]
                assert json.dumps(g) == json.dumps(w)  # nested key order and float spelling too


# -- message spellings: each decodes to a value; several spell the same value differently

MESSAGES = [
    b'{"role": "system", "content": %s}' % json.dumps(LONG).encode(),
    b'{"role": "system", "content": %s}' % json.dumps(LONG, ensure_ascii=False).encode(),
    b'{"role":"user","content":"\\u0041BC"}',
    b'{"role":"user","content":"ABC"}',
    b'{"role":"user","content":"\\ud83d\\ude00"}',
    "{\"role\":\"user\",\"content\":\"\U0001f600\"}".encode(),
    b'{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]}',
    b'{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\\"x\\": 1.0}"}}]}',
    b'{"role":"tool","tool_call_id":"c1","content":"42"}',
    b'{"role":"user","content":"x","role":"assistant"}',  # duplicate key: the last wins
    b'{"role":"user","content":"n","n":1}',
    b'{"role":"user","content":"n","n":1.0}',
    b'{"role":"user","content":"n","n":1e0}',
    b'{"role":"user","content":"n","n":-0}',
    b'{"role":"user","content":"n","n":12345678901234567890123}',
    b'  {  "role" : "user" , "content" : "spaced"  }  ',
    b'{"role":"user","content":"\\"}, {\\"role\\": \\"x\\"}"}',  # a fake message end inside a string
    b'{"role":"user","content":"end\\\\"}',
]

TAILS = [
    b'], "model": "m"}',
    b'], "model": "m", "model": "other"}',
    b'], "chat_template_kwargs": {"thinking": true}, "add_generation_prompt": false}',
    b'], "continue_final_message": true, "add_generation_prompt": false}',
    b'], "tools": [{"type": "function", "function": {"name": "f"}}]}',
    b'], "messages": []}',
    b']}',
    b'], "model": "\xc3"}',  # invalid UTF-8 after the shared bytes
    b'], "model": "m"',  # truncated
    b'],}',
]

HEADS = [b'{"model": "m", "messages": [', b'{"messages": [', b'{"tools": [], "model": "m", "messages":[']


def _body(head: bytes, msgs: list[bytes], tail: bytes) -> bytes:
    return head + b", ".join(msgs) + tail


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    head=st.sampled_from(HEADS),
    first=st.lists(st.sampled_from(MESSAGES[2:]), min_size=1, max_size=5),
    system=st.sampled_from(MESSAGES[:2]),
    later=st.lists(st.sampled_from(MESSAGES[2:]), min_size=0, max_size=5),
    tail1=st.sampled_from(TAILS[:5]),
    tail2=st.sampled_from(TAILS),
)
def test_a_continued_body_with_any_spelling_decodes_as_whole(
    head: bytes, first: list[bytes], system: bytes, later: list[bytes], tail1: bytes, tail2: bytes
) -> None:
    memo = BodyMemo()
    kept = [system, *first]
    _same(memo, _body(head, kept, tail1))
    _same(memo, _body(head, [*kept, *later], tail2))
    _same(memo, _body(head, [*kept, *later], tail2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_body_cut_anywhere_in_a_kept_one_and_continued_decodes_as_whole(data: st.DataObject) -> None:
    """The second body shares the first's bytes up to any point (mid-string, mid-escape, mid
    number, mid UTF-8 character), then goes on with anything."""
    memo = BodyMemo()
    msgs = [MESSAGES[0], *data.draw(st.lists(st.sampled_from(MESSAGES[2:]), min_size=2, max_size=6))]
    first = _body(HEADS[0], msgs, TAILS[0])
    _same(memo, first)
    cut = data.draw(st.integers(MIN_BYTES, len(first)))
    rest = data.draw(st.sampled_from([b"", b"}", b"]}", b'"]}', b'"}]}', b'\\u0041"}]}', b'"}, {"role":"user","content":"q"}]}',
                                      b'\x80"}]}', b', "x": 1}]}', b"0}]}", b'e5}]}', *[m + b"]}" for m in MESSAGES[2:]],
                                      *[b", " + m + b"]}" for m in MESSAGES[2:]]]))
    _same(memo, first[:cut] + rest)


def test_another_clients_body_primes_nothing_wrong() -> None:
    """An attacker's bodies share a victim's long system message byte for byte, then differ:
    the victim's body decodes to its own values, whichever was kept first."""
    memo = BodyMemo()
    sys_msg = MESSAGES[0]
    attacker = [
        _body(HEADS[0], [sys_msg, b'{"role":"user","content":"A","content":"evil"}'], TAILS[0]),
        _body(HEADS[0], [sys_msg, b'{"role":"user","content":"A"}', b'{"role":"assistant","content":"evil"}'], TAILS[0]),
        _body(HEADS[0], [sys_msg, b'{"role":"user","content":"A"}'], b'], "model": "evil", "model": "m"}'),
        _body(HEADS[0], [sys_msg], b', {"role":"user","content":"A"}], "messages": [{"role":"user","content":"evil"}]}'),
    ]
    victim = _body(HEADS[0], [sys_msg, b'{"role":"user","content":"A"}', b'{"role":"user","content":"B"}'], TAILS[0])
    for body in attacker:
        _same(memo, body)
    _same(memo, victim)
    assert memo.decode(victim)["messages"][1:] == [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}]


def test_interleaved_chats_sharing_a_system_prompt_decode_as_whole() -> None:
    memo = BodyMemo(max_bytes=2_000_000)
    chats: list[list[bytes]] = [[MESSAGES[0]] for _ in range(6)]
    for turn in range(6):
        for i, msgs in enumerate(chats):
            msgs.append(b'{"role":"user","content":"chat %d turn %d"}' % (i, turn))
            _same(memo, _body(HEADS[0], msgs, TAILS[0]))
            msgs.append(b'{"role":"assistant","content":"answer %d %d"}' % (i, turn))
    assert memo.hits > 0


def test_the_prompt_of_a_memo_decoded_body_is_the_whole_decodes_prompt() -> None:
    """End to end through the real tokenizer: the prompt text and token IDs of each turn of a
    chat with tools, tool calls, parts and escapes are those of a whole decode."""
    tok = PromptTokenizer()
    memo = BodyMemo()
    msgs: list[dict] = [{"role": "system", "content": LONG}]
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "look \u00e9"}, {"type": "text", "text": "\U0001f600"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1.0}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "result"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "\u0041gain"},
    ]
    for t in turns:
        msgs.append(t)
        for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
            body = json.dumps({"model": "m", "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}], **extra}).encode()
            whole = tok.tokenize_body(CHAT, msgspec.json.decode(body))
            got = tok.tokenize_body(CHAT, memo.decode(body))
            assert list(got.token_ids) == list(whole.token_ids)
    assert memo.hits > 0


def test_the_default_template_renders_as_mains_did() -> None:
    """The template now outputs a message's content on its own instead of concatenating it:
    the same text for every message shape the normaliser lets through."""
    repo = Path(__file__).resolve().parents[1]
    old_source = subprocess.run(
        ["git", "show", "main:tokenizer/templates/deepseek_chat.jinja"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    new = ChatTemplate((repo / "tokenizer/templates/deepseek_chat.jinja").read_text(), bos_token="<B>", eos_token="<E>")
    old = ChatTemplate(old_source, bos_token="<B>", eos_token="<E>")
    shapes = [
        [{"role": "user", "content": "a"}],
        [{"role": "system", "content": None}, {"role": "user", "content": ""}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}, {"role": "assistant", "content": None}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "content": None}, {"role": "tool", "content": "{{ x }}"}],
        [{"role": "user", "content": "<\uff5cUser\uff5c>&amp;<b>"}],
    ]
    for msgs in shapes:
        for agp in (True, False):
            assert new.render(msgs, add_generation_prompt=agp) == old.render(msgs, add_generation_prompt=agp)


# -- what the memo costs

def _flat(items: int) -> bytes:
    """A valid-JSON body whose messages array holds many one-byte-wide elements: refused by the
    tokenizer as a chat, but decoded (and kept) by the memo first."""
    return b'{"model":"m","messages":[' + b",".join([b"[]"] * items) + b"]}"


@pytest.mark.parametrize("case", ["kept_then_repeated", "short_chat_then_appended"])
def test_a_body_of_many_tiny_messages_costs_no_more_than_a_whole_decode(case: str) -> None:
    """A body whose messages array holds a million two-byte elements ("[]", valid JSON; the
    tokenizer refuses it only after the decode). ``kept_then_repeated``: sent twice, the second
    time with one element more, its lookup works out where each kept element ends;
    ``short_chat_then_appended``: one body continuing a kept 70 kB chat with those elements, each
    decoded and located on its own. Both are per-element Python work on the event loop. A whole
    decode of the same body is the bar: the memo may cost up to twice it, not ~8 times."""
    memo = BodyMemo()
    if case == "kept_then_repeated":
        first = _flat(1_000_000)
        body = first[:-2] + b",[]]}"
        memo.decode(first)
    else:
        head = b'{"model":"m","messages":[{"role":"system","content":"' + b"x" * 70_000 + b'"}'
        memo.decode(head + b"]}")
        body = head + b"," + b",".join([b"[]"] * 1_000_000) + b"]}"
    gc.collect()
    t = time.perf_counter()
    msgspec.json.decode(body)
    whole = time.perf_counter() - t
    gc.collect()
    t = time.perf_counter()
    memo.decode(body)
    took = time.perf_counter() - t
    assert took <= 2 * whole + 0.01, f"memo {took * 1000:.0f} ms against a whole decode's {whole * 1000:.0f} ms"


def test_the_memo_holds_no_more_memory_than_its_bound() -> None:
    """``BodyMemo(max_bytes=...)`` charges a kept body twice its length; the memory it really
    keeps (bytes, decoded messages, message ends) should stay near that bound, whatever the body."""
    bound = 4_000_000
    memo = BodyMemo(max_bytes=bound)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for chat in range(3):
            body = b'{"model":"m%d","messages":[' % chat + b",".join([b"[]"] * 300_000) + b"]}"
            memo.decode(body)
            memo.decode(body[:-2] + b",[]]}")  # a lookup: the kept body's messages are decoded and kept
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert memo._bytes <= bound
    assert held <= 2 * bound, f"{held / 1e6:.1f} MB held for a bound of {bound / 1e6:.1f} MB"


def test_an_honest_chat_with_one_emoji_stays_within_the_bound() -> None:
    """No hostile shape: long ASCII system messages holding one emoji each (sent as UTF-8, as
    ``json.dumps(ensure_ascii=False)`` or a browser does). One character past U+FFFF makes Python
    keep the whole decoded string at 4 bytes a character: four times its JSON bytes, where the
    memo's charge assumes once."""
    bound = 8_000_000
    memo = BodyMemo(max_bytes=bound)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for chat in range(8):
            msgs = [{"role": "system", "content": f"Chat {chat}: you are kind \U0001f600. " + "x" * 400_000}, {"role": "user", "content": "hi"}]
            memo.decode(json.dumps({"model": "m", "messages": msgs}, ensure_ascii=False).encode())
            msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            memo.decode(json.dumps({"model": "m", "messages": msgs}, ensure_ascii=False).encode())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert memo.hits == 8
    assert held <= 1.1 * bound, f"{held / 1e6:.1f} MB held for a bound of {bound / 1e6:.1f} MB"
