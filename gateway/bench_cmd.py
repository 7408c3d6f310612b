"""``kvgate bench overhead``: what kvgate costs per request, measured beside its baselines.

In one run, on the same requests (multi-turn chats with ~8k-token histories, tokenization warm):
``direct`` — straight to an upstream; ``envoy`` — through Envoy without kvgate;
``kvgate_ext_proc`` — through Envoy + ``kvgate serve`` over ext_proc (gRPC; also reported as
``kvgate``); ``kvgate_ext_authz`` — the same decision over Envoy's ext_authz (HTTP). Latency is
measured at concurrency 1 (the added latency per request), requests/s at ``--concurrency``;
kvgate's CPU per request is read from ``/proc`` (user + system time of the serve process over
that integration's measured requests). Envoy's own CPU per request is reported beside it.

The upstream is a null server (fixed reply) so that only the routing path is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web
from rich.console import Console
from rich.table import Table

from gateway.envoy_config import EnvoySettings, render_yaml

MODEL = "bench-model"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = sub.add_parser("overhead", help="latency and CPU kvgate adds over direct and plain Envoy")
    p.add_argument("--requests", type=int, default=400, help="measured requests per target")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--conversations", type=int, default=8, help="distinct chats cycled through")
    p.add_argument("--history-tokens", type=int, default=8000, help="approximate tokens of each chat history")
    p.add_argument("--concurrency", type=int, default=8, help="for the requests/s figure")
    p.add_argument("--directory", default="memory://")
    p.add_argument("--json", dest="json_path", help="write the figures here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_chats(n: int, history_tokens: int) -> list[bytes]:
    """Distinct multi-turn chats of roughly ``history_tokens`` tokens (one sentence ≈ 18 tokens)."""
    bodies = []
    for c in range(n):
        doc = " ".join(
            f"Chat {c}: paragraph {i} records that shipment {i * 13 % 997} left port {i % 17} on time."
            for i in range(history_tokens // 18)
        )
        messages = [
            {"role": "system", "content": "You are a careful analyst."},
            {"role": "user", "content": doc + "\nSummarise the shipments."},
            {"role": "assistant", "content": "Most shipments left on time; a few ports dominate."},
            {"role": "user", "content": "Which port shipped most?"},
        ]
        bodies.append(json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8}).encode())
    return bodies


async def _null_upstream(port: int) -> web.AppRunner:
    reply = json.dumps({"id": "bench", "object": "chat.completion", "choices": []}).encode()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _measure(url: str, bodies: Sequence[bytes], n: int, warmup: int, concurrency: int) -> dict:
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> float:
            t = time.perf_counter()
            async with s.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url} answered {r.status}")
            return time.perf_counter() - t

        for i in range(warmup):
            await one(i)
        if n == 0:
            return {}
        lat = [await one(i) for i in range(n)]
        t0 = time.perf_counter()
        queue = iter(range(n))

        async def worker() -> None:
            for i in queue:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        rps = n / (time.perf_counter() - t0)
    lat.sort()
    return {
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        "rps": rps,
    }


async def overhead(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    up_port, ep_port, authz_port, admin_port = _free_port(), _free_port(), _free_port(), _free_port()
    listen = {"envoy": _free_port(), "kvgate_ext_proc": _free_port(), "kvgate_ext_authz": _free_port()}
    upstream = await _null_upstream(up_port)
    node = f"127.0.0.1:{up_port}"
    cfg = {
        "listen_host": "127.0.0.1",
        "ext_proc_port": ep_port,
        "ext_authz_port": authz_port,
        "admin_port": admin_port,
        "models": [MODEL],
        "directory": {"url": args.directory, "key_prefix": f"kvgate-bench-{os.getpid()}"},
        "fleet": [{"node_id": "n1", "address": node}],
        "log": {"level": "WARNING"},
    }
    (work / "kvgate.yaml").write_text(yaml.safe_dump(cfg))
    procs: list[subprocess.Popen] = []
    envoy_bin = str(Path(sys.executable).with_name("envoy"))
    try:
        kv = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / "kvgate.yaml")],
            stdout=open(work / "kvgate.log", "wb"), stderr=subprocess.STDOUT,
        )
        procs.append(kv)
        envoys: dict[str, subprocess.Popen] = {}
        for name, integration in (("envoy", "none"), ("kvgate_ext_proc", "ext_proc"), ("kvgate_ext_authz", "ext_authz")):
            settings = EnvoySettings(
                fleet=[node], integration=integration, ext_proc_address=f"127.0.0.1:{ep_port}",
                ext_authz_address=f"127.0.0.1:{authz_port}", listen_address=f"127.0.0.1:{listen[name]}",
                admin_address=f"127.0.0.1:{_free_port()}", message_timeout_ms=1000,
            )
            (work / f"{name}.yaml").write_text(render_yaml(settings))
            envoys[name] = subprocess.Popen(
                [envoy_bin, "-c", str(work / f"{name}.yaml"), "--concurrency", "1", "--disable-hot-restart", "-l", "error"],
                stdout=open(work / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
            )
            procs.append(envoys[name])
        for port in (admin_port, *listen.values()):
            await _wait_port(port)
        await asyncio.sleep(1.0)  # the fleet keeper registers the node
        bodies = build_chats(args.conversations, args.history_tokens)
        path = "/v1/chat/completions"
        results: dict = {}
        results["direct"] = await _measure(f"http://{node}{path}", bodies, args.requests, args.warmup, args.concurrency)
        for name, port in listen.items():
            url = f"http://127.0.0.1:{port}{path}"
            await _measure(url, bodies, 0, args.warmup, 1)  # warm connections and the token cache
            kv0, env0 = _cpu_seconds(kv.pid), _cpu_seconds(envoys[name].pid)
            results[name] = await _measure(url, bodies, args.requests, 0, args.concurrency)
            kv1, env1 = _cpu_seconds(kv.pid), _cpu_seconds(envoys[name].pid)
            results[name]["envoy_cpu_ms_per_request"] = (env1 - env0) * 1000 / (2 * args.requests)
            if name != "envoy":
                results[name]["cpu_ms_per_request"] = (kv1 - kv0) * 1000 / (2 * args.requests)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
                text = await r.text()
        results["routed_requests"] = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvgate_decisions_total") and 'outcome="fail_open"' not in line
        )
        results["kvgate"] = results["kvgate_ext_proc"]
        results["meta"] = {"requests": args.requests, "concurrency_for_rps": args.concurrency,
                           "history_tokens": args.history_tokens, "directory": args.directory}
        return results
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
        await upstream.cleanup()


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(overhead(args))
    if results["routed_requests"] < 2 * args.requests:
        print(f"warning: kvgate routed only {results['routed_requests']:.0f} requests; the rest failed open", file=sys.stderr)
    table = Table(title="kvgate overhead (latency at concurrency 1; req/s at --concurrency)")
    table.add_column("target", no_wrap=True, min_width=len("kvgate_ext_authz"))
    for col in ("p50 ms", "p99 ms", "req/s", "added p50 vs envoy", "kvgate CPU ms/req", "Envoy CPU ms/req"):
        table.add_column(col, justify="right")
    base = results["envoy"]["p50_ms"]
    for name in ("direct", "envoy", "kvgate_ext_proc", "kvgate_ext_authz"):
        r = results[name]
        table.add_row(
            name, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['rps']:.0f}",
            f"{r['p50_ms'] - base:+.2f}" if name != "direct" else "",
            f"{r['cpu_ms_per_request']:.3f}" if "cpu_ms_per_request" in r else "",
            f"{r['envoy_cpu_ms_per_request']:.3f}" if "envoy_cpu_ms_per_request" in r else "",
        )
    Console().print(table)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 0
