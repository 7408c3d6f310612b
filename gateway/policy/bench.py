"""``python -m gateway.policy.bench``: microseconds per decision, per policy, per fleet size.

Decisions run on the request path, once per request; this prints the median (and p99) over
many random views so a change to a policy shows its cost. Views are built beforehand: only
``decide`` is timed. Figures are printed, never asserted (shared CI machines are noisy).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
from gateway.policy.registry import POLICY_NAMES, make_policy
from gateway.profile import PROFILE_DIR, load_profile
from gateway.types import RoutingRequest

DEFAULT_SIZES = (16, 64, 256)


def random_view(rng: random.Random, nodes: int, total_blocks: int) -> DirectoryView:
    """A fleet where a few nodes hold prefixes of the prompt and loads vary, as in a busy fleet."""
    views = []
    for i in range(nodes):
        held = rng.randint(1, total_blocks) if rng.random() < 0.25 else 0
        tier = Tier.CPU if held and rng.random() < 0.1 else Tier.GPU
        inflight = rng.randint(0, 300)
        info = NodeInfo(f"n{i:03d}", f"10.0.{i // 250}.{i % 250 + 1}:8000", f"10.0.{i // 250}.{i % 250 + 1}:9000")
        views.append(NodeView(info, held, tier, NodeLoad(inflight, inflight * rng.randint(0, 4000))))
    return DirectoryView(tuple(views))


def measure(policy_name: str, nodes: int, *, decisions: int, seed: int, profile_name: str) -> tuple[float, float]:
    """(median µs, p99 µs) of ``decide`` for one policy on ``nodes``-node views."""
    rng = random.Random(seed)
    profile = load_profile(str(PROFILE_DIR / f"{profile_name}.yaml"))
    policy = make_policy(policy_name)
    sizes = [rng.randint(8, 512) for _ in range(64)]
    requests = [RoutingRequest("m", 16 * b + rng.randint(0, 15), b, 16) for b in sizes]
    views = [random_view(rng, nodes, 512) for _ in range(64)]
    for k in range(50):  # warm-up
        policy.decide(requests[k % 64], views[k % 64], profile, now=0.0)
    samples = []
    clock = time.perf_counter_ns
    for k in range(decisions):
        req, view = requests[k % 64], views[(k * 7) % 64]
        t0 = clock()
        policy.decide(req, view, profile, now=float(k))
        samples.append((clock() - t0) / 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.policy.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="fleet sizes")
    parser.add_argument("--decisions", type=int, default=2000, help="timed decisions per policy and size")
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), choices=POLICY_NAMES)
    parser.add_argument("--profile", default="llama-3.1-8b-h100")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    print(f"{'policy':<15}" + "".join(f"{f'{n} nodes':>22}" for n in args.sizes))
    print(f"{'':<15}" + "".join(f"{'median / p99 µs':>22}" for _ in args.sizes))
    for name in args.policies:
        cells = []
        for n in args.sizes:
            med, p99 = measure(name, n, decisions=args.decisions, seed=args.seed, profile_name=args.profile)
            cells.append(f"{med:>12.1f} / {p99:>7.1f}")
        print(f"{name:<15}" + "".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
