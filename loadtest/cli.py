"""``kvgate loadtest {replay,simulate}``: the subcommand's options and dispatch."""

from __future__ import annotations

import argparse
import importlib

_MODES = {
    "replay": ("loadtest.replay", "replay traffic through real gateways in front of a local (or given) fleet"),
    "simulate": ("loadtest.simulate_cmd", "discrete-event simulation: the same policy and engine code, virtual clock"),
}


Modes = dict[str, tuple[str, str]]  # mode -> (module with configure/run, help text)


def configure_modes(parser: argparse.ArgumentParser, modes: Modes) -> None:
    """One subparser per mode, configured by its module (imported only when the CLI is built)."""
    sub = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, (module, help_text) in modes.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).configure(p)


def run_mode(args: argparse.Namespace, modes: Modes) -> int:
    return int(importlib.import_module(modes[args.mode][0]).run(args) or 0)


def configure(parser: argparse.ArgumentParser) -> None:
    configure_modes(parser, _MODES)


def run(args: argparse.Namespace) -> int:
    return run_mode(args, _MODES)
