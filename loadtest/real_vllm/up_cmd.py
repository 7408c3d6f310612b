"""``kvgate vllm up``: start N real vLLM engines, print a ``kvgate serve`` fleet for them, wait.

Ctrl-C (or SIGTERM) stops every engine by its pid. The printed YAML is the ``block_size``,
``tokenizer`` and ``fleet`` part of a ``kvgate serve`` config for these engines.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

import yaml

from loadtest.local_fleet import FleetOptions
from loadtest.real_vllm.fleet import VllmFleet, VllmOptions
from loadtest.real_vllm.install import DEFAULT_VENV


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=os.cpu_count() or 1, help="engines (default: one per core)")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="where `kvgate vllm install` put vLLM")
    p.add_argument("--workdir", type=Path, default=None, help="model directory and logs (default: a temporary directory)")


def run(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvgate-vllm-"))
    print(f"starting {args.nodes} vLLM engines (logs in {workdir}) ...", flush=True)
    try:
        fleet = VllmFleet(FleetOptions(nodes=args.nodes, model=args.model), workdir, VllmOptions(venv=args.venv)).start()
    except (FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"kvgate vllm up: {e}", file=sys.stderr)
        return 2
    try:
        config = {
            "models": [args.model],
            **fleet.serve_settings(),
            "fleet": [
                {"node_id": w.node_id, "address": w.address, "events_endpoint": f"tcp://127.0.0.1:{w.events_port}",
                 "replay_endpoint": f"tcp://127.0.0.1:{w.replay_port}"}
                for w in fleet.workers
            ],
            "doctor": {"interval_s": 600},  # each node's canary check at start and every 10 min
            "usage_sample": 0.05,  # read cached_tokens from 5% of the answers (ext_proc)
        }
        print(yaml.safe_dump(config, sort_keys=False), flush=True)
        print("engines ready; Ctrl-C stops them", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        fleet.close()
    return 0
