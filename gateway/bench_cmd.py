"""``kvgate bench overhead``: what kvgate costs per request, measured beside its baselines and a peer.

In one run, on the same requests (multi-turn chats with ~8k-token histories, each seen once before):
``direct`` — straight to an upstream; ``envoy`` — through Envoy without kvgate;
``kvgate_ext_proc`` — through Envoy + ``kvgate serve`` over ext_proc (gRPC; also reported as
``kvgate``); ``kvgate_ext_authz`` — the same decision over Envoy's ext_authz (HTTP); ``sglang`` —
the ``sglang-router`` package (Rust, ``--policy cache_aware``), a peer router that replaces Envoy,
in front of the same upstream. Latency is measured at concurrency 1 (the added latency per
request), requests/s at ``--concurrency``; each router's CPU per request is read from ``/proc``
(user + system time of its process and its children over that target's measured requests), and
Envoy's own beside it. Absolute figures depend on the machine; the ratios between targets measured
in the same run are what carries over.

``--prompt-tokens 1k,8k,32k,128k`` adds the prompt-length sweep (``gateway.bench_prompts``).

The upstream is a null server (fixed reply) so that only the routing path is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from gateway.local_ports import free_port
from loadtest.policies import check_prerequisites
from loadtest.procs import envoy_binary
from tokenizer.loading import default_tokenizer_path

MODEL = "bench-model"
TARGETS = ("direct", "envoy", "kvgate_ext_proc", "kvgate_ext_authz", "sglang")
ENVOY_TARGETS = {"envoy": "none", "kvgate_ext_proc": "ext_proc", "kvgate_ext_authz": "ext_authz"}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = sub.add_parser("overhead", help="latency and CPU kvgate adds over direct and plain Envoy")
    p.add_argument("--requests", type=int, default=400, help="measured requests per target")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--conversations", type=int, default=8, help="distinct chats cycled through")
    p.add_argument("--history-tokens", type=int, default=8000, help="approximate tokens of each chat history")
    p.add_argument("--concurrency", type=int, default=8, help="for the requests/s figure")
    p.add_argument("--directory", default="memory://")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, from: {', '.join(TARGETS)}")
    p.add_argument("--prompt-tokens", default=None,
                   help="also sweep prompt lengths, e.g. 1k,8k,32k,128k (continuing chat, fresh prompt, token IDs)")
    p.add_argument("--sweep-requests", type=int, default=40, help="requests per sweep cell at concurrency 1")
    p.add_argument("--sweep-concurrency", type=int, default=32, help="requests in flight in the sweep's loaded cells")
    p.add_argument("--rounds", type=int, default=4,
                   help="the sweep's rounds of smallest/largest continuing chats and of the interference run (per-round spread)")
    p.add_argument("--background-worker", choices=("process", "thread"), default="process",
                   help="kvgate's tokenizer.background_worker for this run")
    p.add_argument("--json", dest="json_path", help="write the figures here")


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


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return out


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """CPU time of ``pid``'s threads (``children``: of the processes it started, recursively, instead).

    Read from each thread's ``schedstat`` (nanoseconds), not ``stat`` (10 ms ticks: too coarse for
    a few dozen requests of a millisecond each).
    """
    if children:
        return sum(cpu_seconds(c) + cpu_seconds(c, children=True) for c in _children(pid))
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return total / 1e9


def tree_cpu_seconds(pid: int) -> float:
    return cpu_seconds(pid) + cpu_seconds(pid, children=True)


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
    """A fixed reply to every POST; ``GET /get_model_info`` names a local tokenizer directory, so
    that sglang-router (which probes it) finds one instead of trying a model hub."""
    reply = json.dumps({"id": "bench", "object": "chat.completion", "choices": []}).encode()
    model_info = {"model_path": str(default_tokenizer_path().parent), "tokenizer_path": str(default_tokenizer_path().parent)}

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", lambda _: web.json_response(model_info))
    app.router.add_get("/v1/models", lambda _: web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def serve_upstream(port: int) -> None:
    """The null upstream in a process of its own: the bench's client, busy building long prompts,
    must not delay its answers (nor kvgate's health probes of it)."""

    async def main() -> None:
        await _null_upstream(port)
        await asyncio.Event().wait()

    asyncio.run(main())


def upstream_process(work: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", f"from gateway.bench_cmd import serve_upstream; serve_upstream({port})"],
        stdout=open(work / "upstream.log", "wb"), stderr=subprocess.STDOUT,
    )


HEADERS = {"content-type": "application/json"}


async def post(s: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """One request; its latency in seconds (a non-200 answer is an error: the bench measures routing)."""
    t = time.perf_counter()
    async with s.post(url, data=body, headers=HEADERS) as r:
        answer = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {answer[:300]!r}")
    return time.perf_counter() - t


async def run_requests(s: aiohttp.ClientSession, url: str, bodies: Sequence[bytes], concurrency: int) -> list[float]:
    """Every body once, ``concurrency`` in flight; the latencies in seconds, in completion order."""
    queue = iter(bodies)
    lat: list[float] = []

    async def worker() -> None:
        for body in queue:
            lat.append(await post(s, url, body))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


def percentiles(lat: Sequence[float]) -> dict[str, float]:
    """p50 and p99 in ms (p99: the sample at rank 0.99·n, so the largest one below 100 samples)."""
    ordered = sorted(lat)
    return {"p50_ms": statistics.median(ordered) * 1000, "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000}


async def _measure(url: str, bodies: Sequence[bytes], n: int, warmup: int, concurrency: int) -> dict:
    async with aiohttp.ClientSession() as s:
        for i in range(warmup):
            await post(s, url, bodies[i % len(bodies)])
        if n == 0:
            return {}
        ordered = [bodies[i % len(bodies)] for i in range(n)]
        lat = await run_requests(s, url, ordered, 1)
        t0 = time.perf_counter()
        await run_requests(s, url, ordered, concurrency)
        rps = n / (time.perf_counter() - t0)
    return {**percentiles(lat), "rps": rps}


async def scrape(s: aiohttp.ClientSession, admin_url: str) -> str:
    async with s.get(admin_url + "/metrics") as r:
        return await r.text()


async def background_idle(s: aiohttp.ClientSession, admin_url: str, timeout_s: float = 300.0) -> None:
    """Wait until kvgate has no prompt pending in the background: a history then counts as seen,
    and CPU measured next is not the background's work for earlier requests."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = await scrape(s, admin_url)
        pending = [line for line in text.splitlines() if line.startswith("kvgate_background_tokenize_pending ")]
        if not pending or float(pending[0].rsplit(" ", 1)[1]) == 0:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("kvgate's background tokenization did not drain")


def background_submitted(metrics_text: str) -> float:
    """Prompts kvgate handed to its background tokenizer so far (queued or dropped): one per
    request routed on the head of a prompt it had not tokenized whole — a first sight."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
        if line.startswith("kvgate_background_tokenize_total{") and 'outcome="done"' not in line
    )


async def see_histories(url: str, bodies: Sequence[bytes], admin_url: str) -> int:
    """Send each distinct chat once, waiting for kvgate's background tokenizer after each, so the
    measured requests are all continuing chats. A warm-up cycling through the chats is not
    enough: the background queue holds a few prompts (``tokenizer.background_queue``), and a
    history arriving while it is full is dropped and seen for the first time again later — in
    the measured window, with the background's work for it. Returns how many were sent."""
    distinct = list(dict.fromkeys(bodies))
    async with aiohttp.ClientSession() as s:
        for body in distinct:
            await post(s, url, body)
            await background_idle(s, admin_url)
    return len(distinct)


def envoy_process(work: Path, name: str, settings: EnvoySettings) -> subprocess.Popen:
    (work / f"{name}.yaml").write_text(render_yaml(settings))
    return subprocess.Popen(
        [envoy_binary(), "-c", str(work / f"{name}.yaml"), "--concurrency", "1", "--disable-hot-restart", "-l", "error"],
        stdout=open(work / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
    )


def sglang_process(work: Path, port: int, node: str) -> subprocess.Popen:
    """sglang-router's cache-aware policy in front of ``node`` (it replaces Envoy: no Envoy in its path)."""
    args = [
        "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware", "--worker-urls", f"http://{node}",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", *args],
        stdout=open(work / "sglang.log", "wb"), stderr=subprocess.STDOUT,
    )


async def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s:g} s")


def parse_targets(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown targets {', '.join(unknown) or '(none)'}; choose from {', '.join(TARGETS)}")
    if "envoy" not in names:
        names.insert(0, "envoy")  # every added figure is over plain Envoy
    return [t for t in TARGETS if t in names]


def check_targets(targets: Sequence[str], sweep: bool) -> None:
    """Fail before the first run when a target cannot run here (``RuntimeError``, every reason)."""
    kinds = {"sglang" if t == "sglang" else "envoy" for t in targets if t != "direct"}
    check_prerequisites(kinds | ({"envoy"} if sweep else set()))


async def overhead(args: argparse.Namespace, targets: Sequence[str], sizes: Sequence[int]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    up_port, ep_port, authz_port, admin_port = free_port(), free_port(), free_port(), free_port()
    listen = {name: free_port() for name in targets if name != "direct"}
    node = f"127.0.0.1:{up_port}"
    cfg = {
        "listen_host": "127.0.0.1",
        "ext_proc_port": ep_port,
        "ext_authz_port": authz_port,
        "admin_port": admin_port,
        "models": [MODEL],
        "directory": {"url": args.directory, "key_prefix": f"kvgate-bench-{os.getpid()}"},
        "fleet": [{"node_id": "n1", "address": node}],
        "tokenizer": {"background_worker": args.background_worker},
        "log": {"level": "WARNING"},
    }
    (work / "kvgate.yaml").write_text(yaml.safe_dump(cfg))
    procs: dict[str, subprocess.Popen] = {"upstream": upstream_process(work, up_port)}
    try:
        await _wait_port(up_port)
        kv = procs["kvgate"] = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / "kvgate.yaml")],
            stdout=open(work / "kvgate.log", "wb"), stderr=subprocess.STDOUT,
        )
        for name, port in listen.items():
            if name == "sglang":
                procs[name] = sglang_process(work, port, node)
                continue
            procs[name] = envoy_process(work, name, EnvoySettings(
                fleet=[node], integration=ENVOY_TARGETS[name], ext_proc_address=f"127.0.0.1:{ep_port}",  # type: ignore[arg-type]
                ext_authz_address=f"127.0.0.1:{authz_port}", listen_address=f"127.0.0.1:{port}",
                admin_address=f"127.0.0.1:{free_port()}", message_timeout_ms=1000,
            ))
        for port in (admin_port, *listen.values()):
            await _wait_port(port)
        if "sglang" in listen:
            await _wait_ready(f"http://127.0.0.1:{listen['sglang']}/v1/models")
        await asyncio.sleep(1.0)  # the fleet keeper registers the node
        bodies = build_chats(args.conversations, args.history_tokens)
        path = "/v1/chat/completions"
        results: dict = {}
        seen = 0  # chats kvgate has seen once (its process serves both kvgate targets)
        if "direct" in targets:
            results["direct"] = await _measure(f"http://{node}{path}", bodies, args.requests, args.warmup, args.concurrency)
            results["direct"].update(cpu_ms_per_request=None, envoy_cpu_ms_per_request=None)
        for name, port in listen.items():
            url = f"http://127.0.0.1:{port}{path}"
            router = procs["sglang"] if name == "sglang" else (kv if name != "envoy" else None)
            envoy = procs[name] if name in ENVOY_TARGETS else None
            admin_url = f"http://127.0.0.1:{admin_port}"
            if router is kv and not seen:
                seen = await see_histories(url, bodies, admin_url)
            await _measure(url, bodies, 0, args.warmup, 1)  # warm connections
            before = ""
            if router is kv:
                async with aiohttp.ClientSession() as s:
                    await background_idle(s, admin_url)
                    before = await scrape(s, admin_url)
            r0 = tree_cpu_seconds(router.pid) if router else 0.0
            e0 = cpu_seconds(envoy.pid) if envoy else 0.0
            results[name] = await _measure(url, bodies, args.requests, 0, args.concurrency)
            n = 2 * args.requests
            results[name]["cpu_ms_per_request"] = (tree_cpu_seconds(router.pid) - r0) * 1000 / n if router else None
            results[name]["envoy_cpu_ms_per_request"] = (cpu_seconds(envoy.pid) - e0) * 1000 / n if envoy else None
            if router is kv:
                async with aiohttp.ClientSession() as s:
                    after = await scrape(s, admin_url)
                results[name]["first_sights"] = background_submitted(after) - background_submitted(before)
        base = results["envoy"]
        for name in listen:
            results[name]["added_p50_ms"] = results[name]["p50_ms"] - base["p50_ms"]
            results[name]["added_p99_ms"] = results[name]["p99_ms"] - base["p99_ms"]
        results["ratios"] = ratios(results)
        if any(t.startswith("kvgate_") for t in targets):
            results["routed_requests"] = await _routed(admin_port)
            results["histories_seen_before"] = seen
        if "kvgate_ext_proc" in results:
            results["kvgate"] = results["kvgate_ext_proc"]
        if sizes:
            from gateway.bench_prompts import sweep

            results["prompt_sweep"] = await sweep(
                sizes, envoy_url=f"http://127.0.0.1:{listen['envoy']}", kvgate_url=f"http://127.0.0.1:{listen['kvgate_ext_authz']}",
                kvgate_pid=kv.pid, envoy_pid=procs["kvgate_ext_authz"].pid, admin_url=f"http://127.0.0.1:{admin_port}",
                requests=args.sweep_requests, concurrency=args.sweep_concurrency, model=MODEL, rounds=args.rounds,
                sglang_url=f"http://127.0.0.1:{listen['sglang']}" if "sglang" in listen else None,
                sglang_pid=procs["sglang"].pid if "sglang" in procs else None,
            )
        results["meta"] = {"requests": args.requests, "concurrency_for_rps": args.concurrency, "targets": list(targets),
                           "history_tokens": args.history_tokens, "directory": args.directory,
                           "background_worker": args.background_worker, "rounds": args.rounds}
        return results
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def _routed(admin_port: int) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
            text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith("kvgate_decisions_total") and 'outcome="fail_open"' not in line
    )


def ratios(results: dict) -> dict[str, float]:
    """What a claim can rest on: kvgate against the peer and against Envoy, measured in the same run."""
    out: dict[str, float] = {}
    peer = results.get("sglang")
    for name in ("kvgate_ext_proc", "kvgate_ext_authz"):
        r = results.get(name)
        if r is None:
            continue
        if peer is not None and peer["added_p50_ms"] > 0:
            out[f"{name}_added_p50_over_sglang"] = r["added_p50_ms"] / peer["added_p50_ms"]
        if peer is not None and peer["cpu_ms_per_request"]:
            out[f"{name}_cpu_over_sglang_cpu"] = r["cpu_ms_per_request"] / peer["cpu_ms_per_request"]
        if r["envoy_cpu_ms_per_request"]:
            out[f"{name}_cpu_over_its_envoy_cpu"] = r["cpu_ms_per_request"] / r["envoy_cpu_ms_per_request"]
    return out


def parse_sizes(text: str | None) -> list[int]:
    """``"1k,8k,32k,128k"`` → token counts (k = 1,000)."""
    if not text:
        return []
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            sizes.append(int(float(part[:-1]) * 1000) if part.endswith("k") else int(part))
        except ValueError:
            raise ValueError(f"--prompt-tokens: {part!r} is not a token count like 8k or 8000") from None
    if any(n <= 0 for n in sizes):
        raise ValueError("--prompt-tokens: counts must be positive")
    return sizes


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "" if v is None else format(v, spec)


def run(args: argparse.Namespace) -> int:
    try:
        targets = parse_targets(args.targets)
        sizes = parse_sizes(args.prompt_tokens)
        if args.rounds < 1:
            raise ValueError("--rounds must be at least 1")
        if sizes and "kvgate_ext_authz" not in targets:
            raise ValueError("--prompt-tokens sweeps kvgate over ext_authz: keep kvgate_ext_authz in --targets")
        check_targets(targets, bool(sizes))
    except (ValueError, RuntimeError) as e:
        print(f"kvgate bench overhead: {e}", file=sys.stderr)
        return 2
    results = asyncio.run(overhead(args, targets, sizes))
    if "routed_requests" in results:
        kvgate_targets = sum(1 for t in targets if t.startswith("kvgate_"))
        if results["routed_requests"] < kvgate_targets * 2 * args.requests:
            print(f"warning: kvgate routed only {results['routed_requests']:.0f} requests; the rest failed open", file=sys.stderr)
    table = Table(title="overhead (latency at concurrency 1; req/s at --concurrency; added = over plain Envoy)")
    table.add_column("target", no_wrap=True, min_width=len("kvgate_ext_authz"))
    for col in ("p50 ms", "p99 ms", "req/s", "added p50", "added p99", "router CPU ms/req", "Envoy CPU ms/req"):
        table.add_column(col, justify="right")
    for name in targets:
        r = results[name]
        table.add_row(
            name, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['rps']:.0f}",
            _fmt(r.get("added_p50_ms"), "+.2f"), _fmt(r.get("added_p99_ms"), "+.2f"),
            _fmt(r["cpu_ms_per_request"], ".3f"), _fmt(r["envoy_cpu_ms_per_request"], ".3f"),
        )
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for key, value in results["ratios"].items():
        console.print(f"{key}: {value:.2f}")
    if sizes:
        from gateway.bench_prompts import print_sweep

        print_sweep(results["prompt_sweep"], console)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 0
