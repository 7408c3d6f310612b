"""``kvgate loadtest replay``: the same traffic through real gateways in front of real engines.

For each policy in ``--policies``: empty every engine's prefix cache (``POST /debug/reset``),
bring up that policy's gateway (``policies.REPLAY_POLICIES``), replay the workload through it,
read the engines' busy time and kvgate's decision-latency histogram before and after, and stop
the gateway. The engines stay up across policies, so every policy meets the same fleet.

``--attach URL --attach-workers URL ...`` skips the local fleet: traffic goes to URL (whatever
gateway runs there; the run is labelled with the single policy given), caches are reset and busy
time read on the listed workers, decision latency from ``--attach-metrics`` if given.

``--engine vllm`` runs the same workloads against real vLLM engines (``loadtest.real_vllm``): one
per core by default, block size 32, caches emptied with ``POST /reset_prefix_cache``; hit rates
come from vLLM's own ``cached_tokens``. vLLM's answers name no node, so the per-node figures come
from each engine's ``/metrics`` (``per_node_engine``: requests finished, prefix-cache hit and query
tokens and its hit rate, prefill and decode seconds); busy time is vLLM's prefill + decode
seconds per request (request-seconds: concurrent requests each count).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from gateway.profile import load_profile
from loadtest.accounting import fill_seen_tokens
from loadtest.local_fleet import FleetOptions, LocalFleet, http, wait_until
from loadtest.pd_fleet import parse_roles
from loadtest.policies import REPLAY_POLICIES, check_prerequisites, parse_policies
from loadtest.prom import bucket_delta, counter_value, histogram_buckets, histogram_quantile
from loadtest.report import print_results, wide_console, write_json, write_report
from loadtest.runner import run_workload
from loadtest.summary import imbalance, summarize, ttft_samples_ms
from loadtest.workload_args import add_workload_args, build_workload
from loadtest.workloads.base import Workload
from tokenizer import PromptTokenizer

DECISION_METRIC = "kvgate_decision_seconds"


def add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--max-requests", type=int, default=None, help="send at most this many requests per policy")
    g.add_argument("--duration", type=float, default=300.0, help="send nothing after this many seconds per policy")
    g.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    g.add_argument("--json", dest="json_path", default=None, help="write the figures here (schema: loadtest/README.md)")
    g.add_argument("--report", default=None, help="directory for PNG plots + index.html")


def configure(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_run_args(p)
    f = p.add_argument_group("fleet")
    f.add_argument("--policies", default="round_robin,least_request,kvgate",
                   help=f"comma-separated, from: {', '.join(REPLAY_POLICIES)}")
    f.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: kvgate's simulated engines; vllm: real vLLM (CPU build, `kvgate vllm install` first)")
    f.add_argument("--vllm-venv", type=Path, default=None, help="where `kvgate vllm install` put vLLM (default .venv-vllm)")
    f.add_argument("--nodes", type=int, default=None, help="engines (default: 8 simulated, or one vLLM per core)")
    f.add_argument("--profile", default="llama-3.1-8b-h100", help="hardware profile of engines and cost model")
    f.add_argument("--time-scale", type=float, default=1.0, help="engines' real seconds per modelled second")
    f.add_argument("--kv-blocks", type=int, default=None, help="engines' KV capacity in blocks")
    f.add_argument("--roles", default=None, metavar="P:D",
                   help="disaggregated fleet (sim engines): P prefill and D decode engines, a pd-sidecar on each decode one")
    f.add_argument("--link", choices=("tcp", "rdma"), default="tcp",
                   help="with --roles: the link KV transfers are modelled (engines) and priced (kvgate) over")
    f.add_argument("--integration", choices=("ext_proc", "ext_authz"), default="ext_proc",
                   help="how Envoy asks kvgate serve (kvgate policies): ext_proc (gRPC, exact load) or ext_authz (HTTP)")
    f.add_argument("--directory", default="memory://", help="kvgate's directory: memory:// or redis://host:port/db")
    f.add_argument("--workdir", default=None, help="logs and configs (default: a temporary directory)")
    f.add_argument("--attach", default=None, help="send traffic to this URL instead of starting a fleet")
    f.add_argument("--attach-workers", nargs="*", default=[], help="engine URLs to reset and read (with --attach)")
    f.add_argument("--attach-metrics", default=None, help="kvgate admin /metrics URL (with --attach)")


def scrape(url: str | None) -> str:
    if not url:
        return ""
    status, body = http(url)
    return body.decode() if status == 200 else ""


def decision_ms(before: str, after: str) -> dict[str, float | None]:
    """p50/p99 of kvgate's total decision time over the run, in ms (None without kvgate)."""
    labels = {"stage": "total"}
    delta = bucket_delta(histogram_buckets(after, DECISION_METRIC, labels), histogram_buckets(before, DECISION_METRIC, labels))
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        v = histogram_quantile(q, delta)
        out[name] = None if v is None else v * 1000.0
    return out


@dataclass
class PolicyRun:
    summary: dict[str, Any]
    samples_ms: list[float]


def measure(
    workload: Workload, url: str, *, label: str, args: argparse.Namespace, tokenizer: PromptTokenizer,
    block_size: int, busy_before: dict[str, float], busy_after_fn, metrics_url: str | None, nodes: Sequence[str],
    engine_counters=None, engine_ttft=None,
) -> PolicyRun:
    """Run the workload once against ``url`` and turn the records into the policy's figures.

    ``engine_counters``: per-node counters the engines keep (real vLLM names no node in its
    answers, so its requests and hits per node come from there). ``engine_ttft``: the engines'
    summed TTFT and request count, so the client's mean TTFT splits into the engines' part
    (queue + prefill) and the request path's (client, proxies, routing decision)."""
    c0 = engine_counters() if engine_counters else {}
    e0 = engine_ttft() if engine_ttft else None
    m0 = scrape(metrics_url)
    run = asyncio.run(
        run_workload(workload, url, max_requests=args.max_requests, duration_s=args.duration,
                     timeout_s=args.timeout, label=label)
    )
    m1 = scrape(metrics_url)
    busy_after = busy_after_fn()
    busy = {n: busy_after.get(n, 0.0) - busy_before.get(n, 0.0) for n in busy_after}
    fill_seen_tokens(run.records, tokenizer, block_size=block_size)
    summary = summarize(run.records, wall_s=run.wall_s, busy_s=busy, nodes=nodes,
                        decision_ms=decision_ms(m0, m1) if metrics_url else None)
    if e0 is not None:
        summary.update(_ttft_split(run.records, e0, engine_ttft()))
    if engine_counters:
        per_node = _counter_deltas(c0, engine_counters())
        summary["per_node_engine"] = per_node
        if not any(summary["per_node_requests"].values()):  # the answers named no node
            summary["per_node_requests"] = {n: int(c["requests"]) for n, c in per_node.items()}
            if summary["imbalance_basis"] == "requests":
                summary["imbalance"] = imbalance({n: c["requests"] for n, c in per_node.items()})
    return PolicyRun(summary, ttft_samples_ms(run.records))


def _ttft_split(records, before: tuple[float, float], after: tuple[float, float]) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
    """Mean TTFT at the client, at the engines (their histogram's growth), and the difference:
    what the path in front of the engines adds to a request on average."""
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    client = 1000.0 * sum(ttfts) / len(ttfts) if ttfts else None
    n = after[1] - before[1]
    engine = 1000.0 * (after[0] - before[0]) / n if n > 0 else None
    path = client - engine if client is not None and engine is not None else None
    return {"ttft_mean_ms": client, "engine_ttft_mean_ms": engine, "path_ttft_mean_ms": path}


def _counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per node: each counter's growth, and the node's own prefix-cache hit rate over it."""
    out = {}
    for node, now in sorted(after.items()):
        d = {k: v - before.get(node, {}).get(k, 0.0) for k, v in now.items()}
        d["hit_rate"] = d["hit_tokens"] / d["query_tokens"] if d.get("query_tokens") else 0.0
        out[node] = d
    return out


def _workload_info(w: Workload) -> dict[str, Any]:
    return {"name": w.name, "description": w.description, "sessions": len(w.sessions), "max_requests": w.max_requests}


def replay(args: argparse.Namespace, console: Console) -> tuple[dict[str, Any], dict[str, list[float]]]:
    policies = parse_policies(args.policies, list(REPLAY_POLICIES))
    if args.attach and len(policies) != 1:
        raise ValueError("--attach measures whatever gateway runs at the URL: give exactly one --policies name")
    if not args.attach:  # every policy's gateway must be runnable before the first one runs
        check_prerequisites(REPLAY_POLICIES[name].kind for name in policies)
    profile = load_profile(args.profile)
    console.print("[bold]building the workload[/] (tokenizer loads once)")
    tokenizer = PromptTokenizer()
    workload = build_workload(args, tokenizer)
    console.print(f"workload: {workload.description}")
    result: dict[str, Any] = {
        "kind": "replay",
        "command": "kvgate " + shlex.join(sys.argv[1:]),
        "workload": _workload_info(workload),
        "policies": {},
        "skipped": {},
    }
    samples: dict[str, list[float]] = {}

    if args.attach:
        workers = list(args.attach_workers)

        def busy_fn() -> dict[str, float]:
            return {u: counter_value(http(u + "/metrics")[1].decode(), "kvgate_engine_busy_seconds") for u in workers}

        for u in workers:
            wait_until(lambda u=u: http(u + "/debug/reset", method="POST", body=b"{}")[0] == 200,
                       timeout_s=60, what=f"cache reset of {u}")
        result["fleet"] = {"attach": args.attach, "workers": workers}
        name = policies[0]
        run = measure(workload, args.attach, label=name, args=args, tokenizer=tokenizer, block_size=profile.block_size,
                      busy_before=busy_fn(), busy_after_fn=busy_fn, metrics_url=args.attach_metrics, nodes=[])
        result["policies"][name] = run.summary
        samples[name] = run.samples_ms
        return result, samples

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvgate-loadtest-"))
    nodes = args.nodes or (8 if args.engine == "sim" else os.cpu_count() or 1)
    roles = parse_roles(args.roles, nodes)
    if roles and args.engine != "sim":
        raise ValueError("--roles runs simulated engines (for vLLM's NIXL connector see docs/disaggregated.md)")
    opts = FleetOptions(nodes=nodes, model=args.model, profile=args.profile, time_scale=args.time_scale,
                        kv_blocks=args.kv_blocks, directory_url=args.directory, roles=roles, link=args.link,
                        integration=args.integration)
    result["fleet"] = {"engine": args.engine, "nodes": nodes, "profile": args.profile, "time_scale": args.time_scale,
                       "kv_blocks": args.kv_blocks, "directory": args.directory, "workdir": str(workdir),
                       "roles": args.roles or "all both",
                       "integration": args.integration, **({"link": args.link} if roles else {})}
    block_size = profile.block_size
    if args.engine == "vllm":
        from loadtest.real_vllm.fleet import VllmFleet, VllmOptions
        from loadtest.real_vllm.install import DEFAULT_VENV

        vllm_fleet = VllmFleet(opts, workdir, VllmOptions(venv=args.vllm_venv or DEFAULT_VENV, kv_blocks=args.kv_blocks))
        block_size = vllm_fleet.vllm.block_size
        fleet_cm: LocalFleet = vllm_fleet
        result["fleet"]["block_size"] = block_size
    else:
        fleet_cm = LocalFleet(opts, workdir)
    console.print(f"starting {nodes} {args.engine} engines (logs in {workdir})")
    with fleet_cm as fleet:
        for name in policies:
            gw_spec = REPLAY_POLICIES[name]
            if gw_spec.kind == "sglang" and workload.token_id_prompts:
                result["skipped"][name] = "sglang-router rejects token-ID prompts (HTTP 422): it routes on text"
                continue
            fleet.reset_caches()
            with fleet.gateway(gw_spec.kind, lb_policy=gw_spec.lb_policy, policy=gw_spec.policy,
                               options=dict(gw_spec.options)) as gw:
                run = measure(workload, gw.url, label=name, args=args, tokenizer=tokenizer,
                              block_size=block_size, busy_before=fleet.busy_seconds(),
                              busy_after_fn=fleet.busy_seconds, metrics_url=gw.metrics_url, nodes=fleet.node_ids,
                              engine_counters=getattr(fleet, "engine_counters", None), engine_ttft=fleet.engine_ttft)
            result["policies"][name] = run.summary
            samples[name] = run.samples_ms
    return result, samples


def emit(result: dict[str, Any], samples: dict[str, list[float]], args: argparse.Namespace, console: Console) -> None:
    print_results(result, console, title=f"{result['kind']}: {result['workload']['description']}")
    if args.json_path:
        console.print(f"JSON: {write_json(result, args.json_path).resolve()}")
    if args.report:
        console.print(f"report: {write_report(result, samples, args.report).resolve()}")


def run(args: argparse.Namespace) -> int:
    console = wide_console()
    try:
        result, samples = replay(args, console)
    except (ValueError, FileNotFoundError, TimeoutError, RuntimeError) as e:
        console.print(f"[red]kvgate loadtest replay: {escape(str(e))}[/]")  # the message may hold [brackets]
        return 2
    emit(result, samples, args, console)
    return 0
