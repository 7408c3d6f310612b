"""``kvgate bridge``: follow engines' KV events and keep the directory in step (see workers.bridge).

Runs as a sidecar beside one engine or as one process for several; several may follow one engine
(one writes it, the others take over if it goes: see workers.bridge). Exits 0 after SIGTERM/SIGINT
once pending writes are flushed and the nodes it writes deregistered; 2 on bad arguments or a
directory whose settings contradict ours.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from directory_client import open_directory
from directory_client.types import DirectoryUnavailable
from workers.bridge import EngineSpec, KVEventBridge, parse_engine_spec
from workers.bridge_metrics import MetricsServer

log = logging.getLogger("kvgate.bridge")


def _engine(text: str) -> EngineSpec:
    try:
        return parse_engine_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--directory",
        # From the environment by default, so a password in the URL never shows on a command line.
        default=os.environ.get("KVGATE_DIRECTORY__URL", "redis://127.0.0.1:6379/0"),
        help="directory URL (redis://…, redis+cluster://…; default: $KVGATE_DIRECTORY__URL)",
    )
    for part, what in (("ca", "CA bundle that signed the Redis server's certificate"),
                       ("cert", "client certificate, if Redis asks for one"), ("key", "the client certificate's key")):
        env = f"KVGATE_DIRECTORY__TLS_{part.upper()}_FILE"  # the names `kvgate serve` reads too
        parser.add_argument(
            f"--tls-{part}-file", default=os.environ.get(env, ""), help=f"rediss://: PEM {what} (default: ${env})"
        )
    parser.add_argument(
        "--username", default=os.environ.get("KVGATE_DIRECTORY__USERNAME", ""),
        help="Redis ACL user, e.g. the bridge role's (default: $KVGATE_DIRECTORY__USERNAME; its password only "
        "from $KVGATE_DIRECTORY__PASSWORD)",
    )
    parser.add_argument("--key-prefix", default="kvgate", help="key prefix of the directory in Redis")
    parser.add_argument("--index-stride", type=int, default=None, help="directory index stride (must match the gateway's)")
    parser.add_argument("--model", required=True, help="served model name: seeds the block keys (must match the gateway's)")
    parser.add_argument("--block-size", type=int, default=16, help="engine block size in tokens")
    parser.add_argument("--heartbeat-ttl", type=float, default=10.0, help="seconds a node stays live without a heartbeat")
    parser.add_argument(
        "--heartbeat-interval", type=float, default=None, help="seconds between heartbeats (default: a third of the TTL)"
    )
    parser.add_argument("--replay-timeout", type=float, default=2.0, help="seconds to wait for each batch of a replay answer (the whole answer: 15 times that)")
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=3.0,
        help="seconds an engine may leave ZMTP heartbeats unanswered (paused, hung) before its node is dropped",
    )
    parser.add_argument(
        "--engine",
        type=_engine,
        action="append",
        required=True,
        metavar="SPEC",
        help="node_id=n1,address=IP:PORT,events=tcp://IP:PORT|collector[,replay=tcp://IP:PORT][,transfer=IP:PORT]"
        "[,capacity=BLOCKS][,topic=PREFIX][,model=NAME]; repeat for each engine",
    )
    parser.add_argument(
        "--max-blocks-per-node",
        type=int,
        default=None,
        help="engine blocks tracked per node (~210 B each); past it the node is cleared and rebuilt "
        "(default: 8x the engine's capacity= if given, else 1000000)",
    )
    parser.add_argument(
        "--collector",
        default=None,
        metavar="ENDPOINT",
        help="bind this ZMQ endpoint (e.g. tcp://0.0.0.0:5557) for engines whose PUB connects to us "
        "(their spec says events=collector; told apart by topic kv@<address>@<model>)",
    )
    parser.add_argument(
        "--unproven-ttl",
        type=float,
        default=1800.0,
        help="seconds before entries the engine's replay could not confirm are dropped (a bridge started after "
        "the replay window)",
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)")
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--log-level", default="INFO")


async def bridge_main(args: argparse.Namespace, *, stop: asyncio.Event | None = None) -> int:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ttl = args.heartbeat_ttl
    interval = args.heartbeat_interval if args.heartbeat_interval is not None else ttl / 3
    if not 0 < interval < ttl:
        log.error("--heartbeat-interval must be positive and below --heartbeat-ttl")
        return 2
    try:
        directory = open_directory(
            args.directory, key_prefix=args.key_prefix, heartbeat_ttl_s=ttl, index_stride=args.index_stride,
            tls_ca_file=args.tls_ca_file, tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file,
            username=args.username, password=os.environ.get("KVGATE_DIRECTORY__PASSWORD", ""),
        )
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        try:
            await directory.live_nodes()  # first use checks that our settings match the directory's
        except DirectoryUnavailable as exc:
            log.warning("directory unavailable at start (%s); will keep trying", exc)
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        try:
            bridge = KVEventBridge(
                directory,
                args.engine,
                model=args.model,
                block_size=args.block_size,
                heartbeat_interval_s=interval,
                replay_timeout_s=args.replay_timeout,
                engine_timeout_s=args.engine_timeout,
                collector=args.collector,
                max_blocks_per_node=args.max_blocks_per_node,
                unproven_ttl_s=args.unproven_ttl,
            )
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        await bridge.start()
        log.info(
            "following %d engine(s): %s", len(args.engine), ", ".join(f"{e.node_id}@{e.events}" for e in args.engine)
        )
        try:
            await stop.wait()
        finally:
            log.info("stopping: flushing and deregistering")
            await bridge.aclose(deregister=True)
    finally:
        await directory.aclose()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_with_metrics(args))


async def _with_metrics(args: argparse.Namespace) -> int:
    """``bridge_main``, with /metrics served on the same loop when ``--metrics-port`` is set."""
    if not args.metrics_port:
        return await bridge_main(args)
    metrics = MetricsServer()
    await metrics.start(args.metrics_host, args.metrics_port)
    try:
        return await bridge_main(args)
    finally:
        await metrics.aclose()
