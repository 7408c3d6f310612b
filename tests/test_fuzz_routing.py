"""Hostile request bodies against ``RoutingCore.route`` in-process, with hypothesis for breadth.

What a client sees, whatever it sends to an inference path: either a clear 4xx with vLLM's JSON
error shape (its own mistake: not JSON, not an object, wrong types, unknown model, over a limit),
or its request goes on (routed to a node, or passed through to the fallback route). Never an
internal error, never a crash of the server, never memory that grows with the input beyond the
configured caps. The wire-level sample (real Envoy + `kvgate serve`) is in test_hostile_wire.py.

Every case tried is counted (``CASES``) and the totals are printed at the end of the module.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from directory_client import NodeInfo, Tier, open_directory
from gateway.core import RouteResult, RoutingCore, RoutingLimits
from gateway.policy import make_policy
from gateway.profile import load_profile
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed

MODEL = "deepseek-chat"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMITS = RoutingLimits(
    block_size=16,
    max_body_bytes=256 << 10,
    max_prompt_tokens=8192,
    models=frozenset({MODEL}),
    lookup_timeout_s=1.0,
    max_prompt_bytes=64 << 10,
)
CASES: Counter[str] = Counter()  # outcome -> cases tried, over the whole module
FUZZ = settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def core(loop) -> RoutingCore:
    tok = PromptTokenizer()
    directory = open_directory("memory://", heartbeat_ttl_s=3600, index_stride=1)
    seed_ids = [(i * 7919) % 120000 for i in range(512)]

    async def setup() -> None:
        for n in ("a", "b", "c"):
            await directory.register_node(NodeInfo(n, f"10.0.0.{ord(n)}:8000", model=MODEL))
        await directory.record_stored("b", block_keys(seed_ids, block_size=16, seed=namespace_seed(MODEL)), Tier.GPU)

    loop.run_until_complete(setup())
    return RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), LIMITS)


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    total = sum(CASES.values())
    print(f"\nfuzzed RoutingCore.route: {total} cases; by outcome: {dict(sorted(CASES.items()))}")


def route(core: RoutingCore, loop, path: str, body: bytes) -> RouteResult:
    """One hostile request; checks what every answer must satisfy and counts it."""
    result = loop.run_until_complete(core.route(path, body, "fuzz"))
    CASES[f"{result.kind}:{result.status if result.kind == 'rejected' else result.reason or 'ok'}"] += 1
    assert result.kind in ("routed", "rejected", "fail_open")
    if result.kind == "rejected":
        assert 400 <= result.status < 500, result
        err = json.loads(result.body)
        assert err["object"] == "error" and err["code"] == result.status and err["message"]
    else:
        assert result.reason != "internal_error", f"an internal error on client input: {body[:300]!r}"
    if result.kind == "routed":
        loop.run_until_complete(core.release(result))  # leave no load behind for later cases
    return result


# -- strategies -----------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=30)
token_ids = st.one_of(
    st.integers(min_value=0, max_value=129279),  # in the vocabulary
    st.integers(min_value=-(2**70), max_value=-1),
    st.integers(min_value=129280, max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(max_size=5),
    st.none(),
)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), st.text(max_size=8), st.integers())
contents = st.one_of(
    st.text(max_size=200),
    st.none(),
    st.integers(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "bogus"]), "text": st.one_of(st.text(max_size=50), st.integers())}), max_size=3),
    json_values,
)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=6),
    st.lists(json_values, max_size=4),
    json_values,
)
models = st.one_of(st.just(MODEL), st.text(max_size=12), st.integers(), st.none())


def _dumps(value) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


# -- the fuzz tests ---------------------------------------------------------------------------


@FUZZ
@given(body=st.binary(max_size=512), path=st.sampled_from([CHAT, COMPLETIONS]))
def test_arbitrary_bytes_get_a_clear_answer(core, loop, body: bytes, path: str) -> None:
    """Random bytes (invalid JSON, invalid UTF-8) → 400, never an internal error."""
    route(core, loop, path, body)


@FUZZ
@given(value=json_values, path=st.sampled_from([CHAT, COMPLETIONS]))
def test_arbitrary_json_gets_a_clear_answer(core, loop, value, path: str) -> None:
    result = route(core, loop, path, _dumps(value))
    if not isinstance(value, dict):
        assert (result.kind, result.status) == ("rejected", 400)


@FUZZ
@given(model=models, msgs=messages, extra=st.dictionaries(st.sampled_from(["chat_template_kwargs", "tools", "add_generation_prompt", "continue_final_message", "cache_salt", "add_special_tokens"]), json_values, max_size=3))
def test_hostile_chat_bodies(core, loop, model, msgs, extra) -> None:
    """Messages of the wrong types, odd roles and contents, unknown models, bad options."""
    result = route(core, loop, CHAT, _dumps({"model": model, "messages": msgs, **extra}))
    if model != MODEL:
        assert result.kind == "rejected"  # unknown model (404) or not a string (400)


@FUZZ
@given(model=models, ids=st.lists(token_ids, max_size=300))
def test_hostile_token_id_prompts(core, loop, model, ids) -> None:
    """Token-ID prompts with negative, huge, float, boolean or non-integer IDs → 400."""
    result = route(core, loop, COMPLETIONS, _dumps({"model": model, "prompt": ids}))
    valid = bool(ids) and all(type(i) is int and 0 <= i < 129280 for i in ids)
    if ids and isinstance(ids[0], str):  # an array of strings is a batch of text prompts
        valid = ids[0] != "" and all(isinstance(i, str) for i in ids)
    if model == MODEL:
        assert (result.kind == "routed") == valid, result
        if not valid:
            assert result.status == 400


@FUZZ
@given(text=st.text(max_size=3000), model=st.just(MODEL))
def test_any_text_prompt_is_routed(core, loop, text: str, model: str) -> None:
    """Any non-empty Unicode text (lone surrogates excluded: not valid UTF-8 JSON) is a prompt."""
    result = route(core, loop, COMPLETIONS, json.dumps({"model": model, "prompt": text}).encode())
    assert result.kind == ("routed" if text else "rejected")


# -- the big ones: bounded time and memory ----------------------------------------------------


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


BIG_CASES = {
    "deep nesting (100k arrays)": (CHAT, b'{"model": "deepseek-chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "rejected"),
    "deep nesting in tools (5k objects)": (
        CHAT,
        b'{"model":"deepseek-chat","messages":[{"role":"user","content":"hi"}],"tools":[' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"]}",
        "any",
    ),
    "body over the byte limit (1 MiB string)": (COMPLETIONS, _dumps({"model": MODEL, "prompt": "x" * (1 << 20)}), "rejected"),
    "prompt over the prompt-byte cap (200 KiB of text)": (COMPLETIONS, _dumps({"model": MODEL, "prompt": "word " * 40_000}), "fail_open"),
    "prompt over the token cap (60 KiB of text)": (COMPLETIONS, _dumps({"model": MODEL, "prompt": "word " * 12_000}), "rejected"),
    "token-ID prompt over the token cap (50k IDs)": (COMPLETIONS, _dumps({"model": MODEL, "prompt": [5] * 50_000}), "rejected"),
    "invalid UTF-8 inside a JSON string": (COMPLETIONS, b'{"model": "deepseek-chat", "prompt": "abc\xff\xfe"}', "rejected"),
    "lone surrogate escape": (COMPLETIONS, b'{"model": "deepseek-chat", "prompt": "\\ud800"}', "any"),
    "token ID of 2**64": (COMPLETIONS, _dumps({"model": MODEL, "prompt": [1, 2**64]}), "rejected"),
}


@pytest.mark.parametrize("name", list(BIG_CASES))
def test_big_hostile_bodies_are_bounded(core, loop, name: str) -> None:
    path, body, expected = BIG_CASES[name]
    before = _rss_mib()
    t0 = time.perf_counter()
    result = route(core, loop, path, body)
    elapsed = time.perf_counter() - t0
    grew = _rss_mib() - before
    print(f"{name}: {result.kind} {result.status} {result.reason[:60]!r} in {elapsed * 1000:.0f} ms, max RSS +{grew:.0f} MiB")
    if expected != "any":
        assert result.kind == expected, result
    assert elapsed < 2.0  # a hostile body costs at most the caps' worth of work
    assert grew < 200


def test_a_100k_message_chat_is_bounded(loop) -> None:
    """100,000 messages (3.75 MB of JSON, within a generous body limit): rendered once, then
    refused by the prompt caps before the tokenizer spends seconds on it."""
    tok = PromptTokenizer()
    directory = open_directory("memory://", heartbeat_ttl_s=3600, index_stride=1)
    loop.run_until_complete(directory.register_node(NodeInfo("a", "10.0.0.1:8000", model=MODEL)))
    limits = RoutingLimits(max_body_bytes=8 << 20, max_prompt_tokens=131072, models=frozenset({MODEL}), max_prompt_bytes=1 << 20)
    big_core = RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), limits)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(100_000)]
    before = _rss_mib()
    t0 = time.perf_counter()
    result = route(big_core, loop, CHAT, _dumps({"model": MODEL, "messages": msgs}))
    elapsed = time.perf_counter() - t0
    print(f"100k-message chat: {result.kind} {result.reason!r} in {elapsed * 1000:.0f} ms, max RSS +{_rss_mib() - before:.0f} MiB")
    assert result.kind == "fail_open" and result.reason == "prompt_too_large"  # passed through, not judged
    assert elapsed < 2.0
    assert _rss_mib() - before < 300
