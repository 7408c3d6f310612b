"""``kvgate vllm {install,up}``: real vLLM engines on this machine (see ``docs/real-vllm.md``)."""

from __future__ import annotations

import argparse

from loadtest.cli import configure_modes, run_mode

_MODES = {
    "install": ("loadtest.real_vllm.install", "install vLLM (CPU build) into a venv of its own (default .venv-vllm)"),
    "up": ("loadtest.real_vllm.up_cmd", "start N real vLLM engines with KV events and print the fleet; Ctrl-C stops them"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    configure_modes(parser, _MODES)


def run(args: argparse.Namespace) -> int:
    return run_mode(args, _MODES)
