"""Observability of the decision itself, in process: the real ``RoutingCore`` (real tokenizer, the
in-process directory, the kvgate policy) feeding the decision log, the metrics registry and the
OpenTelemetry sampler (the spans are collected as the OTLP messages the exporter would post; the
OTLP wire itself is tested end to end in test_observability_e2e.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.sampling import DEFAULT_ON

from directory_client import InProcessDirectory, open_directory
from directory_client.types import NodeInfo, NodeLoad, Tier
from gateway import otlp_schema as otlp
from gateway import metrics
from gateway.core import RoutingCore, RoutingLimits
from gateway.decision_log import DecisionLog
from gateway.fleet_status import FleetMonitor
from gateway.logs import REQUEST_ID, JsonLineFormatter, RequestIdFilter, TextFormatter
from gateway.policy import make_policy
from gateway.profile import load_profile
from gateway.otlp import OtlpSettings
from gateway.tracing import DecisionTracer, Tracing, TracingSetupError
from tests.conftest import REPO, free_port
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed

MODEL = "obs-model"
CHAT = "/v1/chat/completions"
NODES = {"a": "10.0.0.1:8000", "b": "10.0.0.2:8000"}


def chat_body(topic: str, question: str = "Summarise it.") -> dict:
    doc = " ".join(f"Line {i} of the {topic} log says value {i * 31 % 97}." for i in range(160))
    return {"model": MODEL, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]}


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


@pytest.fixture
async def directory() -> InProcessDirectory:
    d = InProcessDirectory(heartbeat_ttl_s=600)
    for node_id, address in NODES.items():
        await d.register_node(NodeInfo(node_id=node_id, address=address, model=MODEL))
    return d


@pytest.fixture
def spans() -> list[otlp.Span]:
    """What the tracer hands to the OTLP sender."""
    return []


def tracer_into(spans: list) -> DecisionTracer:
    return DecisionTracer(spans.extend, sampler=DEFAULT_ON)  # OTel's default: parent-based, else always on


def attrs(span: otlp.Span) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


@pytest.fixture
def core(tok, directory, spans) -> RoutingCore:
    return RoutingCore(
        tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), RoutingLimits(block_size=16),
        decision_log=DecisionLog(8), tracer=tracer_into(spans),
    )  # fmt: skip


async def seed(directory: InProcessDirectory, tok: PromptTokenizer, node: str, body: dict) -> int:
    prompt = tok.tokenize_body(CHAT, body)
    keys = block_keys(prompt.token_ids, block_size=16, seed=namespace_seed(prompt.model))
    await directory.record_stored(node, keys, Tier.GPU)
    return len(keys)


def encode(body: dict) -> bytes:
    return json.dumps(body).encode()


async def test_a_routed_decision_is_logged_with_every_candidate_and_its_reason(core, directory, tok) -> None:
    body = chat_body("harbour")
    blocks = await seed(directory, tok, "b", body)
    result = await core.route(CHAT, encode(body), "req-1")
    assert result.kind == "routed"
    (entry,) = core.decision_log.recent()
    assert entry["request_id"] == "req-1" and entry["path"] == CHAT
    assert entry["outcome"] == "owner" and entry["chosen"] == {"node_id": "b", "address": NODES["b"]}
    assert entry["prompt_tokens"] == result.request.prompt_tokens > blocks * 16 - 16
    assert entry["best_cached"] == {"node_id": "b", "blocks": blocks, "tokens": blocks * 16}
    by_node = {c["node_id"]: c for c in entry["candidates"]}
    assert set(by_node) == set(NODES)
    assert by_node["b"]["chosen"] and not by_node["a"]["chosen"]
    assert by_node["b"]["cached_blocks"] == blocks and by_node["a"]["cached_blocks"] == 0
    assert by_node["b"]["total_s"] < by_node["a"]["total_s"]  # why b won, in numbers
    assert entry["candidates"][0]["node_id"] == "b"  # cheapest first
    assert "b" in entry["reason"] and entry["reason"] == result.decision.reason
    assert set(entry["timings_ms"]) == {"parse", "tokenize", "lookup", "score", "total", "reserve"}
    assert entry["headers"]["x-gateway-destination-endpoint"] == NODES["b"]
    await core.release(result)


async def test_rejections_are_counted_but_not_logged_as_decisions(core) -> None:
    before = sample("kvgate_rejected_requests_total", status="400")
    result = await core.route(CHAT, b"{not json", "req-bad")
    assert result.kind == "rejected"
    assert len(core.decision_log) == 0 and core.decision_log.recorded == 0
    assert sample("kvgate_rejected_requests_total", status="400") == before + 1


async def test_explain_takes_no_reservation_and_counts_nothing(core, directory, tok, spans) -> None:
    body = chat_body("orchard")
    await seed(directory, tok, "a", body)
    decisions_before = sample("kvgate_decisions_total", policy="kvgate", outcome="owner")
    inflight_before = sample("kvgate_inflight_requests")
    result = await core.explain(CHAT, encode(body))
    assert result.kind == "routed" and result.decision.node.node_id == "a"
    assert result.reservation is None and "reserve" not in result.timings
    assert await directory.loads() == {n: NodeLoad(0, 0) for n in NODES}
    assert sample("kvgate_decisions_total", policy="kvgate", outcome="owner") == decisions_before
    assert sample("kvgate_inflight_requests") == inflight_before
    await asyncio.sleep(0)  # spans are built just after route returns
    assert len(core.decision_log) == 0 and spans == []
    # the same body routed for real does take the load explain left alone
    routed = await core.route(CHAT, encode(body), "req-2")
    assert (await directory.loads())["a"].inflight == 1
    await core.release(routed)
    assert (await directory.loads())["a"] == NodeLoad(0, 0)


async def test_route_counts_each_stage_outcome_and_tokens(core, directory, tok) -> None:
    body = chat_body("glacier")
    await seed(directory, tok, "a", body)
    stages_before = {s: sample("kvgate_decision_seconds_count", stage=s) for s in metrics.STAGES}
    owner_before = sample("kvgate_decisions_total", policy="kvgate", outcome="owner")
    prompt_before, cached_before = sample("kvgate_prompt_tokens_total"), sample("kvgate_expected_cached_tokens_total")
    lookups_before = sample("kvgate_directory_lookup_seconds_count")
    inflight_before = sample("kvgate_inflight_requests")
    result = await core.route(CHAT, encode(body), "req-3")
    for s in metrics.STAGES:
        assert sample("kvgate_decision_seconds_count", stage=s) == stages_before[s] + 1, s
    assert sample("kvgate_decisions_total", policy="kvgate", outcome="owner") == owner_before + 1
    assert sample("kvgate_prompt_tokens_total") == prompt_before + result.request.prompt_tokens
    assert sample("kvgate_expected_cached_tokens_total") == cached_before + result.decision.expected_cached_tokens > 0
    assert sample("kvgate_directory_lookup_seconds_count") == lookups_before + 1
    assert sample("kvgate_inflight_requests") == inflight_before + 1
    await core.release(result)
    assert sample("kvgate_inflight_requests") == inflight_before


async def test_a_decision_is_one_span_with_a_child_per_stage(core, directory, tok, spans) -> None:
    body = chat_body("quarry")
    blocks = await seed(directory, tok, "b", body)
    result = await core.route(CHAT, encode(body), "req-4")
    assert spans == []  # not on the request's latency path...
    await asyncio.sleep(0)
    (root,) = [s for s in spans if s.name == "kvgate.route"]  # ...but right after it
    assert root.parent_span_id == b"" and root.kind == otlp.Span.SpanKind.SPAN_KIND_SERVER
    children = sorted((s for s in spans if s.parent_span_id), key=lambda s: s.start_time_unix_nano)
    assert [c.name for c in children] == ["kvgate.parse", "kvgate.tokenize", "kvgate.lookup", "kvgate.score", "kvgate.reserve"]
    assert len({s.span_id for s in spans}) == 6 and all(len(s.span_id) == 8 for s in spans)
    for c in children:
        assert c.parent_span_id == root.span_id and c.trace_id == root.trace_id and len(c.trace_id) == 16
        assert root.start_time_unix_nano <= c.start_time_unix_nano <= c.end_time_unix_nano <= root.end_time_unix_nano
    for prev, nxt in zip(children, children[1:]):
        assert prev.end_time_unix_nano == nxt.start_time_unix_nano  # laid end to end, as the stages ran
    tokenize_ns = children[1].end_time_unix_nano - children[1].start_time_unix_nano
    assert abs(tokenize_ns - int(result.timings["tokenize"] * 1e9)) <= 1
    a = attrs(root)
    assert a["kvgate.model"] == MODEL and a["kvgate.request_id"] == "req-4"
    assert a["kvgate.prompt_tokens"] == result.request.prompt_tokens
    assert a["kvgate.best_cached_tokens"] == blocks * 16 and a["kvgate.best_cached_node"] == "b"
    assert a["kvgate.chosen_node"] == "b" and a["kvgate.outcome"] == "owner" and a["kvgate.policy"] == "kvgate"
    assert root.status.code == otlp.Status.StatusCode.STATUS_CODE_UNSET
    await core.release(result)


async def test_traceparent_makes_the_decision_part_of_the_request_trace(core, spans) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    result = await core.route(CHAT, encode(chat_body("delta")), "req-5", f"00-{trace_id}-{parent_id}-01")
    await asyncio.sleep(0)
    (root,) = [s for s in spans if s.name == "kvgate.route"]
    assert root.trace_id.hex() == trace_id and root.parent_span_id.hex() == parent_id
    assert all(s.trace_id.hex() == trace_id for s in spans)
    await core.release(result)
    spans.clear()
    result = await core.route(CHAT, encode(chat_body("delta")), "req-6", f"00-{trace_id}-{parent_id}-00")
    await asyncio.sleep(0)
    assert spans == []  # the caller did not sample this request: neither do we
    await core.release(result)


async def test_a_directory_outage_fails_open_and_says_so_everywhere(tok, spans) -> None:
    dead = open_directory(f"redis://127.0.0.1:{free_port()}/0", key_prefix="kvgate-test:dead", op_timeout_s=0.2)
    log = DecisionLog(4)
    core = RoutingCore(
        tok, dead, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
        RoutingLimits(block_size=16, lookup_timeout_s=1.0), decision_log=log, tracer=tracer_into(spans),
    )  # fmt: skip
    errors_before = sample("kvgate_directory_errors_total", op="lookup")
    fail_open_before = sample("kvgate_fail_open_total", reason="directory_unavailable")
    try:
        result = await core.route(CHAT, encode(chat_body("outage")), "req-7")
        await asyncio.sleep(0)
    finally:
        await dead.aclose()
    assert result.kind == "fail_open" and result.reason == "directory_unavailable"
    assert sample("kvgate_directory_errors_total", op="lookup") == errors_before + 1
    assert sample("kvgate_fail_open_total", reason="directory_unavailable") == fail_open_before + 1
    (entry,) = log.recent()
    assert entry["outcome"] == "fail_open" and entry["fail_open_reason"] == "directory_unavailable"
    assert entry["model"] == MODEL and "lookup" in entry["timings_ms"] and "score" not in entry["timings_ms"]
    assert log.timeline()[-1]["fail_open"] == 1
    (root,) = [s for s in spans if s.name == "kvgate.route"]
    assert root.status.code == otlp.Status.StatusCode.STATUS_CODE_ERROR
    assert root.status.message == "directory_unavailable" and attrs(root)["kvgate.outcome"] == "fail_open"
    assert [s.name for s in spans if s.parent_span_id] == ["kvgate.parse", "kvgate.tokenize", "kvgate.lookup"]


async def test_the_timeline_counts_outcomes_and_tokens_per_second(tok, directory) -> None:
    now = [1000.2]
    log = DecisionLog(3, window_s=2, clock=lambda: now[0])
    core = RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), RoutingLimits(), decision_log=log)
    body = chat_body("meadow")
    blocks = await seed(directory, tok, "a", body)
    results = [await core.route(CHAT, encode(body), f"r{i}") for i in range(2)]
    now[0] = 1001.7
    results.append(await core.route(CHAT, encode(chat_body("fresh", "Anything cached?")), "r2"))
    now[0] = 1002.1
    results.append(await core.route(CHAT, encode(body), "r3"))
    seconds = log.timeline()
    assert [s["t"] for s in seconds] == [1001, 1002]  # window of 2 s: the first second fell out
    assert seconds[0]["owner"] == 0 and seconds[0]["recompute"] == 1 and seconds[0]["cached_tokens"] == 0
    assert seconds[1]["owner"] == 1 and seconds[1]["cached_tokens"] == blocks * 16
    assert seconds[1]["prompt_tokens"] == results[3].request.prompt_tokens
    assert [e["request_id"] for e in log.recent()] == ["r3", "r2", "r1"]  # bounded to 3, newest first
    assert log.recorded == 4 and [e["request_id"] for e in log.recent(1)] == ["r3"]
    for r in results:
        await core.release(r)


async def test_fleet_snapshot_shows_load_down_nodes_and_is_shared(directory) -> None:
    monitor = FleetMonitor(directory, configured=[("a", NODES["a"]), ("c", "10.0.0.3:8000")], max_age_s=60)
    await directory.reserve("a", 300)
    snap = await monitor.snapshot()
    nodes = {n.node_id: n for n in snap.nodes}
    assert [n.node_id for n in snap.nodes] == ["a", "b", "c"]
    assert nodes["a"].live and nodes["a"].inflight == 1 and nodes["a"].prefill_tokens == 300
    assert nodes["b"].live and nodes["b"].inflight == 0
    assert not nodes["c"].live  # configured but never registered
    # the directory counts every block a node holds, whatever the prompt
    assert snap.cached_blocks_source == "directory"
    assert nodes["a"].cached_blocks == (await directory.lookup([])).nodes[0].total_blocks
    await directory.reserve("b", 10)
    assert await monitor.snapshot() is snap  # within max_age: shared, the directory is not asked
    both = await asyncio.gather(*(FleetMonitor(directory, max_age_s=0).snapshot() for _ in range(3)))
    assert all(s.nodes[1].inflight == 1 for s in both)


async def test_fleet_snapshot_reports_an_unreachable_directory() -> None:
    dead = open_directory(f"redis://127.0.0.1:{free_port()}/0", key_prefix="kvgate-test:dead", op_timeout_s=0.2)
    try:
        snap = await FleetMonitor(dead, configured=[("a", NODES["a"])]).snapshot()
    finally:
        await dead.aclose()
    assert snap.error.startswith("directory unavailable")
    assert [(n.node_id, n.live) for n in snap.nodes] == [("a", False)]


async def test_log_lines_carry_the_request_id_of_their_own_task() -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonLineFormatter())
    logger = logging.getLogger("kvgate.test-obs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    async def handle(request_id: str) -> None:
        REQUEST_ID.set(request_id)
        await asyncio.sleep(0)
        logger.info("deciding", extra={"node": "b"})

    try:
        await asyncio.gather(handle("rid-A"), handle("rid-B"))
        logger.info("outside any request")
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert sorted(e.get("request_id") for e in lines[:2]) == ["rid-A", "rid-B"]
    assert all(e["node"] == "b" and e["logger"] == "kvgate.test-obs" for e in lines[:2])
    assert "request_id" not in lines[2]
    record = logging.LogRecord("kvgate.x", logging.INFO, __file__, 1, "hello", None, None)
    record.request_id = "rid-C"
    assert "kvgate.x [rid-C]: hello" in TextFormatter().format(record)


def test_tracing_off_never_loads_the_tracing_module() -> None:
    code = (
        "import sys; from gateway.serve_cmd import start_tracing; from gateway.config import load_config;"
        "import ext_proc.server, ext_proc.ext_authz, gateway.admin;"
        "assert start_tracing(load_config(None)) is None;"
        "assert 'gateway.tracing' not in sys.modules, 'tracing imported while off'"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_exporter_follows_the_otel_variables() -> None:
    s = OtlpSettings.from_env({})
    assert (s.endpoint, s.timeout_s, s.gzip, s.schedule_delay_s, s.max_batch) == (
        "http://localhost:4318/v1/traces", 10.0, False, 5.0, 512)  # the specification's defaults
    s = OtlpSettings.from_env({
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/", "OTEL_EXPORTER_OTLP_HEADERS": "api-key=a%20b,X-Team=ml",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2500", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "500",
    })  # fmt: skip
    assert s.endpoint == "https://collector:4318/v1/traces" and s.headers == {"api-key": "a b", "x-team": "ml"}
    assert (s.timeout_s, s.gzip, s.schedule_delay_s, s.max_queue, s.max_batch) == (2.5, True, 0.2, 100, 100)
    s = OtlpSettings.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert s.endpoint == "http://c:4318/custom"  # the signal-specific URL is used as given
    assert Tracing(env={"OTEL_TRACES_EXPORTER": "none"}).sender is None
    for env, message in (
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
        ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "gzip or none"),
        ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "not a number"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "http:// or https://"),
    ):
        with pytest.raises(TracingSetupError, match=message):
            Tracing(env=env)


def test_loop_histograms_expose_cumulative_buckets_as_prometheus_parses_them() -> None:
    """What a Prometheus scrape sees of the lock-free request-path histograms: "<= bound" buckets,
    cumulative, a +Inf bucket equal to the count, and the sum."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    family = metrics.LoopHistograms("t_seconds", "test", ["stage"], buckets=(0.001, 0.01), registry=registry)
    series = family.labels("lookup")
    for value in (0.0005, 0.001, 0.002, 5.0):  # 0.001 sits exactly on a bound: it counts as "<= 0.001"
        series.observe(value)
    samples = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    assert samples[("t_seconds_bucket", "0.001")] == 2
    assert samples[("t_seconds_bucket", "0.01")] == 3
    assert samples[("t_seconds_bucket", "+Inf")] == samples[("t_seconds_count", None)] == 4
    assert samples[("t_seconds_sum", None)] == pytest.approx(5.0035)
    with pytest.raises(ValueError, match="takes labels"):
        family.labels()
