"""``kvgate vllm {install,up}``: real vLLM engines on this machine (see ``docs/real-vllm.md``)."""

from __future__ import annotations

import argparse
import importlib

_MODES = {
    "install": ("loadtest.real_vllm.install", "install vLLM (CPU build) into a venv of its own (default .venv-vllm)"),
    "up": ("loadtest.real_vllm.up_cmd", "start N real vLLM engines with KV events and print the fleet; Ctrl-C stops them"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, (module, help_text) in _MODES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure(p)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(_MODES[args.mode][0]).run(args) or 0)
