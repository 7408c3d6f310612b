"""The chart's own manifests, run: render the chart, take the Redis command, the tokenizer init
container, the gateway's config and environment, and Envoy's bootstrap and preStop from the
manifests, patch only hostnames, ports and mount paths (what Kubernetes resolves), and run them
with real Redis, `kvgate serve`, real Envoy and two simulated engines: prefix decisions, fail-open,
a config change, and a rollout drain in which Envoy gets SIGTERM mid-stream and the stream
completes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import free_port
from tests.support.http import eventually, get_json, request
from tests.support.procs import Proc, wait_for_port
from tests.test_helm_chart import _resolve_env, chart, envoy_bootstrap, gateway_config_text, one, render  # noqa: F401
from tokenizer.chat_template import DEFAULT_TEMPLATE_PATH
from tokenizer.loading import default_tokenizer_path

MODEL = "acme/chat-8b"  # a model whose tokenizer is given as files (here: DeepSeek's, copied)
NODES = {"a": "10.0.0.11", "b": "10.0.0.12"}
TOKENIZER_MOUNT = "/var/lib/kvgate/tokenizer"
PASSWORD = "p4ss-" + uuid.uuid4().hex[:8]
ROLE_PASSWORDS = {role: f"{role}-" + uuid.uuid4().hex[:8] for role in ("gateway", "gateway-events", "bridge")}
CALLER_TOKEN = "caller-" + uuid.uuid4().hex  # the chart's caller-token Secret, as the kubelet mounts it
SECRETS = {("kv-kvgate-redis", "password"): PASSWORD, ("kv-kvgate-caller-token", "token"): CALLER_TOKEN} | {
    ("kv-kvgate-redis", f"{role}-password"): pw for role, pw in ROLE_PASSWORDS.items()
}


def values(key_prefix: str, **limits: int) -> dict[str, Any]:
    return {
        "models": [MODEL],
        "tokenizer": {"huggingFace": {"model": MODEL, "tokenSecret": {"name": "hf-token"}}},
        "redis": {"keyPrefix": key_prefix, "acl": {"enabled": True}},  # the gateway connects as its role's user
        "fleet": {
            "discovery": {"enabled": False},
            "static": [
                {"node_id": n, "address": f"{ip}:8000", "events_endpoint": f"tcp://{ip}:5557", "replay_endpoint": f"tcp://{ip}:5558"}
                for n, ip in NODES.items()
            ],
        },
        "gateway": {"replicas": 1, "autoscaling": {"enabled": False},
                    "config": {"directory": {"heartbeat_ttl_s": 3}}},  # fmt: skip
        "envoy": {"drainSeconds": 1, "routeTimeoutSeconds": 60},
        "limits": {"maxBodyBytes": 1 << 20, "maxPromptTokens": 131072, **limits},
    }


class Ports:
    """What Kubernetes would resolve: every (host, port) of the manifests → a loopback port."""

    def __init__(self) -> None:
        self.map: dict[tuple[str, int], int] = {}

    def __call__(self, host: str, port: int) -> int:
        return self.map.setdefault((host, int(port)), free_port())


def patch_bootstrap(boot: Any, ports: Ports) -> Any:
    """Every socket_address of Envoy's bootstrap to 127.0.0.1 and its loopback port."""
    if isinstance(boot, dict):
        if "socket_address" in boot:
            sock = boot["socket_address"]
            return {"socket_address": {"address": "127.0.0.1", "port_value": ports(sock["address"], sock["port_value"])}}
        return {k: patch_bootstrap(v, ports) for k, v in boot.items()}
    if isinstance(boot, list):
        return [patch_bootstrap(v, ports) for v in boot]
    return boot


def _hostport(address: str, ports: Ports) -> str:
    scheme, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    local = f"127.0.0.1:{ports(host, int(port))}"
    return f"{scheme}://{local}" if scheme else local


class RenderedStack:
    def __init__(self, chart: Any, tmp: Path, envoy_bin: str) -> None:
        self.chart, self.tmp, self.envoy_bin = chart, tmp, envoy_bin
        self.prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"
        self.ports = Ports()
        self.procs: list[Proc] = []
        self.docs = render(chart, values(self.prefix))
        self.tokenizer_dir = tmp / "tokenizer-volume"
        self.tokenizer_dir.mkdir()
        self.caller_token = tmp / "caller-token"
        self.caller_token.write_text(CALLER_TOKEN)

    # -- the pods, as the kubelet would start them --------------------------------------------------

    def run_tokenizer_init(self, *, hub_reachable: bool = False) -> subprocess.CompletedProcess:
        """The init container's script and env, with its mounts at local paths and the Hub's
        hostname pointing at a closed port (nothing can be downloaded here)."""
        (init,) = one(self.docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["initContainers"]
        script = init["args"][0].replace(TOKENIZER_MOUNT, str(self.tokenizer_dir))
        env = _resolve_env(init, {("hf-token", "token"): "hf_not_a_real_token"})
        env["HF_HOME"] = str(self.tmp / "hf")
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
        env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        return subprocess.run([*init["command"], script], env=env, capture_output=True, text=True, timeout=120)

    def start_redis(self) -> None:
        statefulset = one(self.docs, "StatefulSet", "-redis")
        (c,) = statefulset["spec"]["template"]["spec"]["containers"]
        args = [str(self.tmp) if a == "/data" else a for a in c["args"]]
        self.redis_port = self.ports(f"{statefulset['metadata']['name']}", 6379)
        args += ["--port", str(self.redis_port), "--bind", "127.0.0.1"]
        acl = self.tmp / "redis-acl.conf"  # the ConfigMap the pod mounts at /etc/kvgate-redis
        acl.write_text(one(self.docs, "ConfigMap", "-redis-acl")["data"]["acl.conf"])
        command = [a.replace("/etc/kvgate-redis/acl.conf", str(acl)) for a in c["command"]]
        env = {**_resolve_env(c, SECRETS), "PATH": os.environ["PATH"]}
        self.redis = self._started(Proc("redis", [*command, *args], self.tmp, env))
        wait_for_port(self.redis_port, proc=self.redis.popen)

    def start_engines(self) -> None:
        self.engines: dict[str, Proc] = {}
        for node, ip in NODES.items():
            port = self.ports(ip, 8000)
            self.engines[node] = self._started(Proc(f"engine-{node}", [
                sys.executable, "-m", "workers.engine", "--port", str(port), "--model", MODEL, "--node-id", node,
                "--tokenizer", str(self.tokenizer_dir), "--time-scale", "1", "--debug-headers",
                "--events-endpoint", f"tcp://127.0.0.1:{self.ports(ip, 5557)}",
                "--replay-endpoint", f"tcp://127.0.0.1:{self.ports(ip, 5558)}",
            ], self.tmp))  # fmt: skip
            wait_for_port(port, proc=self.engines[node].popen, timeout_s=60)

    def gateway_config(self, docs: list[dict]) -> tuple[dict, dict[str, str]]:
        cfg = yaml.safe_load(gateway_config_text(docs))
        cfg["listen_host"] = "127.0.0.1"
        # Envoy reaches the decision port through the headless Service's name
        cfg["ext_proc_port"] = self.ports("kv-kvgate-gateway-headless.llm.svc.cluster.local", cfg["ext_proc_port"])
        cfg["admin_port"] = self.ports("gateway", cfg["admin_port"])
        for node in cfg["fleet"]:
            for key in ("address", "events_endpoint", "replay_endpoint"):
                node[key] = _hostport(node[key], self.ports)
        cfg["tokenizer"]["source"] = cfg["tokenizer"]["source"].replace(TOKENIZER_MOUNT, str(self.tokenizer_dir))
        container = one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
        env = _resolve_env(container, SECRETS)
        cfg["caller_token_file"] = cfg["caller_token_file"].replace("/var/run/kvgate-caller/token", str(self.caller_token))
        redis_host = f"kv-kvgate-redis.llm.svc.cluster.local:6379"
        assert redis_host in env["KVGATE_DIRECTORY__URL"]
        env["KVGATE_DIRECTORY__URL"] = env["KVGATE_DIRECTORY__URL"].replace(redis_host, f"127.0.0.1:{self.redis_port}")
        env["HOME"] = str(self.tmp)
        return cfg, env

    def start_gateway(self, docs: list[dict] | None = None) -> None:
        cfg, env = self.gateway_config(docs or self.docs)
        self.admin_port = cfg["admin_port"]
        path = self.tmp / "kvgate.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.gateway = self._started(Proc("gateway", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)], self.tmp, env))
        wait_for_port(self.admin_port, proc=self.gateway.popen, timeout_s=60)

    def run_envoy_init(self, template: Path, out: Path, token: Path | None = None) -> subprocess.CompletedProcess:
        """The Envoy pod's init container: writes the caller token into the bootstrap."""
        (init,) = one(self.docs, "Deployment", "-envoy")["spec"]["template"]["spec"]["initContainers"]
        paths = {"/etc/envoy/envoy.yaml": template, "/var/run/kvgate-caller/token": token or self.caller_token,
                 "/var/run/envoy/envoy.yaml": out}  # fmt: skip
        script = init["args"][0]
        for mounted, local in paths.items():
            script = script.replace(mounted, str(local))
        return subprocess.run([*init["command"], script], capture_output=True, text=True, timeout=30)

    def start_envoy(self) -> None:
        boot = patch_bootstrap(envoy_bootstrap(self.docs), self.ports)
        self.listen_port = boot["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        self.envoy_admin = boot["admin"]["address"]["socket_address"]["port_value"]
        template, path = self.tmp / "envoy-template.yaml", self.tmp / "envoy.yaml"
        template.write_text(yaml.safe_dump(boot))
        self.envoy_init = self.run_envoy_init(template, path)
        assert self.envoy_init.returncode == 0, self.envoy_init.stderr
        container = one(self.docs, "Deployment", "-envoy")["spec"]["template"]["spec"]["containers"][0]
        args = ["-c" if a == "--config-path" else (str(path) if a == "/var/run/envoy/envoy.yaml" else a) for a in container["args"]]
        self.envoy = self._started(Proc("envoy", [self.envoy_bin, *args, "-l", "warning"], self.tmp))
        wait_for_port(self.listen_port, proc=self.envoy.popen, timeout_s=30)

    def _started(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    # -- clients ----------------------------------------------------------------------------------

    def chat(self, messages: list[dict], **extra: Any) -> tuple[int, dict[str, str], bytes]:
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, **extra}).encode()
        return request(f"http://127.0.0.1:{self.listen_port}/v1/chat/completions", method="POST", body=body,
                       headers={"content-type": "application/json"}, timeout=60)  # fmt: skip

    def metric(self, name: str, label: str) -> float:
        """The sum of a counter's samples carrying ``label`` (e.g. ``outcome="owner"``)."""
        _, _, raw = request(f"http://127.0.0.1:{self.admin_port}/metrics")
        lines = raw.decode().splitlines()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name + "{") and label in ln)


@pytest.fixture(scope="module")
def stack(chart: Any, tmp_path_factory: pytest.TempPathFactory, envoy_bin: str) -> Iterator[RenderedStack]:
    s = RenderedStack(chart, tmp_path_factory.mktemp("rendered"), envoy_bin)
    try:
        failed = s.run_tokenizer_init()  # an empty volume, the Hub unreachable: the pod cannot start
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "tokenizer.huggingFace.tokenSecret" in failed.stderr
        for name in ("tokenizer.json", "tokenizer_config.json"):  # a PVC cache filled earlier
            shutil.copy(default_tokenizer_path().with_name(name), s.tokenizer_dir / name)
        shutil.copy(DEFAULT_TEMPLATE_PATH, s.tokenizer_dir / "chat_template.jinja")  # the newer HF layout
        s.init_run = s.run_tokenizer_init()
        s.start_redis()
        s.start_engines()
        s.start_gateway()
        s.start_envoy()
        eventually(lambda: get_json(f"http://127.0.0.1:{s.admin_port}/readyz")[1].get("live_nodes") == 2, timeout_s=60)
        yield s
    finally:
        s.stop()


def test_tokenizer_comes_from_the_volume_the_init_container_filled(stack: RenderedStack) -> None:
    assert stack.init_run.returncode == 0, stack.init_run.stderr
    assert f"ready in {stack.tokenizer_dir}" in stack.init_run.stdout
    assert "Connection refused" in stack.init_run.stderr  # the Hub was not reached: the cached files serve
    status, ready = get_json(f"http://127.0.0.1:{stack.admin_port}/readyz")
    assert status == 200 and ready["ready"] is True
    assert ready["tokenizer"]["source"] == str(stack.tokenizer_dir / "tokenizer.json")
    assert ready["tokenizer"]["chat_template"] == str(stack.tokenizer_dir / "chat_template.jinja")


def test_redis_runs_with_its_password_on_no_command_line(stack: RenderedStack) -> None:
    cmdline = Path(f"/proc/{stack.redis.popen.pid}/cmdline").read_bytes().decode()
    assert "redis-server" in cmdline and PASSWORD not in cmdline
    import redis

    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=stack.redis_port, password="wrong").ping()
    assert not any(pw in cmdline for pw in ROLE_PASSWORDS.values())
    r = redis.Redis(port=stack.redis_port, password=PASSWORD)
    # the gateway follows the static nodes' events itself: it is the gateway-events user (the
    # default user's connections are this test's own, the refused one included)
    assert {c["user"] for c in r.client_list()} - {"default"} == {"kvgate-gateway-events"}
    assert r.config_get("maxmemory")["maxmemory"] == str(768 << 20)
    assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    gateway_cmd = Path(f"/proc/{stack.gateway.popen.pid}/cmdline").read_bytes().decode()
    assert PASSWORD not in gateway_cmd


def _document(topic: str) -> str:
    return " ".join(f"Clause {i} of the {topic} contract sets figure {i * 7 % 101}." for i in range(300))


def test_follow_up_turns_land_where_their_prefix_is_cached(stack: RenderedStack) -> None:
    owners_before = stack.metric("kvgate_decisions_total", 'outcome="owner"')
    for topic in ("lease", "loan", "merger"):
        history = [{"role": "system", "content": _document(topic)}, {"role": "user", "content": "Summarise."}]
        status, headers, _ = stack.chat(history)
        assert status == 200
        first = headers["x-kvgate-node"]
        history += [{"role": "assistant", "content": "It sets figures."}, {"role": "user", "content": "Which?"}]
        time.sleep(0.5)  # the engine's KV events reach the gateway
        status, headers, _ = stack.chat(history)
        assert status == 200 and headers["x-kvgate-node"] == first, topic
    assert stack.metric("kvgate_decisions_total", 'outcome="owner"') >= owners_before + 3


def test_envoy_proves_itself_to_kvgate_with_the_secrets_token(stack: RenderedStack) -> None:
    """The token is in the Secret and, once the init container ran, in Envoy's bootstrap: never in
    a ConfigMap. kvgate answers Envoy's calls (routed, nothing refused as unauthenticated); a
    token Envoy could not carry stops the Envoy pod at its init container, saying why."""
    configmap = one(stack.docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"]
    assert CALLER_TOKEN not in configmap and "__KVGATE_CALLER_TOKEN__" in configmap
    assert CALLER_TOKEN in (stack.tmp / "envoy.yaml").read_text()
    status, headers, _ = stack.chat([{"role": "user", "content": "Who are you?"}])
    assert status == 200 and headers["x-kvgate-node"] in NODES
    _, _, raw = request(f"http://127.0.0.1:{stack.admin_port}/metrics")
    assert "kvgate_ext_proc_unauthenticated_total 0.0" in raw.decode()
    bad = stack.tmp / "bad-token"
    bad.write_text('a"token-that-breaks-yaml')
    failed = stack.run_envoy_init(stack.tmp / "envoy-template.yaml", stack.tmp / "unused.yaml", bad)
    assert failed.returncode == 1 and "gateway.callerToken" in failed.stderr


def test_a_config_change_rolls_the_gateway_and_takes_effect(stack: RenderedStack) -> None:
    """A smaller prompt limit: the ConfigMap's checksum on the pod template changes (Kubernetes
    rolls the pods), and the restarted gateway enforces it. Meanwhile Envoy fails open."""
    changed = render(stack.chart, values(stack.prefix, maxPromptTokens=512))
    annotation = "checksum/config"
    old_sum = one(stack.docs, "Deployment", "-gateway")["spec"]["template"]["metadata"]["annotations"][annotation]
    assert one(changed, "Deployment", "-gateway")["spec"]["template"]["metadata"]["annotations"][annotation] != old_sum
    long_chat = [{"role": "user", "content": _document("rollout")}]
    assert stack.chat(long_chat)[0] == 200

    stack.gateway.stop()  # the old pod goes: requests fail open to plain balancing
    statuses = [stack.chat([{"role": "user", "content": f"while rolling {i}"}])[0] for i in range(6)]
    assert statuses == [200] * 6
    stack.start_gateway(changed)
    eventually(lambda: get_json(f"http://127.0.0.1:{stack.admin_port}/readyz")[1].get("live_nodes") == 2, timeout_s=60)
    status, _, raw = eventually(lambda: (r := stack.chat(long_chat))[0] != 200 and r, timeout_s=20)
    assert status in (400, 413) and b"512" in raw, raw[:300]


def test_rollout_drain_lets_the_stream_in_flight_complete(stack: RenderedStack) -> None:
    """Kubernetes runs the preStop hook, then sends SIGTERM. The stream started before it ends
    with [DONE]; new connections are refused once the listeners closed."""
    out: dict[str, Any] = {}

    def stream() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
        out["status"], _, out["raw"] = request(
            f"http://127.0.0.1:{stack.listen_port}/v1/chat/completions", method="POST",
            body=json.dumps(body).encode(), headers={"content-type": "application/json"}, timeout=60,
        )  # fmt: skip
        out["ended"] = time.monotonic()

    client = threading.Thread(target=stream)
    client.start()
    eventually(lambda: get_json(f"http://127.0.0.1:{stack.envoy_admin}/stats?filter=kvgate_ingress.downstream_rq_active&format=json")
               [1]["stats"][0]["value"] >= 1, timeout_s=10)  # fmt: skip
    container = one(stack.docs, "Deployment", "-envoy")["spec"]["template"]["spec"]["containers"][0]
    drain_sh = one(stack.docs, "ConfigMap", "-envoy")["data"]["drain.sh"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    (stack.tmp / "drain.sh").write_text(drain_sh)
    args = [str(stack.tmp / "drain.sh") if a == "/etc/envoy/drain.sh" else a for a in command]
    args[2] = str(stack.envoy_admin)  # the admin port, patched like the bootstrap's
    started = time.monotonic()
    hook = subprocess.run(args, capture_output=True, text=True, timeout=120)
    hook_done = time.monotonic()
    assert hook.returncode == 0, hook.stderr
    assert "no request in flight" in hook.stdout
    stack.envoy.kill(signal.SIGTERM)
    client.join(timeout=60)
    assert out["status"] == 200
    assert out["raw"].rstrip().endswith(b"data: [DONE]")
    # the stream outlived the drain period (1 s): the hook waited for it, then Envoy stopped
    assert started + 1.0 < out["ended"] <= hook_done, (out["ended"] - started, hook_done - started)
    assert "requests in flight" in hook.stdout


def test_without_the_hook_sigterm_cuts_the_stream(stack: RenderedStack) -> None:
    """Why the preStop hook: Envoy exits at once on SIGTERM, cutting what is in flight."""
    stack.start_envoy()  # the next pod of the rollout
    status: dict[str, Any] = {}

    def stream() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Another long story."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            status["answer"] = request(
                f"http://127.0.0.1:{stack.listen_port}/v1/chat/completions", method="POST",
                body=json.dumps(body).encode(), headers={"content-type": "application/json"}, timeout=60,
            )  # fmt: skip
        except Exception as e:  # the connection is cut mid-body
            status["error"] = e

    client = threading.Thread(target=stream)
    client.start()
    eventually(lambda: get_json(f"http://127.0.0.1:{stack.envoy_admin}/stats?filter=kvgate_ingress.downstream_rq_active&format=json")
               [1]["stats"][0]["value"] >= 1, timeout_s=10)  # fmt: skip
    stack.envoy.kill(signal.SIGTERM)
    client.join(timeout=60)
    assert "error" in status or not status["answer"][2].rstrip().endswith(b"data: [DONE]")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def test_tls_to_the_decision_port_routes_and_plaintext_is_refused(stack: RenderedStack) -> None:
    """gateway.tls: the gateway pod's TLS sidecar (its bootstrap from the ConfigMap) in front of
    the running kvgate, and an Envoy from the TLS bootstrap. Requests are decided by kvgate (not
    failed open) over TLS; a plaintext gRPC client on the TLS port gets nothing."""
    docs = render(stack.chart, {**values(stack.prefix), "gateway": {
        **values(stack.prefix)["gateway"], "tls": {"enabled": True, "secretName": "kvgate-tls"}}})  # fmt: skip
    headless = "kv-kvgate-gateway-headless.llm.svc.cluster.local"
    certs = stack.tmp / "kvgate-tls"  # laid out as Kubernetes mounts a Secret: files -> ..data -> a version
    certs.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test-ca", cwd=certs)
    (certs / "ext.cnf").write_text(f"subjectAltName=DNS:{headless}\n")

    def secret_version(version: str) -> None:
        """A new certificate in ``..version``, then ``..data`` swapped to it atomically (as the kubelet does)."""
        folder = certs / f"..{version}"
        folder.mkdir()
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={headless}", cwd=folder)
        _openssl("x509", "-req", "-in", "tls.csr", "-CA", "../ca.crt", "-CAkey", "../ca.key", "-CAcreateserial",
                 "-out", "tls.crt", "-days", "2", "-extfile", "../ext.cnf", cwd=folder)  # fmt: skip
        (certs / "..data_tmp").symlink_to(folder.name)
        (certs / "..data_tmp").rename(certs / "..data")
        for name in ("tls.crt", "tls.key"):
            if not (certs / name).is_symlink():
                (certs / name).symlink_to(f"..data/{name}")

    secret_version("v1")

    ports = Ports()  # engines and kvgate as already running; new ports for the new Envoys
    ports.map = {k: v for k, v in stack.ports.map.items() if k[0] in NODES.values() or k[0] in ("gateway", headless)}
    sidecar_port = free_port()
    served = ports(headless, 9002)  # kvgate's plaintext port, reached over localhost in the pod
    ports.map[(headless, 9443)] = sidecar_port

    def local_files(text: str) -> str:
        return text.replace("/var/run/kvgate-tls", str(certs))  # the Secret's mount

    gateway_files = one(docs, "ConfigMap", "-gateway")["data"]
    (stack.tmp / "tls-sds.yaml").write_text(local_files(gateway_files["tls-sds.yaml"]))
    proxy_boot = yaml.safe_load(local_files(gateway_files["tls-proxy.yaml"]).replace("/etc/kvgate/", f"{stack.tmp}/"))
    proxy_ports = Ports()
    proxy_ports.map = {("0.0.0.0", 9443): sidecar_port, ("127.0.0.1", 9002): served}
    (stack.tmp / "tls-proxy.yaml").write_text(yaml.safe_dump(patch_bootstrap(proxy_boot, proxy_ports)))
    proxy = stack._started(Proc("tls-proxy", [stack.envoy_bin, "-c", str(stack.tmp / "tls-proxy.yaml"),
                                              "--disable-hot-restart", "-l", "warning"], stack.tmp))  # fmt: skip
    wait_for_port(sidecar_port, proc=proxy.popen)

    boot = patch_bootstrap(yaml.safe_load(local_files(one(docs, "ConfigMap", "-envoy")["data"]["envoy.yaml"])), ports)
    listen = boot["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    (stack.tmp / "envoy-tls-template.yaml").write_text(yaml.safe_dump(boot))
    init = stack.run_envoy_init(stack.tmp / "envoy-tls-template.yaml", stack.tmp / "envoy-tls.yaml")  # the caller token
    assert init.returncode == 0, init.stderr
    envoy = stack._started(Proc("envoy-tls", [stack.envoy_bin, "-c", str(stack.tmp / "envoy-tls.yaml"),
                                              "--disable-hot-restart", "-l", "warning"], stack.tmp))  # fmt: skip
    wait_for_port(listen, proc=envoy.popen)

    decided = stack.metric("kvgate_decisions_total", "")
    failed_open = stack.metric("kvgate_fail_open_total", "")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "over TLS"}], "max_tokens": 2}).encode()
    for _ in range(4):
        status, _, raw = request(f"http://127.0.0.1:{listen}/v1/chat/completions", method="POST", body=body,
                                 headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert status == 200, raw[:300]
    assert stack.metric("kvgate_decisions_total", "") - decided >= 4
    assert stack.metric("kvgate_fail_open_total", "") == failed_open

    # A renewed Secret is served without a restart (before: the sidecar read its files once).
    served_before = ssl.get_server_certificate(("127.0.0.1", sidecar_port))
    secret_version("v2")
    eventually(lambda: ssl.get_server_certificate(("127.0.0.1", sidecar_port)) != served_before, timeout_s=20)
    assert ssl.get_server_certificate(("127.0.0.1", sidecar_port)).strip() == (certs / "tls.crt").read_text().strip()
    status, _, raw = request(f"http://127.0.0.1:{listen}/v1/chat/completions", method="POST", body=body,
                             headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert status == 200 and stack.metric("kvgate_fail_open_total", "") == failed_open, raw[:300]

    import grpc  # a client that speaks plaintext h2c, as Envoy did before: no answer on the TLS port

    channel = grpc.insecure_channel(f"127.0.0.1:{sidecar_port}")
    with pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=2)
    channel.close()
