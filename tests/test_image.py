"""The container image: `make image` builds it (on a Debian base made with debootstrap, since no
image registry is reachable here), and `kvgate serve` runs from it as the chart runs it — non-root,
read-only root filesystem, no capabilities — answering /healthz and deciding a request that real
Envoy on the host sends to the container's ext_proc port (host networking: all on loopback).

Needs root, `dockerd` and `debootstrap` (`make test` installs docker.io and debootstrap). A daemon
already answering is used as it is; otherwise this module starts its own and stops it by pid. The
first build takes minutes (debootstrap, apt, pip); later ones reuse the cached base and layers.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gateway.envoy_config import EnvoySettings
from tests.conftest import REPO, free_port
from tests.support.http import eventually, get_json, post_json, request
from tests.support.procs import Proc, start_echo, start_envoy
from tests.support.stack import MODEL, chat, document
from tokenizer.loading import load_tokenizer

pytestmark = pytest.mark.timeout(1500)  # a cold build: debootstrap, apt-get and pip in the image

NODES = ("a", "b")


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


def daemon_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def docker_daemon(tmp_path_factory) -> Iterator[None]:
    """A Docker daemon to build and run with: the machine's, or one started here (stopped by pid)."""
    if not shutil.which("docker") or not shutil.which("dockerd"):
        pytest.fail("docker and dockerd not found: `make test` installs Debian's docker.io")
    if daemon_answers():
        yield
        return
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT)
    try:
        eventually(lambda: proc.poll() is None and daemon_answers(), timeout_s=90, interval_s=0.5,
                   show=lambda: log.read_text(errors="replace")[-2000:])
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_image_tag() -> str:
    """The tag `make image` builds, as make itself would compute it."""
    dry = subprocess.run(["make", "-s", "-n", "image"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return re.search(r"IMAGE='([^']+)'", dry).group(1)


@pytest.fixture(scope="module")
def image(docker_daemon, tmp_path_factory) -> str:
    log = tmp_path_factory.mktemp("build") / "make-image.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        rc = subprocess.run(["make", "image"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=1400).returncode
    assert rc == 0, f"make image failed ({rc}):\n" + log.read_text(errors="replace")[-4000:]
    print(f"make image: {time.monotonic() - t0:.1f} s")
    return make_image_tag()


def test_chart_default_image_is_what_make_image_tags() -> None:
    chart = yaml.safe_load((REPO / "helm/kvgate/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "helm/kvgate/values.yaml").read_text())
    default = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    assert default == make_image_tag()


def test_image_runs_as_the_charts_user_without_compilers_and_with_the_shipped_tokenizer(image: str) -> None:
    config = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001"  # podSecurityContext.runAsUser of the chart
    assert config["Entrypoint"] == ["kvgate"]

    script = "command -v kvgate; for c in gcc cc c++ g++ clang make ld; do command -v $c; done; id -u"
    out = docker("run", "--rm", "--entrypoint", "sh", image, "-c", script, check=False).stdout.split()
    assert out == ["/opt/kvgate/bin/kvgate", "10001"], f"expected only kvgate on PATH and uid 10001, got {out}"

    text = document("lighthouse", 40)
    code = ("import json, sys; from tokenizer.loading import load_tokenizer; "
            "print(json.dumps(load_tokenizer().tokenizer.encode(sys.argv[1]).ids))")
    ids = json.loads(docker("run", "--rm", "--entrypoint", "python3", image, "-c", code, text).stdout)
    assert ids == load_tokenizer().tokenizer.encode(text).ids


@pytest.fixture
def served(image: str, tmp_path: Path, envoy_bin: str) -> Iterator[dict]:
    """Two echo nodes on the host, `kvgate serve` in a container, Envoy on the host.

    The container shares the host's network (``--network host``), so every hop stays on
    127.0.0.1: kvgate probes the nodes (`GET /health`, as it probes engine pods) and Envoy calls
    the container's ext_proc port, all over loopback.
    """
    procs: list[Proc] = []
    name = f"kvgate-test-{uuid.uuid4().hex[:10]}"
    ports = {n: free_port() for n in NODES}
    admin_port, ext_proc_port, listen_port = free_port(), free_port(), free_port()
    addr = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({
        "listen_host": "127.0.0.1",
        "admin_port": admin_port,
        "ext_proc_port": ext_proc_port,
        "models": [MODEL],
        "directory": {"url": "memory://"},
        "fleet": [{"node_id": n, "address": a} for n, a in addr.items()],
    }))
    config.chmod(0o644)
    try:
        for n, p in ports.items():
            procs.append(start_echo(n, p, tmp_path))
        docker(
            "run", "-d", "--name", name, "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--network", "host",
            "-v", f"{config}:/etc/kvgate/kvgate.yaml:ro",
            image, "serve", "--config", "/etc/kvgate/kvgate.yaml",
        )
        logs = lambda: docker("logs", name, check=False).stdout[-3000:] + docker("logs", name, check=False).stderr[-3000:]  # noqa: E731
        ready = lambda: get_json(f"http://127.0.0.1:{admin_port}/readyz")[1].get("live_nodes") == len(NODES)  # noqa: E731
        eventually(ready, timeout_s=60, show=logs)
        procs.append(start_envoy(envoy_bin, EnvoySettings(
            fleet=list(addr.values()),
            integration="ext_proc",
            ext_proc_address=f"127.0.0.1:{ext_proc_port}",
            listen_address=f"127.0.0.1:{listen_port}",
            admin_address=f"127.0.0.1:{free_port()}",
            message_timeout_ms=2000,
        ), tmp_path))
        yield {"admin": f"http://127.0.0.1:{admin_port}", "envoy": f"http://127.0.0.1:{listen_port}", "addr": addr,
               "logs": logs}
    finally:
        for p in reversed(procs):
            p.stop()
        docker("rm", "-f", name, check=False)


def test_kvgate_serve_from_the_image_decides_a_request_through_envoy(served: dict) -> None:
    status, health = get_json(served["admin"] + "/healthz")
    assert status == 200, health

    status, body = post_json(served["envoy"] + "/v1/chat/completions", chat(document("harbour"), "Summarise it."))
    assert status == 200, (body, served["logs"]())
    # The destination header is kvgate's decision (clients' are stripped); without it Envoy's
    # fallback would have balanced the request with no header at all.
    assert body["headers"].get("x-gateway-destination-endpoint") == served["addr"][body["node"]], served["logs"]()

    status, err = post_json(served["envoy"] + "/v1/chat/completions", {**chat("hi", "hello"), "model": "no-such-model"})
    assert status == 404 and err["object"] == "error", err  # answered by the container's kvgate

    _, _, raw = request(served["admin"] + "/metrics")
    assert re.search(r'kvgate_decisions_total\{outcome="[a-z_]+",policy="kvgate"\} 1\.0', raw.decode()), raw.decode()
