"""``kvgate bench overhead`` end to end (real Envoy, real ``kvgate serve``, the real sglang-router
peer, a real upstream process) with a few requests, and the peers' prerequisites checked before
anything starts: a user missing ``sglang-router`` learns it at once, with the right install line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = {"p50_ms", "p99_ms", "rps", "cpu_ms_per_request", "envoy_cpu_ms_per_request"}


def kvgate(*args: str, hide_sglang: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    """``kvgate ARGS``; ``hide_sglang``: as on a machine without the sglang-router package."""
    hide = "sys.modules['sglang_router'] = None; " if hide_sglang else ""
    code = f"import sys; {hide}from gateway.cli import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_overhead_reports_every_target_and_the_prompt_sweep(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = kvgate(
        "bench", "overhead", "--requests", "20", "--warmup", "5", "--concurrency", "2",
        "--prompt-tokens", "1k,2k", "--sweep-requests", "3", "--sweep-concurrency", "2", "--rounds", "3", "--json", str(out),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for target in ("direct", "envoy", "kvgate_ext_proc", "kvgate_ext_authz", "sglang"):
        assert FIGURES <= set(data[target]), (target, data[target])
        assert data[target]["p50_ms"] > 0 and data[target]["rps"] > 0
    # each router's own CPU, and Envoy's where Envoy is in the path (sglang-router replaces it)
    for target in ("kvgate_ext_proc", "kvgate_ext_authz", "sglang"):
        assert data[target]["cpu_ms_per_request"] > 0
        assert data[target]["added_p50_ms"] == data[target]["p50_ms"] - data["envoy"]["p50_ms"]
    assert data["sglang"]["envoy_cpu_ms_per_request"] is None and data["envoy"]["envoy_cpu_ms_per_request"] > 0
    # per kvgate target: warm-up + 2 × 20, and each of the 8 chats once before; none failed open
    assert data["histories_seen_before"] == 8
    assert data["routed_requests"] == 2 * (5 + 2 * 20) + 8
    for target in ("kvgate_ext_proc", "kvgate_ext_authz"):  # only continuing chats in the measured window
        assert data[target]["first_sights"] == 0, data[target]
    assert set(data["ratios"]) >= {"kvgate_ext_authz_added_p50_over_sglang", "kvgate_ext_authz_cpu_over_its_envoy_cpu"} - (
        set() if data["sglang"]["added_p50_ms"] > 0 else {"kvgate_ext_authz_added_p50_over_sglang"}
    )
    sweep = data["prompt_sweep"]
    assert [(c["kind"], c["size"], c["concurrency"]) for c in sweep["cells"]] == [
        (kind, size, conc) for size in (1000, 2000) for conc in (1, 2) for kind in ("chat", "fresh", "tokens")
    ]
    for cell in sweep["cells"]:
        assert 0.9 * cell["size"] <= cell["prompt_tokens"] <= cell["size"], cell  # sized with the gateway's own tokenizer
        assert cell["failed_open"] == 0 and cell["decision_p50_ms"] is not None
        assert ("sglang_p50_ms" in cell) == (cell["kind"] != "tokens")  # sglang-router refuses token IDs
    interference = sweep["interference"]
    assert interference["fresh_tokens"] == 2000
    assert interference["kvgate"]["with_fresh"]["p99_ms"] > 0 and interference["envoy"]["fresh_requests"] > 0
    # per round, so that one run says how far its figures can be trusted
    rises = [r["rise_over_envoy_ms"] for r in interference["rounds"]]
    assert len(rises) == 3 and interference["rise_over_envoy"]["per_round"] == rises
    assert interference["rise_over_envoy"]["min"] <= interference["rise_over_envoy"]["median"] <= interference["rise_over_envoy"]["max"]
    chats = sweep["chat_rounds"]
    assert chats["sizes"] == [1000, 2000] and len(chats["rounds"]) == 3
    assert all(set(r["added_p50_ms"]) == {"1000", "2000"} for r in chats["rounds"])
    assert [r["ratio"] for r in chats["rounds"] if r["ratio"] is not None] == chats["ratio"]["per_round"]
    assert sweep["goals"]["interference_p99_rise_over_envoy_ms"] == interference["rise_over_envoy"]["median"]
    assert "per round" in proc.stdout
    for heading in ("kvgate_ext_authz", "sglang", "prompt-length sweep", "interference"):
        assert heading in proc.stdout


def test_overhead_without_sglang_router_fails_before_any_run() -> None:
    started = time.monotonic()
    proc = kvgate("bench", "overhead", "--requests", "5", hide_sglang=True, timeout=60)
    assert proc.returncode == 2
    assert "sglang-router" in proc.stderr and "pip install -e '.[loadtest]'" in proc.stderr
    assert time.monotonic() - started < 30 and "overhead (" not in proc.stdout  # nothing was measured


def test_replay_checks_every_policy_before_the_first_one_runs(tmp_path: Path) -> None:
    """round_robin would run for its whole duration before sglang failed; now nothing starts."""
    started = time.monotonic()
    proc = kvgate(
        "loadtest", "replay", "--workload", "chat", "--conversations", "2", "--turns", "2",
        "--nodes", "2", "--policies", "round_robin,sglang", "--duration", "90",
        "--workdir", str(tmp_path / "wd"), hide_sglang=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "pip install -e '.[loadtest]'" in proc.stdout
    assert time.monotonic() - started < 30
    assert "starting" not in proc.stdout and not (tmp_path / "wd").exists()  # no engine was started


async def test_the_sweep_alternates_its_two_targets_request_by_request() -> None:
    """At concurrency 1 plain Envoy and kvgate get each body in turn, which one first swapped every
    body: a load that drifts during the cell then weighs on both, not on their difference."""
    import aiohttp
    from aiohttp import web

    from gateway.bench_prompts import alternating

    seen: list[tuple[str, bytes]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.match_info["target"], await request.read()))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/{target}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    bodies = [b"0", b"1", b"2", b"3", b"4"]
    try:
        async with aiohttp.ClientSession() as s:
            first, second = await alternating(s, f"http://127.0.0.1:{port}/a", f"http://127.0.0.1:{port}/b", bodies)
    finally:
        await runner.cleanup()
    assert len(first) == len(second) == len(bodies) and min(first + second) > 0
    assert seen == [
        ("a", b"0"), ("b", b"0"), ("b", b"1"), ("a", b"1"), ("a", b"2"), ("b", b"2"),
        ("b", b"3"), ("a", b"3"), ("a", b"4"), ("b", b"4"),
    ]


def test_overhead_refuses_zero_rounds_before_any_run() -> None:
    proc = kvgate("bench", "overhead", "--requests", "5", "--prompt-tokens", "1k", "--rounds", "0", timeout=60)
    assert proc.returncode == 2 and "--rounds must be at least 1" in proc.stderr
    assert "overhead (" not in proc.stdout
