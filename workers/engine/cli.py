"""``kvgate worker``: run one simulated inference engine (OpenAI API, KV events, /metrics)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from gateway.conn_gate import ConnectionGuard
from gateway.profile import load_profile
from workers.engine.openai_api import DEFAULT_MAX_TOKENS
from workers.transfer.backend import BACKENDS, TransferError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument("--model", default="kvgate-sim", help="served model name (requests must name it)")
    parser.add_argument(
        "--profile", default="llama-3.1-8b-h100", help="hardware profile: a shipped name or a YAML path"
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0,
        help="real seconds per modelled second (0.01 = 100x faster than the hardware; 0 = no waiting)",
    )
    parser.add_argument("--kv-blocks", type=int, default=None, help="KV cache capacity in blocks (default: the profile's)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + reply (default: the profile's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="max running sequences (default: the profile's)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget per step (default: the profile's)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or tokenizer.json (default: DeepSeek's)")
    parser.add_argument("--chat-template", default=None, help="Jinja chat template file overriding the tokenizer's")
    parser.add_argument(
        "--events-endpoint", default=None, help="ZMQ PUB endpoint for KV events, e.g. tcp://127.0.0.1:5557 (off if unset)"
    )
    parser.add_argument("--replay-endpoint", default=None, help="ZMQ ROUTER endpoint for KV-event replay")
    parser.add_argument("--events-topic", default="", help="topic frame of KV-event messages (default: empty)")
    parser.add_argument(
        "--events-connect",
        action="store_true",
        help="connect the PUB socket to --events-endpoint (a collector kvgate binds) instead of binding it",
    )
    parser.add_argument(
        "--replay-buffer", type=int, default=10_000, help="KV-event batches kept for replay (vLLM: 10000)"
    )
    parser.add_argument("--node-id", default=None, help="node id in x-kvgate-node (default: host:port)")
    parser.add_argument(
        "--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS,
        help=f"reply length when a request gives no max_tokens (default: {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--transfer-port", type=int, default=None,
        help="port of this node's KV transfer agent (serves and pulls blocks; its transfer_endpoint); off if unset",
    )
    parser.add_argument("--transfer-host", default=None, help="address the transfer agent binds and advertises (default: --host)")
    parser.add_argument(
        "--transfer-backend", default="kvgate-tcp", choices=BACKENDS,
        help="transport of the real bytes (default: kvgate-tcp, through the agent's signed port; "
        "mooncake-* open unauthenticated ports; verbs = pyverbs RDMA READ)",
    )
    parser.add_argument("--transfer-device", default="", help="RDMA device for mooncake-rdma / verbs (default: the first)")
    parser.add_argument(
        "--transfer-link", default="tcp", choices=("rdma", "tcp"),
        help="link whose profile speed models a pull's time: must match the gateway's policy.link (default: tcp)",
    )
    parser.add_argument(
        "--transfer-payload-bytes", type=int, default=4096,
        help="real bytes kept and moved per block, a scaled-down stand-in for its KV (default: 4096)",
    )
    parser.add_argument(
        "--debug-headers", action="store_true",
        help="answer with x-kvgate-node/-cached-tokens/-pull headers (benchmarks, tests); off: clients see none",
    )
    parser.add_argument(
        "--transfer-secret-file", default=None,
        help="file holding the fleet's transfer secret (>= 16 bytes; a Kubernetes Secret): required with --transfer-port",
    )
    parser.add_argument(
        "--transfer-peers", default=None,
        help="comma-separated transfer endpoints (host:port) this node may pull from: the fleet's (default: any signed peer)",
    )
    parser.add_argument(
        "--pull-timeout", type=float, default=5.0, help="real seconds a pull may take before recomputing (default: 5)"
    )
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")


def _check(args: argparse.Namespace) -> str | None:
    if args.time_scale < 0:
        return "--time-scale must be >= 0"
    for name in ("kv_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            return f"--{name.replace('_', '-')} must be positive"
    if args.max_tokens_default < 1:
        return "--max-tokens-default must be >= 1"
    if args.replay_buffer < 1:
        return "--replay-buffer must be at least 1"
    if args.replay_endpoint and not args.events_endpoint:
        return "--replay-endpoint needs --events-endpoint"
    if args.transfer_port is not None and not 0 < args.transfer_port < 65536:
        return "--transfer-port must be 1-65535"
    if args.transfer_port is not None and not args.transfer_secret_file:
        return "--transfer-port needs --transfer-secret-file: the agent answers only peers holding the fleet's secret"
    if args.transfer_payload_bytes <= 0:
        return "--transfer-payload-bytes must be positive"
    if not args.pull_timeout > 0:
        return "--pull-timeout must be positive"
    return None


async def _serve(args: argparse.Namespace) -> None:
    from tokenizer import PromptTokenizer
    from workers.engine.server import Engine, EngineConfig, create_app

    profile = load_profile(args.profile)
    config = EngineConfig(
        model=args.model,
        profile=profile,
        node_id=args.node_id or f"{args.host}:{args.port}",
        time_scale=args.time_scale,
        kv_blocks=args.kv_blocks,
        max_model_len=args.max_model_len,
        default_max_tokens=args.max_tokens_default,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        transfer_port=args.transfer_port,
        transfer_host=args.transfer_host or args.host,
        transfer_backend=args.transfer_backend,
        transfer_device=args.transfer_device,
        transfer_link=args.transfer_link,
        transfer_payload_bytes=args.transfer_payload_bytes,
        pull_timeout_s=args.pull_timeout,
        debug_headers=args.debug_headers,
        transfer_secret_file=args.transfer_secret_file or "",
        transfer_peers=tuple(p.strip() for p in args.transfer_peers.split(",") if p.strip()) if args.transfer_peers else None,
    )
    tokenizer = PromptTokenizer(args.tokenizer, chat_template=args.chat_template)
    events = None
    if args.events_endpoint:
        from workers.engine.events import EventPublisher

        events = EventPublisher(
            args.events_endpoint, replay_endpoint=args.replay_endpoint, topic=args.events_topic,
            buffer_batches=args.replay_buffer, connect=args.events_connect,
        )  # fmt: skip
    engine = Engine(config, tokenizer, events)
    # a request (head and body) within 10 s, at most 256 connections waiting for one, requests in
    # progress never closed for it: a client trickling heads cannot use up the port's descriptors
    guard = ConnectionGuard(lambda why: engine.metrics.closed_connections.labels(why).inc(), whole_requests=True)
    app = create_app(engine)
    app.middlewares.insert(0, guard.middleware)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await guard.listen(runner, args.host, args.port)
        ev = f" kv-events {events.endpoint}" if events else ""
        if engine.transfer is not None:
            ev += f" transfer {engine.transfer.endpoint} ({config.transfer_backend}, link {config.transfer_link})"
        print(
            f"kvgate worker {config.node_id}: {config.model} ({profile.name}, {config.capacity_blocks} blocks, "
            f"time-scale {config.time_scale}) on http://{args.host}:{args.port}{ev}",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await guard.close()
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = _check(args)
    if problem:
        print(f"kvgate worker: {problem}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(_serve(args))
    except (FileNotFoundError, ValueError, OSError, TransferError) as e:
        print(f"kvgate worker: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate worker", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))
