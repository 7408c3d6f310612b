"""The body memo (``gateway.body_memo``): every body it decodes equals a whole decode of it, values,
key order and errors alike, however the body repeats, edits or breaks a kept one."""

from __future__ import annotations

import json
import sys

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.body_memo import MIN_BYTES, BodyMemo

HISTORY = " ".join(f"sentence {i} of a long history, with a \\\"quote\\\" and \\u00e9." for i in range(2500))
assert len(HISTORY) > 2 * MIN_BYTES


def _whole(body: bytes) -> tuple[str, object]:
    try:
        return "ok", msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        return "error", str(e)


def _memo(memo: BodyMemo, body: bytes) -> tuple[str, object]:
    try:
        return "ok", memo.decode(body)
    except msgspec.DecodeError as e:
        return "error", str(e)


def _same(memo: BodyMemo, body: bytes) -> None:
    want, got = _whole(body), _memo(memo, body)
    assert got == want
    if want[0] == "ok" and isinstance(want[1], dict):
        assert list(got[1]) == list(want[1])  # key order too  # type: ignore[arg-type]


def _message(role: str, content: str) -> bytes:
    return b'{"role": "%s", "content": "%s"}' % (role.encode(), content.encode())


def _body(messages: list[bytes], *, head: bytes = b'"model": "m", ', tail: bytes = b', "max_tokens": 8') -> bytes:
    return b"{" + head + b'"messages": [' + b", ".join(messages) + b"]" + tail + b"}"


BASE = [_message("system", "Be brief."), _message("user", HISTORY), _message("assistant", "Noted.")]


def test_a_continuing_chat_decodes_its_history_from_the_memo() -> None:
    memo = BodyMemo()
    turns = [_body([*BASE, _message("user", f"question {t}")]) for t in range(5)]
    grown = _body([*BASE, _message("user", "question 4"), _message("assistant", "answer"), _message("user", "next")])
    for body in [*turns, grown, grown]:
        _same(memo, body)
    assert memo.hits == 6 and memo.misses == 1


def test_short_bodies_and_other_values_are_decoded_whole() -> None:
    memo = BodyMemo()
    for body in (b'{"model": "m", "messages": []}', b"[1, 2]", b'"x"', b"{", b'{"prompt": "' + HISTORY.encode() + b'"}'):
        _same(memo, body)
    assert memo.hits == 0


# what may follow the kept messages: each either decodes as the whole body does or fails as it does
RESTS = [
    b"]",
    b" ] ",
    b", " + _message("user", "new"),
    b",\n\t" + _message("user", "new") + b" ,  " + _message("assistant", "x"),
    b", 1, null, [2], \"s\"",
    b",]",  # invalid
    b", {\"role\": \"user\", \"content\": \"\\x\"}",  # invalid escape
    b", {\"role\": \"user\", \"content\": \"\xff\"}",  # invalid UTF-8
    b", {}",
]
TAILS = [
    b"",
    b', "max_tokens": 8',
    b', "model": "other"',  # a duplicate of a field before the array: the last one wins
    b', "messages": [1]',  # the array replaced by a later one
    b', "\\u006dessages": [2]',  # ... spelled with an escape
    b', "messages": 3, "model": "x", "messages": [4]',
    b', "x": {"messages": [5]}',
    b"} trailing",  # invalid: the object closed twice
    b', "max_tokens": 8}, "extra": 1',  # invalid
    b', "n": 1e999',
]
HEADS = [b'"model": "m", ', b'"model": "a", "model": "b", ', b'"messages": [0], "model": "m", ', b"", b'"tools": [{"a": [1, {"b": null}]}], ']


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    head=st.sampled_from(HEADS),
    kept=st.integers(1, len(BASE)),
    rest=st.sampled_from(RESTS),
    tail=st.sampled_from(TAILS),
    space=st.sampled_from([b"", b" ", b"\n  "]),
)
def test_a_body_after_a_kept_one_decodes_as_whole(head: bytes, kept: int, rest: bytes, tail: bytes, space: bytes) -> None:
    memo = BodyMemo()
    first = _body([*BASE, _message("user", "q0")], head=head)
    _same(memo, first)
    prefix = b"{" + head + b'"messages": [' + b", ".join(BASE[:kept])  # the first body's bytes up to a message's end
    body = prefix + space + rest + (b"" if rest.rstrip().endswith(b"]") else b"]") + tail + b"}"
    _same(memo, body)
    _same(memo, body)  # and again, now that it is kept itself


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_kept_body_edited_anywhere_decodes_as_whole(data: st.DataObject) -> None:
    memo = BodyMemo()
    first = _body([*BASE, _message("user", "q0")])
    _same(memo, first)
    body = bytearray(_body([*BASE, _message("user", "q1")]))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.sampled_from(b'x"\\{}[],: 0\xff'))
    _same(memo, bytes(body))


def test_a_deep_nesting_in_the_new_turn_is_the_whole_decodes_error() -> None:
    memo = BodyMemo()
    _same(memo, _body([*BASE, _message("user", "q0")]))
    deep = _body([*BASE, b"[" * 100_000 + b"]" * 100_000])
    with pytest.raises(RecursionError):
        msgspec.json.decode(deep)
    with pytest.raises(RecursionError):
        memo.decode(deep)


def test_results_are_new_containers_each_time() -> None:
    """The top-level object and the messages array are the caller's: changing them changes no
    later answer (the messages themselves are shared, and the request path never changes them)."""
    memo = BodyMemo()
    body = _body([*BASE, _message("user", "q0")])
    memo.decode(body)
    first = memo.decode(body)
    first["messages"].append("changed")
    first["model"] = "changed"
    _same(memo, body)


def test_the_memo_stays_within_its_byte_bound() -> None:
    memo = BodyMemo(max_bytes=1_000_000)
    for i in range(40):
        body = _body([_message("user", f"chat {i} " + HISTORY), _message("user", f"q{i}")])
        _same(memo, body)
        _same(memo, _body([_message("user", f"chat {i} " + HISTORY), _message("user", f"r{i}")]))
        assert memo._bytes <= 1_000_000
    assert memo.hits == 40
    memo.clear()
    assert memo._bytes == 0


def test_chats_sharing_a_long_system_prompt_each_find_their_own_history() -> None:
    memo = BodyMemo()
    system = _message("system", HISTORY)
    chats = [[system, _message("user", f"chat {i}: " + HISTORY[997 * i :])] for i in range(12)]
    for turn in range(3):
        for msgs in chats:
            before = memo.reused_bytes
            _same(memo, _body([*msgs, _message("user", f"turn {turn}")]))
            if turn:  # its own history, not only the system prompt
                assert memo.reused_bytes - before == len(b'{"model": "m", "messages": [' + b", ".join(msgs))


def test_a_json_dumps_body_round_trips() -> None:
    memo = BodyMemo()
    msgs = [{"role": "user", "content": "日本語 " + HISTORY}, {"role": "assistant", "content": None}]
    for t in range(3):
        body = json.dumps({"model": "m", "messages": [*msgs, {"role": "user", "content": f"t{t}"}], "stream": True}).encode()
        _same(memo, body)
    assert memo.hits == 2


async def test_a_core_with_the_memo_routes_a_long_chat_as_one_without() -> None:
    """Through ``RoutingCore``: the same turns, with the memo and without, ask the policy about the
    same prompt (its length and its last block key, which chains every token before it)."""
    from directory_client import InProcessDirectory, NodeInfo
    from gateway.core import RoutingCore, RoutingLimits
    from gateway.policy import make_policy
    from gateway.profile import load_profile
    from tokenizer import PromptTokenizer

    tok = PromptTokenizer()
    cores = []
    for memo_bytes in (64 << 20, 0):
        directory = InProcessDirectory()
        await directory.register_node(NodeInfo("n1", "127.0.0.1:9001"))
        cores.append(RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
                                 RoutingLimits(head_chars=0), body_memo_bytes=memo_bytes))
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HISTORY.replace("\\", "")}]
    for turn in range(4):
        history += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"question {turn}"}]
        body = json.dumps({"model": "m", "messages": history, "max_tokens": 8}).encode()
        asked = []
        for core in cores:
            result = await core.route("/v1/chat/completions", body, sees_response_end=False)
            assert result.kind == "routed" and result.request is not None
            asked.append((result.request.prompt_tokens, result.request.affinity, result.request.total_blocks))
        assert asked[0] == asked[1]
    assert cores[0].bodies.hits == 3 and cores[1].bodies.hits == 0


def test_many_small_messages_are_charged_what_they_decode_to() -> None:
    """Objects decode to several times their JSON bytes (an empty object: 3 bytes, 64 in memory):
    the bound counts them, so a body of tiny messages is charged past its length, and a bound
    below that keeps none of it decoded."""
    small = [b"{}"] * 40_000
    bodies = [_body([*small, _message("user", turn)]) for turn in "abc"]
    roomy, tight = BodyMemo(max_bytes=64 << 20), BodyMemo(max_bytes=4 * len(bodies[0]))
    for body in bodies:
        _same(roomy, body)
        _same(tight, body)
        for memo in (roomy, tight):
            assert memo._bytes == sum(k.cost for k in memo._kept.values()) <= memo.max_bytes
    assert roomy.hits == 2 and tight.hits == 0
    assert all(k.cost >= 2 * len(k.data) + 256 * 40_000 for k in roomy._kept.values() if k.weights)
    assert all(k.weights is None for k in tight._kept.values())


@pytest.mark.parametrize("spacing", ["even", "uneven_few", "uneven_many"])
def test_many_messages_are_located_at_once_or_one_by_one_and_decode_as_whole(spacing: str) -> None:
    """A kept body's message ends are a running sum of lengths when one separator joins them all
    (checked by one comparison); unevenly spaced ones are located one by one if few, or the body
    is decoded whole. Either way every answer is a whole decode's."""
    count = 40 if spacing == "uneven_few" else 300
    msgs = [_message("user", HISTORY)] + [_message("user", f"m{i}") for i in range(count)]
    seps = [b", " if spacing == "even" or i % 2 else b" ,\n" for i in range(len(msgs) - 1)]
    joined = msgs[0] + b"".join(s + m for s, m in zip(seps, msgs[1:]))
    memo = BodyMemo()
    first = b'{"model": "m", "messages": [' + joined + b"]}"
    second = b'{"model": "m", "messages": [' + joined + b', {"role": "user", "content": "next"}]}'
    for body in (first, second, second):
        _same(memo, body)
    assert memo.hits == (0 if spacing == "uneven_many" else 2)


def test_a_body_with_more_messages_than_the_cap_is_decoded_whole_and_not_kept() -> None:
    from gateway.body_memo import MAX_MESSAGES

    body = b'{"messages": [' + b",".join([b"[]"] * (MAX_MESSAGES + 1)) + b"]}"
    memo = BodyMemo()
    for b in (body, body[:-2] + b",[]]}"):
        _same(memo, b)
    assert memo.hits == 0 and not memo._kept


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=300), min_size=1, max_size=12),
    ascii_only=st.booleans(),
)
def test_a_messages_charge_covers_its_text_at_the_width_python_keeps_it(texts: list[str], ascii_only: bool) -> None:
    """One character past U+00FF (or U+FFFF) makes Python keep a whole string at 2 (or 4) bytes a
    character, however it was spelled (UTF-8 or an escape): each message is charged at least its
    decoded string's size, and counting ranges one by one agrees with counting them at once."""
    from gateway.body_memo import _charges, _charges_at_once, _Kept, _work_out

    pad = {"role": "system", "content": "x" * MIN_BYTES}
    body = json.dumps({"model": "m", "messages": [pad] + [{"role": "user", "content": t} for t in texts]},
                      ensure_ascii=ascii_only).encode()
    kept = _Kept(body, [])
    _work_out(kept)
    assert kept.ends and kept.weights is not None and len(kept.ends) == len(texts) + 1
    charged = [b - a for a, b in zip(kept.weights, kept.weights[1:])]
    for text, charge in zip(texts, charged):
        assert charge >= sys.getsizeof(text)
    bounds = [kept.ends[0], *kept.ends[1:]]
    for lo in range(0, len(bounds) - 1, 3):
        few = bounds[lo : lo + 4]
        assert _charges(body, few) == _charges_at_once(body, few)
