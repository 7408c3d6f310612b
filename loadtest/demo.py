"""``kvgate demo`` (= ``make demo``): the headline experiment at demo scale, in about 2–3 minutes.

Eight simulated nodes, multi-turn chats whose documents are 4,000–8,000 tokens, replayed through
Envoy three times on the same fleet: Envoy's round-robin, Envoy's least-request, and kvgate
(ext_proc, embedded in-process directory, no Redis; ``--directory redis://…`` to use one). Prints
the table and where the report (PNG plots + HTML) and the JSON are.

It is ``kvgate loadtest replay`` with fixed arguments; any replay option given here overrides them.
"""

from __future__ import annotations

import argparse

from loadtest import replay

DEMO_ARGS = [
    "--workload", "chat", "--conversations", "20", "--turns", "5", "--rate", "1.0",
    "--doc-tokens", "4000", "8000", "--think", "1.0", "2.5", "--max-tokens", "64",
    "--nodes", "8", "--profile", "llama-3.1-8b-h100", "--time-scale", "1.0",
    "--policies", "round_robin,least_request,kvgate",
    "--duration", "45", "--timeout", "60",
    "--report", "kvgate-demo-report", "--json", "kvgate-demo-report/results.json",
]


def configure(parser: argparse.ArgumentParser) -> None:
    replay.configure(parser)
    parser.set_defaults(**vars(_preset()))


def _preset() -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    replay.configure(p)
    return p.parse_args(DEMO_ARGS)


def run(args: argparse.Namespace) -> int:
    return replay.run(args)
