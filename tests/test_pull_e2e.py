"""Pulls end to end: real Envoy, real `kvgate serve` (ext_proc, in-process KV-event bridge, Redis
directory), three real `kvgate worker` processes with transfer agents (Mooncake over loopback).

The shared profile gives every node ``max_num_seqs: 1``, so one long request saturates its node in
the gateway's eyes and in the engine alike; ``policy.link: rdma`` and ``--transfer-link rdma``
price and model the same 400 Gb/s link.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
import uuid

import pytest
import yaml

from directory_client import open_directory
from gateway.envoy_config import EnvoySettings
from gateway.profile import load_profile
from tests.conftest import free_port
from tests.redis_servers import purge_prefix
from tests.support.http import eventually, get_json, request
from tests.support.procs import Proc, python_module, start_envoy, start_kvgate, wait_for_port
from tests.support.transfer import secret_file
from tokenizer.keys import block_keys, namespace_seed

MODEL = "deepseek-chat"
NODES = ("a", "b", "c")
PAYLOAD = 1 << 20  # real bytes per block: big enough that a pull takes a while to read


class PullStack:
    def __init__(self, tmp, envoy_bin: str, redis_url: str, *, admin: dict | None = None) -> None:
        self.admin = admin  # the kvgate config's admin section (None: its defaults)
        self.tmp, self.redis_url, self.key_prefix = tmp, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}"
        self.workers: dict[str, Proc] = {}
        try:
            self._start(tmp, envoy_bin, redis_url)
        except BaseException:
            self.stop()  # a failed start leaves no process behind
            raise

    def _start(self, tmp, envoy_bin: str, redis_url: str) -> None:
        profile = load_profile("llama-3.1-8b-h100").model_dump()
        profile.update(name="pull-e2e", max_num_seqs=1, kv_capacity_blocks=1024)
        self.profile_path = tmp / "pull-e2e.yaml"
        self.profile_path.write_text(yaml.safe_dump(profile))
        self.ports = {n: {k: free_port() for k in ("http", "events", "replay", "transfer")} for n in NODES}
        for n, p in self.ports.items():
            self.workers[n] = python_module(
                f"worker-{n}", "workers.engine",
                [
                    "--port", str(p["http"]), "--model", MODEL, "--node-id", n, "--profile", str(self.profile_path),
                    "--time-scale", "1.0", "--events-endpoint", f"tcp://127.0.0.1:{p['events']}",
                    "--replay-endpoint", f"tcp://127.0.0.1:{p['replay']}", "--transfer-port", str(p["transfer"]),
                    "--transfer-link", "rdma", "--transfer-payload-bytes", str(PAYLOAD),
                    "--transfer-secret-file", secret_file(tmp), "--debug-headers",
                    "--transfer-peers", ",".join(f"127.0.0.1:{q['transfer']}" for q in self.ports.values()),
                ],
                tmp,
            )
        for n, p in self.ports.items():
            wait_for_port(p["http"], proc=self.workers[n].popen, timeout_s=30)
            wait_for_port(p["transfer"], proc=self.workers[n].popen, timeout_s=30)
        self.ext_proc_port, self.admin_port, self.listen_port = free_port(), free_port(), free_port()
        config = {
            "listen_host": "127.0.0.1",
            "ext_proc_port": self.ext_proc_port,
            "admin_port": self.admin_port,
            "models": [MODEL],
            "directory": {"url": redis_url, "key_prefix": self.key_prefix, "heartbeat_ttl_s": 3.0, "lookup_timeout_ms": 1000},
            "fleet": [
                {
                    "node_id": n, "address": self.addr(n), "model": MODEL,
                    "events_endpoint": f"tcp://127.0.0.1:{p['events']}",
                    "replay_endpoint": f"tcp://127.0.0.1:{p['replay']}",
                    "transfer_endpoint": f"127.0.0.1:{p['transfer']}",
                }
                for n, p in self.ports.items()
            ],
            "policy": {"name": "kvgate", "profile": str(self.profile_path), "link": "rdma"},
            "limits": {"max_body_bytes": 1 << 20},
        }
        if self.admin is not None:
            config["admin"] = self.admin
        self.kvgate = start_kvgate(config, tmp)
        self.envoy = start_envoy(
            envoy_bin,
            EnvoySettings(
                fleet=[self.addr(n) for n in NODES],
                ext_proc_address=f"127.0.0.1:{self.ext_proc_port}",
                listen_address=f"127.0.0.1:{self.listen_port}",
                admin_address=f"127.0.0.1:{free_port()}",
                max_body_bytes=1 << 20,
                message_timeout_ms=2000,
            ),
            tmp,
        )
        eventually(lambda: get_json(f"http://127.0.0.1:{self.admin_port}/readyz")[1].get("live_nodes") == 3, timeout_s=30)

    def addr(self, n: str) -> str:
        return f"127.0.0.1:{self.ports[n]['http']}"

    def complete(self, prompt: list[int], max_tokens: int, *, timeout: float = 30):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        status, hdrs, raw = request(
            f"http://127.0.0.1:{self.listen_port}/v1/completions", method="POST",
            body=json.dumps(body).encode(), headers={"content-type": "application/json"}, timeout=timeout,
        )
        return status, hdrs, raw

    def metric(self, n: str, name: str, **labels: str) -> float:
        _, _, raw = request(f"http://{self.addr(n)}/metrics", timeout=2)
        total = 0.0
        for line in raw.decode().splitlines():
            m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def cached_blocks(self, prompt: list[int]) -> dict[str, int]:
        keys = block_keys(prompt, block_size=16, seed=namespace_seed(MODEL))

        async def go():
            d = open_directory(self.redis_url, key_prefix=self.key_prefix, heartbeat_ttl_s=3.0)
            try:
                view = await d.lookup(keys)
            finally:
                await d.aclose()
            return {nv.node.node_id: nv.cached_blocks for nv in view.nodes}

        return asyncio.run(go())

    def saturate(self, prompt: list[int]) -> tuple[threading.Thread, dict]:
        """A long request (300 decode steps at 8.4 ms) that keeps its node's one sequence slot busy."""
        out: dict = {}

        def run() -> None:
            try:
                out["status"], out["headers"], _ = self.complete(prompt, 300)
            except OSError as e:  # its node may be killed on purpose
                out["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, out

    def stop(self) -> None:
        for p in (getattr(self, "envoy", None), getattr(self, "kvgate", None), *self.workers.values()):
            if p is not None:
                p.stop()
        purge_prefix(self.redis_url, self.key_prefix)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, envoy_bin, redis_url):
    s = PullStack(tmp_path_factory.mktemp("pull-e2e"), envoy_bin, redis_url)
    yield s
    s.stop()


def document(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 100000 + 1 for i in range(n)]


def owner_of(stack: PullStack, prompt: list[int]) -> str:
    status, hdrs, raw = stack.complete(prompt, 2)
    assert status == 200, raw
    owner = hdrs["x-kvgate-node"]
    full = (len(prompt) - 1) // 16
    # Lookups are sampled (the directory's index stride), so a prefix reads back rounded down a little.
    eventually(lambda: stack.cached_blocks(prompt).get(owner, 0) >= full - 8, timeout_s=10,
               show=lambda: stack.cached_blocks(prompt))
    return owner


def wait_running(stack: PullStack, node: str) -> None:
    eventually(lambda: stack.metric(node, "vllm:num_requests_running") >= 1, timeout_s=10, interval_s=0.01)


def test_a_saturated_owner_gets_a_second_copy_by_pull(stack: PullStack) -> None:
    doc = document(1, 2000)  # 124 full blocks before the last token
    owner = owner_of(stack, doc)
    long_req, long_out = stack.saturate(doc + [7] * 16)
    wait_running(stack, owner)

    status, hdrs, raw = stack.complete(doc + [9] * 20, 4)
    assert status == 200, raw
    puller = hdrs["x-kvgate-node"]
    assert puller != owner  # not queued behind the owner's busy slot
    assert hdrs["x-kvgate-pull"] == "ok"
    pulled = int(hdrs["x-kvgate-pulled-blocks"])
    assert pulled >= 124 - 8  # the directory rounds prefixes down to its sampling stride
    cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == int(hdrs["x-kvgate-cached-tokens"]) == pulled * 16  # the pulled prefix is a hit
    assert stack.metric(puller, "kvgate_engine_pulls_total", result="ok") == 1
    assert stack.metric(puller, "kvgate_engine_pulled_bytes_total") == pulled * (PAYLOAD + 16)
    assert stack.metric(puller, "kvgate_transfer_corrupt_blocks_total") == 0
    assert stack.metric(owner, "kvgate_transfer_served_blocks_total") >= pulled

    # The copy was published (BlockStored): the directory now lists two holders of the prefix.
    eventually(lambda: stack.cached_blocks(doc).get(puller, 0) >= pulled, timeout_s=10,
               show=lambda: stack.cached_blocks(doc))
    long_req.join(timeout=30)
    assert long_out.get("status") == 200 and long_out["headers"]["x-kvgate-node"] == owner


def test_owner_killed_mid_pull_the_request_still_succeeds(stack: PullStack) -> None:
    doc = document(2, 4000)  # 249 blocks x 1 MiB: the read takes a few hundred ms
    owner = owner_of(stack, doc)
    stack.saturate(doc + [3] * 16)
    wait_running(stack, owner)
    others = [n for n in NODES if n != owner]
    before = {n: stack.metric(n, "kvgate_engine_pulls_total", result="failed") for n in others}

    out: dict = {}
    t = threading.Thread(target=lambda: out.update(zip(("status", "headers", "raw"), stack.complete(doc + [5] * 20, 4))))
    t.start()
    deadline = time.monotonic() + 15
    pulling = None
    while pulling is None:
        assert time.monotonic() < deadline and t.is_alive(), f"no pull started: {out}"
        for n in others:
            if stack.metric(n, "kvgate_engine_pulls_inflight") >= 1:
                pulling = n
                break
    stack.workers[owner].kill(signal.SIGKILL)
    t.join(timeout=30)

    assert out["status"] == 200, out.get("raw")
    assert out["headers"]["x-kvgate-node"] == pulling
    assert out["headers"]["x-kvgate-pull"].startswith("failed:")
    body = json.loads(out["raw"])
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    assert stack.metric(pulling, "kvgate_engine_pulls_total", result="failed") == before[pulling] + 1
