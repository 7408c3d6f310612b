"""Render the Envoy bootstrap that puts kvgate in front of a fleet (``kvgate envoy-config``).

What the rendered config does, and why (each point measured with Envoy 1.40):
- client-supplied kvgate headers are stripped by ``early_header_mutation_extensions`` before any
  filter runs, so a client can never pick its own node or order a pull;
- the ext_proc filter gets request headers (``SEND``: with ``SKIP`` the host is picked before the
  body is seen) and the buffered body, and ``failure_mode_allow`` lets requests continue when
  kvgate is down or slow (``message_timeout``);
- a route matching ``x-gateway-destination-endpoint`` goes to ``kvgate_destination``: the fleet's
  endpoints under Envoy's override-host load balancer, which sends the first attempt to the node
  the header names (only if the fleet has it: a foreign address is never a destination) and a
  retry to another node by least-request; kvgate clears the route cache so the match is
  re-evaluated after its mutation;
- every other request (kvgate failed open, or a path kvgate does not route) takes the fallback
  route: a least-request cluster of the same fleet;
- kvgate runs only on the inference paths; other paths pass through untouched. Paths are
  normalised first (``%63hat``, ``//``, ``/./``; an escaped slash is redirected to its unescaped
  form), and a path that merely looks like inference (``/v1/chat/completions/``, ``/V1/...``) is
  answered 404 by Envoy: no spelling of an inference path gets past kvgate to an engine;
- Envoy protects itself: header and whole-request receive timeouts, a stream idle timeout, bounded
  per-connection buffers, a connection limit and an overload manager with a heap limit (stalled
  uploads are reset before the heap runs out), circuit breakers sized from the fleet, and outlier
  detection on every cluster that sends to engines.

Two integrations carry the same decision (``integration``): ``ext_proc`` (gRPC, exact load
accounting, what the Gateway API Inference Extension speaks) and ``ext_authz`` (HTTP with the
body, about a quarter of the CPU); ``none`` renders plain balancing, the load tests' baseline.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import yaml

from gateway.sessions import RETENTION_HEADER, SESSION_HEADER

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PULL_SOURCE_HEADER = "x-kv-cache-source-host-port"
PULL_BLOCKS_HEADER = "x-kv-cache-pull-blocks"
PREFILLER_HEADER = "x-prefiller-host-port"  # split request: its prefill node (llm-d's P/D sidecar contract)
KVGATE_HEADERS = (DESTINATION_HEADER, PULL_SOURCE_HEADER, PULL_BLOCKS_HEADER, PREFILLER_HEADER)
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")
CALLER_TOKEN_HEADER = "x-kvgate-authz-token"  # Envoy → kvgate: this call is Envoy's (gRPC metadata or HTTP header)

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_EXT_AUTHZ = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_EXT_AUTHZ_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_EARLY_MUTATION = "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_FIXED_HEAP = "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig"
_DOWNSTREAM_CONNS = (
    "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)
_OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
_LEAST_REQUEST = "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
_UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"


@dataclass(frozen=True, slots=True)
class EnvoySettings:
    """Everything the bootstrap depends on; one place so the CLI, tests and Helm agree."""

    fleet: Sequence[str]  # "host:port" of every serving node (the fallback cluster)
    integration: Literal["ext_proc", "ext_authz", "none"] = "ext_proc"
    ext_proc_address: str = "127.0.0.1:9002"
    ext_proc_addresses: Sequence[str] = ()  # several kvgate replicas (overrides ext_proc_address)
    ext_authz_address: str = "127.0.0.1:9004"
    listen_address: str = "0.0.0.0:8080"
    admin_address: str = "127.0.0.1:9901"
    max_body_bytes: int = 8 << 20
    message_timeout_ms: int = 200
    route_timeout_s: float = 600.0
    connect_timeout_ms: int = 1000
    lb_policy: str = "LEAST_REQUEST"  # of the fallback cluster: LEAST_REQUEST or ROUND_ROBIN
    retries: int = 2  # per request, on connect failure / reset / refused stream (0 = off)
    health_check_interval_ms: int = 1000  # active health checks of nodes and kvgate replicas (0 = off)
    request_headers_timeout_s: float = 10.0  # a client has this long to send its headers
    request_timeout_s: float = 60.0  # ... and this long for the whole request (not the answer)
    max_connections: int = 4096  # downstream connections over all listeners
    max_heap_bytes: int = 1 << 30  # the overload manager's heap limit (keep under the memory limit)
    max_requests_per_node: int = 256  # circuit breakers: the fleet's clusters allow this × fleet_size
    fleet_size: int = 0  # engines behind `fleet` (0 = its length; one DNS name may stand for many)
    kvgate_tls_ca_file: str = ""  # set: Envoy speaks TLS to kvgate and verifies it against this CA
    kvgate_tls_server_name: str = ""  # SNI and the DNS name its certificate must carry (default: the host)

    def max_upstream_requests(self) -> int:
        """Concurrent requests (and pending ones) a cluster of the fleet allows: Envoy's default
        of 1,024 overflows (503 ``upstream_rq_pending_overflow``) with a few busy engines."""
        return max(1024, self.max_requests_per_node * (self.fleet_size or len(self.fleet)))
    caller_token: str = ""  # sent to kvgate with every ext_proc stream / ext_authz check (kvgate's caller_token_file)
    observe_responses: bool = False  # ext_proc: send kvgate the response headers (it ejects nodes answering 5xx)

    def ext_proc_endpoints(self) -> tuple[str, ...]:
        return tuple(self.ext_proc_addresses) or (self.ext_proc_address,)


def _socket(address: str) -> dict:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _cluster_type(addresses: Sequence[str]) -> str:
    """``STATIC`` for IP literals; ``STRICT_DNS`` as soon as one address is a DNS name (e.g. a
    Kubernetes headless Service): Envoy re-resolves it every few seconds and balances over every
    address it returns, so pods that come and go are followed without a new bootstrap."""
    for address in addresses:
        host = address.rpartition(":")[0].strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return "STRICT_DNS"
    return "STATIC"


def _endpoints(addresses: Sequence[str]) -> list[dict]:
    return [{"lb_endpoints": [{"endpoint": {"address": _socket(a)}} for a in addresses]}]


LOOKALIKE_PATHS = "(?i).*completions.*"
"""Any other spelling of an inference path (trailing slash, case, ``;params``): answered 404 by
Envoy, since an engine may serve it while kvgate's routes, allow-list and limits do not see it."""
LOOKALIKE_ANSWER = '{"error": {"message": "not an inference path: use /v1/chat/completions or /v1/completions"}}\n'

RETRY_ON = "connect-failure,reset,refused-stream"
"""Failures before any response byte reached the client: a retry cannot duplicate an answer."""


def _retry_policy(s: EnvoySettings) -> dict:
    """A retry goes to another node (``previous_hosts``): on ``kvgate_destination`` the header's
    node had its one attempt, and a retry falls to least-request over the others, so a node
    kvgate chose but that fails before answering costs a retry, not the request."""
    return {
        "retry_on": RETRY_ON,
        "num_retries": s.retries,
        "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.250s"},
        "retry_host_predicate": [
            {"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {"@type": _PREVIOUS_HOSTS}}
        ],
        "host_selection_retry_max_attempts": 5,
    }


def _route(match: dict, cluster: str, s: EnvoySettings, *, kvgate_disabled: bool = False) -> dict:
    route: dict = {"match": match, "route": {"cluster": cluster, "timeout": f"{s.route_timeout_s}s"}}
    if s.retries > 0:
        route["route"]["retry_policy"] = _retry_policy(s)
    if kvgate_disabled and s.integration == "ext_proc":
        route["typed_per_filter_config"] = {
            "envoy.filters.http.ext_proc": {"@type": _EXT_PROC_PER_ROUTE, "disabled": True}
        }
    elif kvgate_disabled and s.integration == "ext_authz":
        route["typed_per_filter_config"] = {
            "envoy.filters.http.ext_authz": {"@type": _EXT_AUTHZ_PER_ROUTE, "disabled": True}
        }
    return route


def _routes(s: EnvoySettings) -> list[dict]:
    """Inference paths: routed by the header when kvgate set it, else the fallback.

    Other paths (``/v1/models``, ``/health`` …) skip kvgate and go to the fallback cluster.
    """
    routes = []
    if s.integration != "none":
        for path in INFERENCE_PATHS:
            routes.append(
                _route(
                    {"path": path, "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
                    "kvgate_destination",
                    s,
                )
            )
    for path in INFERENCE_PATHS:  # also without kvgate: before the look-alike route below
        routes.append(_route({"path": path}, "fleet", s))
    routes.append(
        {
            "match": {"safe_regex": {"regex": LOOKALIKE_PATHS}},
            "direct_response": {"status": 404, "body": {"inline_string": LOOKALIKE_ANSWER}},
        }
    )
    routes.append(_route({"prefix": "/"}, "fleet", s, kvgate_disabled=True))
    return routes


def _ext_authz_filter(s: EnvoySettings) -> dict:
    def exact(*names: str) -> dict:
        return {"patterns": [{"exact": n} for n in names]}

    return {
        "name": "envoy.filters.http.ext_authz",
        "typed_config": {
            "@type": _EXT_AUTHZ,
            "http_service": {
                "server_uri": {
                    "uri": f"{'https' if s.kvgate_tls_ca_file else 'http'}://{s.ext_authz_address}",
                    "cluster": "kvgate_ext_authz",
                    "timeout": f"{s.message_timeout_ms / 1000:.3f}s",
                },
                "path_prefix": "/kvgate/authz",
                **({"authorization_request": {"headers_to_add": [{"key": CALLER_TOKEN_HEADER, "value": s.caller_token}]}}
                   if s.caller_token else {}),
                "authorization_response": {
                    "allowed_upstream_headers": exact(*KVGATE_HEADERS),
                    "allowed_client_headers": exact("content-type"),
                },
            },
            "allowed_headers": exact("x-request-id", "content-type", "traceparent", SESSION_HEADER, RETENTION_HEADER),
            # The whole body or nothing: a partial body would be judged malformed.
            "with_request_body": {"max_request_bytes": s.max_body_bytes, "allow_partial_message": False},
            "failure_mode_allow": True,
            "clear_route_cache": True,
            "transport_api_version": "V3",
        },
    }


def _http_filters(s: EnvoySettings) -> list[dict]:
    filters = []
    if s.integration == "ext_authz":
        filters.append(_ext_authz_filter(s))
    if s.integration == "ext_proc":
        filters.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": _EXT_PROC,
                    "grpc_service": {
                        "envoy_grpc": {"cluster_name": "kvgate_ext_proc"},
                        "timeout": "5s",
                        **({"initial_metadata": [{"key": CALLER_TOKEN_HEADER, "value": s.caller_token}]}
                           if s.caller_token else {}),
                    },
                    "failure_mode_allow": True,
                    "message_timeout": f"{s.message_timeout_ms / 1000:.3f}s",
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "response_header_mode": "SEND" if s.observe_responses else "SKIP",
                        "request_body_mode": "BUFFERED",
                        "response_body_mode": "NONE",
                        "request_trailer_mode": "SKIP",
                        "response_trailer_mode": "SKIP",
                    },
                    "allow_mode_override": True,
                    "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
                },
            }
        )
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}})
    return filters


def _health(s: EnvoySettings, check: dict) -> dict:
    """Active health checking and outlier detection: a dead node or kvgate replica leaves the
    rotation within about one interval, not after its connections time out one by one."""
    if s.health_check_interval_ms <= 0:
        return {}
    interval = f"{s.health_check_interval_ms / 1000:.3f}s"
    return {
        "health_checks": [
            {
                "timeout": interval,
                "interval": interval,
                "no_traffic_interval": interval,  # the fallback cluster may see no traffic for long
                "unhealthy_threshold": 2,  # one slow answer from a busy node is not death
                "healthy_threshold": 1,
                **check,
            }
        ],
        **_outlier_detection(s),
    }


def _kvgate_tls(s: EnvoySettings, address: str, *, http2: bool) -> dict:
    """TLS to kvgate's decision port, e.g. through a TLS-terminating sidecar (the chart's
    ``gateway.tls``): the certificate must be signed by the CA and name ``server_name``."""
    if not s.kvgate_tls_ca_file:
        return {}
    name = s.kvgate_tls_server_name or address.rpartition(":")[0].strip("[]")
    context: dict = {
        "validation_context": {
            "trusted_ca": {"filename": s.kvgate_tls_ca_file},
            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": name}}],
        }
    }
    if http2:
        context["alpn_protocols"] = ["h2"]
    return {
        "transport_socket": {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {"@type": _UPSTREAM_TLS, "sni": name, "common_tls_context": context},
        }
    }


def _override_host() -> dict:
    """The node named by the destination header, if the fleet has it; else, and for a retry,
    least-request (Envoy's override-host policy takes each listed host once)."""
    least_request = {"name": "envoy.load_balancing_policies.least_request", "typed_config": {"@type": _LEAST_REQUEST}}
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": _OVERRIDE_HOST,
                        "override_host_sources": [{"header": DESTINATION_HEADER}],
                        "fallback_policy": {"policies": [{"typed_extension_config": least_request}]},
                    },
                }
            }
        ]
    }


def _circuit_breakers(s: EnvoySettings) -> dict:
    limit = s.max_upstream_requests()
    return {
        "circuit_breakers": {
            "thresholds": [
                {"priority": "DEFAULT", "max_connections": limit, "max_pending_requests": limit,
                 "max_requests": limit, "max_retries": max(3, limit // 10)}
            ]
        }
    }  # fmt: skip


def _outlier_detection(s: EnvoySettings) -> dict:
    """Ejects a node answering 5xx or resetting: with retries elsewhere, a node that fails fast
    no longer attracts the traffic its short queue invites. On ``kvgate_destination`` the
    ejections are counted per node (the header's choice still goes to an ejected node: kvgate
    decides; its retries do not)."""
    interval = f"{max(s.health_check_interval_ms, 1000) / 1000:.3f}s"
    return {
        "outlier_detection": {
            "consecutive_5xx": 3,
            "consecutive_gateway_failure": 2,
            "interval": interval,
            "base_ejection_time": "5s",
            "max_ejection_percent": 50,
        }
    }


def _clusters(s: EnvoySettings) -> list[dict]:
    connect = f"{s.connect_timeout_ms / 1000:.3f}s"
    clusters: list[dict] = [
        {
            "name": "fleet",
            "type": _cluster_type(s.fleet),
            "connect_timeout": connect,
            "lb_policy": s.lb_policy,
            "load_assignment": {"cluster_name": "fleet", "endpoints": _endpoints(s.fleet)},
            **_circuit_breakers(s),
            **_health(s, {"http_health_check": {"path": "/health"}}),
        }
    ]
    if s.integration != "none":
        clusters.append(
            {
                "name": "kvgate_destination",
                "type": _cluster_type(s.fleet),
                "connect_timeout": connect,
                "load_assignment": {"cluster_name": "kvgate_destination", "endpoints": _endpoints(s.fleet)},
                "load_balancing_policy": _override_host(),
                **_circuit_breakers(s),
                **_outlier_detection(s),
            }
        )
    if s.integration == "ext_authz":
        clusters.append(
            {
                "name": "kvgate_ext_authz",
                "type": _cluster_type([s.ext_authz_address]),
                "connect_timeout": connect,
                "load_assignment": {
                    "cluster_name": "kvgate_ext_authz",
                    "endpoints": _endpoints([s.ext_authz_address]),
                },
                **_kvgate_tls(s, s.ext_authz_address, http2=False),
            }
        )
    if s.integration == "ext_proc":
        clusters.append(
            {
                "name": "kvgate_ext_proc",
                "type": _cluster_type(s.ext_proc_endpoints()),
                "connect_timeout": connect,
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": _HTTP_OPTIONS,
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                "load_assignment": {
                    "cluster_name": "kvgate_ext_proc",
                    "endpoints": _endpoints(s.ext_proc_endpoints()),
                },
                **_kvgate_tls(s, s.ext_proc_endpoints()[0], http2=True),
                **_health(s, {"tcp_health_check": {}}),
            }
        )
    return clusters


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def _overload_manager(s: EnvoySettings) -> dict:
    """Envoy stays up when clients try to exhaust it: past 85% of the heap limit the streams
    holding the most buffered memory are reset (stalled uploads first), at 95% it returns memory
    to the system, at 98% it stops accepting requests; past ``max_connections`` new connections
    are refused."""
    heap, conns = "envoy.resource_monitors.fixed_heap", "envoy.resource_monitors.global_downstream_max_connections"
    return {
        "refresh_interval": "0.250s",
        "resource_monitors": [
            {"name": heap, "typed_config": {"@type": _FIXED_HEAP, "max_heap_size_bytes": s.max_heap_bytes}},
            {"name": conns, "typed_config": {"@type": _DOWNSTREAM_CONNS, "max_active_downstream_connections": s.max_connections}},
        ],
        "actions": [
            {"name": "envoy.overload_actions.reset_high_memory_stream",
             "triggers": [{"name": heap, "scaled": {"scaling_threshold": 0.85, "saturation_threshold": 0.95}}]},
            {"name": "envoy.overload_actions.shrink_heap", "triggers": [{"name": heap, "threshold": {"value": 0.95}}]},
            {"name": "envoy.overload_actions.stop_accepting_requests",
             "triggers": [{"name": heap, "threshold": {"value": 0.98}}]},
        ],
        # Streams are charged for what they buffer (from 1 MiB on), so the biggest can be reset.
        "buffer_factory_config": {"minimum_account_to_track_power_of_two": 20},
    }  # fmt: skip


def render_bootstrap(s: EnvoySettings) -> dict:
    """The whole Envoy bootstrap as a dict (dump it as YAML or JSON)."""
    if not s.fleet:
        raise ValueError("the fleet is empty: give at least one node address")
    hcm = {
        "@type": _HCM,
        "stat_prefix": "kvgate_ingress",
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {"@type": _EARLY_MUTATION, "mutations": [{"remove": h} for h in KVGATE_HEADERS]},
            }
        ],
        # One spelling per path before routing: kvgate's routes see what the engine will serve.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
        # A client that trickles headers or a body is cut off; a generation is not (the route's
        # timeout bounds it, and a non-streamed answer may be silent for all of it).
        "request_headers_timeout": _seconds(s.request_headers_timeout_s),
        "request_timeout": _seconds(s.request_timeout_s),
        "stream_idle_timeout": _seconds(s.route_timeout_s),
        "common_http_protocol_options": {"idle_timeout": "300s", "max_headers_count": 100},
        "route_config": {"name": "fleet", "virtual_hosts": [{"name": "fleet", "domains": ["*"], "routes": _routes(s)}]},
        "http_filters": _http_filters(s),
    }
    return {
        "admin": {"address": _socket(s.admin_address)},
        "overload_manager": _overload_manager(s),
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": _socket(s.listen_address),
                    "per_connection_buffer_limit_bytes": s.max_body_bytes + (64 << 10),
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": _clusters(s),
        },
    }


def render_yaml(s: EnvoySettings) -> str:
    return yaml.safe_dump(render_bootstrap(s), sort_keys=False)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="kvgate YAML config: fleet, ports and limits come from it")
    parser.add_argument("--fleet", nargs="*", default=None, help="node addresses host:port (overrides the config)")
    parser.add_argument("--listen", default="0.0.0.0:8080", help="Envoy listener host:port")
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy admin host:port")
    parser.add_argument(
        "--integration",
        choices=("ext_proc", "ext_authz", "none"),
        default="ext_proc",
        help="how Envoy asks kvgate: ext_proc (gRPC), ext_authz (HTTP), or none (plain least-request)",
    )
    parser.add_argument("--ext-proc", default=None, help="kvgate ext_proc host:port (default: from the config)")
    parser.add_argument("--ext-authz", default=None, help="kvgate ext_authz host:port (default: from the config)")
    parser.add_argument("--message-timeout-ms", type=int, default=200)
    parser.add_argument(
        "--observe-responses", action="store_true",
        help="ext_proc: send kvgate each answer's headers, so it stops choosing nodes that answer 5xx (~0.2 ms CPU a request)",
    )
    parser.add_argument("--fleet-size", type=int, default=0, help="engines behind --fleet, for circuit breakers (default: its length)")
    parser.add_argument("--max-heap-mib", type=int, default=1024, help="Envoy's heap limit (overload manager), MiB")
    parser.add_argument("--kvgate-tls-ca", default="", help="speak TLS to kvgate, verifying it with this CA file")
    parser.add_argument("--kvgate-tls-server-name", default="", help="name kvgate's certificate carries (default: its host)")
    parser.add_argument("-o", "--output", help="write here instead of stdout")


def settings_from_args(args: argparse.Namespace) -> EnvoySettings:
    from gateway.config import load_config

    cfg = load_config(args.config)
    fleet = args.fleet if args.fleet is not None else [n.address for n in cfg.fleet]
    ext_proc = args.ext_proc or f"{cfg.listen_host}:{cfg.ext_proc_port}"
    ext_authz = args.ext_authz or f"{cfg.listen_host}:{cfg.ext_authz_port or 9004}"
    return EnvoySettings(
        fleet=fleet,
        integration=args.integration,
        ext_proc_address=ext_proc,
        ext_authz_address=ext_authz,
        listen_address=args.listen,
        admin_address=args.admin,
        max_body_bytes=cfg.limits.max_body_bytes,
        message_timeout_ms=args.message_timeout_ms,
        observe_responses=args.observe_responses,
        caller_token=cfg.caller_token(),
        fleet_size=args.fleet_size,
        max_heap_bytes=args.max_heap_mib << 20,
        kvgate_tls_ca_file=args.kvgate_tls_ca,
        kvgate_tls_server_name=args.kvgate_tls_server_name,
    )


def run(args: argparse.Namespace) -> int:
    text = render_yaml(settings_from_args(args))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
