"""Attacks on the rendered Envoy, run against real Envoy, `kvgate serve` and real upstreams: another
spelling of an inference path must not reach an engine past kvgate, and clients that trickle or
stall cannot hold Envoy's connections and memory (issue: hardening, items 5 and 8)."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest

from tests.support.http import request
from tests.support.stack import Stack

LIMITS = {"request_headers_timeout_s": 1.0, "request_timeout_s": 2.0, "max_connections": 12}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, envoy_bin, redis_url):
    s = Stack(tmp_path_factory.mktemp("hostile"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}", **LIMITS)
    yield s
    s.stop()


def _raw(stack: Stack, data: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send bytes as they are (no client normalises the path) and read until Envoy closes."""
    with socket.create_connection(("127.0.0.1", stack.listen_port), timeout=wait_s) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def _post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


@pytest.mark.parametrize(
    "path",
    [
        "/v1/%63hat/completions",  # percent-encoded letter
        "/v1/chat%2Fcompletions",  # escaped slash
        "/v1/chat%2fcompletions",
        "/v1//chat/completions",  # doubled slash
        "/v1/./chat/completions",  # dot segment
        "/v1/x/../chat/completions",
        "/v1/chat/completions/",  # trailing slash: an engine may redirect or serve it
        "/V1/CHAT/COMPLETIONS",  # case
        "/v1/chat/completions;x=1",
    ],
)
def test_no_spelling_of_an_inference_path_bypasses_kvgate(stack: Stack, path: str) -> None:
    """Before: the engine answered 200 to a body kvgate rejects (past the allow-list and limits).
    After: kvgate answers 400 (the path was normalised), Envoy redirects to the unescaped path
    (307), or Envoy answers 404; no node sees the request."""
    before = stack.node_requests()
    answer = _raw(stack, _post(path, b"{not json"))
    status = int(answer.split(b" ", 2)[1])
    assert status in (400, 307, 404), answer[:400]
    if status == 307:
        location = next(h for h in answer.split(b"\r\n") if h.lower().startswith(b"location:"))
        assert b"%2f" not in location.lower()
    assert stack.node_requests() == before


def test_normalised_path_still_routes(stack: Stack) -> None:
    """A correct request sent with a merged slash is still served (kvgate saw it)."""
    body = b'{"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    answer = _raw(stack, _post("/v1//chat/completions", body))
    assert answer.startswith(b"HTTP/1.1 200"), answer[:400]
    assert b'"path": "/v1/chat/completions"' in answer  # what the node saw


def test_trickled_headers_are_cut_off(stack: Stack) -> None:
    """Before: a connection sending half its headers stayed open indefinitely. After: Envoy
    answers 408 or closes within request_headers_timeout (1 s here)."""
    start = time.monotonic()
    answer = _raw(stack, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", wait_s=8)
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"connection still open after {elapsed:.1f}s"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_stalled_upload_is_answered_408(stack: Stack) -> None:
    """Before: 8 MiB announced, 64 KiB sent, then silence held the stream (and its buffer) for
    the stream idle timeout (5 min). After: 408 within request_timeout (2 s here)."""
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {8 << 20}\r\n\r\n"
    ).encode()
    start = time.monotonic()
    answer = _raw(stack, head + b"{" + b" " * (64 << 10), wait_s=10)
    elapsed = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert elapsed < 6


def test_connections_over_the_limit_are_refused(stack: Stack) -> None:
    """Before: Envoy accepted every connection. After: past max_connections (12 here) a new
    connection is closed at once and ``overload.…downstream_cx_overflow`` counts it; the others
    still get answers once the flood ends."""
    held = [socket.create_connection(("127.0.0.1", stack.listen_port), timeout=5) for _ in range(LIMITS["max_connections"])]
    try:
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", stack.listen_port), timeout=5)
        extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            got = extra.recv(4096)
        except (ConnectionResetError, TimeoutError):
            got = b""
        extra.close()
        assert got == b"", got[:200]
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    status, _, _ = request(stack.url("/v1/models"))
    assert status == 200


def test_a_retry_after_the_chosen_node_failed_goes_to_another_node(tmp_path, envoy_bin, redis_url, key_prefix) -> None:
    """kvgate picks the node holding the prefix; that node is dead (connection refused) and kvgate
    has not noticed yet. Before: every retry was pinned to it by the destination header and the
    client got 503. After: the retry drops the header's choice and goes to another node (200).
    An address the fleet does not have is never a destination (Envoy balances instead)."""
    from tests.support.stack import chat, document, keys_of
    from tokenizer import PromptTokenizer

    s = Stack(tmp_path, envoy_bin, redis_url, key_prefix)
    try:
        body = chat(document("retry"), "Summarise.")
        s.seed("a", keys_of(PromptTokenizer(), "/v1/chat/completions", body))
        status, headers, raw = request(s.url("/v1/chat/completions"), method="POST",
                                       body=json.dumps(body).encode(), headers={"content-type": "application/json"})  # fmt: skip
        assert status == 200 and json.loads(raw)["node"] == "a"  # the owner, while it lives
        s.echos["a"].kill()
        for _ in range(3):
            status, _, raw = request(s.url("/v1/chat/completions"), method="POST",
                                     body=json.dumps(body).encode(), headers={"content-type": "application/json"})  # fmt: skip
            assert status == 200, raw[:300]
            assert json.loads(raw)["node"] in ("b", "c")
    finally:
        s.stop()


def test_a_node_registered_only_in_the_directory_never_receives_traffic(
    tmp_path, envoy_bin, redis_url, key_prefix
) -> None:
    """Anyone who can write to Redis registers "evil" at an address of their own and seeds it as
    the owner of a prompt. Whatever kvgate then decides, Envoy sends requests only to the fleet's
    nodes: the evil listener sees nothing and the client is answered by a, b or c."""
    from directory_client.types import NodeInfo
    from tests.conftest import free_port
    from tests.support.procs import start_echo
    from tests.support.stack import chat, document, keys_of
    from tokenizer import PromptTokenizer

    s = Stack(tmp_path, envoy_bin, redis_url, key_prefix)
    try:
        evil_port = free_port()
        evil = s._started(start_echo("evil", evil_port, tmp_path))
        s.directory_call(lambda d: d.register_node(NodeInfo("evil", f"127.0.0.1:{evil_port}")))
        body = chat(document("exfiltrate"), "Summarise.")
        s.seed("evil", keys_of(PromptTokenizer(), "/v1/chat/completions", body))
        for _ in range(3):
            status, _, raw = request(s.url("/v1/chat/completions"), method="POST",
                                     body=json.dumps(body).encode(), headers={"content-type": "application/json"})  # fmt: skip
            assert status == 200 and json.loads(raw)["node"] in ("a", "b", "c")
        assert json.loads(request(f"http://127.0.0.1:{evil_port}/_stats")[2])["requests"] == 0
        assert evil.alive()
    finally:
        s.stop()
