"""``kvgate drain`` end to end: real Envoy, real ``kvgate serve`` (admin API, Redis directory,
in-process KV-event bridges), three real ``kvgate worker`` processes whose transfer agents move
the drained node's prefixes (the stack of ``test_pull_e2e``), and the real CLI as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.http import eventually
from tests.test_pull_e2e import PullStack, document, owner_of, wait_running

TOKEN = "drain-test-admin-token-0123456789"
FULL = (2000 - 1) // 16  # full blocks of a 2000-token document before its last token


@pytest.fixture(scope="module")
def stack(tmp_path_factory, envoy_bin, redis_url):
    s = PullStack(tmp_path_factory.mktemp("drain-e2e"), envoy_bin, redis_url, admin={"token": TOKEN})
    yield s
    s.stop()


def kvgate_drain(stack: PullStack, *args: str, token: str = TOKEN, timeout: float = 60) -> subprocess.CompletedProcess:
    token_file = Path(stack.tmp) / "admin-token"
    token_file.write_text(token)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "drain", *args, "--admin-url", f"http://127.0.0.1:{stack.admin_port}",
         "--token-file", str(token_file)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def test_a_drained_nodes_conversation_continues_on_another_node_with_its_cache(stack: PullStack) -> None:
    doc = document(11, 2000)
    owner = owner_of(stack, doc)
    try:
        done = kvgate_drain(stack, owner, "--deadline", "20")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["complete"] and report["copied"] >= 1 and report["copy_failures"] == 0, report
        others = lambda: {n: b for n, b in stack.cached_blocks(doc).items() if n != owner}  # noqa: E731
        eventually(lambda: max(others().values()) >= FULL - 8, timeout_s=10, show=others)
        target = max(others(), key=others().get)
        assert stack.metric(target, "kvgate_engine_pulls_total", result="ok") >= 1  # moved by its transfer agent

        status, hdrs, raw = stack.complete(doc + [5] * 40, 2)  # the conversation's next turn
        assert status == 200, raw
        assert hdrs["x-kvgate-node"] == target  # the directory moved it with its KV
        assert int(hdrs["x-kvgate-cached-tokens"]) >= (FULL - 8) * 16  # a hit, not a recompute
        assert "x-kvgate-pull" not in hdrs  # already there: nothing pulled on the request's path
    finally:
        assert kvgate_drain(stack, owner, "--undo").returncode == 0


def test_a_drain_stops_at_its_deadline_and_says_what_is_left(stack: PullStack) -> None:
    doc = document(12, 2000)
    owner = owner_of(stack, doc)
    long_req = threading.Thread(target=stack.complete, args=(doc + [3] * 16, 1500), daemon=True)
    long_req.start()  # 1500 decode steps at 8.4 ms: ~13 s in flight on the owner
    wait_running(stack, owner)
    try:
        t0 = time.monotonic()
        done = kvgate_drain(stack, owner, "--deadline", "0.5")
        took = time.monotonic() - t0
        assert done.returncode == 3, (done.stdout, done.stderr)  # the deadline came first
        report = json.loads(done.stdout)
        assert report["deadline_reached"] and report["inflight_left"] >= 1 and not report["complete"]
        assert report["elapsed_s"] < 0.5 + 1.0  # the admin API stops at the deadline
        assert took < 0.5 + 5 + 10  # and the CLI with it (its own timeout is deadline + 5 s; + process start here)
        status, hdrs, _ = stack.complete(doc + [4] * 20, 2)  # the node takes no new request meanwhile
        assert status == 200 and hdrs["x-kvgate-node"] != owner
    finally:
        long_req.join(timeout=60)
        assert kvgate_drain(stack, owner, "--undo").returncode == 0


def test_what_an_operator_sees_when_a_drain_cannot_run(stack: PullStack) -> None:
    unknown = kvgate_drain(stack, "no-such-node", "--deadline", "2")
    assert unknown.returncode == 1 and "HTTP 404" in unknown.stderr and "not live" in unknown.stderr
    wrong = kvgate_drain(stack, "a", "--deadline", "2", token="not-the-admin-token-at-all")
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr
    bad = kvgate_drain(stack, "a", "--deadline", "-1")
    assert bad.returncode == 1 and "--deadline must be > 0" in bad.stderr
    nowhere = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "drain", "a", "--admin-url", "http://127.0.0.1:9", "--deadline", "1"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "KVGATE_ADMIN_TOKEN": TOKEN,
                                                         "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )  # fmt: skip
    assert nowhere.returncode == 1 and "cannot reach the admin API" in nowhere.stderr
