"""Prediction headers through the real request path: Envoy → ``kvgate serve`` (ext_proc) → three
upstreams, Redis as the directory, the decision log and tracing on.

What a client sees with ``prediction.response_headers`` on: ``x-kvgate-expected-cached-tokens``
and ``x-kvgate-estimated-ttft-ms`` on the response to a request carrying its tenant's
``cache_salt`` — the same figures the decision log and the decision's span carry — and nothing on
a request without one (it would learn whether someone else's prompt is cached). Off by default;
refused at start unless every tenant salts its keys, and refused without ext_proc.
"""

from __future__ import annotations

import json
import uuid

import pytest

from gateway.config import ConfigError, load_config
from gateway.prediction import ESTIMATED_TTFT_HEADER, EXPECTED_CACHED_TOKENS_HEADER
from tests.support.http import eventually, request
from tests.support.stack import Stack, chat, document
from tests.test_observability_e2e import OtlpReceiver, attributes
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed

TOKEN = "prediction-admin-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PATH = "/v1/chat/completions"
PREDICTION = (EXPECTED_CACHED_TOKENS_HEADER, ESTIMATED_TTFT_HEADER)


def test_prediction_headers_are_off_by_default() -> None:
    assert load_config().prediction.response_headers is False


def test_prediction_headers_are_refused_unless_every_tenant_salts_its_keys() -> None:
    with pytest.raises(ConfigError, match="cache_salt_per_tenant") as e:
        load_config(prediction={"response_headers": True})
    assert "\n  prediction: response_headers would tell" in str(e.value)  # the section is named
    cfg = load_config(prediction={"response_headers": True, "cache_salt_per_tenant": True})
    assert cfg.prediction.response_headers


def test_prediction_headers_are_refused_over_ext_authz_alone() -> None:
    with pytest.raises(ConfigError, match="ext_authz answers before the response exists"):
        load_config(
            ext_proc_enabled=False, ext_authz_port=9004,
            prediction={"response_headers": True, "cache_salt_per_tenant": True},
        )  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


def start_stack(tmp_path_factory, envoy_bin, redis_url, env: dict[str, str]) -> Stack:
    with pytest.MonkeyPatch.context() as mp:  # the kvgate process inherits these
        for k, v in env.items():
            mp.setenv(k, v)
        return Stack(tmp_path_factory.mktemp("prediction"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, envoy_bin, redis_url, receiver):
    s = start_stack(tmp_path_factory, envoy_bin, redis_url, {
        "KVGATE_PREDICTION__RESPONSE_HEADERS": "true",
        "KVGATE_PREDICTION__CACHE_SALT_PER_TENANT": "true",
        "KVGATE_ADMIN__DEBUG": "true",
        "KVGATE_ADMIN__TOKEN": TOKEN,
        "KVGATE_TRACING__ENABLED": "true",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    })
    yield s
    s.stop()


def salted_keys(tok: PromptTokenizer, body: dict) -> list[int]:
    prompt = tok.tokenize_body(PATH, body)
    assert prompt.cache_salt == body.get("cache_salt")
    return block_keys(prompt.token_ids, block_size=16, seed=namespace_seed(prompt.model, cache_salt=prompt.cache_salt))


def send(stack: Stack, body: dict) -> tuple[dict[str, str], dict]:
    """POST through Envoy; the response's headers (as the client sees them) and the node's echo."""
    status, headers, raw = request(stack.url(PATH), method="POST", body=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})  # fmt: skip
    assert status == 200, raw
    return headers, json.loads(raw)


def logged(stack: Stack, request_id: str) -> dict:
    def find():
        status, _, raw = request(f"http://127.0.0.1:{stack.admin_port}/debug/decisions?limit=100", headers=AUTH)
        assert status == 200
        return {d["request_id"]: d for d in json.loads(raw)["decisions"]}.get(request_id)

    return eventually(find, timeout_s=5)


def test_a_salted_request_is_told_what_the_decision_log_and_trace_say(stack: Stack, tok, receiver) -> None:
    body = {**chat(document("harbour"), "Summarise the report."), "cache_salt": "tenant-a-" + uuid.uuid4().hex}
    keys = salted_keys(tok, body)
    stack.seed("b", keys)

    headers, echo = send(stack, body)
    assert echo["node"] == "b"
    cached, ttft_ms = int(headers[EXPECTED_CACHED_TOKENS_HEADER]), int(headers[ESTIMATED_TTFT_HEADER])
    # the directory answers at its sampling stride, so the prefix may end a few blocks short
    assert len(keys) * 16 // 2 < cached <= len(keys) * 16
    assert ttft_ms > 0

    rid = echo["headers"]["x-request-id"]
    entry = logged(stack, rid)
    assert (entry["expected_cached_tokens"], entry["estimated_ttft_ms"]) == (cached, ttft_ms)

    def span():
        spans = [attributes(s.attributes) for _, s in receiver.spans()]
        return next((a for a in spans if a.get("kvgate.request_id") == rid), None)

    a = eventually(span, timeout_s=10)
    assert (a["kvgate.expected_cached_tokens"], a["kvgate.estimated_ttft_ms"]) == (cached, ttft_ms)


def test_the_estimate_is_longer_when_nothing_is_cached(stack: Stack, tok) -> None:
    salt = "tenant-b-" + uuid.uuid4().hex
    warm = {**chat(document("orchard"), "Which trees?"), "cache_salt": salt}
    stack.seed("c", salted_keys(tok, warm))
    warm_headers, _ = send(stack, warm)
    cold_headers, _ = send(stack, {**chat(document("quarry"), "Which stone?"), "cache_salt": salt})
    assert int(cold_headers[EXPECTED_CACHED_TOKENS_HEADER]) == 0 < int(warm_headers[EXPECTED_CACHED_TOKENS_HEADER])
    assert int(cold_headers[ESTIMATED_TTFT_HEADER]) > int(warm_headers[ESTIMATED_TTFT_HEADER])


def test_a_request_without_cache_salt_learns_nothing(stack: Stack, tok) -> None:
    # Another tenant's prompt is cached on node a; an unsalted request for the same text is routed
    # there (same keys) but its response must not say so: that would be the oracle.
    body = chat(document("glacier"), "What melts?")
    prompt = tok.tokenize_body(PATH, body)
    stack.seed("a", block_keys(prompt.token_ids, block_size=16, seed=namespace_seed(prompt.model)))
    headers, echo = send(stack, body)
    assert echo["node"] == "a"
    assert not [h for h in headers if h in PREDICTION], headers
    assert logged(stack, echo["headers"]["x-request-id"])["expected_cached_tokens"] > 0  # the operator still sees it


def test_without_the_setting_no_response_carries_them(tmp_path_factory, envoy_bin, redis_url, tok) -> None:
    plain = start_stack(tmp_path_factory, envoy_bin, redis_url, {})
    try:
        body = {**chat(document("lagoon"), "Tides?"), "cache_salt": "tenant-c"}
        plain.seed("b", salted_keys(tok, body))
        headers, echo = send(plain, body)
        assert echo["node"] == "b"
        assert not [h for h in headers if h in PREDICTION], headers
    finally:
        plain.stop()
