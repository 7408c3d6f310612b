"""Sessions: a conversation named by the client keeps its node when a turn's prompt is not a
prefix extension (edited history, summarised context), recorded with a TTL in the directory, and
weighed by the cost model — never kept on a node that is much more expensive than another. A
session asking for long retention is remembered longer and weighs more.

The request-path tests run real Envoy, ``kvgate serve`` over ext_proc and over ext_authz, Redis
and three upstreams.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import redis

from directory_client import open_directory
from directory_client.memory import InProcessDirectory
from gateway.policy import make_policy
from gateway.profile import load_profile
from gateway.sessions import retention, session_id, session_key
from gateway.types import RoutingRequest
from tests.support.http import eventually, post_json
from tests.support.stack import MODEL, Stack, chat, document
from tests.test_policy import node, view

PATH = "/v1/chat/completions"


# --- naming a session -----------------------------------------------------------------------------


def test_the_header_wins_then_safety_identifier_then_user() -> None:
    body = {"user": "u-1", "safety_identifier": "s-1"}
    assert session_id("h-1", body) == "h-1"
    assert session_id("", body) == "s-1"
    assert session_id("", {"user": "u-1"}) == "u-1"
    assert session_id("", {"user": 7}) == ""  # not a string: no session, not an error


def test_prompt_cache_key_names_a_session_before_the_person_fields() -> None:
    body = {"user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k-1"}
    assert session_id("", body) == "k-1"
    assert session_id("h-1", body) == "h-1"


def test_retention_classes() -> None:
    assert retention("long", {}) == "long"
    assert retention("LONG", {}) == "long"
    assert retention("", {"prompt_cache_retention": "24h"}) == "long"  # OpenAI's field
    assert retention("", {"prompt_cache_retention": "in_memory"}) == ""
    assert retention("default", {"prompt_cache_retention": "24h"}) == ""  # the header wins
    assert retention("forever", {}) == ""  # unknown: the default, not an error
    assert retention("", {"prompt_cache_retention": 24}) == ""


def test_session_keys_are_per_model_and_tenant_and_hide_the_id() -> None:
    key = session_key("alice", "m", None)
    assert "alice" not in key
    assert len({key, session_key("alice", "m2", None), session_key("alice", "m", "tenant-b")}) == 3


# --- the directory remembers, for a while -----------------------------------------------------------


async def test_memory_directory_forgets_a_session_after_its_ttl() -> None:
    now = [100.0]
    d = InProcessDirectory(clock=lambda: now[0])
    await d.record_session("s", "n1", ttl_s=30)
    assert await d.session_node("s") == "n1"
    await d.record_session("s", "n2", ttl_s=30)  # the conversation moved
    now[0] += 29
    assert await d.session_node("s") == "n2"
    now[0] += 2
    assert await d.session_node("s") is None


async def test_redis_directory_keeps_a_session_with_its_ttl(redis_url, key_prefix) -> None:
    d = open_directory(redis_url, key_prefix=key_prefix)
    try:
        assert await d.session_node("s") is None
        await d.record_session("s", "n1", ttl_s=30)
        assert await d.session_node("s") == "n1"
        ttl_ms = redis.Redis.from_url(redis_url).pttl(f"{key_prefix}:session:s")
        assert 25_000 < ttl_ms <= 30_000
    finally:
        await d.aclose()


# --- the policy weighs it ---------------------------------------------------------------------------


def decide(session_node: str, queued_on_n1: int, retention: str = ""):
    req = RoutingRequest(
        model="m", prompt_tokens=6500, total_blocks=406, block_size=16, session_node=session_node, retention=retention
    )
    v = view(node(1, inflight=1, queued=queued_on_n1), node(2), node(3))
    return make_policy("kvgate").decide(req, v, load_profile("llama-3.1-8b-h100"), now=0.0)


def test_a_session_keeps_a_slightly_busier_node() -> None:
    d = decide("n1", queued_on_n1=500)
    assert d.node.node_id == "n1" and d.reason.startswith("keeps its session's node")
    assert decide("", queued_on_n1=500).node.node_id != "n1"  # without the session it would move


def test_a_session_never_overrides_a_much_cheaper_node() -> None:
    d = decide("n1", queued_on_n1=20_000)
    costs = {c.node_id: c.total_s for c in d.candidates}
    assert d.node.node_id != "n1" and costs["n1"] > 1.25 * costs[d.node.node_id]


def test_long_retention_keeps_a_busier_node_but_not_any() -> None:
    moved = decide("n1", queued_on_n1=3000)
    costs = {c.node_id: c.total_s for c in moved.candidates}
    ratio = costs["n1"] / min(costs.values())
    assert moved.node.node_id != "n1" and 1.25 < ratio < 2  # a default session moves at this cost
    assert decide("n1", queued_on_n1=3000, retention="long").node.node_id == "n1"
    assert decide("n1", queued_on_n1=20_000, retention="long").node.node_id != "n1"  # up to 2x, no more
    with pytest.raises(ValueError, match="session_slack_long"):
        make_policy("kvgate", session_slack=0.5, session_slack_long=0.25)


def test_a_session_slack_of_zero_turns_the_preference_into_a_tie_breaker() -> None:
    req = RoutingRequest(model="m", prompt_tokens=6500, total_blocks=406, block_size=16, session_node="n1")
    v = view(node(1, inflight=1, queued=500), node(2), node(3))
    d = make_policy("kvgate", session_slack=0.0).decide(req, v, load_profile("llama-3.1-8b-h100"), now=0.0)
    assert d.node.node_id != "n1"
    with pytest.raises(ValueError, match="session_slack"):
        make_policy("kvgate", session_slack=-1)


# --- in the routing core ---------------------------------------------------------------------------


async def test_the_core_routes_a_short_named_turn_and_records_its_class() -> None:
    """A prompt short enough to be tokenized whole (not routed on its head) names its session and
    class in the body; the session is read with the lookup, recorded with the default TTL on its
    first turn and with the long one once it came back."""
    from gateway.core import RoutingCore, RoutingLimits
    from directory_client.types import NodeInfo
    from tokenizer import PromptTokenizer

    now = [1000.0]
    directory = InProcessDirectory(clock=lambda: now[0])
    for i in (1, 2):
        await directory.register_node(NodeInfo(f"n{i}", f"127.0.0.1:{9000 + i}"))
    limits = RoutingLimits(session_ttl_s=60, session_long_ttl_s=3600)
    core = RoutingCore(PromptTokenizer(), directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), limits)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello there."}], "user": "u-7",
            "prompt_cache_retention": "24h"}
    result = await core.route(PATH, json.dumps(body).encode())
    assert result.kind == "routed" and result.request is not None
    assert result.request.session == session_key("u-7", "m", None) and result.request.retention == "long"
    for _ in range(3):  # recorded off the answer's path
        await asyncio.sleep(0)
    node = result.decision.node.node_id
    now[0] += 30  # within the default TTL
    for i in (1, 2):
        await directory.heartbeat(f"n{i}")
    again = await core.route(PATH, json.dumps(body).encode())
    assert again.kind == "routed" and again.request.session_node == node  # read back with the lookup
    for _ in range(3):
        await asyncio.sleep(0)
    now[0] += 3000  # past the default TTL, within the long one: the session came back, so it is kept
    assert await directory.session_node(result.request.session) == again.decision.node.node_id


async def test_a_session_seen_once_is_not_kept_a_day_however_it_asks() -> None:
    """A client minting a fresh session ID for every request, each asking for long retention.
    Before: each left a directory key for the long TTL (2,000 requests, 2,000 keys kept 24 h, until
    Redis's memory is full and it refuses every write). What that client gets now: its one-off
    sessions are remembered for the default TTL only."""
    from gateway.core import RoutingCore, RoutingLimits
    from directory_client.types import NodeInfo
    from tokenizer import PromptTokenizer

    now = [1000.0]
    directory = InProcessDirectory(clock=lambda: now[0])
    await directory.register_node(NodeInfo("n1", "127.0.0.1:9001"))
    core = RoutingCore(PromptTokenizer(), directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
                       RoutingLimits(session_ttl_s=60, session_long_ttl_s=3600))
    sessions = []
    for i in range(20):
        body = {"model": "m", "messages": [{"role": "user", "content": "Hello there."}], "user": f"mint-{i}",
                "prompt_cache_retention": "24h"}
        result = await core.route(PATH, json.dumps(body).encode())
        assert result.kind == "routed"
        sessions.append(result.request.session)
    for _ in range(3):
        await asyncio.sleep(0)
    assert all([await directory.session_node(s) == "n1" for s in sessions])  # remembered ...
    now[0] += 61
    assert not any([await directory.session_node(s) for s in sessions])  # ... for the default TTL


# --- through Envoy ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory, envoy_bin, redis_url):
    s = Stack(tmp_path_factory.mktemp("sessions"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}")
    yield s
    s.stop()


def send(stack: Stack, body: dict, session: str = "", retention: str = "") -> str:
    headers = {"x-session-id": session} if session else {}
    if retention:
        headers["x-kvgate-retention"] = retention
    status, echo = post_json(stack.url(PATH), body, headers=headers)
    assert status == 200, echo
    return echo["node"]


def recorded(stack: Stack, name: str, node: str = "") -> None:
    """Wait for the session's node (``node``, if given) to be in the directory: it is recorded
    after the answer."""
    key = f"{stack.key_prefix}:session:{session_key(name, MODEL, None)}"

    def stored() -> bool:
        value = redis.Redis.from_url(stack.redis_url).get(key)
        return value is not None and (not node or value.decode() == node)

    eventually(stored, timeout_s=5)


def settled(stack: Stack) -> None:
    """Wait until no earlier request's queued prefill is left on any node: ext_proc gives it back
    when the answer's stream ends, a moment after the client has the answer, and the cost
    comparisons below assume idle nodes. (Requests in flight are not waited for: a count of 1
    was seen to linger past 10 s on one node, an open bug.)"""

    def loads():
        return stack.directory_call(lambda d: d.loads())

    eventually(lambda: all(not v.prefill_tokens for v in loads().values()), timeout_s=10, show=loads)


def load(stack: Stack, node_id: str, tokens: int):
    """Queue ``tokens`` of prefill on a node (once the others are idle), as another request in
    flight there would."""
    settled(stack)
    return stack.directory_call(lambda d: d.reserve(node_id, tokens, first_token_s=120))


def release(stack: Stack, reservation) -> None:
    """Give the load back, retried: one lost to a timeout on a busy machine would skew later tests."""
    eventually(lambda: stack.directory_call(lambda d: d.release(reservation)) or True, timeout_s=10)


def test_a_rewritten_conversation_keeps_its_node_unless_another_is_much_cheaper(stack: Stack) -> None:
    session = "conv-" + uuid.uuid4().hex
    first = send(stack, chat(document("harbour"), "Summarise the report."), session)
    recorded(stack, session)
    # The client summarised the history: the next prompt shares no prefix with the first.
    summary = chat(document("harbour summary", 300), "And the tides?")

    busy = load(stack, first, 500)  # the session's node is a little busier than the others
    try:
        assert send(stack, summary) != first  # unnamed, it goes elsewhere
        assert send(stack, summary, session) == first  # named, it stays
    finally:
        release(stack, busy)

    busy = load(stack, first, 40_000)  # now the session's node is far behind the others
    try:
        moved = send(stack, chat(document("harbour summary 2", 300), "And the wind?"), session)
        assert moved != first
    finally:
        release(stack, busy)
    # The directory moved the session with it: its next rewritten turn follows. (Wait for the
    # record first: a turn sent before it would be cached where the old record sent it.)
    recorded(stack, session, moved)
    settled(stack)  # the moved turn's load is given back when its stream ends, a moment after its answer
    assert send(stack, chat(document("harbour summary 3", 300), "Rain?"), session) == moved


def test_a_long_retention_session_stays_where_a_default_one_moves(stack: Stack, redis_url) -> None:
    """The retention header reaches the policy and the directory: the session's node is
    remembered for ``sessions.long_ttl_s`` and kept at a cost a default session would not pay
    (about 1.5x the cheapest here, between the two slacks)."""
    short, long = "conv-" + uuid.uuid4().hex, "conv-" + uuid.uuid4().hex
    first_short = send(stack, chat(document("estuary"), "Summarise the report."), short)
    first_long = send(stack, chat(document("delta"), "Summarise the report."), long, retention="long")

    def ttl_ms(name: str) -> int:
        return redis.Redis.from_url(redis_url).pttl(f"{stack.key_prefix}:session:{session_key(name, MODEL, None)}")

    eventually(lambda: ttl_ms(short) > 0 and ttl_ms(long) > 0, timeout_s=5)  # recorded after the answer
    assert ttl_ms(long) <= 1800_000  # a first turn: kept long only once it comes back
    for session, first, kept in ((short, first_short, False), (long, first_long, True)):
        busy = load(stack, first, 2000)
        try:
            # a fixed topic: a session ID in the text would change the prompt's length, and the
            # cost ratio with it
            turn = send(stack, chat(document("retention kept" if kept else "retention moved", 300), "And the tides?"), session,
                        retention="long" if kept else "")
            assert (turn == first) is kept
        finally:
            release(stack, busy)
    eventually(lambda: ttl_ms(long) > 3600_000, timeout_s=5)  # it came back: remembered for the long TTL
    assert ttl_ms(short) <= 1800_000


def test_the_openai_user_field_names_a_session_too(stack: Stack) -> None:
    user = "user-" + uuid.uuid4().hex
    first = send(stack, {**chat(document("orchard"), "Which trees?"), "user": user})
    recorded(stack, user)
    busy = load(stack, first, 500)
    try:
        assert send(stack, {**chat(document("orchard notes", 300), "Apples?"), "user": user}) == first
    finally:
        release(stack, busy)


def test_sessions_are_off_with_a_zero_ttl(tmp_path_factory, envoy_bin, redis_url) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVGATE_SESSIONS__TTL_S", "0")
        s = Stack(tmp_path_factory.mktemp("no-sessions"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}")
    try:
        session = "conv-" + uuid.uuid4().hex
        first = send(s, chat(document("lagoon"), "Tides?"), session)
        busy = load(s, first, 500)
        try:
            assert send(s, chat(document("lagoon summary", 300), "Fish?"), session) != first
        finally:
            release(s, busy)
        assert redis.Redis.from_url(redis_url).keys(f"{s.key_prefix}:session:*") == []
    finally:
        s.stop()


def test_ext_authz_sees_the_session_and_retention_headers(tmp_path_factory, envoy_bin, redis_url) -> None:
    """Over ext_authz Envoy forwards ``x-session-id`` and ``x-kvgate-retention`` to kvgate (the
    rendered filter's allowed headers): each session is recorded at the node it was routed to,
    with the TTL of its class (long once it came back), and the body's ``user`` names one too. (The cost comparisons above
    run over ext_proc, whose loads end with the response; over ext_authz a turn's load is held
    for its estimate, so back-to-back turns see their own earlier load.)"""
    s = Stack(tmp_path_factory.mktemp("sessions-authz"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}",
              integration="ext_authz")
    try:
        r = redis.Redis.from_url(redis_url)

        def recorded_at(name: str) -> tuple[str, int]:
            key = f"{s.key_prefix}:session:{session_key(name, MODEL, None)}"
            eventually(lambda: r.exists(key), timeout_s=5)
            return r.get(key).decode(), r.pttl(key)

        short, long, user = ("conv-" + uuid.uuid4().hex for _ in range(3))
        node_short = send(s, chat(document("fjord"), "Tides?"), short)
        node_long = send(s, chat(document("atoll"), "Reefs?"), long, retention="long")
        node_user = send(s, {**chat(document("steppe"), "Grass?"), "user": user})
        at, ttl = recorded_at(short)
        assert at == node_short and 0 < ttl <= 1800_000
        at, ttl = recorded_at(long)
        assert at == node_long and 0 < ttl <= 1800_000  # its first turn
        assert send(s, chat(document("atoll"), "Reefs?"), long, retention="long") == node_long
        eventually(lambda: recorded_at(long)[1] > 3600_000, timeout_s=5)  # it came back: kept long
        at, ttl = recorded_at(user)
        assert at == node_user and 0 < ttl <= 1800_000
    finally:
        s.stop()
