"""``python -m workers.transfer serve``: a standalone agent serving synthetic blocks.

``python -m workers.transfer.bench`` is the throughput benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from workers.transfer.agent import TransferAgent
from workers.transfer.auth import PeerAuth
from workers.transfer.backend import BACKENDS, TransferError, make_backend
from workers.transfer.slots import SlotTable
from workers.transfer.standalone import StaticHolder, synthetic_chain


async def _serve(args: argparse.Namespace) -> None:
    auth = PeerAuth.from_file(args.secret_file, f"{args.host}:{args.port}")
    slots = SlotTable(args.blocks + args.spare_slots, args.payload_bytes, checksum_key=auth.checksum_key)
    holder = StaticHolder(slots, synthetic_chain(args.blocks, args.seed))
    agent = TransferAgent(make_backend(args.backend, host=args.host, auth=auth, device=args.device), slots, holder, auth=auth)
    await agent.start(args.host, args.port)
    print(f"transfer agent on {agent.endpoint}: {args.blocks} blocks of {slots.slot_size} bytes, {args.backend}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await agent.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.transfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a synthetic chain of blocks")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--blocks", type=int, default=256, help="blocks held (synthetic_chain(blocks, seed))")
    serve.add_argument("--spare-slots", type=int, default=0, help="extra slots for pulls into this agent")
    serve.add_argument("--payload-bytes", type=int, default=4096, help="payload bytes per block")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--backend", choices=BACKENDS, default="kvgate-tcp")
    serve.add_argument("--device", default="", help="RDMA device name (rdma backends)")
    serve.add_argument("--secret-file", required=True, help="the fleet's transfer secret (>= 16 bytes): peers must sign with it")
    args = parser.parse_args(argv)
    if args.blocks <= 0 or args.payload_bytes <= 0 or args.spare_slots < 0:
        parser.error("--blocks and --payload-bytes must be positive, --spare-slots >= 0")
    try:
        asyncio.run(_serve(args))
    except (TransferError, OSError, ValueError) as e:
        print(f"transfer agent: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
