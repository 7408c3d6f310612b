"""Render the Envoy bootstrap that puts kvgate in front of a fleet (``kvgate envoy-config``).

What the rendered config does, and why (FACTS.md, "Envoy + ext_proc"):
- client-supplied kvgate headers are stripped by ``early_header_mutation_extensions`` before any
  filter runs, so a client can never pick its own node or order a pull;
- the ext_proc filter gets request headers (``SEND``: with ``SKIP`` the host is picked before the
  body is seen) and the buffered body, and ``failure_mode_allow`` lets requests continue when
  kvgate is down or slow (``message_timeout``);
- a route matching ``x-gateway-destination-endpoint`` goes to an ``ORIGINAL_DST`` cluster keyed on
  that header; kvgate clears the route cache so the match is re-evaluated after its mutation;
- every other request (kvgate failed open, or a path kvgate does not route) takes the fallback
  route: a least-request cluster of the same fleet;
- kvgate runs only on the inference paths; other paths pass through untouched.

Two integrations carry the same decision (``integration``): ``ext_proc`` (gRPC, exact load
accounting, what the Gateway API Inference Extension speaks) and ``ext_authz`` (HTTP with the
body, about a quarter of the CPU); ``none`` renders plain balancing, the load tests' baseline.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import yaml

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PULL_SOURCE_HEADER = "x-kv-cache-source-host-port"
PULL_BLOCKS_HEADER = "x-kv-cache-pull-blocks"
KVGATE_HEADERS = (DESTINATION_HEADER, PULL_SOURCE_HEADER, PULL_BLOCKS_HEADER)
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_EXT_AUTHZ = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
_EXT_AUTHZ_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_EARLY_MUTATION = "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@dataclass(frozen=True, slots=True)
class EnvoySettings:
    """Everything the bootstrap depends on; one place so the CLI, tests and Helm agree."""

    fleet: Sequence[str]  # "host:port" of every serving node (the fallback cluster)
    integration: Literal["ext_proc", "ext_authz", "none"] = "ext_proc"
    ext_proc_address: str = "127.0.0.1:9002"
    ext_authz_address: str = "127.0.0.1:9004"
    listen_address: str = "0.0.0.0:8080"
    admin_address: str = "127.0.0.1:9901"
    max_body_bytes: int = 8 << 20
    message_timeout_ms: int = 200
    route_timeout_s: float = 600.0
    connect_timeout_ms: int = 1000
    lb_policy: str = "LEAST_REQUEST"  # of the fallback cluster: LEAST_REQUEST or ROUND_ROBIN


def _socket(address: str) -> dict:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _endpoints(addresses: Sequence[str]) -> list[dict]:
    return [{"lb_endpoints": [{"endpoint": {"address": _socket(a)}} for a in addresses]}]


def _route(match: dict, cluster: str, s: EnvoySettings, *, kvgate_disabled: bool = False) -> dict:
    route: dict = {"match": match, "route": {"cluster": cluster, "timeout": f"{s.route_timeout_s}s"}}
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
        for path in INFERENCE_PATHS:
            routes.append(_route({"path": path}, "fleet", s))
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
                    "uri": f"http://{s.ext_authz_address}",
                    "cluster": "kvgate_ext_authz",
                    "timeout": f"{s.message_timeout_ms / 1000:.3f}s",
                },
                "path_prefix": "/kvgate/authz",
                "authorization_request": {"allowed_headers": exact("x-request-id", "content-type")},
                "authorization_response": {
                    "allowed_upstream_headers": exact(*KVGATE_HEADERS),
                    "allowed_client_headers": exact("content-type"),
                },
            },
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
                    "grpc_service": {"envoy_grpc": {"cluster_name": "kvgate_ext_proc"}, "timeout": "5s"},
                    "failure_mode_allow": True,
                    "message_timeout": f"{s.message_timeout_ms / 1000:.3f}s",
                    "processing_mode": {
                        "request_header_mode": "SEND",
                        "response_header_mode": "SKIP",
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


def _clusters(s: EnvoySettings) -> list[dict]:
    connect = f"{s.connect_timeout_ms / 1000:.3f}s"
    clusters: list[dict] = [
        {
            "name": "fleet",
            "type": "STATIC",
            "connect_timeout": connect,
            "lb_policy": s.lb_policy,
            "load_assignment": {"cluster_name": "fleet", "endpoints": _endpoints(s.fleet)},
        }
    ]
    if s.integration != "none":
        clusters.append(
            {
                "name": "kvgate_destination",
                "type": "ORIGINAL_DST",
                "connect_timeout": connect,
                "lb_policy": "CLUSTER_PROVIDED",
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
            }
        )
    if s.integration == "ext_authz":
        clusters.append(
            {
                "name": "kvgate_ext_authz",
                "type": "STATIC",
                "connect_timeout": connect,
                "load_assignment": {
                    "cluster_name": "kvgate_ext_authz",
                    "endpoints": _endpoints([s.ext_authz_address]),
                },
            }
        )
    if s.integration == "ext_proc":
        clusters.append(
            {
                "name": "kvgate_ext_proc",
                "type": "STATIC",
                "connect_timeout": connect,
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": _HTTP_OPTIONS,
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                "load_assignment": {
                    "cluster_name": "kvgate_ext_proc",
                    "endpoints": _endpoints([s.ext_proc_address]),
                },
            }
        )
    return clusters


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
        "route_config": {"name": "fleet", "virtual_hosts": [{"name": "fleet", "domains": ["*"], "routes": _routes(s)}]},
        "http_filters": _http_filters(s),
    }
    return {
        "admin": {"address": _socket(s.admin_address)},
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
    )


def run(args: argparse.Namespace) -> int:
    text = render_yaml(settings_from_args(args))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
