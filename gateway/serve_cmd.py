"""``kvgate serve``: the Envoy integrations (ext_proc over gRPC, ext_authz over HTTP, either or
both) and the admin API in one process, over one routing core.

Start-up order: config → tokenizer → directory → policy → fleet keepers → gRPC + admin servers.
Fleet nodes with a KV-event endpoint are followed by an in-process bridge (the embedded default:
one gateway, ``memory://`` directory, no Redis); the others are probed and kept alive by
``StaticFleetKeeper``.
Shutdown runs in reverse on SIGTERM/SIGINT: stop accepting streams (with a grace period for
those in flight), then close what they used. Bad config fails here, before any traffic, with a
message naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

from aiohttp import web

from directory_client import open_directory
from directory_client.factory import redact_url
from directory_client.types import NodeInfo
from ext_proc.ext_authz import ExtAuthzService
from ext_proc.server import build_server
from gateway.admin import build_admin_app
from gateway.admin_debug import DebugApi
from gateway.admin_drain import drain_api
from gateway.background_tokenize import BackgroundTokenizer
from gateway.conn_gate import ConnectionGuard
from gateway.config import ConfigError, KvgateConfig, load_config
from gateway.core import RoutingCore, RoutingLimits
from gateway.decision_log import DecisionLog
from gateway.discovery import build_discovery
from gateway.engine_scrape import EngineCacheScraper
from gateway.fleet import StaticFleetKeeper
from gateway.fleet_status import FleetMonitor
from gateway.logs import setup_logging
from gateway.metrics import CLOSED_CONNECTIONS
from gateway.policy import make_policy
from gateway.profile import load_profile
from gateway.node_doctor import NodeVerdicts, PeriodicDoctor
from gateway.node_health import NodeHealth
from gateway.trusted_fleet import TrustedDirectory, TrustedFleet
from tokenizer import PromptTokenizer

if TYPE_CHECKING:
    from gateway.discovery.runner import KubernetesDiscovery
    from gateway.tracing import Tracing


log = logging.getLogger("kvgate.serve")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (also KVGATE_CONFIG); env KVGATE_* overrides it")
    parser.add_argument("--directory", help="directory URL: memory://, redis://host:port/db, redis+cluster://…")
    parser.add_argument("--policy", help="routing policy name (kvgate, kvgate_nopull, prefix_only, …)")


def _overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    if args.directory:
        out["directory"] = {"url": args.directory}
    if args.policy:
        out["policy"] = {"name": args.policy}
    return out


def limits_from_config(cfg: KvgateConfig) -> RoutingLimits:
    return RoutingLimits(
        block_size=cfg.block_size,
        max_body_bytes=cfg.limits.max_body_bytes,
        max_prompt_tokens=cfg.limits.max_prompt_tokens,
        max_prompt_bytes=cfg.limits.max_prompt_bytes,
        models=frozenset(cfg.models) | frozenset(cfg.lora_adapters) if cfg.models else frozenset(),
        lora_adapters=dict(cfg.lora_adapters),
        max_answer_tokens=cfg.limits.max_answer_tokens,
        max_hold_s=cfg.limits.max_hold_s,
        lookup_timeout_s=cfg.directory.lookup_timeout_ms / 1000,
        session_ttl_s=cfg.sessions.ttl_s,
        session_long_ttl_s=cfg.sessions.long_ttl_s,
    )


def trusted_fleet(cfg: KvgateConfig, discovery: KubernetesDiscovery | None) -> TrustedFleet:
    """What may be routed to: the static fleet and the nodes discovery reports now."""
    if not cfg.fleet and discovery is None:
        log.warning("no static fleet and no discovery: no directory node is trusted, every request fails open")
    static = [(n.address, n.transfer_endpoint) for n in cfg.fleet]
    if discovery is None:
        return TrustedFleet(static)
    membership = discovery.membership
    return TrustedFleet(static, lambda: [(n.address, n.transfer_endpoint) for n in membership.nodes.values()])


def static_nodes(cfg: KvgateConfig) -> list[NodeInfo]:
    """Nodes without KV events: kvgate itself keeps them registered while they are healthy."""
    return [
        NodeInfo(
            node_id=n.node_id, address=n.address, transfer_endpoint=n.transfer_endpoint, model=cfg.node_model(n), role=n.role,
            capacity_blocks=n.capacity_blocks,
        )
        for n in cfg.fleet
        if not n.events_endpoint
    ]


def embedded_bridges(cfg: KvgateConfig, directory) -> list:
    """One in-process KV-event bridge per model among the nodes that publish events."""
    from workers.bridge import COLLECTOR, EngineSpec, KVEventBridge

    by_model: dict[str, list[EngineSpec]] = {}
    collected = [
        EngineSpec(
            node_id=n.node_id, address=n.address, events=COLLECTOR, replay=n.replay_endpoint or None,
            transfer=n.transfer_endpoint, topic=n.events_topic, model=cfg.node_model(n), role=n.role,
            capacity=n.capacity_blocks, sources=tuple(n.events_sources),
        )
        for n in cfg.fleet
        if cfg.events_collector and not n.events_endpoint
    ]  # fmt: skip
    for n in cfg.fleet:
        if n.events_endpoint:
            by_model.setdefault(cfg.node_model(n), []).append(
                EngineSpec(
                    node_id=n.node_id,
                    address=n.address,
                    events=n.events_endpoint,
                    replay=n.replay_endpoint or None,
                    transfer=n.transfer_endpoint,
                    capacity=n.capacity_blocks,
                    role=n.role,
                )
            )
    bridges = [
        KVEventBridge(
            directory,
            specs,
            model=model,
            block_size=cfg.block_size,
            heartbeat_interval_s=max(cfg.directory.heartbeat_ttl_s / 3, 0.1),
            max_blocks_per_node=cfg.max_tracked_blocks_per_node,
            unproven_ttl_s=cfg.unproven_ttl_s,
        )
        for model, specs in by_model.items()
    ]
    if collected:  # one socket for every engine that connects to us, whatever its model
        bridges.append(
            KVEventBridge(
                directory, collected, model=collected[0].model, block_size=cfg.block_size,
                heartbeat_interval_s=max(cfg.directory.heartbeat_ttl_s / 3, 0.1), collector=cfg.events_collector,
                max_blocks_per_node=cfg.max_tracked_blocks_per_node, unproven_ttl_s=cfg.unproven_ttl_s,
            )  # fmt: skip
        )
    return bridges


def settle_heap() -> int:
    """Move what start-up allocated (modules, classes, templates, config: ~100k objects) out of
    the garbage collector's reach; returns how many objects that was.

    A full collection walks every tracked object, and walking these took 60–180 ms on a 2-core
    machine under load, with the event loop stopped: every request in flight waited it out (a
    1k chat beside a flood of fresh 128k prompts, whose survivors trigger full collections, saw
    its p99 rise by ~70 ms). Frozen, they are never walked again; start-up objects that become
    garbage later are never freed (few, and bounded by what start-up made)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def tokenizer_from_config(cfg: KvgateConfig) -> PromptTokenizer:
    """The request path's tokenizer with the configured source, template and memory bounds."""
    t = cfg.tokenizer
    return PromptTokenizer(
        t.source, chat_template=t.chat_template, cache_bytes=t.cache_bytes, chunk_memo_bytes=t.chunk_memo_bytes
    )


async def serve(cfg: KvgateConfig, *, stop: asyncio.Event | None = None, freeze_heap: bool = False) -> None:
    """Serve until ``stop`` (or SIGTERM/SIGINT). ``freeze_heap``: once started, ``settle_heap``
    (the CLI's process; a test serving inside its runner must not freeze the runner's heap)."""
    stop = stop or asyncio.Event()
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    tokenizer = tokenizer_from_config(cfg)
    directory = open_directory(
        cfg.directory.url,
        key_prefix=cfg.directory.key_prefix,
        heartbeat_ttl_s=cfg.directory.heartbeat_ttl_s,
        index_stride=cfg.directory.index_stride,
        op_timeout_s=cfg.directory.op_timeout_s,
        tls_ca_file=cfg.directory.tls_ca_file,
        tls_cert_file=cfg.directory.tls_cert_file,
        tls_key_file=cfg.directory.tls_key_file,
        username=cfg.directory.username,
        password=cfg.directory.password.get_secret_value(),
        shard_timeout_s=cfg.directory.lookup_timeout_ms / 1000 * 0.8,  # a slow shard leaves time for the others
    )
    policy = make_policy(
        cfg.policy.name,
        **cfg.policy.options(),
    )
    decision_log = DecisionLog(cfg.admin.decision_log_size) if cfg.admin.debug else None
    tracing = start_tracing(cfg)
    background = BackgroundTokenizer(
        tokenizer, worker=cfg.tokenizer.background_worker, max_pending=cfg.tokenizer.background_queue
    )
    discovery = build_discovery(cfg, directory)  # None unless discovery.kubernetes.enabled
    health = NodeHealth()  # fed by ext_proc when Envoy sends response headers
    verdicts = NodeVerdicts()  # the doctor's canary checks: a failing node is routed by load only
    core = RoutingCore(
        tokenizer, TrustedDirectory(directory, trusted_fleet(cfg, discovery), health, verdicts), policy,
        load_profile(cfg.policy.profile), limits_from_config(cfg),
        decision_log=decision_log, tracer=tracing.tracer if tracing is not None else None, background=background,
        body_memo_bytes=cfg.tokenizer.body_memo_bytes, token_memo_bytes=cfg.tokenizer.token_memo_bytes,
    )

    keeper = StaticFleetKeeper(directory, static_nodes(cfg), interval_s=max(cfg.directory.heartbeat_ttl_s / 3, 0.2))
    bridges = embedded_bridges(cfg, directory)
    caller_token = cfg.caller_token()
    authz = ExtAuthzService(core, caller_token=caller_token) if cfg.ext_authz_port is not None else None
    if not caller_token:
        log.warning("caller_token_file is not set: anyone reaching the ext_proc/ext_authz ports learns which node holds a prompt")
    grpc_server = None
    if cfg.ext_proc_enabled:
        grpc_server = build_server(
            core, f"{cfg.listen_host}:{cfg.ext_proc_port}", health,
            caller_token=caller_token, prediction_headers=cfg.prediction.response_headers, usage_sample=cfg.usage_sample,
        )
    scraper = None
    if cfg.fleet and cfg.engine_scrape_interval_s > 0:
        scraper = EngineCacheScraper([(n.node_id, n.address) for n in cfg.fleet], interval_s=cfg.engine_scrape_interval_s)
    doctor = None
    if cfg.fleet and cfg.doctor.interval_s > 0:
        doctor = PeriodicDoctor(cfg, tokenizer, verdicts, interval_s=cfg.doctor.interval_s,
                                timeout_s=cfg.doctor.timeout_s, retry_s=cfg.doctor.retry_s)  # fmt: skip
    monitor = FleetMonitor(
        directory, configured=[(n.node_id, n.address) for n in cfg.fleet], bridges=lambda: bridges, verdicts=verdicts
    )
    debug = None
    if decision_log is not None:
        debug = DebugApi(core, decision_log, monitor, token=cfg.admin.bearer_token() or "")
    token = cfg.admin.bearer_token()
    drain = drain_api(core, token=token, link=cfg.policy.link, adapters=cfg.lora_adapters) if token else None
    admin = build_admin_app(
        directory, tokenizer=tokenizer, monitor=monitor, debug=debug, drain=drain,
        client_max_size=cfg.limits.max_body_bytes + (1 << 20),
    )
    # probes and scrapes send a whole head at once: none needs more, and a flood of connections
    # must not use up the descriptors Envoy's connections and Redis need
    admin_guard = ConnectionGuard(lambda why: CLOSED_CONNECTIONS.labels("admin", why).inc())
    admin.middlewares.append(admin_guard.middleware)
    admin_runner = web.AppRunner(admin, access_log=None)
    try:
        if tracing is not None:
            await tracing.start()
        await keeper.start()
        for bridge in bridges:
            await bridge.start()
        if discovery is not None:
            await discovery.start()
        if grpc_server is not None:
            await grpc_server.start()
        if authz is not None:
            assert cfg.ext_authz_port is not None
            await authz.start(cfg.listen_host, cfg.ext_authz_port, max_body_bytes=cfg.limits.max_body_bytes)
        if scraper is not None:
            await scraper.start()
        if doctor is not None:
            await doctor.start()
        await admin_runner.setup()
        await admin_guard.listen(admin_runner, cfg.listen_host, cfg.admin_port)
        if freeze_heap:
            log.info("start-up heap frozen: %d objects out of the garbage collector's reach", settle_heap())
        log.info(
            "kvgate serving on %s: ext_proc %s, ext_authz %s, admin %d; directory %s, policy %s, %d nodes (%d bridged)",
            cfg.listen_host, cfg.ext_proc_port if grpc_server else "off", cfg.ext_authz_port or "off", cfg.admin_port,
            redact_url(cfg.directory.url), cfg.policy.name, len(cfg.fleet), len(cfg.fleet) - len(keeper.nodes),
        )
        await stop.wait()
    finally:
        log.info("kvgate shutting down")
        if grpc_server is not None:
            await grpc_server.stop(grace=5)
        if authz is not None:
            await authz.aclose()  # stop accepting checks, then give back the load still held
        await admin_guard.close()
        await admin_runner.cleanup()
        if scraper is not None:
            await scraper.aclose()
        if doctor is not None:
            await doctor.aclose()
        if discovery is not None:
            await discovery.aclose()
        for bridge in bridges:
            await bridge.aclose(deregister=False)  # other replicas may follow these engines
        await keeper.aclose()
        await directory.aclose()
        background.close()
        if tracing is not None:
            await tracing.aclose()  # exports the spans still queued


def start_tracing(cfg: KvgateConfig) -> Tracing | None:
    """The OpenTelemetry pipeline when ``tracing.enabled`` (and not ``OTEL_SDK_DISABLED``), else None.

    Imported here, not at the top: with tracing off ``gateway.tracing`` is never loaded. An
    ``OTEL_*`` value it cannot use is a configuration error, reported before any traffic.
    """
    if not cfg.tracing.enabled:
        return None
    from gateway.tracing import Tracing, TracingSetupError, tracing_disabled_by_env

    if tracing_disabled_by_env():
        log.info("tracing is enabled in the config but OTEL_SDK_DISABLED=true: no spans")
        return None
    try:
        return Tracing(cfg.tracing.service_name)
    except TracingSetupError as e:
        raise ConfigError(f"tracing: {e}") from None


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, **_overrides(args))
    except ConfigError as e:
        print(f"kvgate: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, json_lines=cfg.log.json_lines)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(cfg, freeze_heap=True))
    except ConfigError as e:  # found while wiring, e.g. an OTEL_* variable tracing cannot use
        print(f"kvgate: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    return 0
