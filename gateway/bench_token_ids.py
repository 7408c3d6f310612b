"""What a token-ID prompt's decision costs kvgate in process: ``python -m gateway.bench_token_ids``.

``RoutingCore.route`` (as ext_authz calls it) over the in-process directory, no Envoy, for
``/v1/completions`` bodies whose prompt is token IDs, of each size: ``fresh`` (never seen: a
history's IDs rotated anew each request), ``resent`` (a continuing chat's IDs: the history seen
before plus a new question, as ``bench overhead``'s ``tokens`` kind) and ``growing`` (an agent's
history: each request the last one plus 40 IDs). The median and p90 of each decision's CPU time,
the cases taking turns in a shuffled order so that the machine's drift weighs on all alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import numpy as np

from directory_client import InProcessDirectory, NodeInfo
from directory_client.sampling import DEFAULT_INDEX_STRIDE
from gateway.bench_cmd import parse_sizes
from gateway.bench_prompts import COMPLETIONS, Bodies
from gateway.core import RoutingCore, RoutingLimits
from gateway.policy import make_policy
from gateway.profile import load_profile

MODEL = "bench-model"
WARM = 4  # requests of each case routed before measuring (a resent history is then seen)


def _bodies(make: Bodies, size: int, n: int) -> dict[str, list[bytes]]:
    histories = [make.doc(f"Chat {size}-{c}", size) for c in range(4)]
    base = json.loads(make.token_ids(histories[0], 0))["prompt"]
    fresh = [json.dumps({"model": MODEL, "prompt": np.roll(base, 1 + 97 * i).tolist(), "max_tokens": 8}).encode()
             for i in range(n)]
    grow, growing = list(base), []
    for i in range(n):
        grow = grow + [(7 * i + j) % 30000 for j in range(40)]
        growing.append(json.dumps({"model": MODEL, "prompt": grow, "max_tokens": 8}).encode())
    resent = [make.token_ids(histories[i % 4], i) for i in range(n)]
    return {"fresh": fresh, "resent": resent, "growing": growing}


async def run(sizes: list[int], requests: int) -> dict[tuple[int, str], list[int]]:
    make = Bodies(MODEL)
    cases: dict[tuple[int, str], tuple[RoutingCore, list[bytes], list[int]]] = {}
    for size in sizes:
        for kind, bodies in _bodies(make, size, requests + WARM).items():
            directory = InProcessDirectory(index_stride=DEFAULT_INDEX_STRIDE)
            for n in (1, 2):
                await directory.register_node(NodeInfo(f"n{n}", f"127.0.0.1:{9000 + n}"))
            core = RoutingCore(make.tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
                               RoutingLimits(models=frozenset([MODEL])))
            cases[size, kind] = (core, bodies, [])
    for core, bodies, _ in cases.values():
        for body in bodies[:WARM]:
            await core.release(await core.route(COMPLETIONS, body, sees_response_end=False))
    order = list(cases.values())
    rng = random.Random(0)
    for i in range(WARM, requests + WARM):
        rng.shuffle(order)
        for core, bodies, cpu in order:
            t0 = time.thread_time_ns()
            result = await core.route(COMPLETIONS, bodies[i], sees_response_end=False)
            cpu.append(time.thread_time_ns() - t0)
            if result.kind != "routed":
                raise RuntimeError(f"a token-ID prompt was not routed: {result.kind} {result.reason}")
            await core.release(result)
    return {key: cpu for key, (_, _, cpu) in cases.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench_token_ids", description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", default="1k,128k", help="prompt sizes (k = 1,000)")
    parser.add_argument("--requests", type=int, default=30, help="decisions measured per size and case")
    args = parser.parse_args(argv)
    result = asyncio.run(run(parse_sizes(args.prompt_tokens), args.requests))
    print(f"{'tokens':>7}  {'case':>8}  {'CPU median µs':>13}  {'p90 µs':>8}")
    for (size, kind), cpu in result.items():
        ordered = sorted(cpu)
        print(f"{size:>7}  {kind:>8}  {statistics.median(ordered) / 1000:>13.0f}  {ordered[int(len(ordered) * 0.9)] / 1000:>8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
