"""End to end through real Envoy, the real `kvgate serve` (ext_proc), real Redis and three real
upstream HTTP servers: a request lands on the node the directory says holds its prefix."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.http import eventually, post_json, request
from directory_client.types import NodeLoad
from tests.support.stack import NODES, MODEL, Stack, chat, document, keys_of
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed

@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


@pytest.fixture(scope="module", params=["ext_proc", "ext_authz"])
def stack(request, tmp_path_factory, envoy_bin, redis_url):
    """The same tests run against both Envoy integrations: one decision, two wires."""
    s = Stack(
        tmp_path_factory.mktemp("e2e"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}", request.param
    )
    yield s
    s.stop()


def test_request_lands_on_the_node_holding_its_prefix(stack: Stack, tok: PromptTokenizer) -> None:
    history_b = chat(document("harbour"), "Summarise the report.", "It is about a harbour.")
    history_c = chat(document("orchard"), "Summarise the report.", "It is about an orchard.")
    stack.seed("b", keys_of(tok, "/v1/chat/completions", history_b))
    stack.seed("c", keys_of(tok, "/v1/chat/completions", history_c))

    for _ in range(3):
        status, body = post_json(stack.url("/v1/chat/completions"), chat(*[m["content"] for m in history_b["messages"]], "And the figures?"))
        assert status == 200, body
        assert body["node"] == "b"
        assert body["headers"]["x-gateway-destination-endpoint"] == stack.addr("b")
        status, body = post_json(stack.url("/v1/chat/completions"), chat(*[m["content"] for m in history_c["messages"]], "Which trees?"))
        assert status == 200, body
        assert body["node"] == "c"


def test_completions_token_id_prompt_follows_its_prefix(stack: Stack) -> None:
    prompt = [(i * 7919) % 120000 for i in range(2048)]
    keys = block_keys(prompt, block_size=16, seed=namespace_seed(MODEL))
    stack.seed("a", keys[:100])
    status, body = post_json(stack.url("/v1/completions"), {"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert status == 200, body
    assert body["node"] == "a"


def test_spoofed_routing_headers_never_reach_a_node(stack: Stack, tok: PromptTokenizer) -> None:
    history = chat(document("glacier"), "What melts?")
    stack.seed("c", keys_of(tok, "/v1/chat/completions", history))
    spoof = {
        "x-gateway-destination-endpoint": stack.addr("a"),
        "x-kv-cache-source-host-port": "10.9.9.9:1",
        "x-kv-cache-pull-blocks": "999",
    }
    status, body = post_json(stack.url("/v1/chat/completions"), history, headers=spoof)
    assert status == 200, body
    assert body["node"] == "c"  # kvgate's choice, not the client's
    assert body["headers"]["x-gateway-destination-endpoint"] == stack.addr("c")
    assert "x-kv-cache-source-host-port" not in body["headers"]
    assert "x-kv-cache-pull-blocks" not in body["headers"]

    status, raw_headers, raw = request(stack.url("/v1/models"), headers=spoof)
    seen = json.loads(raw)
    assert status == 200
    assert not any(h in seen["headers"] for h in spoof)


def test_non_inference_paths_pass_through(stack: Stack) -> None:
    status, _, raw = request(stack.url("/v1/models"))
    assert status == 200
    assert json.loads(raw)["path"] == "/v1/models"
    status, _, raw = request(stack.url("/tokenize"), method="POST", body=b"not json at all")
    assert status == 200  # not an inference path: kvgate does not judge its body
    assert json.loads(raw)["body_len"] == len(b"not json at all")


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400, "messages"),
        ("/v1/completions", json.dumps({"model": MODEL}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, -5]}).encode(), 400, ""),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * (300 << 10)}).encode(), 413, ""),
    ],
)
def test_bad_requests_get_a_clear_error_and_touch_no_node(stack: Stack, path, body, status, message) -> None:
    before = stack.node_requests()
    got, headers, raw = request(stack.url(path), method="POST", body=body, headers={"content-type": "application/json"})
    assert got == status, raw
    if got == 400:  # kvgate's own answer: vLLM's error shape
        err = json.loads(raw)
        assert err["object"] == "error" and err["code"] == 400
        assert message in err["message"]
    assert stack.node_requests() == before


def test_load_reservations_are_released_when_responses_end(stack: Stack) -> None:
    for i in range(5):
        status, _ = post_json(stack.url("/v1/completions"), {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 2})
        assert status == 200

    def loads():
        return stack.directory_call(lambda d: d.loads())

    eventually(lambda: loads() == {n: NodeLoad(0, 0) for n in NODES}, timeout_s=15, show=loads)  # 15 s: a loaded 2-core machine


def test_metrics_count_decisions(stack: Stack) -> None:
    status, _, raw = request(f"http://127.0.0.1:{stack.admin_port}/metrics")
    text = raw.decode()
    assert status == 200
    assert 'kvgate_decisions_total{outcome="owner",policy="kvgate"}' in text
    assert 'kvgate_rejected_requests_total{status="400"}' in text
