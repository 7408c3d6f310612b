"""``kvgate loadtest {replay,simulate}``: the subcommand's options and dispatch."""

from __future__ import annotations

import argparse
import importlib

_MODES = {
    "replay": ("loadtest.replay", "replay traffic through real gateways in front of a local (or given) fleet"),
    "simulate": ("loadtest.simulate_cmd", "discrete-event simulation: the same policy and engine code, virtual clock"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, (module, help_text) in _MODES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure(p)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(_MODES[args.mode][0]).run(args) or 0)
