"""``kvgate loadtest simulate``: the replay's workloads and figures, on a virtual clock.

Runs ``loadtest.sim.Simulator`` once per policy (fresh fleet each time) on fleets of up to 256
nodes, prints the same table and writes the same JSON and report as ``replay``. TTFT and
throughput are modelled (the hardware profile's time, not this machine's); decision latency is
the real CPU time of the directory lookup plus the policy's ``decide`` per request.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gateway.profile import load_profile
from loadtest.pd_fleet import parse_roles
from loadtest.policies import SIM_POLICIES, parse_policies
from loadtest.replay import add_run_args, emit
from loadtest.report import wide_console
from loadtest.elastic_figures import elastic_figures
from loadtest.sim.elastic import parse_scale, split_variant
from loadtest.sim.simulator import SimConfig, Simulator
from loadtest.summary import add_pool_share, summarize, ttft_samples_ms
from loadtest.workload_args import TOKEN_ID_WORKLOADS, add_workload_args, build_workload
from tokenizer import PromptTokenizer

MAX_NODES = 256


def configure(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_run_args(p)
    p.set_defaults(duration=float("inf"))
    f = p.add_argument_group("simulated fleet")
    f.add_argument("--policies", default="round_robin,least_request,prefix_only,kvgate,oracle,oracle_pool",
                   help=f"comma-separated, from: {', '.join(SIM_POLICIES)}")
    f.add_argument("--nodes", type=int, default=16, help=f"1..{MAX_NODES}")
    f.add_argument("--profile", default="llama-3.1-8b-h100")
    f.add_argument("--kv-blocks", type=int, default=None, help="KV capacity per node in blocks (default: the profile's)")
    f.add_argument("--view", choices=("directory", "engines"), default="directory",
                   help="policy input: the real in-process directory fed by KV events, or the engines' caches directly")
    f.add_argument("--pulls", choices=("off", "tcp", "rdma"), default="off",
                   help="give nodes transfer agents so kvgate may pull prefixes over this link")
    f.add_argument("--roles", default=None, metavar="P:D",
                   help="disaggregated fleet: P prefill nodes and D decode nodes (P + D = --nodes); default: every node both")
    f.add_argument("--scale", default=None, metavar="T:+N,T:-N",
                   help="scale events: at virtual second T add N nodes (+N) or remove N (-N), e.g. 300:+4,600:-4")
    f.add_argument("--drain", choices=("on", "off"), default="off",
                   help="drain removed nodes first (also per policy: kvgate+drain); kvgate+nowarm turns warm-up off")
    f.add_argument("--block-size", type=int, default=None,
                   help="override the profile's block size (e.g. 512 for the whole Mooncake trace)")


def _profile(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    p = load_profile(args.profile)
    if args.block_size and args.block_size != p.block_size:
        scale = args.block_size / p.block_size
        p = p.model_copy(update={"block_size": args.block_size, "kv_capacity_blocks": int(p.kv_capacity_blocks / scale)})
    return p


def simulate(args: argparse.Namespace, console: Console) -> tuple[dict[str, Any], dict[str, list[float]]]:
    if not 1 <= args.nodes <= MAX_NODES:
        raise ValueError(f"--nodes must be 1..{MAX_NODES}")
    variants = {name: split_variant(name) for name in dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip())}
    parse_policies(",".join(base for base, _, _ in variants.values()), list(SIM_POLICIES))
    policies = list(variants)
    scale = parse_scale(args.scale)
    profile = _profile(args)
    tokenizer = None if args.workload in TOKEN_ID_WORKLOADS and not args.as_text else PromptTokenizer()
    workload = build_workload(args, tokenizer)
    if tokenizer is None:
        tokenizer = PromptTokenizer()  # replies still decode to text (unused by one-turn trace sessions)
    console.print(f"workload: {workload.description}")
    result: dict[str, Any] = {
        "kind": "simulate",
        "command": "kvgate " + shlex.join(sys.argv[1:]),
        "workload": {"name": workload.name, "description": workload.description,
                     "sessions": len(workload.sessions), "max_requests": workload.max_requests},
        "fleet": {"nodes": args.nodes, "profile": profile.name, "block_size": profile.block_size,
                  "kv_blocks": args.kv_blocks or profile.kv_capacity_blocks, "view": args.view, "pulls": args.pulls,
                  "roles": args.roles or "all both", "scale": args.scale or "", "drain": args.drain},
        "policies": {},
        "skipped": {},
    }
    samples: dict[str, list[float]] = {}
    cap = workload.max_requests if args.max_requests is None else min(args.max_requests, workload.max_requests)
    for name in policies:
        base, drain, warm = variants[name]
        cfg = SimConfig(
            policy=base, nodes=args.nodes, scale=scale, drain=drain or args.drain == "on",
            policy_options={} if warm or base != "kvgate" else {"warmup_s": 0.0}, profile=profile, capacity_blocks=args.kv_blocks, view=args.view,
            pull_link=None if args.pulls == "off" else args.pulls, max_requests=args.max_requests,
            duration_s=args.duration, roles=parse_roles(args.roles),
        )
        sim = Simulator(workload, cfg, tokenizer)
        with Progress(TextColumn(f"[bold]{name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            task = progress.add_task("requests", total=cap)
            res = sim.run(on_request=lambda: progress.advance(task))
        dec = sorted(res.decision_s)
        decision = {"p50": dec[len(dec) // 2] * 1000 if dec else None,
                    "p99": dec[min(int(len(dec) * 0.99), len(dec) - 1)] * 1000 if dec else None}
        result["policies"][name] = summarize(
            res.records, wall_s=res.wall_s, busy_s=res.busy_s, nodes=list(sim.by_id),
            decision_ms=decision, extra={"sim_cpu_s": res.cpu_s, **res.extra},
        )
        if sim.elastic is not None:
            result["policies"][name].update(elastic_figures(res.records, sim.elastic.members, sim.elastic.copies))
        samples[name] = ttft_samples_ms(res.records)
        console.print(f"{name}: simulated {res.wall_s:,.0f} s of fleet time in {res.cpu_s:.1f} s")
    add_pool_share(result["policies"])
    return result, samples


def run(args: argparse.Namespace) -> int:
    console = wide_console()
    try:
        result, samples = simulate(args, console)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]kvgate loadtest simulate: {escape(str(e))}[/]")
        return 2
    emit(result, samples, args, console)
    return 0
