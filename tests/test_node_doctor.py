"""The doctor inside ``kvgate serve``: a node failing the canary check is routed by load only, and says so.

Two real simulated-engine processes publishing KV events (vLLM's wire format) and answering
``POST /tokenize``; ``kvgate serve`` in process with its embedded bridges and the doctor on. One
engine renders chats with another template than kvgate's: its blocks are still in the directory
(the bridge keys token IDs), but none of kvgate's chat prompts can ever hit them, so the doctor
degrades it: kvgate then hides its cached prefixes from the policy (a prompt it holds is not
routed to it for its cache), and ``/readyz``, ``/debug/nodes``, the metric and a log line name
the node and the check. The healthy engine passes and keeps its cache affinity. The same against
real vLLM (a node served under another model name) is in test_vllm_conformance.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.config import KvgateConfig
from gateway.doctor import Finding
from gateway.metrics import REGISTRY
from gateway.node_doctor import NodeVerdicts
from gateway.serve_cmd import serve
from tests.conftest import REPO, free_port

MODEL = "doctor-sim"
TOKEN = "doctor-test-token-0123456789"
OTHER_TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>>"


def _view(*cached: tuple[str, int]) -> DirectoryView:
    return DirectoryView(
        tuple(NodeView(NodeInfo(node_id=n, address=f"127.0.0.1:{8000 + i}"), c, Tier.CPU, NodeLoad()) for i, (n, c) in enumerate(cached))
    )


def test_a_degraded_node_holds_nothing_of_any_prompt_until_it_passes_again() -> None:
    verdicts = NodeVerdicts()
    view = _view(("a", 5), ("b", 7))
    assert verdicts.vet(view) is view
    verdicts.record(Finding("b", False, "block size", "node stores blocks of [64] tokens, kvgate's block_size is 16"))
    vetted = verdicts.vet(view)
    assert [(nv.node.node_id, nv.cached_blocks, nv.tier) for nv in vetted.nodes] == [("a", 5, Tier.CPU), ("b", 0, Tier.GPU)]
    assert verdicts.degraded() == {"b": "doctor block size: node stores blocks of [64] tokens, kvgate's block_size is 16"}
    assert REGISTRY.get_sample_value("kvgate_node_doctor_degraded", {"node": "b", "check": "block size"}) == 1
    verdicts.record(Finding("b", False, "reachable", "GET http://…/v1/models: refused"))  # down says nothing of keys
    assert "b" in verdicts.degraded()
    verdicts.record(Finding("b", True, "all", "3 blocks keyed equally"))
    assert verdicts.vet(view) is view and verdicts.degraded() == {}
    assert REGISTRY.get_sample_value("kvgate_node_doctor_degraded", {"node": "b", "check": "block size"}) == 0
    verdicts.record(Finding("a", False, "reachable", "refused"))  # never degraded for not answering
    assert verdicts.degraded() == {} and verdicts.view("a")["degraded"] is False


class SimEngine:
    def __init__(self, node_id: str, tmp: Path, chat_template: str | None = None) -> None:
        self.node_id = node_id
        self.port, self.events = free_port(), f"tcp://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "workers.engine", "--port", str(self.port), "--model", MODEL, "--time-scale", "0",
               "--kv-blocks", "400", "--node-id", node_id, "--events-endpoint", self.events]  # fmt: skip
        if chat_template is not None:
            path = tmp / f"{node_id}.jinja"
            path.write_text(chat_template)
            cmd += ["--chat-template", str(path)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"engine {self.node_id} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _http(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {TOKEN}"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[tuple[SimEngine, SimEngine]]:
    good, odd = SimEngine("good", tmp_path), SimEngine("odd", tmp_path, OTHER_TEMPLATE)
    try:
        await asyncio.gather(asyncio.to_thread(good.wait_ready), asyncio.to_thread(odd.wait_ready))
        yield good, odd
    finally:
        good.stop()
        odd.stop()


async def _until(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = await asyncio.to_thread(check)
        except OSError:  # the admin server is still starting
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_serve_degrades_the_node_whose_chat_template_differs(
    engines: tuple[SimEngine, SimEngine], caplog: pytest.LogCaptureFixture
) -> None:
    good, odd = engines
    admin = free_port()
    cfg = KvgateConfig(
        ext_proc_port=free_port(), admin_port=admin, models=[MODEL],
        fleet=[{"node_id": e.node_id, "address": f"127.0.0.1:{e.port}", "events_endpoint": e.events} for e in engines],
        doctor={"interval_s": 300, "timeout_s": 5}, admin={"debug": True, "token": TOKEN}, engine_scrape_interval_s=0,
    )  # fmt: skip
    base = f"http://127.0.0.1:{admin}"
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, logger="kvgate.doctor")
    server = asyncio.create_task(serve(cfg, stop=stop))
    try:
        ready = await _until("the odd node degraded", lambda: (r := _http(base + "/readyz")).get("degraded_nodes") and r)
        assert list(ready["degraded_nodes"]) == ["odd"], ready
        assert ready["degraded_nodes"]["odd"].startswith("doctor chat template: kvgate "), ready
        assert REGISTRY.get_sample_value("kvgate_node_doctor_degraded", {"node": "odd", "check": "chat template"}) == 1
        assert any("node odd: degraded" in r.getMessage() and "'chat template'" in r.getMessage() for r in caplog.records)

        def checked() -> dict | None:
            nodes = {n["node_id"]: n for n in _http(base + "/debug/nodes")["nodes"]}
            return nodes if all((nodes.get(e.node_id) or {}).get("doctor") for e in engines) else None

        nodes = await _until("both checked", checked)
        assert nodes["good"]["doctor"]["ok"] is True and nodes["good"]["doctor"]["degraded"] is False, nodes["good"]
        assert nodes["odd"]["doctor"]["check"] == "chat template" and nodes["odd"]["doctor"]["degraded"] is True

        # each engine holds a prompt of its own (sent to it directly); the directory has both
        prompts = {e.node_id: [1000 * (i + 1) + t for t in range(8 * 16)] for i, e in enumerate(engines)}
        for e in engines:
            await asyncio.to_thread(_http, e.url + "/v1/completions", {"model": MODEL, "prompt": prompts[e.node_id], "max_tokens": 1})
        def explain(node_id: str) -> dict:
            return _http(base + "/debug/explain", {"model": MODEL, "prompt": prompts[node_id]})

        def odd_blocks() -> int:
            return next(n for n in _http(base + "/debug/nodes")["nodes"] if n["node_id"] == "odd")["cached_blocks"]

        good_view = await _until("good's prompt bridged", lambda: (x := explain("good")).get("best_cached") and x)
        assert good_view["best_cached"]["node_id"] == "good" and good_view["chosen"]["node_id"] == "good"
        await _until("odd's blocks in the directory", odd_blocks)
        odd_view = await asyncio.to_thread(explain, "odd")
        assert odd_view["best_cached"] is None and odd_view["expected_cached_tokens"] == 0, odd_view  # routed by load only
    finally:
        stop.set()
        await asyncio.wait_for(server, 30)
