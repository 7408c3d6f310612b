"""`kvgate pd-sidecar --protocol sglang`: SGLang's disaggregation handshake, format-tested.

SGLang cannot run here (no GPU), so its two servers are stand-ins that record what they receive;
the sidecar is the real process on real sockets. What it sends is checked against the request
fields SGLang's OpenAI server declares for disaggregation (``CompletionRequest`` /
``ChatCompletionRequest`` in ``sglang/srt/entrypoints/openai/protocol.py``):
``bootstrap_host: Optional[Union[List[str], str]]``, ``bootstrap_port: Optional[Union[List[Optional[int]], int]]``,
``bootstrap_room: Optional[Union[List[int], int]]``; its router sends the same body to both nodes
at once with a random room in [0, 2**63).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

import pytest
from aiohttp import web
from pydantic import BaseModel, ConfigDict

from tests.conftest import free_port
from tests.support.http import request
from tests.support.procs import Proc, python_module, wait_for_port

BOOTSTRAP_PORT = 8998


class SglangDisaggFields(BaseModel):
    """The disaggregation fields of SGLang's OpenAI request models, with their upstream types."""

    model_config = ConfigDict(extra="allow", strict=True)
    bootstrap_host: list[str] | str | None = None
    bootstrap_port: list[int | None] | int | None = None
    bootstrap_room: list[int] | int | None = None


class Recorder:
    """A stand-in SGLang server on a real port: records each request body, answers like a completion."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name, self.status, self.bodies = name, status, []
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, daemon=True).start()
        wait_for_port(self.port)

    def _serve(self) -> None:
        async def handle(req: web.Request) -> web.Response:
            self.bodies.append(json.loads(await req.read()))
            return web.json_response({"node": self.name, "choices": [{"text": "ok"}]}, status=self.status)

        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.loop.run_forever()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-sglang")
    nodes = {"prefill": Recorder("prefill"), "decode": Recorder("decode"), "broken": Recorder("broken", status=503)}
    port = free_port()
    proc: Proc = python_module(
        "pd-sidecar-sglang", "gateway.cli",
        ["pd-sidecar", "--port", str(port), "--engine", f"http://{nodes['decode'].address}", "--protocol", "sglang",
         "--bootstrap-port", str(BOOTSTRAP_PORT), "--any-prefiller"],
        tmp,
    )  # fmt: skip
    try:
        wait_for_port(port, proc=proc.popen, timeout_s=30)
        yield nodes, f"127.0.0.1:{port}"
    finally:
        proc.stop()


def ask(sidecar: str, prefiller: str | None) -> tuple[int, dict[str, str], Any]:
    headers = {"content-type": "application/json"}
    if prefiller:
        headers["x-prefiller-host-port"] = prefiller
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 16}).encode()
    status, head, raw = request(f"http://{sidecar}/v1/completions", method="POST", body=body, headers=headers, timeout=30)
    return status, head, json.loads(raw)


def split_count(sidecar: str, name: str, reason: str = "") -> float:
    raw = request(f"http://{sidecar}/pd-sidecar/metrics")[2].decode()
    label = f'{{reason="{reason}"}}' if reason else ""
    m = re.search(rf"^{name}_total{re.escape(label)} (\S+)$", raw, re.M)
    return float(m.group(1)) if m else 0.0


def arrived(bodies: list[Any], count: int, timeout_s: float = 10.0) -> list[Any]:
    """The bodies once ``count`` have come: the prefill node's copy is sent at the same time as the
    decode node's, so it may land after the client's answer."""
    deadline = time.monotonic() + timeout_s
    while len(bodies) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return bodies


def test_a_split_request_reaches_both_nodes_with_one_bootstrap_room(sglang) -> None:
    nodes, sidecar = sglang
    before = len(nodes["prefill"].bodies)
    status, head, body = ask(sidecar, nodes["prefill"].address)
    assert status == 200 and body["node"] == "decode"  # the client gets the decode node's answer
    assert head["x-kvgate-prefilled-by"] == nodes["prefill"].address
    (to_prefill,), (to_decode,) = arrived(nodes["prefill"].bodies, before + 1)[-1:], nodes["decode"].bodies[-1:]
    assert to_prefill == to_decode  # one body, both nodes
    fields = SglangDisaggFields.model_validate(to_decode)  # the types SGLang declares
    assert fields.bootstrap_host == "127.0.0.1" and fields.bootstrap_port == BOOTSTRAP_PORT
    assert isinstance(fields.bootstrap_room, int) and 0 <= fields.bootstrap_room < 2**63
    assert {k: to_decode[k] for k in ("model", "prompt", "max_tokens")} == {"model": "m", "prompt": "hello", "max_tokens": 16}
    assert "kv_transfer_params" not in to_decode  # not vLLM's handshake
    ask(sidecar, nodes["prefill"].address)
    assert nodes["decode"].bodies[-1]["bootstrap_room"] != to_decode["bootstrap_room"]  # a room per request
    assert len(arrived(nodes["prefill"].bodies, before + 2)) == before + 2  # (so no late copy reaches the next test)


def test_without_the_header_nothing_is_added(sglang) -> None:
    nodes, sidecar = sglang
    before = len(nodes["prefill"].bodies)
    status, head, _ = ask(sidecar, None)
    assert status == 200 and "x-kvgate-prefilled-by" not in head
    assert "bootstrap_room" not in nodes["decode"].bodies[-1] and len(nodes["prefill"].bodies) == before


def test_a_failing_prefill_node_is_counted(sglang) -> None:
    nodes, sidecar = sglang
    before = split_count(sidecar, "kvgate_pd_sidecar_fallbacks", "prefill_error")
    status, _, body = ask(sidecar, nodes["broken"].address)
    assert status == 200 and body["node"] == "decode"  # (a real decode-mode engine would time out in its room)
    for _ in range(50):  # the prefill call ends on its own task
        if split_count(sidecar, "kvgate_pd_sidecar_fallbacks", "prefill_error") == before + 1:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert split_count(sidecar, "kvgate_pd_sidecar_fallbacks", "prefill_error") == before + 1


def test_the_documented_sidecar_commands_parse() -> None:
    """docs/disaggregated.md: both sidecar command lines are valid `kvgate pd-sidecar` arguments."""
    import argparse
    import shlex
    from pathlib import Path

    from workers.pd_sidecar import configure

    doc = (Path(__file__).resolve().parents[1] / "docs" / "disaggregated.md").read_text()
    commands = [c.replace("\\\n", " ") for c in re.findall(r"^kvgate pd-sidecar (.*?)\n```", doc, re.S | re.M)]
    assert len(commands) == 2
    parsed = []
    for command in commands:
        parser = argparse.ArgumentParser()
        configure(parser)
        parsed.append(parser.parse_args(shlex.split(command)))
    assert [a.protocol for a in parsed] == ["nixl", "sglang"]
    assert parsed[1].bootstrap_port == BOOTSTRAP_PORT and parsed[1].prefiller == ["10.0.0.1:30000"]
