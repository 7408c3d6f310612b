"""The live dashboard in a real browser (Debian's headless Chromium, driven over the DevTools
protocol) against a running fleet: two simulated engines publishing KV events, ``kvgate serve``
following them with its embedded bridge, and Envoy in front.

The page must render the fleet as the directory sees it, then — without a reload — show the
requests sent through Envoy: their decisions and explanations, the outcome chart, and the cached
blocks the engines reported back through their KV events. A screenshot is kept as an artifact
(under the test's tmp dir, and copied to ``$KVGATE_ARTIFACTS`` when set).

Chromium is installed by this module's set-up when missing (``apt-get install chromium``; CI runs
as root with the Debian archive reachable).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import pytest

from gateway.envoy_config import EnvoySettings
from tests.conftest import free_port
from tests.support.http import eventually, get_json, post_json, request
from tests.support.procs import Proc, start_envoy, start_kvgate

pytestmark = pytest.mark.timeout(900)  # the first run may install Chromium; the test itself takes ~15 s

MODEL = "dash-model"
TOKEN = "dashboard-token-" + uuid.uuid4().hex
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--remote-debugging-port=0",
)  # fmt: skip


@pytest.fixture(scope="session")
def chromium_bin() -> str:
    """Debian's Chromium, installed now if it is missing."""
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("chromium is not installed and this is not root: run `apt-get install -y chromium`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env, timeout=900)
    return "/usr/bin/chromium"


# --- a minimal DevTools protocol client -----------------------------------------------------------


class Browser:
    """Headless Chromium in its own process group with a fresh profile; one page driven over CDP."""

    def __init__(self, binary: str, tmp: Path) -> None:
        self.profile = tmp / f"chromium-{uuid.uuid4().hex[:8]}"
        self.profile.mkdir()
        self.log = open(tmp / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "--window-size=1400,1000", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        port_file = self.profile / "DevToolsActivePort"
        eventually(lambda: port_file.exists() and port_file.read_text().count("\n") >= 1, timeout_s=30)
        self.port = int(port_file.read_text().split()[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=5))
        self.page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next = 0

    async def call(self, method: str, **params) -> dict:
        self._next += 1
        msg_id = self._next
        await self._ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self._ws.receive_json(), 30)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, timeout_s: float = 15.0, what: str = ""):
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.1)
        state = await self.js("document.body.innerText.slice(0, 1500)")
        raise AssertionError(f"page never showed {what or expression!r}; last {value!r}; page text:\n{state}")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", what="page load")


@contextlib.asynccontextmanager
async def open_page(browser: Browser):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(browser.page_ws, max_msg_size=0) as ws:
            page = Page(ws)
            await page.call("Emulation.setDeviceMetricsOverride", width=1400, height=1100, deviceScaleFactor=1, mobile=False)
            yield page


# --- the fleet under test -------------------------------------------------------------------------


class Fleet:
    """Two simulated engines with KV events, ``kvgate serve`` bridging them, Envoy in front."""

    def __init__(self, tmp: Path, envoy_bin: str) -> None:
        self.engines: dict[str, dict] = {}
        self.procs: list[Proc] = []
        for node in ("e1", "e2"):
            spec = {"port": free_port(), "events": f"tcp://127.0.0.1:{free_port()}", "replay": f"tcp://127.0.0.1:{free_port()}"}
            self.engines[node] = spec
            self.procs.append(Proc(f"engine-{node}", [
                sys.executable, "-m", "workers.engine", "--port", str(spec["port"]), "--model", MODEL,
                "--time-scale", "0", "--kv-blocks", "4096", "--node-id", node,
                "--events-endpoint", spec["events"], "--replay-endpoint", spec["replay"],
            ], tmp))  # fmt: skip
        self.admin, self.ext_proc, self.listen = free_port(), free_port(), free_port()
        config = {
            "listen_host": "127.0.0.1",
            "ext_proc_port": self.ext_proc,
            "admin_port": self.admin,
            "models": [MODEL],
            "fleet": [
                {"node_id": n, "address": f"127.0.0.1:{s['port']}", "events_endpoint": s["events"],
                 "replay_endpoint": s["replay"]}
                for n, s in self.engines.items()
            ],  # fmt: skip
            "admin": {"debug": True, "token": TOKEN},
            "usage_sample": 1.0,  # every answer's cached_tokens is read (the cache-loop panel)
            "engine_scrape_interval_s": 0.5,
        }
        for node, spec in self.engines.items():
            eventually(lambda: request(f"http://127.0.0.1:{spec['port']}/health")[0] == 200, timeout_s=60)
        self.procs.append(start_kvgate(config, tmp))
        self.procs.append(start_envoy(envoy_bin, EnvoySettings(
            fleet=[f"127.0.0.1:{s['port']}" for s in self.engines.values()],
            ext_proc_address=f"127.0.0.1:{self.ext_proc}", listen_address=f"127.0.0.1:{self.listen}",
            admin_address=f"127.0.0.1:{free_port()}", message_timeout_ms=2000,
        ), tmp))  # fmt: skip
        eventually(lambda: get_json(self.admin_url("/readyz"))[1].get("live_nodes") == 2, timeout_s=30)

    def admin_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin}{path}"

    def debug(self, path: str) -> dict:
        status, _, raw = request(self.admin_url(path), headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, raw
        return json.loads(raw)

    def explain(self, body: dict) -> dict:
        status, got = post_json(self.admin_url("/debug/explain"), body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, got
        return got

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, envoy_bin):
    f = Fleet(tmp_path_factory.mktemp("dashboard"), envoy_bin)
    yield f
    f.stop()


@pytest.fixture(scope="module")
def browser(chromium_bin, tmp_path_factory):
    b = Browser(chromium_bin, tmp_path_factory.mktemp("browser"))
    yield b
    b.close()


def conversation(turns: int) -> dict:
    doc = " ".join(f"Section {i} of the turbine manual sets torque {i * 11 % 73} Nm." for i in range(150))
    messages = [{"role": "system", "content": doc}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t}: which bolt comes next?"})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"Bolt {t + 1}, at the listed torque."})
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


FLEET_ROWS = """Object.fromEntries([...document.querySelectorAll('#fleet tbody tr')].map(r =>
  [r.dataset.nodeId, {live: r.dataset.live, cached: r.querySelector('[data-field=cached]').textContent}]))"""


def keep_artifact(png: bytes, tmp: Path, name: str) -> Path:
    path = tmp / name
    path.write_bytes(png)
    target = os.environ.get("KVGATE_ARTIFACTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        path = Path(shutil.copy(path, Path(target) / name))
    print(f"dashboard screenshot: {path}")
    return path


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


async def test_the_dashboard_shows_the_fleet_and_follows_traffic(fleet: Fleet, browser: Browser, tmp_path) -> None:
    async with open_page(browser) as page:
        await page.goto(fleet.admin_url(f"/dashboard/#token={TOKEN}&interval=300"))
        await page.wait_for("document.querySelectorAll('#fleet tbody tr[data-live=\"true\"]').length === 2",
                            what="two live nodes")  # fmt: skip
        rows = await page.js(FLEET_ROWS)
        assert rows == {"e1": {"live": "true", "cached": "0"}, "e2": {"live": "true", "cached": "0"}}
        assert await page.js("document.querySelectorAll('#decisions tbody tr').length") == 0
        assert await page.js("document.getElementById('fleet-source').textContent") == "cached blocks from: directory"
        assert "token" not in await page.js("location.href")  # dropped from the address bar once read

        # traffic through Envoy: one conversation over three turns, then an unrelated prompt
        chosen = []
        for turns in (1, 2, 3):
            if turns > 1:  # the engine's KV events reach the directory a moment after its reply
                eventually(lambda: fleet.explain(conversation(turns))["outcome"] == "owner", timeout_s=10)
            status, body = post_json(f"http://127.0.0.1:{fleet.listen}/v1/chat/completions", conversation(turns))
            assert status == 200, body
            chosen.append(fleet.debug("/debug/decisions?limit=1")["decisions"][0])
        status, body = post_json(
            f"http://127.0.0.1:{fleet.listen}/v1/completions", {"model": MODEL, "prompt": "unrelated " * 200, "max_tokens": 2}
        )
        assert status == 200, body
        recent = fleet.debug("/debug/decisions?limit=4")["decisions"]
        owner_node = chosen[0]["chosen"]["node_id"]
        assert [d["chosen"]["node_id"] for d in chosen] == [owner_node] * 3  # the conversation stayed put
        assert [d["outcome"] for d in chosen[1:]] == ["owner", "owner"]

        # the open page catches up by itself: every decision, the owner's cached blocks, the charts
        ids = [d["request_id"] for d in recent]
        assert all(ids)
        await page.wait_for(
            f"{json.dumps(ids)}.every(id => document.querySelector(`#decisions tr[data-request-id=\"${{id}}\"]`))",
            what="the four decisions",
        )
        shown = await page.js("[...document.querySelectorAll('#decisions tr.decision')].map(r => r.dataset.requestId)")
        assert shown[:4] == ids  # newest first, as the API lists them
        await page.wait_for(f"Number(({FLEET_ROWS})[{json.dumps(owner_node)}].cached.replace(/,/g, '')) > 0",
                            what="cached blocks on the conversation's node")  # fmt: skip
        snap = fleet.debug("/debug/nodes")
        assert {n["node_id"]: n["cached_blocks"] for n in snap["nodes"]}[owner_node] > 0
        await page.wait_for("Number(document.getElementById('chart-outcomes').dataset.total) >= 4", what="outcome bars")
        assert await page.js("document.querySelectorAll('#chart-outcomes rect.o-owner').length") >= 1

        # predicted vs delivered, per node: kvgate's prediction beside what the engine reported
        loop = {n["node_id"]: n["cache_loop"] for n in fleet.debug("/debug/nodes")["nodes"]}[owner_node]
        assert loop["expected_cached_tokens"] > 0 and loop["observed_responses"] >= 3, loop
        assert 0 < loop["observed_expected_cached_tokens"] <= loop["observed_cached_tokens"], loop
        await page.wait_for(
            f"document.querySelector('#cache-loop tr[data-node-id=\"{owner_node}\"] [data-field=\"read\"]').textContent.includes('÷')"
            f" && document.querySelector('#cache-loop tr[data-node-id=\"{owner_node}\"] [data-field=\"engine\"]').textContent.includes('%')",
            what="the owner's predicted vs delivered figures",
        )  # fmt: skip
        predicted = await page.js(f"document.querySelector('#cache-loop tr[data-node-id=\"{owner_node}\"] [data-field=\"predicted\"]').textContent")
        assert int(predicted.replace(",", "")) > 0
        assert (await page.js("document.getElementById('tile-hit').textContent")).endswith("%")

        # a click opens the explanation: every candidate's cost, the chosen one marked, the reason
        last_turn = chosen[2]
        await page.js(f"document.querySelector('#decisions tr[data-request-id=\"{last_turn['request_id']}\"]').click()")
        await page.wait_for("document.querySelectorAll('.explain tr[data-candidate]').length === 2", what="explanation")
        assert await page.js("document.querySelector('.explain .reason').textContent") == last_turn["reason"]
        assert await page.js("document.querySelector('.explain tr.chosen').dataset.candidate") == owner_node
        polls = int(await page.js("document.body.dataset.polls"))
        await page.wait_for(f"Number(document.body.dataset.polls) > {polls}", what="another refresh")
        assert await page.js("document.querySelectorAll('.explain tr[data-candidate]').length") == 2  # stays open

        shot = await page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        png = base64.b64decode(shot["data"])
        path = keep_artifact(png, tmp_path, "dashboard.png")
        width, height = png_size(png)
        assert width == 1400 and height >= 900
        assert path.stat().st_size > 20_000  # a rendered page, not a blank one


async def test_the_dashboard_asks_for_a_token_and_shows_no_data_without_it(fleet: Fleet, browser: Browser) -> None:
    async with open_page(browser) as page:
        await page.goto("about:blank")  # a real load, not a same-document fragment change
        await page.goto(fleet.admin_url("/dashboard/#token=not-the-token-at-all"))
        await page.wait_for("!document.getElementById('login').hidden", what="the token form")
        assert "refused" in await page.js("document.getElementById('status').textContent")
        assert await page.js("document.getElementById('main').hidden") is True
        assert await page.js("document.querySelectorAll('#fleet tbody tr').length") == 0
        await page.js(f"document.getElementById('token-input').value = {json.dumps(TOKEN)};"
                      "document.getElementById('login').requestSubmit()")  # fmt: skip
        await page.wait_for("document.querySelectorAll('#fleet tbody tr').length === 2", what="the fleet after login")
