"""What one decision of a continuing chat costs kvgate in process: ``python -m gateway.bench_decision``.

The bodies of ``kvgate bench overhead --prompt-tokens`` (``bench_prompts.Bodies``: a history of
that size seen before, plus a new turn), routed by ``RoutingCore`` over the in-process directory
(stride 4, as served) with no Envoy and no sockets, one at a time. Per size: the median CPU time
of a whole decision (``route``, as ext_authz calls it), once with no node holding the chat and once
with a node holding its history (as after its previous turn), and the median time of each step of
the request path. A continuing chat should cost what its new turn costs, not what its history costs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import msgspec

from directory_client import InProcessDirectory, NodeInfo, Tier
from directory_client.sampling import DEFAULT_INDEX_STRIDE
from gateway.bench_cmd import parse_sizes
from gateway.bench_prompts import CHAT, Bodies
from gateway.core import RoutingCore, RoutingLimits
from gateway.policy import make_policy
from gateway.profile import load_profile
from tokenizer.keys import request_seed

MODEL = "bench-model"
STEPS = ("json", "prepare", "complete", "keys", "lookup")


class _Case:
    """Continuing chats of one size through their own core and directory, ready to be routed."""

    def __init__(self, core: RoutingCore, directory: InProcessDirectory, bodies: list[bytes]) -> None:
        self.core, self.directory, self.bodies = core, directory, bodies
        self.cpu: list[float] = []
        self.steps: dict[str, list[float]] = {s: [] for s in STEPS}

    @classmethod
    async def make(cls, make: Bodies, size: int, requests: int, *, held: bool) -> "_Case":
        tok = make.tok
        directory = InProcessDirectory(index_stride=DEFAULT_INDEX_STRIDE)
        for i in (1, 2):
            await directory.register_node(NodeInfo(f"n{i}", f"127.0.0.1:{9000 + i}"))
        core = RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
                           RoutingLimits(models=frozenset([MODEL])))
        history = make.doc(f"Chat {size} {held}", size)
        first = make.chat(history, -1)  # the turn before: its history is tokenized and cached
        ids = tok.tokenize_body(CHAT, msgspec.json.decode(first)).token_ids
        await core.release(await core.route(CHAT, first, sees_response_end=False))
        if held:
            keys = core.keys.block_keys(ids, block_size=16, seed=request_seed(MODEL))
            await directory.record_stored("n1", keys.tolist(), Tier.GPU)
        case = cls(core, directory, [make.chat(history, turn) for turn in range(requests + 3)])
        for body in case.bodies[:3]:  # warm: what a chat's turns after the first one meet
            await case.route(body)
        return case

    async def route(self, body: bytes) -> None:
        t0 = time.thread_time_ns()
        result = await self.core.route(CHAT, body, sees_response_end=False)
        self.cpu.append(time.thread_time_ns() - t0)
        if result.kind != "routed":
            raise RuntimeError(f"a continuing chat was not routed: {result.kind} {result.reason}")
        await self.core.release(result)

    async def steps_of(self, body: bytes) -> None:
        """The request path's steps one by one (wall time: nothing here waits)."""
        tok, core = self.core.tokenizer, self.core
        marks = [time.perf_counter_ns()]
        req = core.bodies.decode(body)  # as route decodes it: the history from the body memo
        marks.append(time.perf_counter_ns())
        prepared = tok.prepare(CHAT, req)
        marks.append(time.perf_counter_ns())
        prompt = tok.complete(prepared)
        marks.append(time.perf_counter_ns())
        keys = core.keys.block_keys(prompt.token_ids, block_size=16, seed=request_seed(MODEL))
        marks.append(time.perf_counter_ns())
        await self.directory.lookup(keys)
        marks.append(time.perf_counter_ns())
        for name, a, b in zip(STEPS, marks, marks[1:]):
            self.steps[name].append(b - a)

    def figures(self) -> dict[str, float]:
        out = {"decision_cpu_us": statistics.median(self.cpu[3:]) / 1000}
        out.update({f"{name}_us": statistics.median(v) / 1000 for name, v in self.steps.items()})
        return out


async def run(sizes: list[int], requests: int) -> dict[int, dict[str, dict[str, float]]]:
    """Every size, with no node holding the chat ("cold") and with one holding its history
    ("held"), measured request by request in turn (in a shuffled order), so that the machine's
    drift weighs on all alike."""
    make = Bodies(MODEL)
    cases = {(size, held): await _Case.make(make, size, requests, held=held) for size in sizes for held in (False, True)}
    order = list(cases.values())
    rng = random.Random(0)
    for turn in range(3, requests + 3):
        rng.shuffle(order)  # none always follows the largest, whose passes flush the CPU's caches
        for case in order:
            await case.route(case.bodies[turn])
            await case.steps_of(case.bodies[turn])
    return {size: {"cold": cases[size, False].figures(), "held": cases[size, True].figures()} for size in sizes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench_decision", description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", default="1k,8k,32k,128k", help="history sizes (k = 1,000)")
    parser.add_argument("--requests", type=int, default=200, help="decisions measured per size and case")
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.prompt_tokens)
    result = asyncio.run(run(sizes, args.requests))
    print(f"{'tokens':>7}  {'decision CPU µs':>16}  {'node holds it':>13}  " + "  ".join(f"{s:>8}" for s in STEPS))
    for size, cases in result.items():
        cold, held = cases["cold"], cases["held"]
        print(f"{size:>7}  {cold['decision_cpu_us']:>16.0f}  {held['decision_cpu_us']:>13.0f}  "
              + "  ".join(f"{held[f'{s}_us']:>8.1f}" for s in STEPS))
    base = result[sizes[0]]
    for size in sizes[1:]:
        print(f"{size} / {sizes[0]} tokens: decision CPU x{result[size]['cold']['decision_cpu_us'] / base['cold']['decision_cpu_us']:.2f}"
              f" (node holding it: x{result[size]['held']['decision_cpu_us'] / base['held']['decision_cpu_us']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
