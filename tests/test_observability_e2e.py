"""Observability through the real request path: Envoy → ``kvgate serve`` (over ext_proc and over
ext_authz) → three upstreams, with Redis as the directory, JSON-lines logs, the decision log and
tracing on. Spans leave kvgate over real OTLP/HTTP to a small receiver this test runs.

What must hold: the request ID Envoy gives a request (and forwards to the node) is the one in
kvgate's log lines and in ``/debug/decisions``; each decision arrives as a span tree with the
attributes an operator filters by; a W3C ``traceparent`` sent by the client parents the decision.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import pytest
from aiohttp import web
from gateway.otlp_schema import ExportTraceServiceRequest, ExportTraceServiceResponse

from tests.conftest import free_port
from tests.support.http import eventually, post_json, request
from tests.support.stack import MODEL, Stack, chat, document, keys_of
from tokenizer import PromptTokenizer

TOKEN = "e2e-admin-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf) on its own thread and loop."""

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("OTLP receiver did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def traces(req: web.Request) -> web.Response:
            msg = ExportTraceServiceRequest.FromString(await req.read())
            with self._lock:
                self.requests.append(msg)
            return web.Response(
                body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
            )

        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def spans(self) -> list[tuple[dict, object]]:
        """Every span received so far, with its resource's attributes."""
        out = []
        with self._lock:
            for msg in self.requests:
                for rs in msg.resource_spans:
                    resource = attributes(rs.resource.attributes)
                    for ss in rs.scope_spans:
                        out.extend((resource, span) for span in ss.spans)
        return out

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def attributes(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


@pytest.fixture(scope="module", params=["ext_proc", "ext_authz"])
def stack(request, tmp_path_factory, envoy_bin, redis_url, receiver):
    env = {
        "KVGATE_TRACING__ENABLED": "true",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "kvgate-e2e",
        "KVGATE_LOG__JSON": "true",
        "KVGATE_LOG__LEVEL": "DEBUG",
        "KVGATE_ADMIN__DEBUG": "true",
        "KVGATE_ADMIN__TOKEN": TOKEN,
    }
    with pytest.MonkeyPatch.context() as mp:  # the kvgate process inherits these
        for k, v in env.items():
            mp.setenv(k, v)
        s = Stack(tmp_path_factory.mktemp("obs-e2e"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}", request.param)
    s.integration = request.param
    yield s
    s.stop()


def kvgate_log(stack: Stack) -> list[dict]:
    out = []
    for line in stack.kvgate.output().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def decisions(stack: Stack) -> list[dict]:
    status, _, raw = request(f"http://127.0.0.1:{stack.admin_port}/debug/decisions?limit=100", headers=AUTH)
    assert status == 200
    return json.loads(raw)["decisions"]


def test_envoys_request_id_is_in_kvgates_logs_and_decisions(stack: Stack, tok: PromptTokenizer) -> None:
    history = chat(document(f"ledger-{stack.integration}"), "Totals?")
    stack.seed("b", keys_of(tok, "/v1/chat/completions", history))
    seen = []
    for _ in range(2):
        status, body = post_json(stack.url("/v1/chat/completions"), history)
        assert status == 200, body
        assert body["node"] == "b"
        seen.append(body["headers"]["x-request-id"])  # what Envoy forwarded to the node
    assert len(set(seen)) == 2
    for rid in seen:
        lines = eventually(lambda: [e for e in kvgate_log(stack) if e.get("request_id") == rid], timeout_s=5)
        assert any(e["logger"] == "kvgate.core" and e["msg"].startswith("routed to b") for e in lines), lines
        assert all(e["level"] in ("DEBUG", "INFO", "WARNING", "ERROR") and "ts" in e for e in lines)
    logged = {d["request_id"]: d for d in decisions(stack)}
    for rid in seen:
        assert logged[rid]["chosen"]["node_id"] == "b" and logged[rid]["outcome"] == "owner"


def test_each_decision_arrives_over_otlp_as_a_span_tree(stack: Stack, tok: PromptTokenizer, receiver) -> None:
    history = chat(document(f"quarry-{stack.integration}"), "Which stone?")
    blocks = len(keys_of(tok, "/v1/chat/completions", history))
    stack.seed("c", keys_of(tok, "/v1/chat/completions", history))
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    status, body = post_json(
        stack.url("/v1/chat/completions"), history, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}
    )
    assert status == 200 and body["node"] == "c"
    rid = body["headers"]["x-request-id"]

    def mine():
        roots = [(res, s) for res, s in receiver.spans() if attributes(s.attributes).get("kvgate.request_id") == rid]
        return roots or None

    ((resource, root),) = eventually(mine, timeout_s=10)
    assert root.name == "kvgate.route" and resource["service.name"] == "kvgate-e2e"
    a = attributes(root.attributes)
    assert a["kvgate.model"] == MODEL and a["kvgate.outcome"] == "owner"
    assert a["kvgate.chosen_node"] == "c" and a["kvgate.chosen_address"] == stack.addr("c")
    # the directory answers at its sampling stride, so the prefix may end a few blocks short
    logged = {d["request_id"]: d for d in decisions(stack)}[rid]
    assert a["kvgate.best_cached_node"] == "c" and a["kvgate.best_cached_tokens"] == logged["best_cached"]["tokens"]
    assert blocks * 16 // 2 < a["kvgate.best_cached_tokens"] <= blocks * 16
    assert a["kvgate.expected_cached_tokens"] == logged["expected_cached_tokens"] > 0
    assert a["kvgate.prompt_tokens"] >= blocks * 16 and a["kvgate.candidates"] == 3
    children = eventually(
        lambda: [s for _, s in receiver.spans() if s.parent_span_id == root.span_id and s.trace_id == root.trace_id],
        timeout_s=5,
    )
    assert sorted(s.name for s in children) == sorted(
        ["kvgate.parse", "kvgate.tokenize", "kvgate.lookup", "kvgate.score", "kvgate.reserve"]
    )
    assert all(root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= root.end_time_unix_nano
               for s in children)  # fmt: skip
    if stack.integration == "ext_proc":  # ext_proc sees every request header, traceparent included
        assert root.trace_id.hex() == trace_id and root.parent_span_id.hex() == parent_id
