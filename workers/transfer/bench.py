"""``python -m workers.transfer.bench``: what a pull costs, measured and modelled.

1. Measured: real throughput of each TCP backend (``kvgate-tcp``, ``mooncake-tcp``) between two
   processes on this host (loopback) for 1, 16 and 64 MiB, the backends run one after the other. "read" is the backend's one-sided batch read alone; "pull" is
   the whole agent path a request waits for: lease over HTTP, read, checksum of every block,
   lease release. Median of ``--repeat`` runs after one warm-up.
2. Modelled: the time the simulated engine charges for pulling 1k tokens of full-size KV over
   each link (``profile.transfer_seconds``) beside recomputing them (``profile.prefill_seconds``),
   for every shipped profile: the comparison the gateway's cost model makes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gateway.profile import load_profile, shipped_profiles
from workers.transfer.agent import TransferAgent
from workers.transfer.auth import PeerAuth
from workers.transfer.backend import ReadOp, coalesce, make_backend
from workers.transfer.slots import SlotTable
from workers.transfer.standalone import synthetic_chain

SLOT = 256 << 10  # bytes per slot: sizes below are whole numbers of slots
REPO = Path(__file__).resolve().parents[2]


class _Nothing:
    def hold(self, hashes: object) -> int:
        return 0

    def unhold(self, hashes: object) -> None:
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"owner exited with {proc.returncode}")
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise TimeoutError("owner did not start")


async def measure(sizes_mib: list[int], repeat: int, backend: str) -> list[tuple[int, float, float]]:
    """(MiB, read MB/s, pull MB/s) per size, median of ``repeat`` runs."""
    blocks = max(sizes_mib) * (1 << 20) // SLOT
    payload = SLOT - 16
    port = _free_port()
    secret = tempfile.NamedTemporaryFile(prefix="kv-bench-secret-")  # noqa: SIM115 (closed below)
    secret.write(secrets.token_hex(32).encode())
    secret.flush()
    owner = subprocess.Popen(
        [sys.executable, "-m", "workers.transfer", "serve", "--port", str(port), "--blocks", str(blocks),
         "--payload-bytes", str(payload), "--secret-file", secret.name, "--backend", backend],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    auth = PeerAuth.from_file(secret.name, "bench")
    slots = SlotTable(blocks, payload, checksum_key=auth.checksum_key)
    agent = TransferAgent(make_backend(backend, host="127.0.0.1", auth=auth), slots, _Nothing(), auth=auth)
    endpoint = f"127.0.0.1:{port}"
    chain = synthetic_chain(blocks)
    out: list[tuple[int, float, float]] = []
    try:
        await _wait_port(port, owner)
        async with aiohttp.ClientSession() as http:
            for mib in sizes_mib:
                n = mib * (1 << 20) // SLOT
                body = json.dumps({"hashes": chain[:n], "start": 0}).encode()
                signed = auth.sign("POST", endpoint, "/kv/lease", body)
                async with http.post(f"http://{endpoint}/kv/lease", data=body, headers=signed) as r:
                    lease = await r.json()
                slots = agent.slots.reserve(n)
                assert slots is not None
                ops = coalesce(ReadOp(agent.slots.address(s), a, SLOT) for s, a in zip(slots, lease["addrs"]))
                reads, pulls = [], []
                for i in range(repeat + 1):
                    t = time.perf_counter()
                    peer = {**lease["backend"], "endpoint": endpoint, "lease": lease["lease"]}
                    await asyncio.to_thread(agent.backend.read, peer, ops)
                    if i:
                        reads.append(time.perf_counter() - t)
                agent.slots.release(slots)
                path = f"/kv/lease/{lease['lease']}"
                async with http.delete(f"http://{endpoint}{path}", headers=auth.sign("DELETE", endpoint, path)) as r:
                    await r.read()
                for i in range(repeat + 1):
                    t = time.perf_counter()
                    pulled = await agent.pull(endpoint, chain[:n], 0, timeout_s=60)
                    if i:
                        pulls.append(time.perf_counter() - t)
                    agent.discard(pulled)
                size = n * SLOT / 1e6
                out.append((mib, size / statistics.median(reads), size / statistics.median(pulls)))
    finally:
        await agent.close()
        owner.terminate()
        owner.wait(timeout=10)
        secret.close()
    return out


def modelled_rows(tokens: int = 1000) -> list[tuple[str, float, float, float, float]]:
    """(profile, MB of KV, pull rdma ms, pull tcp ms, recompute ms) for ``tokens`` tokens."""
    rows = []
    for name in shipped_profiles():
        p = load_profile(name)
        rows.append(
            (
                name,
                tokens * p.kv_bytes_per_token / 1e6,
                p.transfer_seconds(tokens, "rdma") * 1e3,
                p.transfer_seconds(tokens, "tcp") * 1e3,
                p.prefill_seconds(tokens, 0) * 1e3,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.transfer.bench", description=__doc__)
    parser.add_argument("--sizes", default="1,16,64", help="transfer sizes in MiB (default: 1,16,64)")
    parser.add_argument("--repeat", type=int, default=5, help="measured runs per size (default: 5)")
    parser.add_argument("--backends", default="kvgate-tcp,mooncake-tcp", help="TCP backends to measure, in turn")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if not sizes or min(sizes) <= 0 or args.repeat < 1:
        parser.error("sizes must be positive MiB and --repeat >= 1")

    for backend in args.backends.split(","):
        print(f"{backend} backend, loopback, two processes (median of {args.repeat} runs):")
        print(f"{'size':>8} {'read MB/s':>10} {'pull MB/s':>10}   (pull = lease + read + checksum of every block)")
        for mib, read, pull in asyncio.run(measure(sizes, args.repeat, backend)):
            print(f"{mib:>5} MiB {read:>10.0f} {pull:>10.0f}")
    print()
    print("Modelled, per 1k tokens of full-size KV (what the engine sleeps and the gateway prices):")
    print(f"{'profile':<26} {'KV MB':>7} {'pull rdma ms':>13} {'pull tcp ms':>12} {'recompute ms':>13}  cheaper (rdma / tcp)")
    for name, mb, rdma, tcp, recompute in modelled_rows():
        best = "/".join("pull" if t < recompute else "recompute" for t in (rdma, tcp))
        print(f"{name:<26} {mb:>7.1f} {rdma:>13.2f} {tcp:>12.2f} {recompute:>13.2f}  {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
