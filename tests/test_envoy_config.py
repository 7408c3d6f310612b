"""The rendered Envoy bootstrap is one Envoy accepts, and it says what the request path relies on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.envoy_config import DESTINATION_HEADER, KVGATE_HEADERS, EnvoySettings, render_bootstrap, render_yaml

REPO = Path(__file__).resolve().parent.parent
FLEET = ["10.0.0.11:8000", "10.0.0.12:8000", "10.0.0.13:8000"]


@pytest.mark.parametrize("integration", ["ext_proc", "ext_authz", "none"])
def test_envoy_accepts_the_rendered_bootstrap(tmp_path: Path, envoy_bin: str, integration: str) -> None:
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(render_yaml(EnvoySettings(fleet=FLEET, integration=integration)))
    out = subprocess.run([envoy_bin, "--mode", "validate", "-c", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Deprecated field" not in out.stdout + out.stderr  # ext_authz's allowed_headers moved


@pytest.mark.parametrize("integration", ["ext_proc", "ext_authz", "none"])
def test_every_bootstrap_normalises_paths_and_limits_clients(integration: str) -> None:
    """The settings tests/test_envoy_hardening.py attacks, present whatever the integration."""
    s = EnvoySettings(fleet=FLEET, integration=integration, route_timeout_s=900, max_heap_bytes=512 << 20)
    boot = render_bootstrap(s)
    hcm = _hcm(boot)
    assert hcm["normalize_path"] is True and hcm["merge_slashes"] is True
    assert hcm["path_with_escaped_slashes_action"] == "UNESCAPE_AND_REDIRECT"
    assert hcm["request_headers_timeout"] == "10.000s" and hcm["request_timeout"] == "60.000s"
    assert hcm["stream_idle_timeout"] == "900.000s"  # a silent non-streamed generation is not cut
    overload = boot["overload_manager"]
    heap = next(m for m in overload["resource_monitors"] if m["name"].endswith("fixed_heap"))
    assert heap["typed_config"]["max_heap_size_bytes"] == 512 << 20
    conns = next(m for m in overload["resource_monitors"] if m["name"].endswith("global_downstream_max_connections"))
    assert conns["typed_config"]["max_active_downstream_connections"] == 4096
    actions = {a["name"] for a in overload["actions"]}
    assert "envoy.overload_actions.reset_high_memory_stream" in actions
    assert "envoy.overload_actions.stop_accepting_requests" in actions
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[-2]["direct_response"]["status"] == 404  # lookalike inference paths, before the catch-all


def test_circuit_breakers_are_sized_from_the_fleet() -> None:
    """Envoy's default (1,024 requests a cluster) overflows with ~8 busy engines: 256 a node."""
    small = render_bootstrap(EnvoySettings(fleet=FLEET))
    big = render_bootstrap(EnvoySettings(fleet=["vllm.llm.svc.cluster.local:8000"], fleet_size=40))
    for boot, limit in ((small, 1024), (big, 40 * 256)):
        for c in boot["static_resources"]["clusters"]:
            if c["name"] in ("fleet", "kvgate_destination"):
                (t,) = c["circuit_breakers"]["thresholds"]
                assert t["max_requests"] == t["max_pending_requests"] == t["max_connections"] == limit


def test_destination_cluster_detects_outliers() -> None:
    """Per-node 5xx/reset counts for the cluster kvgate chooses hosts in (ext_authz sees no answer)."""
    clusters = {c["name"]: c for c in render_bootstrap(EnvoySettings(fleet=FLEET))["static_resources"]["clusters"]}
    od = clusters["kvgate_destination"]["outlier_detection"]
    assert od["consecutive_5xx"] == 3 and od["consecutive_gateway_failure"] == 2


def test_shipped_example_equals_the_renderer() -> None:
    shipped = yaml.safe_load((REPO / "envoy" / "envoy.yaml").read_text())
    assert shipped == render_bootstrap(EnvoySettings(fleet=FLEET, ext_proc_address="127.0.0.1:9002"))


def _hcm(boot: dict) -> dict:
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_bootstrap_strips_client_headers_and_fails_open() -> None:
    boot = render_bootstrap(EnvoySettings(fleet=FLEET, max_body_bytes=1 << 20, message_timeout_ms=150))
    hcm = _hcm(boot)
    removed = {m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}
    assert removed == set(KVGATE_HEADERS)
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["message_timeout"] == "0.150s"
    assert ext_proc["processing_mode"]["request_header_mode"] == "SEND"
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    override = clusters["kvgate_destination"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert override["typed_config"]["override_host_sources"] == [{"header": DESTINATION_HEADER}]
    # only the fleet's nodes can be destinations: the same endpoints as the fallback
    assert clusters["kvgate_destination"]["load_assignment"]["endpoints"] == clusters["fleet"]["load_assignment"]["endpoints"]
    assert clusters["fleet"]["lb_policy"] == "LEAST_REQUEST"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[-1]["route"]["cluster"] == "fleet"  # the fallback catches everything else
    assert boot["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] > 1 << 20


def test_bad_fleet_address_is_rejected() -> None:
    with pytest.raises(ValueError, match="host:port"):
        render_bootstrap(EnvoySettings(fleet=["no-port-here"]))
    with pytest.raises(ValueError, match="empty"):
        render_bootstrap(EnvoySettings(fleet=[]))


def test_ext_authz_bootstrap_carries_the_body_and_only_kvgate_headers() -> None:
    boot = render_bootstrap(EnvoySettings(fleet=FLEET, integration="ext_authz", max_body_bytes=1 << 20))
    authz = _hcm(boot)["http_filters"][0]["typed_config"]
    assert authz["failure_mode_allow"] is True and authz["clear_route_cache"] is True
    assert authz["with_request_body"] == {"max_request_bytes": 1 << 20, "allow_partial_message": False}
    allowed = {p["exact"] for p in authz["http_service"]["authorization_response"]["allowed_upstream_headers"]["patterns"]}
    assert allowed == set(KVGATE_HEADERS)
    names = [f["name"] for f in _hcm(boot)["http_filters"]]
    assert "envoy.filters.http.ext_proc" not in names


def test_plain_bootstrap_has_no_kvgate() -> None:
    boot = render_bootstrap(EnvoySettings(fleet=FLEET, integration="none", lb_policy="ROUND_ROBIN"))
    routes = _hcm(boot)["route_config"]["virtual_hosts"][0]["routes"]
    exact = [r["match"]["path"] for r in routes if "path" in r["match"]]
    assert exact == ["/v1/chat/completions", "/v1/completions"]  # not caught by the look-alike 404
    assert all(r["route"]["cluster"] == "fleet" for r in routes if "path" in r["match"])
    assert [f["name"] for f in _hcm(boot)["http_filters"]] == ["envoy.filters.http.router"]
    assert {c["name"] for c in boot["static_resources"]["clusters"]} == {"fleet"}
