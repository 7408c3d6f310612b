"""What broke a real `helm install` (issue: a helm install that works on a real cluster), each
rendered with the values that failed: the tokenizer of the served model, a gateway crash-looping
on documented values, sidecar bridges, rollouts cutting generations, network policies admitting
everyone, the Redis password on command lines, contradictions that rendered cleanly."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_helm_chart import (  # noqa: F401 (chart is a fixture)
    MODEL,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    _admits,
    _pod_labels,
    chart,
    envoy_bootstrap,
    gateway_config_text,
    helm,
    kv,
    one,
    render,
)

from gateway.config import load_config

BASE = VALUE_SETS["defaults"]


def _with(**changes: Any) -> dict[str, Any]:
    values = copy.deepcopy(BASE)
    for key, value in changes.items():
        values[key] = value
    return values


def _pod(docs: list[dict], suffix: str, kind: str = "Deployment") -> dict:
    return one(docs, kind, suffix)["spec"]["template"]["spec"]


def _validate(docs: list[dict]) -> None:
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kv.validate(doc, "1.37.0", strict=True)


# --- the ServiceMonitor needs its CRD -------------------------------------------------------------


def test_a_service_monitor_without_its_crd_fails_the_install_saying_so(chart: Any) -> None:
    """Before: the ServiceMonitor rendered on any cluster, and an install where the Prometheus
    Operator is missing failed half-applied ("no matches for kind ServiceMonitor"). After: the
    render stops first and says what to do (the offline renderer serves no such API)."""
    with pytest.raises(helm.HelmRenderError, match="needs the Prometheus Operator's ServiceMonitor CRD"):
        render(chart, _with(serviceMonitor={"enabled": True}))
    docs = render(chart, _with(serviceMonitor={"enabled": True, "crdCheck": False}))  # helm template, GitOps
    assert [d["kind"] for d in docs].count("ServiceMonitor") == 1


# --- the model's tokenizer -------------------------------------------------------------------------


def test_an_install_without_the_engines_tokenizer_fails_saying_where_to_give_it(chart: Any) -> None:
    """Before: the walkthrough's Llama values loaded the DeepSeek tokenizer (/readyz: vocab
    129,280) and no key ever matched, silently. After: the install says what to set."""
    with pytest.raises(helm.HelmRenderError, match="kvgate needs the engines' tokenizer"):
        render(chart, {"models": [MODEL]})
    both = {"huggingFace": {"model": MODEL}, "builtinDeepSeek": True}
    with pytest.raises(helm.HelmRenderError, match="give the tokenizer one way"):
        render(chart, _with(tokenizer=both))


def test_a_hugging_face_model_id_is_fetched_at_start_with_the_token_from_a_secret(chart: Any) -> None:
    values = _with(tokenizer={"huggingFace": {"model": MODEL, "revision": "0e9e39f", "tokenSecret": {"name": "hf-token"}}})
    docs = render(chart, values)
    _validate(docs)
    pod = _pod(docs, "-gateway")
    (init,) = pod["initContainers"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_MODEL"]["value"] == MODEL and env["HF_REVISION"]["value"] == "0e9e39f"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert "hf_" not in yaml.safe_dump(docs)  # the token itself is nowhere in the manifests
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["tokenizer"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    gateway_mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    source = yaml.safe_load(gateway_config_text(docs))["tokenizer"]["source"]
    assert source == mounts["tokenizer"] == gateway_mounts["tokenizer"]["mountPath"]
    assert gateway_mounts["tokenizer"]["readOnly"] is True
    cached = render(chart, _with(tokenizer={"huggingFace": {"model": MODEL, "cacheClaim": "hf-cache"}}))
    tok_volume = next(v for v in _pod(cached, "-gateway")["volumes"] if v["name"] == "tokenizer")
    assert tok_volume["persistentVolumeClaim"] == {"claimName": "hf-cache"}


def test_a_mounted_volume_or_an_init_container_provides_the_tokenizer(chart: Any) -> None:
    docs = render(chart, VALUE_SETS["external-redis"])  # a PVC with the files under llama-3.1/
    pod = _pod(docs, "-gateway")
    tok_volume = next(v for v in pod["volumes"] if v["name"] == "tokenizer")
    assert tok_volume["persistentVolumeClaim"] == {"claimName": "llama-tokenizer"}
    assert yaml.safe_load(gateway_config_text(docs))["tokenizer"]["source"] == "/var/lib/kvgate/tokenizer/llama-3.1"
    assert "initContainers" not in pod

    docs = render(chart, VALUE_SETS["discovery-pods"])  # the operator's own init container
    (init,) = _pod(docs, "-gateway")["initContainers"]
    assert init["name"] == "copy"
    assert {"name": "tokenizer", "mountPath": "/var/lib/kvgate/tokenizer"} in init["volumeMounts"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True  # hardened like ours

    template = _with(tokenizer={"huggingFace": {"model": MODEL}, "chatTemplate": "tool_use.jinja"})
    tok = yaml.safe_load(gateway_config_text(render(chart, template)))["tokenizer"]
    assert tok["chat_template"] == "/var/lib/kvgate/tokenizer/tool_use.jinja"


def test_extra_volumes_mounts_and_env_reach_gateway_envoy_and_bridges(chart: Any) -> None:
    extra = {
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
        "extraVolumes": [{"name": "certs", "secret": {"secretName": "corp-ca"}}],
        "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/corp-ca", "readOnly": True}],
    }
    values = _with(gateway=copy.deepcopy(extra), envoy=copy.deepcopy(extra))
    docs = render(chart, values)
    _validate(docs)
    for suffix in ("-gateway", "-envoy"):
        pod = _pod(docs, suffix)
        container = pod["containers"][0]
        assert {"name": "TZ", "value": "UTC"} in container["env"]
        assert {"name": "certs", "secret": {"secretName": "corp-ca"}} in pod["volumes"]
        assert {"name": "certs", "mountPath": "/etc/corp-ca", "readOnly": True} in container["volumeMounts"]
    standalone = copy.deepcopy(VALUE_SETS["static-with-bridges"])
    standalone["bridge"]["standalone"].update(copy.deepcopy(extra))
    bridge = _pod(render(chart, standalone), "-bridge")
    assert {"name": "TZ", "value": "UTC"} in bridge["containers"][0]["env"]
    assert {"name": "certs", "mountPath": "/etc/corp-ca", "readOnly": True} in bridge["containers"][0]["volumeMounts"]
    assert {"name": "certs", "secret": {"secretName": "corp-ca"}} in bridge["volumes"]


# --- findings that crash-looped or failed at run time ----------------------------------------------


def test_events_port_null_as_documented_starts_the_gateway(chart: Any, tmp_path: Path) -> None:
    """Before: `fleet.discovery.eventsPort: null` kept replay_port and the gateway exited 2
    (`replay_port is set but events_port is not`) while helm install succeeded."""
    values = _with(fleet={"discovery": {"eventsPort": None}})
    docs = render(chart, values)
    path = tmp_path / "kvgate.yaml"
    path.write_text(gateway_config_text(docs))
    cfg = load_config(path)
    assert cfg.discovery.kubernetes.events_port is None and cfg.discovery.kubernetes.replay_port is None


def test_external_redis_over_tls_gets_its_ca_mounted(chart: Any) -> None:
    """Before: `rediss://` needed a CA file nothing could mount (the schema refused extra keys)."""
    values = copy.deepcopy(VALUE_SETS["external-redis"])
    values["redis"]["external"]["tls"] = {"secretName": "redis-ca", "caKey": "ca.crt", "certKey": "tls.crt", "keyKey": "tls.key"}
    docs = render(chart, values)
    _validate(docs)
    directory = yaml.safe_load(gateway_config_text(docs))["directory"]
    pod = _pod(docs, "-gateway")
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for field, key in (("tls_ca_file", "ca.crt"), ("tls_cert_file", "tls.crt"), ("tls_key_file", "tls.key")):
        folder, _, name = directory[field].rpartition("/")
        assert name == key and volumes[mounts[folder]]["secret"]["secretName"] == "redis-ca"


def test_bridges_get_the_redis_tls_files_too(chart: Any) -> None:
    """Before: only the gateway had the CA mounted; standalone and sidecar bridges could not
    verify a `rediss://` Redis. After: each bridge container mounts the files and names them in
    the variables `kvgate bridge` reads (its --tls-*-file defaults)."""
    values = copy.deepcopy(VALUE_SETS["external-redis"])
    values["redis"]["external"]["tls"] = {"secretName": "redis-ca", "caKey": "ca.crt", "certKey": "", "keyKey": ""}
    values["fleet"] = {"discovery": {"enabled": False}, "static": [{"node_id": "n1", "address": "10.0.0.11:8000"}]}
    values["bridge"] = {"standalone": {"enabled": True, "engines": [
        {"node_id": "n1", "address": "10.0.0.11:8000", "events": "tcp://10.0.0.11:5557"}]}}  # fmt: skip
    docs = render(chart, values)
    _validate(docs)
    pod = _pod(docs, "-bridge")
    bridge = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in bridge["env"]}
    assert env["KVGATE_DIRECTORY__TLS_CA_FILE"] == "/var/run/kvgate/redis-tls/ca.crt"
    assert "KVGATE_DIRECTORY__TLS_CERT_FILE" not in env  # no client certificate asked for
    assert {"name": "redis-tls", "mountPath": "/var/run/kvgate/redis-tls", "readOnly": True} in bridge["volumeMounts"]
    assert {"name": "redis-tls", "secret": {"secretName": "redis-ca"}} in pod["volumes"]

    sidecars = copy.deepcopy(VALUE_SETS["sidecar-bridges"])
    sidecars["redis"] = values["redis"]
    sidecar = one(render(chart, sidecars), "ConfigMap", "-bridge-sidecar")["data"]
    container = yaml.safe_load(sidecar["container.yaml"])
    assert any(e["name"] == "KVGATE_DIRECTORY__TLS_CA_FILE" for e in container["env"])
    assert yaml.safe_load(sidecar["volumes.yaml"]) == [{"name": "redis-tls", "secret": {"secretName": "redis-ca"}}]


def test_sidecar_bridges_need_no_static_fleet_and_refuse_a_duplicate_one(chart: Any, tmp_path: Path) -> None:
    """Before: sidecars as documented failed ("no fleet"), and filling fleet.static registered
    every engine twice (under the static id and under the pod's name)."""
    docs = render(chart, VALUE_SETS["sidecar-bridges"])
    path = tmp_path / "kvgate.yaml"
    path.write_text(gateway_config_text(docs))
    assert load_config(path).fleet == []  # the sidecars register their pods
    doubled = copy.deepcopy(VALUE_SETS["sidecar-bridges"])
    doubled["fleet"]["static"] = [{"node_id": "n1", "address": "10.0.0.11:8000"}]
    with pytest.raises(helm.HelmRenderError, match="registers each twice"):
        render(chart, doubled)


def test_pods_discovery_never_falls_back_to_a_service_that_does_not_exist(chart: Any) -> None:
    """Before: source=pods pointed Envoy's fallback at Service `vllm` (the default of
    fleet.discovery.service), which that setup does not have."""
    values = _with(fleet={"discovery": {"source": "pods", "labelSelector": "app=vllm"}})
    with pytest.raises(helm.HelmRenderError, match="envoy needs a fallback cluster: set envoy.fallback"):
        render(chart, values)
    values["envoy"] = {"fallback": ["vllm-headless.llm.svc.cluster.local:8000"]}
    clusters = {c["name"]: c for c in envoy_bootstrap(render(chart, values))["static_resources"]["clusters"]}
    sock = clusters["fleet"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert sock["address"] == "vllm-headless.llm.svc.cluster.local"


# --- rollouts, capacity, placement -----------------------------------------------------------------


def test_envoy_drains_for_the_longest_route_before_it_stops(chart: Any) -> None:
    """Before: no preStop and the default 30 s grace while routes allow 600 s: every rollout cut
    generations in flight. (tests/test_helm_rendered_run.py runs the drain for real.)"""
    docs = render(chart, BASE)
    pod = _pod(docs, "-envoy")
    container = pod["containers"][0]
    args = container["args"]
    drain_s = int(args[args.index("--drain-time-s") + 1])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["bash", "/etc/envoy/drain.sh"]
    assert command[2:] == ["9901", str(drain_s), "600"]  # admin port, drain, longest route timeout
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 600
    assert "drain.sh" in one(docs, "ConfigMap", "-envoy")["data"]
    with pytest.raises(helm.HelmRenderError, match="terminationGracePeriodSeconds is shorter"):
        render(chart, _with(envoy={"terminationGracePeriodSeconds": 60}))


def test_circuit_breakers_fit_the_fleet(chart: Any) -> None:
    """Before: no thresholds, so Envoy's 1,024 requests a cluster overflowed with ~8 busy engines."""
    for values, engines in ((BASE, 32), (_with(envoy={"circuitBreakers": {"engines": 100}}), 100),
                            (VALUE_SETS["static-with-bridges"], 4)):  # fmt: skip
        clusters = {c["name"]: c for c in envoy_bootstrap(render(chart, values))["static_resources"]["clusters"]}
        for name in ("fleet", "kvgate_destination"):
            (t,) = clusters[name]["circuit_breakers"]["thresholds"]
            assert t["max_requests"] == max(1024, 256 * engines), (name, engines)


def test_envoy_and_gateway_spread_over_nodes_and_zones(chart: Any) -> None:
    docs = render(chart, BASE)
    for suffix in ("-gateway", "-envoy"):
        spread = _pod(docs, suffix)["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        labels = _pod_labels(docs, suffix)
        assert all(c["labelSelector"]["matchLabels"].items() <= labels.items() for c in spread)
    off = render(chart, _with(gateway={"spreadAcrossNodes": False}))
    assert "topologySpreadConstraints" not in _pod(off, "-gateway")


# --- network policies ------------------------------------------------------------------------------


def _rules_for(policy: dict, port: Any) -> list[dict]:
    return [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r["ports"])]


def test_without_envoy_nobody_reaches_the_decision_port_unless_listed(chart: Any) -> None:
    """Before: envoy.enabled=false and no extProcFrom rendered `from: null`, which admits everyone."""
    values = _with(envoy={"enabled": False})
    policy = one(render(chart, values), "NetworkPolicy", "-gateway")
    assert all(r.get("from") for r in policy["spec"]["ingress"])  # no rule admits everyone
    assert _rules_for(policy, 9002) == []
    values["networkPolicy"] = {"extProcFrom": [{"podSelector": {"matchLabels": {"app": "istio-gateway"}}}]}
    (rule,) = _rules_for(one(render(chart, values), "NetworkPolicy", "-gateway"), 9002)
    assert _admits(rule, {"app": "istio-gateway"}) and not _admits(rule, {"app": "other"})


def test_admin_port_is_not_open_to_every_pod(chart: Any) -> None:
    """Before: metricsFrom [] left /metrics and /debug open to every pod of the cluster."""
    policy = one(render(chart, BASE), "NetworkPolicy", "-gateway")
    (rule,) = _rules_for(policy, 9003)
    assert rule["from"] and not _admits(rule, {"app": "anything"})
    assert _admits(rule, {"kvgate.io/admin-client": "true"})


def test_engine_event_ports_admit_only_kvgate(chart: Any) -> None:
    """Engines' KV-event/replay sockets (`tcp://*`) told any pod what every engine caches."""
    docs = render(chart, BASE)
    _validate(docs)
    policy = one(docs, "NetworkPolicy", "-engines")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app": "vllm"}
    gateway, envoy = _pod_labels(docs, "-gateway"), _pod_labels(docs, "-envoy")
    (events,) = _rules_for(policy, 5557)
    assert {p["port"] for p in events["ports"]} == {5557, 5558}
    assert _admits(events, gateway) and not _admits(events, envoy) and not _admits(events, {"app": "vllm"})
    (api,) = _rules_for(policy, 8000)
    assert _admits(api, envoy) and not _admits(api, gateway) and not _admits(api, {"app": "client"})

    other_ns = render(chart, VALUE_SETS["discovery-pods"])  # engines in namespace `engines`
    policy = one(other_ns, "NetworkPolicy", "-engines")
    assert policy["metadata"]["namespace"] == "engines"
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app": "vllm"}  # from labelSelector
    (events,) = _rules_for(policy, "kv-events")
    (peer,) = events["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    (transfer,) = _rules_for(policy, 7000)
    assert transfer["from"] == [{"podSelector": {"matchLabels": {"app": "vllm"}}}]  # engines pull from engines


def test_tls_on_the_decision_port_is_the_only_way_in(chart: Any) -> None:
    """Gateways that speak TLS to an endpoint picker failed open against kvgate's plaintext h2c:
    with gateway.tls, a sidecar terminates TLS and only its port is admitted.
    (tests/test_helm_rendered_run.py routes through it with real Envoy.)"""
    docs = render(chart, _with(gateway={"tls": {"enabled": True, "secretName": "kvgate-tls"}}))
    _validate(docs)
    pod = _pod(docs, "-gateway")
    proxy = next(c for c in pod["containers"] if c["name"] == "tls-proxy")
    assert {"name": "kvgate-tls", "containerPort": 9443, "protocol": "TCP"} in proxy["ports"]
    assert {"name": "kvgate-tls", "secret": {"secretName": "kvgate-tls"}} in pod["volumes"]
    for suffix in ("-gateway", "-gateway-headless"):
        (port,) = [p for p in one(docs, "Service", suffix)["spec"]["ports"] if p["name"] != "admin"]
        assert port["port"] == 9443 and port["targetPort"] == "kvgate-tls"
    policy = one(docs, "NetworkPolicy", "-gateway")
    assert _rules_for(policy, 9002) == [] and _admits(_rules_for(policy, 9443)[0], _pod_labels(docs, "-envoy"))
    clusters = {c["name"]: c for c in envoy_bootstrap(docs)["static_resources"]["clusters"]}
    tls = clusters["kvgate_ext_proc"]["transport_socket"]["typed_config"]
    assert tls["sni"] == f"{RELEASE}-kvgate-gateway-headless.{NAMESPACE}.svc.cluster.local"
    envoy_volumes = {v["name"]: v for v in _pod(docs, "-envoy")["volumes"]}
    assert envoy_volumes["kvgate-tls"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # not the key
    with pytest.raises(helm.HelmRenderError, match="needs gateway.tls.secretName"):
        render(chart, _with(gateway={"tls": {"enabled": True}}))


# --- Redis -----------------------------------------------------------------------------------------


def test_redis_password_is_on_no_command_line(chart: Any) -> None:
    """Before: `redis-server --requirepass $(REDIS_PASSWORD)`, `redis-cli -a "$REDIS_PASSWORD"`
    and `kvgate bridge --directory $(KVGATE_DIRECTORY__URL)` put it in every `ps`.
    (tests/test_helm_rendered_run.py starts the rendered Redis command and reads its argv.)"""
    for name in ("defaults", "static-with-bridges", "sidecar-bridges"):
        docs = render(chart, VALUE_SETS[name])
        workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        for d in workloads:
            for c in d["spec"]["template"]["spec"]["containers"]:
                argv = " ".join(c.get("command", []) + c.get("args", []))
                assert "$(REDIS_PASSWORD)" not in argv and "$(KVGATE_DIRECTORY__URL)" not in argv, c["name"]
                assert not re.search(r"(^|\s)-a\s", argv)
                for probe in ("readinessProbe", "livenessProbe"):
                    exec_cmd = " ".join(c.get(probe, {}).get("exec", {}).get("command", []))
                    assert " -a " not in exec_cmd
    sidecar = yaml.safe_load(one(render(chart, VALUE_SETS["sidecar-bridges"]), "ConfigMap", "-bridge-sidecar")["data"]["container.yaml"])
    assert "$(KVGATE_DIRECTORY__URL)" not in " ".join(sidecar["args"])


def test_redis_has_a_memory_limit_under_its_container_limit(chart: Any) -> None:
    """Before: no maxmemory under a 1 GiB limit (the kernel kills Redis instead of refusing a write)."""
    statefulset = one(render(chart, BASE), "StatefulSet", "-redis")
    (c,) = statefulset["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--maxmemory") + 1] == "768mb" and c["resources"]["limits"]["memory"] == "1Gi"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"  # never evicts a live reservation


def test_turning_persistence_on_replaces_the_statefulset_instead_of_failing(chart: Any) -> None:
    """Before: both modes had one StatefulSet name, and volumeClaimTemplates cannot change: the
    upgrade failed. Now each mode has its own StatefulSet; Service and Secret keep their names."""
    plain = render(chart, BASE)
    persistent = render(chart, _with(redis={"bundled": {"persistence": {"enabled": True}}}))
    assert one(plain, "StatefulSet", "-redis")["spec"].get("volumeClaimTemplates") is None
    assert one(persistent, "StatefulSet", "-redis-persistent")["spec"]["volumeClaimTemplates"]
    for docs in (plain, persistent):
        one(docs, "Service", "-redis")
        one(docs, "Secret", "-redis")


def test_gitops_renders_use_an_existing_secret(chart: Any) -> None:
    """Under `helm template` (GitOps) no cluster is looked up, so a generated password changes on
    every render; with redis.bundled.existingSecret and gateway.callerToken.existingSecret
    nothing is generated and every consumer reads those Secrets."""
    first, second = (one(render(chart, BASE), "Secret", "-redis")["data"]["password"] for _ in range(2))
    assert first != second  # what GitOps would see: hence existingSecret
    docs = render(chart, _with(redis={"bundled": {"existingSecret": "kvgate-redis-auth"}},
                               gateway={"callerToken": {"existingSecret": "kvgate-caller"}}))  # fmt: skip
    assert not [d for d in docs if d["kind"] == "Secret"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", []) if e["name"] == "REDIS_PASSWORD"}  # fmt: skip
    assert refs == {"kvgate-redis-auth"}


# --- contradictions fail the install ---------------------------------------------------------------


@pytest.mark.parametrize(
    "values,message",
    [
        (_with(gateway={"adminPort": 9002}), "gateway.adminPort must differ"),
        (_with(gateway={"integration": "ext_authz", "extAuthzPort": 9003}), "gateway.adminPort must differ"),
        (_with(gateway={"autoscaling": {"minReplicas": 5, "maxReplicas": 3}}), "minReplicas is above"),
    ],
)
def test_values_that_rendered_cleanly_and_failed_at_run_time_now_fail_the_install(chart: Any, values: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(chart, values)


def test_a_release_name_too_long_for_its_objects_fails_the_install(chart: Any) -> None:
    """Before: a 50-character release rendered `<name>-kvgate-gateway-headless` (>63), which the
    API server rejects after half the release was created."""
    long_name = "inference-gateway-for-the-production-llama-fleet-a"
    with pytest.raises(helm.HelmRenderError, match="at most 46 characters"):
        chart.render(values=copy.deepcopy(BASE), name=long_name, namespace=NAMESPACE)
    ok = chart.render(values={**copy.deepcopy(BASE), "fullnameOverride": "kvgate-prod"}, name=long_name, namespace=NAMESPACE)
    assert ok


# --- the walkthrough in docs/kubernetes.md is one that installs --------------------------------------

DOC = Path(__file__).resolve().parent.parent / "docs" / "kubernetes.md"


def _set(values: dict[str, Any], assignment: str) -> None:
    """One `--set a.b=c` as Helm reads it (lists in braces, booleans, integers)."""
    key, _, raw = assignment.partition("=")
    value: Any = raw
    if raw.startswith("{") and raw.endswith("}"):
        value = raw[1:-1].split(",")
    elif raw in ("true", "false"):
        value = raw == "true"
    elif raw.isdigit():
        value = int(raw)
    *parents, last = key.split(".")
    node = values
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def _doc_commands() -> list[str]:
    text = DOC.read_text().replace("\\\n", " ")
    return [re.sub(r"\s+", " ", line.strip()) for line in text.splitlines() if re.match(r"\s*helm (install|upgrade|template) ", line)]


def test_every_helm_command_of_the_walkthrough_renders_and_validates(chart: Any) -> None:
    commands = _doc_commands()
    assert len(commands) >= 3
    installed: dict[str, Any] = {}
    for command in commands:
        values = copy.deepcopy(installed) if "--reuse-values" in command or " ... " in command else {}
        for assignment in re.findall(r"--set (\S+)", command.replace("NAME", MODEL)):
            _set(values, assignment)
        docs = [d for d in render_as(chart, values, "kvgate", "llm")]
        _validate(docs)
        if command.startswith("helm install") and not installed:
            installed = values
            names = {(d["kind"], d["metadata"]["name"]) for d in docs}
            mentioned = re.findall(r"\b(deploy|svc|configmap)/?\s?(kvgate-[\w-]+)", DOC.read_text())
            assert len(mentioned) >= 4
            for kind, name in mentioned:
                kind = {"deploy": "Deployment", "svc": "Service", "configmap": "ConfigMap"}[kind]
                if name != "kvgate-bridge-sidecar":  # the sidecar variation renders it
                    assert (kind, name) in names, (kind, name)


def test_the_walkthroughs_kubernetes_objects_validate() -> None:
    blocks = re.findall(r"<<'YAML'\n(.*?)\nYAML", DOC.read_text(), flags=re.S)
    checked = 0
    for block in blocks:
        for doc in yaml.safe_load_all(block):
            if doc and doc["apiVersion"] in ("v1", "apps/v1"):
                kv.validate(doc, "1.37.0", strict=True)
                checked += 1
    assert checked >= 2  # the engines' Service and StatefulSet


def render_as(chart: Any, values: dict[str, Any], name: str, namespace: str) -> list[dict]:
    out = chart.render(values=copy.deepcopy(values), name=name, namespace=namespace)
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
