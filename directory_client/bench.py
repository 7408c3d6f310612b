"""Lookup latency per backend and index stride, and Redis memory per million blocks.

    python -m directory_client.bench                       # memory:// and redis://127.0.0.1:6379/0
    python -m directory_client.bench --spawn-cluster       # also a throwaway 3-primary cluster
    python -m directory_client.bench --cluster redis+cluster://h:p,h:p --memory-blocks 1000000

The fleet: ``--nodes`` live nodes, each holding ``--background`` unrelated blocks; for the asked
prompt (``--keys`` blocks, 512 = 8k tokens at 16 tokens a block) one node holds 80 %, two hold
the first 20 % (a shared system prompt), the rest nothing — and a worst case where every node
holds all of it. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from directory_client.factory import open_directory
from directory_client.types import NodeInfo
from tokenizer.keys import block_keys, namespace_seed


def _prompt_keys(n: int, salt: int) -> list[int]:
    tokens = [(i * 7919 + salt * 104729) % 100_000 for i in range(n * 16)]
    return list(block_keys(tokens, block_size=16, seed=namespace_seed("bench")))


async def _populate(d: Any, nodes: int, keys: list[int], background: int, worst_case: bool) -> None:
    n = len(keys)
    for i in range(nodes):
        nid = f"node-{i:02d}"
        await d.register_node(NodeInfo(nid, f"10.0.0.{i}:8000", f"10.0.0.{i}:9000", 100_000))
        other = _prompt_keys(background, salt=1000 + i)
        for lo in range(0, len(other), 512):
            await d.record_stored(nid, other[lo : lo + 512])
        if worst_case:
            held = n
        else:
            held = {0: int(n * 0.8), 1: n // 5, 2: n // 5}.get(i, 0)
        if held:
            await d.record_stored(nid, keys[:held])


async def _time_lookups(d: Any, keys: list[int], iterations: int) -> tuple[float, float, int]:
    for _ in range(20):  # warm: connections, scripts, caches
        view = await d.lookup(keys)
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        view = await d.lookup(keys)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    return p50 * 1e3, p99 * 1e3, max(v.cached_blocks for v in view.nodes)


async def bench_lookup(url: str, stride: int, args: argparse.Namespace, worst_case: bool) -> tuple[float, float, int]:
    prefix = f"kvgate-bench:{uuid.uuid4().hex[:10]}"
    kw: dict[str, Any] = {"index_stride": stride, "op_timeout_s": 5.0, "heartbeat_ttl_s": 600.0}
    if not url.startswith("memory"):
        kw["key_prefix"] = prefix
    d = open_directory(url, **kw)
    keys = _prompt_keys(args.keys, salt=1)
    try:
        await _populate(d, args.nodes, keys, args.background, worst_case)
        return await _time_lookups(d, keys, args.iterations)
    finally:
        for i in range(args.nodes):
            await d.deregister_node(f"node-{i:02d}")
        await _drop_config(d, url, prefix)
        await d.aclose()


async def _drop_config(d: Any, url: str, prefix: str) -> None:
    if not url.startswith("memory"):
        await d._client.delete(f"{{{prefix}}}:config")


async def bench_memory(url: str, blocks: int) -> tuple[int, int]:
    """Bytes of one node's block hash holding ``blocks`` entries (MEMORY USAGE, exact), per block."""
    prefix = f"kvgate-bench:{uuid.uuid4().hex[:10]}"
    d = open_directory(url, key_prefix=prefix, op_timeout_s=30.0, index_stride=1)
    keys = _prompt_keys(blocks, salt=7)
    try:
        for lo in range(0, len(keys), 4096):
            await d.record_stored("mem", keys[lo : lo + 4096])
        used = await d._client.memory_usage(f"{prefix}:{{mem}}:blocks", samples=0)
        return used, blocks
    finally:
        await d.deregister_node("mem")
        await _drop_config(d, url, prefix)
        await d.aclose()


@contextmanager
def spawned_cluster() -> Iterator[str]:
    """A throwaway 3-primary cluster on loopback, for benchmarking only."""
    import socket

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    server = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if not server or not cli:
        raise SystemExit("--spawn-cluster needs redis-server and redis-cli on PATH")
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        try:
            ports = [port() for _ in range(3)]
            for p in ports:
                procs.append(
                    subprocess.Popen(
                        [server, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                         "--cluster-port", str(port()), "--cluster-config-file", f"{Path(tmp)}/n{p}.conf",
                         "--save", "", "--appendonly", "no", "--dir", tmp],
                        stdout=subprocess.DEVNULL,
                    )
                )
            time.sleep(0.5)
            addrs = [f"127.0.0.1:{p}" for p in ports]
            subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, timeout=30)
            for _ in range(100):
                info = subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"], capture_output=True, text=True)
                if "cluster_state:ok" in info.stdout:
                    break
                time.sleep(0.1)
            yield "redis+cluster://" + ",".join(addrs)
        finally:
            for p in procs:
                p.kill()
                p.wait()


async def run(args: argparse.Namespace, cluster_url: str | None) -> None:
    backends = [("memory", "memory://")]
    if args.redis:
        backends.append(("redis", args.redis))
    if cluster_url:
        backends.append(("cluster", cluster_url))
    strides = [int(s) for s in args.strides.split(",")]
    print(f"lookup of {args.keys} keys, {args.nodes} live nodes, {args.background} background blocks/node, "
          f"{args.iterations} lookups")
    print(f"{'backend':<8} {'stride':>6} {'case':<8} {'p50 ms':>8} {'p99 ms':>8} {'best hit':>9}")
    for name, url in backends:
        for stride in strides:
            for worst in (False, True):
                p50, p99, best = await bench_lookup(url, stride, args, worst)
                case = "all-hit" if worst else "typical"
                print(f"{name:<8} {stride:>6} {case:<8} {p50:>8.3f} {p99:>8.3f} {best:>9}")
    if args.memory_blocks and args.redis:
        used, n = await bench_memory(args.redis, args.memory_blocks)
        print(f"redis memory: {n:,} indexed blocks in one node hash = {used / 1e6:.1f} MB, {used / n:.1f} B/block "
              f"(at stride k, ~1/k of the engine's blocks are indexed)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m directory_client.bench", description=__doc__.split("\n")[0])
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="single Redis URL ('' to skip)")
    p.add_argument("--cluster", default="", help="Redis Cluster URL (redis+cluster://h:p,…)")
    p.add_argument("--spawn-cluster", action="store_true", help="start a throwaway local cluster")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--keys", type=int, default=512)
    p.add_argument("--background", type=int, default=20000, help="unrelated blocks per node (>512 keeps hashes out of listpack)")
    p.add_argument("--strides", default="1,4,8")
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--memory-blocks", type=int, default=0, help="also measure Redis bytes for this many blocks")
    args = p.parse_args(argv)
    if args.spawn_cluster and not args.cluster:
        with spawned_cluster() as url:
            asyncio.run(run(args, url))
    else:
        asyncio.run(run(args, args.cluster or None))


if __name__ == "__main__":
    main()
