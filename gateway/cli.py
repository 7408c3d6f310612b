"""The ``kvgate`` command. Each subcommand lives in its own module and is imported only when run,
so ``kvgate worker`` never pays for gRPC and ``kvgate serve`` never for matplotlib.

A subcommand module exposes ``configure(parser)`` (adds its arguments) and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help)
    "serve": ("gateway.serve_cmd", "run the gateway: Envoy ext_proc and/or ext_authz service + admin API"),
    "envoy-config": ("gateway.envoy_config", "render the Envoy bootstrap for a fleet"),
    "worker": ("workers.engine.cli", "run a simulated inference engine (OpenAI API, KV events)"),
    "bridge": ("workers.bridge_cmd", "forward engines' KV events into the directory"),
    "pd-sidecar": ("workers.pd_sidecar", "a decode node's P/D sidecar: prefill on x-prefiller-host-port, then decode locally"),
    "drain": ("gateway.drain_cmd", "drain a node before it goes: no new requests, hot prefixes copied, in-flight finished"),
    "doctor": ("gateway.doctor", "check end to end that each node's KV blocks are keyed as kvgate keys its prompts"),
    "bench": ("gateway.bench_cmd", "measure what the gateway costs per request"),
    "demo": ("loadtest.demo", "the headline experiment at demo scale: 8 nodes, multi-turn chats, round-robin vs kvgate"),
    "loadtest": ("loadtest.cli", "replay traffic through a fleet under several policies, or simulate one"),
    "vllm": ("loadtest.real_vllm.cli", "real vLLM engines (CPU build) on this machine: install, start a fleet"),
    "profile": ("gateway.profile_fit", "fit a hardware profile to a vLLM engine's /metrics"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache-affinity gateway for LLM inference fleets")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    module = None
    for name, (mod_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(mod_name)
            module.configure(p)
    args = parser.parse_args(argv)
    assert module is not None  # argparse rejected unknown commands above
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
