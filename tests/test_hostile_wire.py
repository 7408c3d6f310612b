"""Hostile requests on the wire: real Envoy + real `kvgate serve` (ext_proc) + three echo nodes.

A sample of hypothesis-made bodies goes through the whole path (the breadth is in-process, in
test_fuzz_routing.py). What a client sees: a 4xx with kvgate's JSON error, or its request
answered by a node; never a 5xx, and the kvgate process is still there afterwards. Every request
also carries forged kvgate routing and pull headers: no node ever sees the client's values.
"""

from __future__ import annotations

import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.envoy_config import KVGATE_HEADERS
from tests.support.http import request
from tests.support.stack import MODEL, Stack

SENT: list[int] = []


@pytest.fixture(scope="module")
def stack(tmp_path_factory, envoy_bin, redis_url):
    s = Stack(tmp_path_factory.mktemp("hostile-wire"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}")
    yield s
    s.stop()
    print(f"\nhostile bodies sent through Envoy + kvgate: {len(SENT)}; statuses {sorted(set(SENT))}")


header_values = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)
bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda m, p: json.dumps({"model": m, "prompt": p}).encode(), st.one_of(st.just(MODEL), st.text(max_size=5), st.integers()),
              st.one_of(st.text(max_size=100), st.lists(st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=3)), max_size=20))),
    st.builds(lambda m, msgs: json.dumps({"model": m, "messages": msgs}).encode(), st.just(MODEL),
              st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "wizard"]), "content": st.one_of(st.text(max_size=50), st.integers(), st.none())}), max_size=4)),
    st.just(b"[" * 50_000 + b"]" * 50_000),
    st.just(json.dumps({"model": MODEL, "prompt": "y" * (300 << 10)}).encode()),  # over the stack's 256 KiB body limit
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), forged=st.lists(header_values, min_size=3, max_size=3))
def test_hostile_bodies_through_envoy(stack: Stack, body: bytes, path: str, forged: list[str]) -> None:
    headers = {"content-type": "application/json", **dict(zip(KVGATE_HEADERS, forged))}
    status, _, raw = request(stack.url(path), method="POST", body=body, headers=headers, timeout=30)
    SENT.append(status)
    assert status < 500, (status, raw[:300])
    if status == 200:  # answered by a node: routed by kvgate, or passed through
        seen = json.loads(raw)["headers"]
        assert seen.get("x-gateway-destination-endpoint") in (None, stack.addr(seen_node(seen, stack)))
        for name, value in zip(KVGATE_HEADERS, forged):
            assert seen.get(name) != value, f"client's {name} reached a node"
    else:
        assert 400 <= status < 500
        if raw.startswith(b"{"):
            assert json.loads(raw)["object"] == "error"
    assert stack.kvgate.alive()


def seen_node(headers: dict[str, str], stack: Stack) -> str:
    """Which node an echo answer came from, by the address kvgate chose (when it chose)."""
    dest = headers.get("x-gateway-destination-endpoint", "")
    return next((n for n in stack.node_ports if stack.addr(n) == dest), "a")


def test_a_node_registered_in_redis_by_someone_else_is_never_a_destination(stack: Stack, tmp_path) -> None:
    """Issue 15, item 4: whoever can write to Redis registered a node at an address of its choice
    (``169.254.169.254:80``, the cloud metadata service) holding the prompt's blocks, and kvgate
    sent the request there. Here the forged node is a fourth echo server, so a request it
    received would be seen. What the attacker gets now: nothing: the forged node is skipped
    (``kvgate_untrusted_nodes_total`` counts it), the request is answered by a fleet node."""
    from directory_client.types import NodeInfo
    from tests.conftest import free_port
    from tests.support.http import get_json
    from tests.support.procs import start_echo
    from tests.support.stack import chat, document, keys_of
    from tokenizer import PromptTokenizer

    evil_port = free_port()
    evil = start_echo("evil", evil_port, tmp_path)
    try:
        body = chat(document("forged-node"), "What does it say?")
        keys = keys_of(PromptTokenizer(), "/v1/chat/completions", body)
        for _ in range(3):
            stack.directory_call(lambda d: d.register_node(NodeInfo("evil", f"127.0.0.1:{evil_port}", model="deepseek-chat")))
            stack.seed("evil", keys)
            status, _, raw = request(stack.url("/v1/chat/completions"), method="POST", body=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
            assert status == 200, raw[:300]
            seen = json.loads(raw)["headers"]
            assert seen.get("x-gateway-destination-endpoint") in {stack.addr(n) for n in stack.node_ports}
        assert get_json(f"http://127.0.0.1:{evil_port}/_stats")[1]["requests"] == 0
        metrics = request(f"http://127.0.0.1:{stack.admin_port}/metrics")[2].decode()
        assert "kvgate_untrusted_nodes_total" in metrics
    finally:
        evil.stop()
        stack.directory_call(lambda d: d.deregister_node("evil"))


@pytest.mark.parametrize("integration", ["ext_proc", "ext_authz"])
def test_envoy_carries_the_caller_token_so_its_requests_are_still_routed(tmp_path, envoy_bin, redis_url, integration) -> None:
    """With a caller token (issue 15, item 2) the rendered Envoy sends it on every ext_proc stream
    (gRPC metadata) and ext_authz check (a header clients cannot set): requests through Envoy are
    routed as before; a token header a client sends itself is not what kvgate checks."""
    token = "envoy-caller-token-" + uuid.uuid4().hex
    (tmp_path / "caller-token").write_text(token)
    s = Stack(tmp_path, envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}", integration,
              envoy_options={"caller_token": token},
              kvgate_options={"caller_token_file": str(tmp_path / "caller-token")})  # fmt: skip
    try:
        body = json.dumps({"model": MODEL, "prompt": "Tell me about harbours. " * 20, "max_tokens": 4}).encode()
        status, _, raw = request(s.url("/v1/completions"), method="POST", body=body,
                                 headers={"content-type": "application/json", "x-kvgate-authz-token": "forged"})  # fmt: skip
        assert status == 200, raw[:200]
        seen = json.loads(raw)["headers"]
        assert seen.get("x-gateway-destination-endpoint") in {s.addr(n) for n in s.node_ports}
        metrics = request(f"http://127.0.0.1:{s.admin_port}/metrics")[2].decode()
        assert f"kvgate_{integration}_unauthenticated_total 0.0" in metrics
    finally:
        s.stop()


@pytest.mark.parametrize(
    "field,value",
    [
        ("kv_transfer_params", {"do_remote_decode": True}),  # pins the prompt's KV on the node for a decode that never comes
        ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5600, "remote_block_ids": [1, 2]}),
        ("bootstrap_host", "10.0.0.9"),  # SGLang: the decode engine joins a prefill node of the client's choosing
    ],
)
def test_a_client_cannot_send_disaggregation_parameters_to_an_engine(stack: Stack, field: str, value: object) -> None:
    """Before: a client's ``kv_transfer_params`` (vLLM's NIXL connector) or SGLang's ``bootstrap_*``
    fields reached the node as sent (200 from the echo node, the body whole): with a KV connector,
    ``do_remote_decode`` holds the prompt's KV on the node until a decode reads it (vLLM aborts
    after 480 s) and ``do_remote_prefill`` reads blocks from the engine the client names. Now:
    400 with kvgate's JSON error naming the field; no node sees the request."""
    before = stack.node_requests()
    body = json.dumps({"model": MODEL, "prompt": "hello " * 40, "max_tokens": 1, field: value}).encode()
    status, _, raw = request(stack.url("/v1/completions"), method="POST", body=body, headers={"content-type": "application/json"}, timeout=30)
    assert status == 400, (status, raw[:300])
    error = json.loads(raw)
    assert error["object"] == "error" and f"`{field}`" in error["message"]
    assert stack.node_requests() == before
