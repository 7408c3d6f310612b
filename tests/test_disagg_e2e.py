"""Disaggregated prefill/decode through real Envoy, the real `kvgate serve`, real Redis and real
upstreams: node a is a prefill node, b and c decode. What a decode node sees is what its P/D
sidecar acts on: `x-prefiller-host-port` names the prefill node, or is absent (serve whole)."""

from __future__ import annotations

import uuid

import pytest

from tests.support.http import eventually, post_json
from tests.support.stack import MODEL, Stack, chat, document


@pytest.fixture(scope="module", params=["ext_proc", "ext_authz"])
def stack(request, tmp_path_factory, envoy_bin, redis_url):
    s = Stack(
        tmp_path_factory.mktemp("pd"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}", request.param,
        roles={"a": "prefill", "b": "decode", "c": "decode"},
        # over RDMA: a TCP transfer of a long prompt's KV would nearly double its first token
        kvgate_options={"limits": {"max_body_bytes": 256 << 10, "max_answer_tokens": 4096}, "policy": {"link": "rdma"}},
    )
    yield s
    s.stop()


def short_question() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "What is two plus two?"}], "max_tokens": 8}


def test_a_long_answer_never_lands_on_the_prefill_node(stack: Stack) -> None:
    for _ in range(6):
        status, body = post_json(stack.url("/v1/chat/completions"), {**short_question(), "max_tokens": 65})
        assert status == 200, body
        assert body["node"] in ("b", "c")
        assert "x-prefiller-host-port" not in body["headers"]  # idle fleet, short prompt: served whole


def test_a_short_answer_may_be_served_whole_by_the_prefill_node(stack: Stack) -> None:
    # policy.prefill_serves_whole_tokens (64): with both decode nodes decoding 24 answers, the idle
    # prefill node gives the sooner first token, and an 8-token answer is no decode to speak of
    async def busy(d):
        return [await d.reserve(n, 0, hold_s=60.0) for n in ("b", "c") for _ in range(24)]

    held = stack.directory_call(busy)
    try:
        status, body = post_json(stack.url("/v1/chat/completions"), short_question())
        assert status == 200, body
        assert body["node"] == "a" and "x-prefiller-host-port" not in body["headers"]
        status, body = post_json(stack.url("/v1/chat/completions"), {**short_question(), "max_tokens": 65})
        assert status == 200, body
        assert body["node"] in ("b", "c")  # a longer answer would make the prefill node a decode node
    finally:
        async def free(d):
            for r in held:
                await d.release(r)

        stack.directory_call(free)


def test_a_long_prompt_with_a_long_answer_on_busy_decoders_is_split(stack: Stack) -> None:
    async def busy(d):  # both decode nodes are decoding 24 answers each (held one minute)
        return [await d.reserve(n, 0, hold_s=60.0) for n in ("b", "c") for _ in range(24)]

    async def queued(d):
        loads = await d.loads()
        return sum(load.prefill_tokens for load in loads.values())

    held = stack.directory_call(busy)
    try:
        long = chat(document("estuary", sentences=1200), "Write a long essay on it.")
        long["max_tokens"] = 2048
        status, body = post_json(stack.url("/v1/chat/completions"), long)
        assert status == 200, body
        assert "x-prefiller-host-port" not in body["headers"]  # no first-token tail known yet: no split delays one
        for i in range(64):  # the gateway learns its first-token tail from documents longer than this one
            status, _ = post_json(stack.url("/v1/chat/completions"), chat(document(f"tide {i}", sentences=2400), "Sum up."))
            assert status == 200
        eventually(lambda: stack.directory_call(queued) == 0, timeout_s=60)  # their prefills are estimated done
        status, body = post_json(stack.url("/v1/chat/completions"), long)
        assert status == 200, body
        assert body["node"] in ("b", "c")  # the decode node is the destination
        assert body["headers"]["x-gateway-destination-endpoint"] == stack.addr(body["node"])
        assert body["headers"]["x-prefiller-host-port"] == stack.addr("a")

        status, body = post_json(stack.url("/v1/chat/completions"), short_question())
        assert status == 200, body
        assert "x-prefiller-host-port" not in body["headers"]  # a short prompt is not worth a transfer
    finally:
        async def free(d):
            for r in held:
                await d.release(r)

        stack.directory_call(free)


def test_a_client_cannot_name_a_prefill_node(stack: Stack) -> None:
    spoof = {"x-prefiller-host-port": "10.9.9.9:8000"}
    status, body = post_json(stack.url("/v1/chat/completions"), short_question(), headers=spoof)
    assert status == 200, body
    assert "x-prefiller-host-port" not in body["headers"]  # stripped before kvgate decided


@pytest.fixture(scope="module")
def sglang_stack(tmp_path_factory, envoy_bin, redis_url):
    """The same fleet as SGLang runs it: decode-mode servers cannot compute a prompt themselves."""
    s = Stack(
        tmp_path_factory.mktemp("pd-sglang"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}", "ext_authz",
        roles={"a": "prefill", "b": "decode", "c": "decode"},
        kvgate_options={"policy": {"link": "rdma", "decode_serves_whole": False}},
    )
    yield s
    s.stop()


def test_with_decode_nodes_that_serve_only_splits_every_request_is_split(sglang_stack: Stack) -> None:
    """policy.decode_serves_whole: false — even a short question on an idle fleet, which is never
    worth a split, reaches its decode node with the prefill node named."""
    for _ in range(4):
        status, body = post_json(sglang_stack.url("/v1/chat/completions"), short_question())
        assert status == 200, body
        assert body["node"] in ("b", "c")
        assert body["headers"].get("x-prefiller-host-port") == f"127.0.0.1:{sglang_stack.node_ports['a']}"
