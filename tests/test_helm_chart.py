"""The Helm chart, rendered by the real Helm SDK (helm-python-sdk, no helm binary) for several
values sets, every manifest validated strictly against the Kubernetes 1.30 and 1.37 schemas,
and checked for what a deployment relies on: Envoy calls the port kvgate serves, fails open,
routes like ``kvgate envoy-config``; probes hit the admin API's real routes; no secret sits in
values or ConfigMaps; the gateway's ConfigMap is a config ``kvgate serve`` accepts."""

from __future__ import annotations

import base64
import copy
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="install the helm-test extra (make test does)")
kv = pytest.importorskip("kubernetes_validate", reason="install the helm-test extra (make test does)")

from directory_client.memory import InProcessDirectory  # noqa: E402
from gateway.admin import build_admin_app  # noqa: E402
from gateway.config import load_config  # noqa: E402
from gateway.envoy_config import KVGATE_HEADERS, EnvoySettings, render_bootstrap  # noqa: E402
from gateway.policy import POLICY_NAMES  # noqa: E402

CHART = Path(__file__).resolve().parent.parent / "helm" / "kvgate"
RELEASE, NAMESPACE = "kv", "llm"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
K8S_VERSIONS = ("1.30.0", "1.37.0")
CALLER_TOKEN_PLACEHOLDER = "__KVGATE_CALLER_TOKEN__"  # the Envoy pod's init container writes the token here
NO_SCHEMA = {"ServiceMonitor", "PrometheusRule"}  # CRDs (prometheus-operator): checked by hand below

VALUE_SETS: dict[str, dict[str, Any]] = {
    # chart defaults plus the one value every install must give
    "defaults": {"models": [MODEL], "tokenizer": {"huggingFace": {"model": MODEL}}},
    "external-redis": {
        "models": [MODEL],
        "tokenizer": {"volume": {"persistentVolumeClaim": {"claimName": "llama-tokenizer"}}, "subPath": "llama-3.1"},
        "redis": {"mode": "external", "external": {"url": "rediss://redis.data.svc:6380/2",
                                                   "passwordSecret": {"name": "redis-auth", "key": "pw"}}},  # fmt: skip
    },
    "discovery-pods": {
        "models": [MODEL],
        "tokenizer": {"initContainers": [{"name": "copy", "image": "busybox:1.37", "command": ["cp", "-r", "/models/tok/.", "/var/lib/kvgate/tokenizer/"]}]},
        "fleet": {"discovery": {"source": "pods", "namespace": "engines", "labelSelector": "app=vllm",
                                "port": "http", "eventsPort": "kv-events", "replayPort": None, "transferPort": 7000}},  # fmt: skip
        "envoy": {"fallback": ["vllm.engines.svc.cluster.local:8000"]},
        "serviceMonitor": {"enabled": True, "crdCheck": False, "labels": {"release": "prometheus"}},
        "prometheusRule": {"enabled": True, "crdCheck": False, "labels": {"release": "prometheus"}},
    },
    "minimal": {
        "redis": {"mode": "none"},
        "tokenizer": {"builtinDeepSeek": True},
        "fleet": {"discovery": {"enabled": False}, "static": [{"node_id": "n1", "address": "10.0.0.11:8000", "role": "decode"}]},
        "gateway": {"replicas": 1, "autoscaling": {"enabled": False}, "podDisruptionBudget": {"enabled": False}},
        "envoy": {"enabled": False},
        "networkPolicy": {"enabled": False},
    },
    "static-with-bridges": {
        "models": [MODEL],
        "tokenizer": {"huggingFace": {"model": MODEL, "tokenSecret": {"name": "hf-token"}, "cacheClaim": "hf-cache"}},
        "fleet": {"discovery": {"enabled": False},
                  "static": [{"node_id": "n1", "address": "10.0.0.11:8000"}, {"node_id": "n2", "address": "10.0.0.12:8000"}]},
        "bridge": {"standalone": {"enabled": True, "engines": [
                       {"node_id": "n1", "address": "10.0.0.11:8000", "events": "tcp://10.0.0.11:5557", "replay": "tcp://10.0.0.11:5558"},
                       {"node_id": "n2", "address": "10.0.0.12:8000", "events": "tcp://10.0.0.12:5557"}]}},
        "redis": {"bundled": {"persistence": {"enabled": True, "storageClass": "fast"}}},
        "gateway": {"config": {"directory": {"heartbeat_ttl_s": 6}}},
        "serviceMonitor": {"enabled": True, "crdCheck": False},
    },  # fmt: skip
    "sidecar-bridges": {
        "models": [MODEL],
        "tokenizer": {"builtinDeepSeek": True},
        "fleet": {"discovery": {"enabled": False}},
        "bridge": {"sidecar": {"enabled": True}},
        "envoy": {"fallback": ["vllm.llm.svc.cluster.local:8000"]},
    },
    "ext-authz": {"models": [MODEL], "tokenizer": {"builtinDeepSeek": True},
                  "gateway": {"integration": "ext_authz", "extAuthzPort": 9100}},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    out = chart.render(values=copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def one(docs: list[dict], kind: str, name_suffix: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == f"{RELEASE}-kvgate{name_suffix}"]
    assert len(found) == 1, f"expected one {kind} {name_suffix!r}, found {len(found)}"
    return found[0]


def containers(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(pod spec, container) of every workload."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
            for c in spec["containers"] + spec.get("initContainers", []):
                yield spec, c


def sidecar_snippet(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", "-bridge-sidecar")["data"]["container.yaml"])


def envoy_bootstrap(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"])


def gateway_config_text(docs: list[dict]) -> str:
    return one(docs, "ConfigMap", "-gateway")["data"]["kvgate.yaml"]


# --- every manifest is one Kubernetes accepts -----------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_validates_strictly(chart: Any, name: str, version: str) -> None:
    docs = render(chart, VALUE_SETS[name])
    checked = 0
    for doc in docs:
        if doc["kind"] in NO_SCHEMA:
            continue
        kv.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 3
    if any(d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-bridge-sidecar") for d in docs):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine"}, "spec": {"containers": [sidecar_snippet(docs)]}}
        kv.validate(pod, version, strict=True)


def test_the_validator_is_strict(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["defaults"])
    deployment = copy.deepcopy(one(docs, "Deployment", "-gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo must fail
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, "1.30.0", strict=True)


def test_helm_lint_finds_nothing_above_info(chart: Any) -> None:
    for values in VALUE_SETS.values():
        report = helm.lint(str(CHART), copy.deepcopy(values), strict=True, kube_version="v1.30.0")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_service_monitor_scrapes_the_admin_port(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["discovery-pods"])
    sm = one(docs, "ServiceMonitor", "")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"]["release"] == "prometheus"
    selected = [d for d in docs if d["kind"] == "Service"
                and sm["spec"]["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()]  # fmt: skip
    assert [s["metadata"]["name"] for s in selected] == [f"{RELEASE}-kvgate-gateway"]
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    assert any(e["port"] in port_names and e["path"] == "/metrics" for e in sm["spec"]["endpoints"])


def test_prometheus_rule_alerts_on_metrics_kvgate_exports(chart: Any) -> None:
    """Each alert's expression names only series kvgate's /metrics really has (a renamed metric
    would make an alert silently never fire)."""
    from prometheus_client import generate_latest

    from gateway import metrics
    from gateway.node_doctor import DOCTOR_DEGRADED
    from workers.bridge import DEGRADED

    docs = render(chart, VALUE_SETS["discovery-pods"])
    rule = one(docs, "PrometheusRule", "")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"KvgateEngineDeliversLessThanPredicted", "KvgateAnswersCachedLessThanPredicted",
                           "KvgateNodeRoutedByLoadOnly"}  # fmt: skip
    metrics.CACHE_LOOP.count("helm-check", 10, 5)
    metrics.CACHE_LOOP.engine["helm-check"] = (5.0, 10.0)
    metrics.CACHE_LOOP.observe("helm-check", 5, 5)
    DOCTOR_DEGRADED.labels("helm-check", "block size").set(0)
    DEGRADED.labels("helm-check", "block_size").set(0)
    exported = {line.split("{")[0].split(" ")[0] for line in generate_latest(metrics.REGISTRY).decode().splitlines()
                if line and not line.startswith("#")}  # fmt: skip
    exported |= {"kvgate_bridge_node_degraded"}  # the bridge's registry (prometheus_client's default)
    for name, r in alerts.items():
        named = set(re.findall(r"kvgate_[a-z_]+", r["expr"]))
        assert named and named <= exported, (name, named - exported)
        assert "0.8" in r["expr"] or name == "KvgateNodeRoutedByLoadOnly"
        assert r["for"] == "15m" and "{{ $labels.node }}" in r["annotations"]["summary"]


# --- Envoy calls what the gateway serves, and fails open ------------------------------------------


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("name", ["defaults", "discovery-pods", "ext-authz", "external-redis"])
def test_envoy_calls_the_port_the_gateway_serves(chart: Any, name: str) -> None:
    docs = render(chart, VALUE_SETS[name])
    boot = envoy_bootstrap(docs)
    integration = VALUE_SETS[name].get("gateway", {}).get("integration", "ext_proc")
    cluster = next(c for c in boot["static_resources"]["clusters"] if c["name"] == f"kvgate_{integration}")
    sock = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    service_name, _, domain = sock["address"].partition(".")
    assert domain == f"{NAMESPACE}.svc.cluster.local"
    service = one(docs, "Service", service_name.removeprefix(f"{RELEASE}-kvgate"))
    assert service["spec"]["clusterIP"] == "None"  # every replica resolved: streams spread over them
    svc_port = next(p for p in service["spec"]["ports"] if p["port"] == sock["port_value"])

    gateway = one(docs, "Deployment", "-gateway")
    pod = gateway["spec"]["template"]
    assert _selects(service["spec"]["selector"], pod["metadata"]["labels"])
    container = pod["spec"]["containers"][0]
    served = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert served[svc_port["targetPort"]] == sock["port_value"]

    cfg = yaml.safe_load(gateway_config_text(docs))
    if integration == "ext_proc":
        assert cfg["ext_proc_enabled"] is True and cfg["ext_proc_port"] == sock["port_value"]
    else:
        assert cfg["ext_proc_enabled"] is False and cfg["ext_authz_port"] == sock["port_value"]


def _hcm(boot: dict) -> dict:
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


@pytest.mark.parametrize("name", ["defaults", "ext-authz"])
def test_envoy_strips_client_headers_fails_open_and_falls_back_to_least_request(chart: Any, name: str) -> None:
    values = copy.deepcopy(VALUE_SETS[name])
    values["limits"] = {"maxBodyBytes": 4 << 20, "maxPromptTokens": 65536}
    docs = render(chart, values)
    boot = envoy_bootstrap(docs)
    hcm = _hcm(boot)
    removed = {m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]}
    assert removed == set(KVGATE_HEADERS)
    kvgate_filter = hcm["http_filters"][0]["typed_config"]
    assert kvgate_filter["failure_mode_allow"] is True
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    override = clusters["kvgate_destination"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert override["typed_config"]["override_host_sources"] == [{"header": "x-gateway-destination-endpoint"}]
    assert clusters["kvgate_destination"]["load_assignment"]["endpoints"] == clusters["fleet"]["load_assignment"]["endpoints"]
    assert clusters["fleet"]["lb_policy"] == "LEAST_REQUEST"
    assert clusters["fleet"]["type"] == "STRICT_DNS"  # the engines' headless Service
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[-1]["route"]["cluster"] == "fleet"
    listener = boot["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == (4 << 20) + (64 << 10)
    assert yaml.safe_load(gateway_config_text(docs))["limits"]["max_body_bytes"] == 4 << 20


def _settings_for(values: dict[str, Any], fleet: list[str]) -> EnvoySettings:
    e = values.get("envoy", {})
    g = values.get("gateway", {})
    integration = g.get("integration", "ext_proc")
    port = g.get("extAuthzPort", 9004) if integration == "ext_authz" else g.get("extProcPort", 9002)
    tls = g.get("tls", {}).get("enabled", False)
    host = f"{RELEASE}-kvgate-gateway-headless.{NAMESPACE}.svc.cluster.local"
    kvgate = f"{host}:{g['tls'].get('port', 9443) if tls else port}"
    return EnvoySettings(
        fleet=fleet,
        integration=integration,
        ext_proc_address=kvgate,
        ext_authz_address=kvgate,
        listen_address=f"0.0.0.0:{e.get('listenPort', 8080)}",
        admin_address=f"127.0.0.1:{e.get('adminPort', 9901)}",
        max_body_bytes=values.get("limits", {}).get("maxBodyBytes", 8 << 20),
        message_timeout_ms=e.get("messageTimeoutMs", 200),
        route_timeout_s=float(e.get("routeTimeoutSeconds", 600)),
        connect_timeout_ms=e.get("connectTimeoutMs", 1000),
        lb_policy=e.get("lbPolicy", "LEAST_REQUEST"),
        retries=e.get("retries", 2),
        health_check_interval_ms=e.get("healthCheckIntervalMs", 1000),
        request_headers_timeout_s=float(e.get("requestHeadersTimeoutSeconds", 10)),
        request_timeout_s=float(e.get("requestTimeoutSeconds", 60)),
        max_connections=e.get("maxConnections", 4096),
        max_heap_bytes=e.get("maxHeapBytes", 768 << 20),
        max_requests_per_node=e.get("circuitBreakers", {}).get("maxRequestsPerEngine", 256),
        fleet_size=e.get("circuitBreakers", {}).get("engines", 0) or len(values.get("fleet", {}).get("static", [])) or 32,
        kvgate_tls_ca_file="/var/run/kvgate-tls/ca.crt" if tls else "",
        kvgate_tls_server_name=host if tls else "",
        caller_token=CALLER_TOKEN_PLACEHOLDER if g.get("callerToken", {}).get("enabled", True) else "",
        observe_responses=g.get("observeResponses", False),
    )


PARITY = [
    (VALUE_SETS["defaults"], ["vllm.llm.svc.cluster.local:8000"]),
    (VALUE_SETS["ext-authz"], ["vllm.llm.svc.cluster.local:8000"]),
    (
        {**VALUE_SETS["static-with-bridges"], "limits": {"maxBodyBytes": 1 << 20, "maxPromptTokens": 4096},
         "envoy": {"listenPort": 10000, "adminPort": 9911, "messageTimeoutMs": 150, "routeTimeoutSeconds": 120,
                   "connectTimeoutMs": 250, "lbPolicy": "ROUND_ROBIN", "retries": 0, "healthCheckIntervalMs": 0}},
        ["10.0.0.11:8000", "10.0.0.12:8000"],
    ),
    (
        {"models": [MODEL], "tokenizer": {"builtinDeepSeek": True}, "gateway": {"extProcPort": 7002},
         "envoy": {"fallback": ["[fd00::11]:8000", "[fd00::12]:8000"], "retries": 3, "healthCheckIntervalMs": 2500}},
        ["[fd00::11]:8000", "[fd00::12]:8000"],
    ),
    ({**VALUE_SETS["defaults"], "gateway": {"tls": {"enabled": True, "secretName": "kvgate-tls"}}}, ["vllm.llm.svc.cluster.local:8000"]),
    ({**VALUE_SETS["ext-authz"], "gateway": {"integration": "ext_authz", "tls": {"enabled": True, "secretName": "t", "port": 9444}}},
     ["vllm.llm.svc.cluster.local:8000"]),
    ({**VALUE_SETS["defaults"], "gateway": {"callerToken": {"enabled": False}, "observeResponses": True}},
     ["vllm.llm.svc.cluster.local:8000"]),
]  # fmt: skip


@pytest.mark.parametrize("values,fleet", PARITY)
def test_chart_envoy_config_is_what_kvgate_envoy_config_renders(chart: Any, values: dict, fleet: list[str]) -> None:
    assert envoy_bootstrap(render(chart, values)) == render_bootstrap(_settings_for(values, fleet))


def test_envoy_accepts_the_chart_bootstrap(chart: Any, envoy_bin: str, tmp_path: Path) -> None:
    for name in ("defaults", "ext-authz"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(one(render(chart, VALUE_SETS[name]), "ConfigMap", "-envoy")["data"]["envoy.yaml"])
        out = subprocess.run([envoy_bin, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "Deprecated field" not in out.stdout + out.stderr  # ext_authz's allowed_headers moved


# --- the gateway pod ------------------------------------------------------------------------------


def _resolve_env(container: dict, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secretKeyRefs read, $(VAR) expanded."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            ref = item["valueFrom"].get("secretKeyRef")
            if ref is None:
                continue  # downward API: not needed here
            env[item["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
    return env


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_gateway_config_is_one_kvgate_serve_accepts(
    chart: Any, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(chart, VALUE_SETS[name])
    path = tmp_path / "kvgate.yaml"
    path.write_text(gateway_config_text(docs))
    container = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    secrets = {("kv-kvgate-redis", "password"): "s3cret", ("redis-auth", "pw"): "s3cret"}
    for key, value in _resolve_env(container, secrets).items():
        monkeypatch.setenv(key, value)
    cfg = load_config(path)
    assert cfg.listen_host == "0.0.0.0"
    mode = VALUE_SETS[name].get("redis", {}).get("mode", "bundled")
    expected_url = {
        "bundled": f"redis://:s3cret@{RELEASE}-kvgate-redis.{NAMESPACE}.svc.cluster.local:6379/0",
        "external": "rediss://:s3cret@redis.data.svc:6380/2",
        "none": "memory://",
    }[mode]
    assert cfg.directory.url == expected_url
    k8s = cfg.discovery.kubernetes
    discovery = VALUE_SETS[name].get("fleet", {}).get("discovery", {})
    assert k8s.enabled == discovery.get("enabled", True)
    if k8s.enabled:
        assert k8s.namespace == discovery.get("namespace", NAMESPACE)
        assert k8s.events_port == discovery.get("eventsPort", 5557)
        assert k8s.model == MODEL


def test_gateway_config_values_are_merged_over_the_charts(chart: Any, tmp_path: Path) -> None:
    values = {**VALUE_SETS["minimal"], "gateway": {**VALUE_SETS["minimal"]["gateway"],
              "config": {"policy": {"allow_pull": False}, "tokenizer": {"cache_bytes": "64MiB"}}}}  # fmt: skip
    path = tmp_path / "kvgate.yaml"
    path.write_text(gateway_config_text(render(chart, values)))
    cfg = load_config(path)
    assert cfg.policy.allow_pull is False and cfg.policy.name == "kvgate"  # merged, not replaced
    assert cfg.tokenizer.cache_bytes == 64 << 20


async def test_probes_hit_the_admin_api_routes(chart: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    docs = render(chart, VALUE_SETS["defaults"])
    container = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    admin_port = yaml.safe_load(gateway_config_text(docs))["admin_port"]
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p["path"] for p in probes.values()} == {"/healthz", "/readyz"}
    assert probes["readinessProbe"]["path"] == "/readyz" and probes["livenessProbe"]["path"] == "/healthz"
    assert all(ports[p["port"]] == admin_port for p in probes.values())
    async with TestClient(TestServer(build_admin_app(InProcessDirectory()))) as client:
        for probe in probes.values():
            resp = await client.get(probe["path"])
            assert resp.status == 200, probe


# --- secrets, hardening, network policy -----------------------------------------------------------


SECURED = {"redis": {"acl": {"enabled": True}}, "transfer": {"secret": {"enabled": True}}}


@pytest.mark.parametrize("secured", [False, True])
def test_no_secret_in_values_configmaps_or_pod_specs(chart: Any, secured: bool) -> None:
    for name in ("defaults", "external-redis", "static-with-bridges"):
        values = VALUE_SETS[name]
        if secured:
            values = {**values, "redis": {**values.get("redis", {}), **SECURED["redis"]}, "transfer": SECURED["transfer"]}
        docs = render(chart, values)
        secret_docs = [d for d in docs if d["kind"] == "Secret"]
        for _, c in containers(docs):
            for item in c.get("env", []):
                if item["name"] in ("REDIS_PASSWORD", "KVGATE_DIRECTORY__PASSWORD") or item["name"].startswith("PASSWORD_"):
                    assert "secretKeyRef" in item["valueFrom"]
                if item["name"] == "KVGATE_DIRECTORY__URL" and "@" in item["value"]:
                    assert ":$(REDIS_PASSWORD)@" in item["value"]
        for cm in (d for d in docs if d["kind"] == "ConfigMap"):
            text = yaml.safe_dump(cm)
            assert not re.search(r"://[^/\s]*:[^$/\s][^/\s]*@", text), cm["metadata"]["name"]
            for s in secret_docs:
                for value in s["data"].values():
                    assert value not in text and base64.b64decode(value).decode() not in text
        for s in secret_docs:
            assert s["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            assert all(len(v) >= 40 for v in s["data"].values())  # base64 of 32+ generated characters
        generated = {s["metadata"]["name"]: sorted(s["data"]) for s in secret_docs}
        expected = {f"{RELEASE}-kvgate-caller-token": ["token"]}
        if name != "external-redis":  # the user's Redis Secret is referenced, never created from values
            roles = ["bridge-password", "gateway-events-password", "gateway-password"] if secured else []
            expected[f"{RELEASE}-kvgate-redis"] = sorted(["password", *roles])
        if secured:
            expected[f"{RELEASE}-kvgate-transfer"] = ["secret"]
        assert generated == expected


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_containers_run_non_root_read_only_without_capabilities(chart: Any, name: str) -> None:
    docs = render(chart, VALUE_SETS[name])
    found = list(containers(docs))
    if name == "sidecar-bridges":
        found.append(({}, sidecar_snippet(docs)))
    assert found
    for pod, c in found:
        sc = c["securityContext"]
        assert pod.get("securityContext", {}).get("runAsNonRoot") or sc.get("runAsNonRoot") or not pod, c["name"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
    for pod, c in found:
        if pod:
            assert pod["securityContext"]["runAsUser"] != 0


def _pod_labels(docs: list[dict], suffix: str, kind: str = "Deployment") -> dict[str, str]:
    return one(docs, kind, suffix)["spec"]["template"]["metadata"]["labels"]


def _admits(rule: dict, labels: dict[str, str]) -> bool:
    return any("podSelector" in peer and "namespaceSelector" not in peer
               and _selects(peer["podSelector"]["matchLabels"], labels) for peer in rule.get("from", []))  # fmt: skip


def test_only_envoy_reaches_kvgate_and_only_kvgate_reaches_redis(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["static-with-bridges"])
    envoy, gateway, bridge = (_pod_labels(docs, s) for s in ("-envoy", "-gateway", "-bridge"))
    redis = _pod_labels(docs, "-redis-persistent", "StatefulSet")  # persistence on: its own name

    gw_policy = one(docs, "NetworkPolicy", "-gateway")
    assert _selects(gw_policy["spec"]["podSelector"]["matchLabels"], gateway)
    (ext_proc_rule,) = [r for r in gw_policy["spec"]["ingress"] if r["ports"][0]["port"] == 9002]
    assert _admits(ext_proc_rule, envoy)
    assert not any(_admits(ext_proc_rule, labels) for labels in (gateway, bridge, redis, {"app": "vllm"}))

    redis_policy = one(docs, "NetworkPolicy", "-redis")
    assert _selects(redis_policy["spec"]["podSelector"]["matchLabels"], redis)
    (rule,) = redis_policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    assert _admits(rule, gateway) and _admits(rule, bridge)
    assert not _admits(rule, envoy) and not _admits(rule, {"app": "vllm"})
    sidecar_docs = render(chart, VALUE_SETS["sidecar-bridges"])
    labels_for_engines = yaml.safe_load(one(sidecar_docs, "ConfigMap", "-bridge-sidecar")["data"]["pod-labels.yaml"])
    (rule,) = one(sidecar_docs, "NetworkPolicy", "-redis")["spec"]["ingress"]
    assert _admits(rule, {"app": "vllm", **labels_for_engines})  # engines carrying the sidecar


def test_gateway_scales_horizontally_and_keeps_replicas_through_disruptions(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["defaults"])
    deployment = one(docs, "Deployment", "-gateway")
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    hpa = one(docs, "HorizontalPodAutoscaler", "-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}
    assert hpa["spec"]["minReplicas"] >= 2
    for suffix in ("-gateway", "-envoy"):
        pdb = one(docs, "PodDisruptionBudget", suffix)
        assert _selects(pdb["spec"]["selector"]["matchLabels"], _pod_labels(docs, suffix))
    minimal = render(chart, VALUE_SETS["minimal"])
    assert one(minimal, "Deployment", "-gateway")["spec"]["replicas"] == 1
    assert not [d for d in minimal if d["kind"] in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "StatefulSet")]


def test_discovery_gets_read_only_access_to_the_engines_namespace(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["discovery-pods"])
    role = one(docs, "Role", "-discovery")
    assert role["metadata"]["namespace"] == "engines"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "RoleBinding", "-discovery")
    pod = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}]
    assert pod["automountServiceAccountToken"] is True
    default_role = one(render(chart, VALUE_SETS["defaults"]), "Role", "-discovery")
    assert default_role["rules"][0]["resources"] == ["endpointslices"]
    minimal = render(chart, VALUE_SETS["minimal"])
    assert not [d for d in minimal if d["kind"] in ("Role", "RoleBinding")]
    assert one(minimal, "Deployment", "-gateway")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_bridges_write_where_the_gateway_reads(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["static-with-bridges"])
    cfg = yaml.safe_load(gateway_config_text(docs))
    sidecar_values = copy.deepcopy(VALUE_SETS["sidecar-bridges"])
    sidecar_values["gateway"] = {"config": {"directory": {"heartbeat_ttl_s": 6}}}
    sidecar = sidecar_snippet(render(chart, sidecar_values))
    standalone = one(docs, "Deployment", "-bridge")["spec"]["template"]["spec"]["containers"][0]
    for c in (sidecar, standalone):
        args = c["args"]
        opt = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
        # the URL carries the password: the bridge reads it from its environment, not argv
        assert args[0] == "bridge" and "--directory" not in opt and not any("REDIS_PASSWORD" in a for a in args)
        assert opt["--model"] == cfg["models"][0] and opt["--block-size"] == str(cfg["block_size"])
        assert opt["--key-prefix"] == cfg["directory"]["key_prefix"]
        assert opt["--heartbeat-ttl"] == "6"
        env = {e["name"]: e for e in c["env"]}
        assert env["KVGATE_DIRECTORY__URL"]["value"].endswith(f"{RELEASE}-kvgate-redis.{NAMESPACE}.svc.cluster.local:6379/0")
    engines = [sidecar["args"][i + 1] for i, a in enumerate(sidecar["args"]) if a == "--engine"]
    assert engines == ["node_id=$(POD_NAME),address=$(POD_IP):8000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"]
    engines = [standalone["args"][i + 1] for i, a in enumerate(standalone["args"]) if a == "--engine"]
    assert engines == [
        "node_id=n1,address=10.0.0.11:8000,events=tcp://10.0.0.11:5557,replay=tcp://10.0.0.11:5558",
        "node_id=n2,address=10.0.0.12:8000,events=tcp://10.0.0.12:5557",
    ]
    from workers.bridge import parse_engine_spec

    assert [parse_engine_spec(e).node_id for e in engines] == ["n1", "n2"]


# --- bad values fail the install with a clear message ---------------------------------------------


BAD_VALUES = [
    ({"gateway": {"replicas": "two"}}, ["/gateway/replicas", "want integer"]),
    ({"gatewy": {"replicas": 2}}, ["additional properties 'gatewy' not allowed"]),
    ({"redis": {"mode": "external", "external": {"url": "redis://:hunter2@redis:6379/0"}}}, ["/redis/external/url", "does not match pattern"]),
    ({"redis": {"mode": "sentinel"}}, ["/redis/mode", "must be one of 'bundled', 'external', 'none'"]),
    ({"gateway": {"policy": {"name": "fastest"}}}, ["/gateway/policy/name"]),
    ({"gateway": {"integration": "grpc"}}, ["/gateway/integration"]),
    ({"blockSize": 0}, ["/blockSize", "minimum"]),
    ({"fleet": {"discovery": {"port": "HTTP_PORT"}}}, ["/fleet/discovery/port"]),
    ({"fleet": {"static": [{"node_id": "n1", "address": "vllm-0:8000"}]}}, ["/fleet/static/0/address"]),
    ({"fleet": {"static": [{"node_id": "n1", "address": "10.0.0.11:8000", "role": "encode"}]}}, ["/fleet/static/0/role"]),
    ({"envoy": {"messageTimeoutMs": 0}}, ["/envoy/messageTimeoutMs"]),
]  # fmt: skip


@pytest.mark.parametrize("bad,expected", BAD_VALUES)
def test_schema_rejects_bad_values_naming_the_field(chart: Any, bad: dict, expected: list[str]) -> None:
    values = {"models": [MODEL], **bad}
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    for part in expected:
        assert part in str(err.value)


BAD_COMBINATIONS = [
    ({}, "KV events are keyed by model name: set models"),
    ({"models": [MODEL], "redis": {"mode": "none"}}, "redis.mode=none keeps the directory in one gateway's memory"),
    ({"models": [MODEL], "redis": {"mode": "external"}}, "redis.mode=external needs redis.external.url"),
    ({"models": [MODEL], "bridge": {"sidecar": {"enabled": True}}}, "with fleet.discovery the gateway registers"),
    ({"models": [MODEL], "fleet": {"discovery": {"enabled": False}}}, "no fleet: list nodes in fleet.static"),
    ({"models": [MODEL], "fleet": {"discovery": {"source": "pods"}}}, "needs fleet.discovery.labelSelector"),
    ({"models": [MODEL], "fleet": {"discovery": {"port": "http"}}}, "envoy needs a fallback cluster"),
    ({"models": [MODEL], "fleet": {"discovery": {"enabled": False}, "static": [{"node_id": "a", "address": "10.0.0.1:80"}]},
      "bridge": {"standalone": {"enabled": True}}}, "bridge.standalone.enabled needs bridge.standalone.engines"),
]  # fmt: skip


@pytest.mark.parametrize("values,message", BAD_COMBINATIONS)
def test_contradicting_values_fail_with_what_to_change(chart: Any, values: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(values=copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)


def test_schema_knows_every_policy_kvgate_has(chart: Any) -> None:
    schema = chart.schema
    assert schema is not None
    names = schema["properties"]["gateway"]["properties"]["policy"]["properties"]["name"]["enum"]
    assert sorted(names) == sorted(POLICY_NAMES)


# --- secrets the chart wires: caller token, transfer secret, per-role Redis users ----------------


def _volume(spec: dict, name: str) -> dict:
    (volume,) = [v for v in spec["volumes"] if v["name"] == name]
    return volume


@pytest.mark.parametrize("name", ["defaults", "ext-authz"])
def test_envoy_and_kvgate_share_the_caller_token_secret(chart: Any, name: str) -> None:
    """Before: the chart rendered no token, so kvgate answered any pod that reached its port
    (where a tenant's prompt is cached). Now Envoy's init container and kvgate mount the same
    Secret; kvgate's config names the mounted file; a named Secret replaces the generated one."""
    docs = render(chart, VALUE_SETS[name])
    gateway = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    envoy = one(docs, "Deployment", "-envoy")["spec"]["template"]["spec"]
    secret = f"{RELEASE}-kvgate-caller-token"
    assert _volume(gateway, "caller-token")["secret"]["secretName"] == secret
    assert _volume(envoy, "caller-token")["secret"]["secretName"] == secret
    mount = next(m for m in gateway["containers"][0]["volumeMounts"] if m["name"] == "caller-token")
    assert yaml.safe_load(gateway_config_text(docs))["caller_token_file"] == mount["mountPath"] + "/token"
    assert envoy["containers"][0]["args"][1] == "/var/run/envoy/envoy.yaml"  # what the init container wrote
    assert any(d["kind"] == "Secret" and d["metadata"]["name"] == secret for d in docs)
    named = render(chart, {**VALUE_SETS[name], "gateway": {**VALUE_SETS[name].get("gateway", {}),
                                                          "callerToken": {"existingSecret": "mine"}}})  # fmt: skip
    assert _volume(one(named, "Deployment", "-envoy")["spec"]["template"]["spec"], "caller-token")["secret"]["secretName"] == "mine"
    assert not any(d["kind"] == "Secret" and "caller-token" in d["metadata"]["name"] for d in named)
    off = render(chart, {**VALUE_SETS[name], "gateway": {**VALUE_SETS[name].get("gateway", {}), "callerToken": {"enabled": False}}})
    assert "caller_token_file" not in yaml.safe_load(gateway_config_text(off))
    assert "initContainers" not in one(off, "Deployment", "-envoy")["spec"]["template"]["spec"]


def test_observe_responses_makes_envoy_send_kvgate_the_answers_status(chart: Any) -> None:
    docs = render(chart, {**VALUE_SETS["defaults"], "gateway": {"observeResponses": True}})
    listener = envoy_bootstrap(docs)["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["processing_mode"]["response_header_mode"] == "SEND"
    values = {**VALUE_SETS["defaults"], "gateway": {"observeResponses": True}}
    assert envoy_bootstrap(docs) == render_bootstrap(_settings_for(values, ["vllm.llm.svc.cluster.local:8000"]))


def test_engines_get_the_transfer_secret_as_the_worker_reads_it(chart: Any, tmp_path: Path) -> None:
    """The snippet engine pods add: the Secret's volume, its mount, and the argument naming the
    mounted file, which the engine's own parser accepts (and without which --transfer-port is refused)."""
    import argparse

    from workers.engine.cli import configure

    docs = render(chart, {**VALUE_SETS["defaults"], "transfer": {"secret": {"enabled": True}}})
    snippet = one(docs, "ConfigMap", "-engines-transfer")["data"]
    (volume,) = yaml.safe_load(snippet["volumes.yaml"])
    (mount,) = yaml.safe_load(snippet["volume-mounts.yaml"])
    args = yaml.safe_load(snippet["args.yaml"])
    assert volume["secret"]["secretName"] == f"{RELEASE}-kvgate-transfer" and mount["name"] == volume["name"]
    assert args[1] == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    parser = argparse.ArgumentParser()
    configure(parser)
    parsed = parser.parse_args(["--port", "8000", "--model", MODEL, "--transfer-port", "7000", *args])
    assert parsed.transfer_secret_file == args[1]
    assert not [d for d in render(chart, VALUE_SETS["defaults"]) if d["metadata"]["name"].endswith("-engines-transfer")]


def _run_chart_redis(docs: list[dict], tmp_path: Path, secrets: dict) -> tuple[subprocess.Popen, int]:
    """The bundled Redis container's command, run here: ConfigMap and port patched, Secrets resolved."""
    from tests.conftest import free_port
    from tests.support.procs import wait_for_port

    (c,) = one(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"]
    acl = tmp_path / "acl.conf"
    if any(d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-redis-acl") for d in docs):
        acl.write_text(one(docs, "ConfigMap", "-redis-acl")["data"]["acl.conf"])
    port = free_port()
    command = [a.replace("/etc/kvgate-redis/acl.conf", str(acl)) for a in c["command"]]
    args = [str(tmp_path) if a == "/data" else a for a in c["args"]] + ["--port", str(port), "--bind", "127.0.0.1"]
    env = {**_resolve_env(c, secrets), "PATH": os.environ["PATH"]}
    proc = subprocess.Popen([*command, *args], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc=proc)
    return proc, port


@pytest.mark.parametrize("acl", [False, True])
def test_the_bundled_redis_is_the_containers_first_process_and_stops_on_sigterm(chart: Any, tmp_path: Path, acl: bool) -> None:
    """A pod's stop sends SIGTERM to the container's first process: that must be redis-server itself
    (it shuts down and saves), not a shell that ignores it until the kill 30 s later and leaves
    redis-server behind. The password still never appears on its command line."""
    import redis

    docs = render(chart, {**VALUE_SETS["static-with-bridges"], "redis": {"acl": {"enabled": acl}}})
    secrets = {(f"{RELEASE}-kvgate-redis", k): f"{k}-s3cret-value" for k in
               ("password", "gateway-password", "gateway-events-password", "bridge-password")}  # fmt: skip
    proc, port = _run_chart_redis(docs, tmp_path, secrets)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert cmdline.startswith("redis-server") and "s3cret" not in cmdline, cmdline
        with redis.Redis(port=port, password="password-s3cret-value") as r:
            assert r.ping()
        proc.terminate()
        assert proc.wait(timeout=10) == 0  # a clean shutdown, not a kill
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_bundled_redis_gives_each_role_its_own_user(chart: Any, tmp_path: Path) -> None:
    """redis.acl: the chart's Redis loads files/redis-acl.conf with generated passwords, the bridges
    connect as kvgate-bridge, a gateway that follows no events as kvgate-gateway: the gateway cannot
    write block entries, the bridge cannot reserve (both get DirectoryUnavailable, NOPERM beneath)."""
    from directory_client import open_directory
    from directory_client.types import DirectoryUnavailable, NodeInfo

    values = {**VALUE_SETS["static-with-bridges"], "redis": {"acl": {"enabled": True}}}
    docs = render(chart, values)
    secrets = {(f"{RELEASE}-kvgate-redis", k): f"{k}-s3cret-value" for k in
               ("password", "gateway-password", "gateway-events-password", "bridge-password")}  # fmt: skip
    proc, port = _run_chart_redis(docs, tmp_path, secrets)
    directories = []

    def connect(container: dict):
        env = _resolve_env(container, secrets)
        url = env["KVGATE_DIRECTORY__URL"].replace(f"{RELEASE}-kvgate-redis.{NAMESPACE}.svc.cluster.local:6379", f"127.0.0.1:{port}")
        d = open_directory(url, username=env["KVGATE_DIRECTORY__USERNAME"], password=env["KVGATE_DIRECTORY__PASSWORD"],
                           key_prefix="kvgate", op_timeout_s=2)  # fmt: skip
        directories.append(d)
        return env["KVGATE_DIRECTORY__USERNAME"], d

    try:
        gw_container = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
        bridge_container = one(docs, "Deployment", "-bridge")["spec"]["template"]["spec"]["containers"][0]
        gw_user, gateway = connect(gw_container)
        bridge_user, bridge = connect(bridge_container)
        assert (gw_user, bridge_user) == ("kvgate-gateway", "kvgate-bridge")
        await bridge.register_node(NodeInfo("n1", "10.0.0.11:8000"))
        await bridge.record_stored("n1", [11, 12, 13, 14])
        reservation = await gateway.reserve("n1", 10)
        await gateway.release(reservation)
        with pytest.raises(DirectoryUnavailable):
            await connect(gw_container)[1].record_stored("n1", [21, 22, 23, 24])
        with pytest.raises(DirectoryUnavailable):
            await connect(bridge_container)[1].reserve("n1", 10)
        with pytest.raises(DirectoryUnavailable):  # the default user's password is not a role's
            await open_directory(f"redis://127.0.0.1:{port}/0", username="kvgate-gateway", password="password-s3cret-value").lookup([1])
    finally:
        for d in directories:
            await d.aclose()
        proc.kill()
        proc.wait(timeout=10)
def test_the_drain_prestop_hook_calls_the_admin_api_and_never_holds_the_pod(chart: Any) -> None:
    docs = render(chart, {**VALUE_SETS["defaults"], "drain": {"deadlineSeconds": 12}})
    hook = yaml.safe_load(one(docs, "ConfigMap", "-drain-prestop")["data"]["lifecycle.yaml"])
    command = hook["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    script = command[2]
    assert f"http://{RELEASE}-kvgate-gateway.{NAMESPACE}.svc.cluster.local:9003" in script
    assert "deadline = 12" in script and "/var/run/kvgate-admin/token" in script
    # what the pod sees when the drain cannot run (no token file here): a message, exit status 0
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={"HOSTNAME": "vllm-0", "PATH": os.environ.get("PATH", "")})  # fmt: skip
    assert done.returncode == 0 and "kvgate drain failed" in done.stderr
