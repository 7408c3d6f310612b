"""The simulated engine honours pull instructions: two real `kvgate worker` processes, real
transfer agents (Mooncake over loopback TCP), the pull headers the gateway would set."""

from __future__ import annotations

import json
import re

import pytest

from gateway.profile import load_profile
from tests.conftest import free_port
from tests.support.http import eventually, get_json, request
from tests.support.procs import Proc, python_module, wait_for_port
from tests.support.transfer import secret_file

MODEL = "m"
PROFILE = "llama-3.1-8b-h100"


class Worker:
    def __init__(self, name: str, tmp, *extra: str) -> None:
        self.name, self.port, self.transfer_port = name, free_port(), free_port()
        args = [
            "--port", str(self.port), "--model", MODEL, "--node-id", name, "--profile", PROFILE,
            "--time-scale", "0.01", "--kv-blocks", "512", "--transfer-port", str(self.transfer_port),
            "--transfer-link", "rdma", "--transfer-secret-file", secret_file(tmp), "--debug-headers", *extra,
        ]
        self.proc: Proc = python_module(f"worker-{name}", "workers.engine", args, tmp)
        wait_for_port(self.port, proc=self.proc.popen, timeout_s=30)
        wait_for_port(self.transfer_port, proc=self.proc.popen, timeout_s=30)

    @property
    def transfer_endpoint(self) -> str:
        return f"127.0.0.1:{self.transfer_port}"

    def complete(self, prompt: list[int], headers: dict[str, str] | None = None, max_tokens: int = 2):
        status, hdrs, raw = request(
            f"http://127.0.0.1:{self.port}/v1/completions", method="POST",
            body=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode(),
            headers={"content-type": "application/json", **(headers or {})},
        )
        return status, hdrs, json.loads(raw)

    def metric(self, name: str, **labels: str) -> float:
        _, _, raw = request(f"http://127.0.0.1:{self.port}/metrics")
        total = 0.0
        for line in raw.decode().splitlines():
            m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def blocks(self) -> list[dict]:
        return get_json(f"http://127.0.0.1:{self.port}/debug/blocks")[1]["blocks"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pull-engine")
    ws = [Worker("a", tmp), Worker("b", tmp)]
    yield ws
    for w in ws:
        w.proc.stop()


def pull_from(owner: Worker, blocks: int) -> dict[str, str]:
    return {"x-kv-cache-source-host-port": owner.transfer_endpoint, "x-kv-cache-pull-blocks": str(blocks)}


def prompt_of(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 100000 + 1 for i in range(n)]


def test_pulled_blocks_are_cached_reported_and_timed(workers) -> None:
    a, b = workers
    prompt = prompt_of(1, 1000)  # 62 full blocks before the last token
    status, hdrs, body = a.complete(prompt)
    assert status == 200 and hdrs["x-kvgate-cached-tokens"] == "0"

    status, hdrs, body = b.complete(prompt, pull_from(a, 62))
    assert status == 200, body
    assert hdrs["x-kvgate-node"] == "b"
    assert hdrs["x-kvgate-pull"] == "ok" and hdrs["x-kvgate-pulled-blocks"] == "62"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 62 * 16
    assert hdrs["x-kvgate-cached-tokens"] == str(62 * 16)

    # b now holds a's blocks under the same engine hashes (so it can serve them onwards) ...
    a_hashes = [blk["engine_hash"] for blk in a.blocks() if blk["depth"] < 62]
    b_hashes = {blk["engine_hash"] for blk in b.blocks()}
    assert len(a_hashes) == 62 and set(a_hashes) <= b_hashes
    # ... and a released its lease: nothing stays pinned once the pull is over.
    eventually(lambda: all(blk["ref_count"] == 0 for blk in a.blocks()), timeout_s=5)
    assert a.metric("kvgate_transfer_served_blocks_total") == 62
    assert b.metric("kvgate_engine_pulled_blocks_total") == 62
    assert b.metric("kvgate_engine_pulled_bytes_total") == 62 * (4096 + 16)
    modelled = load_profile(PROFILE).transfer_seconds(62 * 16, "rdma")  # full-size KV over 400 Gb/s
    assert b.metric("kvgate_engine_pull_modelled_seconds_total") == pytest.approx(modelled)

    # Asked again, nothing is missing: no second pull.
    status, hdrs, body = b.complete(prompt, pull_from(a, 62))
    assert status == 200 and hdrs["x-kvgate-pull"] == "none"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 62 * 16
    assert b.metric("kvgate_engine_pulls_total", result="ok") == 1


def test_only_the_missing_blocks_are_pulled(workers) -> None:
    a, b = workers
    prompt = prompt_of(2, 1000)
    assert b.complete(prompt[:500])[0] == 200  # b computes the first 31 blocks itself
    assert a.complete(prompt)[0] == 200
    before = b.metric("kvgate_engine_pulled_blocks_total")
    status, hdrs, body = b.complete(prompt, pull_from(a, 62))
    assert status == 200
    assert hdrs["x-kvgate-pulled-blocks"] == str(62 - 31)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 62 * 16
    assert b.metric("kvgate_engine_pulled_blocks_total") - before == 31


def test_an_owner_holding_less_than_announced_gives_what_it_has(workers) -> None:
    a, b = workers
    prompt = prompt_of(3, 1000)
    assert a.complete(prompt[:304], max_tokens=1)[0] == 200  # a holds 19 full blocks, not 62
    status, hdrs, body = b.complete(prompt, pull_from(a, 62))
    assert status == 200 and hdrs["x-kvgate-pull"] == "ok"
    assert hdrs["x-kvgate-pulled-blocks"] == "19"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 19 * 16


@pytest.mark.parametrize(
    ("seed", "headers", "reason"),
    [
        (11, {"x-kv-cache-source-host-port": "127.0.0.1:1", "x-kv-cache-pull-blocks": "40"}, "unreachable"),
        (12, {"x-kv-cache-source-host-port": "not-an-endpoint", "x-kv-cache-pull-blocks": "40"}, "bad_header"),
        (13, {"x-kv-cache-source-host-port": "127.0.0.1:9", "x-kv-cache-pull-blocks": "many"}, "bad_header"),
        (14, {"x-kv-cache-pull-blocks": "40"}, "bad_header"),
    ],
)
def test_a_failed_pull_recomputes_and_is_counted(workers, seed, headers, reason) -> None:
    _, b = workers
    before = b.metric("kvgate_engine_pull_failures_total", reason=reason)
    prompt = prompt_of(seed, 700)
    status, hdrs, body = b.complete(prompt, headers)
    assert status == 200, body
    assert hdrs["x-kvgate-pull"] == f"failed:{reason}"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["usage"]["completion_tokens"] == 2
    assert b.metric("kvgate_engine_pull_failures_total", reason=reason) == before + 1
    # Nothing a failed pull took is left behind: every block is unpinned, no private block lingers.
    assert all(blk["ref_count"] == 0 for blk in b.blocks())
    assert get_json(f"http://127.0.0.1:{b.port}/debug/blocks")[1]["private_blocks"] == 0


def test_a_worker_without_an_agent_ignores_pulls_and_says_so(tmp_path) -> None:
    port = free_port()
    proc = python_module("plain", "workers.engine", ["--port", str(port), "--model", MODEL, "--time-scale", "0", "--debug-headers"], tmp_path)
    try:
        wait_for_port(port, proc=proc.popen, timeout_s=30)
        status, hdrs, _ = request(
            f"http://127.0.0.1:{port}/v1/completions", method="POST",
            body=json.dumps({"model": MODEL, "prompt": prompt_of(4, 300), "max_tokens": 1}).encode(),
            headers={"content-type": "application/json", "x-kv-cache-source-host-port": "127.0.0.1:2",
                     "x-kv-cache-pull-blocks": "10"},
        )
        assert status == 200 and hdrs["x-kvgate-pull"] == "failed:no_agent"
    finally:
        proc.stop()


def test_bad_transfer_flags_fail_at_start(tmp_path) -> None:
    for flags, message in (
        (["--transfer-port", "0"], "--transfer-port"),
        (["--transfer-port", "5000", "--transfer-secret-file", "s", "--transfer-payload-bytes", "0"], "--transfer-payload-bytes"),
        (["--transfer-port", "5000", "--transfer-secret-file", "s", "--pull-timeout", "0"], "--pull-timeout"),
        (["--transfer-port", "5000"], "--transfer-secret-file"),  # an agent never runs unauthenticated
    ):
        proc = python_module("bad", "workers.engine", ["--port", str(free_port()), *flags], tmp_path)
        assert proc.popen.wait(timeout=30) == 2
        proc.stop()
        assert message in proc.output()


def test_a_lease_keeps_blocks_from_eviction_until_released() -> None:
    """The owner side in-process: CacheHolder pins blocks in the real prefix cache."""
    import numpy as np

    from workers.engine.kv_cache import PrefixCache, engine_block_hashes, root_hash
    from workers.engine.pull import CacheHolder
    from workers.engine.runtime import EngineRuntime
    from workers.engine.scheduler import Scheduler

    cache = PrefixCache(4, 16)
    runtime = EngineRuntime(Scheduler(load_profile(PROFILE), cache), time_scale=0)
    tokens = np.arange(64, dtype=np.uint32)
    hashes = engine_block_hashes(tokens, block_size=16, parent=root_hash())
    assert cache.reserve(4)
    cache.commit(hashes, list(range(4)), None, tokens, 0, 0.0)
    cache.unpin(hashes, 0.0)  # cached, unreferenced: evictable
    holder = CacheHolder(cache, runtime)
    assert holder.hold(hashes[:3] + [12345]) == 3
    assert not cache.reserve(2)  # only the unleased block could be evicted
    assert cache.reserve(1) and hashes[3] not in cache
    cache.release_private(1)
    holder.unhold(hashes[:3])
    assert cache.reserve(3)  # released: evictable again
    cache.check_invariants()
