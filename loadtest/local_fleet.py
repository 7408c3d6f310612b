"""A whole fleet on this machine: N simulated engines, and in front of them one gateway at a time.

``LocalFleet`` starts ``kvgate worker`` processes (each with a KV-event PUB and replay socket) and
then, per policy, the gateway that policy needs (``gateway_kinds.GATEWAYS``):

- ``envoy``: plain Envoy balancing (``ROUND_ROBIN`` / ``LEAST_REQUEST``), no ext_proc;
- ``kvgate``: ``kvgate serve`` with the fleet's nodes (embedded KV-event bridges, directory from
  ``directory_url``) and Envoy in front, calling it over ``integration``: ext_proc (gRPC) or
  ext_authz (HTTP);
- ``sglang``: the ``sglang-router`` package's router with ``--policy cache_aware``.

Switching policy restarts the gateway (``kvgate serve`` reads its policy at start), the engines
stay up; ``reset_caches`` empties every engine's prefix cache between runs. Everything binds to
127.0.0.1 on free ports and is stopped by pid in ``close``.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gateway.envoy_config import EnvoySettings, render_yaml
from loadtest.pd_fleet import PdFleet
from loadtest.policies import check_prerequisites
from loadtest.procs import ManagedProcess, envoy_binary, free_port, free_ports, python_module
from loadtest.prom import counter_value, histogram_sum_count

ENGINE_TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class FleetOptions:
    nodes: int = 8
    model: str = "kvgate-sim"
    profile: str = "llama-3.1-8b-h100"
    time_scale: float = 1.0
    kv_blocks: int | None = None
    directory_url: str = "memory://"
    max_body_bytes: int = 8 << 20
    extra_worker_args: tuple[str, ...] = ()
    roles: tuple[int, int] | None = None  # (prefill, decode) engines: a disaggregated fleet (loadtest.pd_fleet)
    link: str = "tcp"  # the link KV transfers are modelled and priced over (with roles)
    integration: str = "ext_proc"  # how Envoy asks kvgate: ext_proc (gRPC) or ext_authz (HTTP)


@dataclass(frozen=True)
class Worker:
    node_id: str
    port: int  # the engine's
    events_port: int
    replay_port: int
    role: str = "both"
    transfer_port: int = 0  # its transfer agent (disaggregated fleets)
    sidecar_port: int = 0  # a decode node's pd-sidecar, in front of the engine

    @property
    def address(self) -> str:
        """Where the gateway routes: the sidecar of a decode node, else the engine."""
        return f"127.0.0.1:{self.sidecar_port or self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass
class Gateway:
    """Where to send traffic for one policy, and where its decision metrics are (kvgate only)."""

    kind: str
    url: str
    metrics_url: str | None = None
    procs: list[ManagedProcess] = field(default_factory=list)


def http(url: str, *, method: str = "GET", body: bytes | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(check, *, timeout_s: float, what: str, interval_s: float = 0.1) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, ValueError) as e:
            last = e
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s:g} s (last error: {last!r})")


class LocalFleet:
    """Start with ``with LocalFleet(opts, workdir) as fleet:``; gateways via ``fleet.gateway(policy)``."""

    def __init__(self, options: FleetOptions, workdir: Path) -> None:
        self.options = options
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workers: list[Worker] = []
        self._procs: list[ManagedProcess] = []
        self.pd = PdFleet(options, self.workdir) if options.roles else None

    # -- engines -----------------------------------------------------------------------------

    def start(self) -> LocalFleet:
        """Start every engine; on any failure stop what was started and raise."""
        try:
            pending = list(range(self.options.nodes))
            for _attempt in range(3):  # a port picked as free can be taken by someone else meanwhile
                pending = self._start_engines(pending)
                if not pending:
                    break
            if pending:
                raise RuntimeError(f"engines {', '.join(f'n{i + 1}' for i in pending)} did not start; logs in {self.workdir}")
            if self.pd is not None:
                self.workers = self.pd.start_sidecars(self.workers, self._procs)
        except BaseException:
            self.close()
            raise
        self.workers.sort(key=lambda w: int(w.node_id[1:]))
        return self

    def _start_engines(self, indices: list[int]) -> list[int]:
        """Start engines ``indices``; returns those whose process died before listening."""
        o = self.options
        started: list[tuple[int, Worker, ManagedProcess]] = []
        ports = free_ports(4 * len(indices))
        for j, i in enumerate(indices):
            w = Worker(f"n{i + 1}", *ports[4 * j : 4 * j + 3])
            if self.pd is not None:
                w = self.pd.with_role(w, i, ports[4 * j + 3])
            args = [
                "worker", "--host", "127.0.0.1", "--port", str(w.port), "--model", o.model,
                "--profile", o.profile, "--time-scale", str(o.time_scale), "--node-id", w.node_id,
                "--events-endpoint", f"tcp://127.0.0.1:{w.events_port}",
                "--replay-endpoint", f"tcp://127.0.0.1:{w.replay_port}",
                "--debug-headers",  # the client attributes answers to nodes
                *(["--kv-blocks", str(o.kv_blocks)] if o.kv_blocks else []),
                *(self.pd.worker_args(w) if self.pd is not None else []),
                *o.extra_worker_args,
            ]
            p = python_module(f"worker-{w.node_id}", "gateway.cli", args, self.workdir)
            self._procs.append(p)
            started.append((i, w, p))
        failed = []
        for i, w, p in started:
            try:
                p.wait_port(w.port, timeout_s=60)
                self.workers.append(w)
            except RuntimeError:  # exited (e.g. a port was taken): retried with new ports
                p.stop()
                self._procs.remove(p)
                failed.append(i)
        return failed

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in reversed(self._procs):
            p.stop()
        self._procs.clear()

    @property
    def node_ids(self) -> list[str]:
        return [w.node_id for w in self.workers]

    def reset_caches(self, timeout_s: float = 60.0) -> None:
        """``POST /debug/reset`` on every engine (retried while it still has requests: 409)."""
        for w in self.workers:
            wait_until(
                lambda w=w: http(w.url + "/debug/reset", method="POST", body=b"{}")[0] == 200,
                timeout_s=timeout_s, what=f"cache reset of {w.node_id}", interval_s=0.2,
            )

    def busy_seconds(self) -> dict[str, float]:
        """Modelled GPU seconds each engine has spent in steps so far (a counter)."""
        out = {}
        for w in self.workers:
            status, text = http(w.url + "/metrics")
            out[w.node_id] = counter_value(text.decode(), "kvgate_engine_busy_seconds") if status == 200 else 0.0
        return out

    def engine_ttft(self) -> tuple[float, float]:
        """Seconds from arrival at an engine to its first token, summed over every engine, and the
        requests counted (vLLM's TTFT histogram, which the simulated engines keep too): counters."""
        total = count = 0.0
        for w in self.workers:
            status, text = http(w.url + "/metrics")
            if status == 200:
                s, c = histogram_sum_count(text.decode(), ENGINE_TTFT)
                total, count = total + s, count + c
        return total, count

    # -- gateways ----------------------------------------------------------------------------

    def serve_settings(self) -> dict[str, object]:
        """Extra ``kvgate serve`` settings these engines need (block size, tokenizer); none here."""
        return {}

    @contextmanager
    def gateway(
        self, kind: str, *, lb_policy: str = "", policy: str = "", options: dict[str, object] | None = None
    ) -> Iterator[Gateway]:
        """Bring up the gateway ``kind`` in front of the engines; stop it on exit."""
        if kind == "envoy":
            gw = self._envoy(integration="none", lb_policy=lb_policy, kvgate_port=0, name=f"envoy-{lb_policy.lower()}")
        elif kind == "kvgate":
            gw = self._kvgate(policy, options or {})
        elif kind == "sglang":
            gw = self._sglang(policy or "cache_aware")
        else:
            raise ValueError(f"unknown gateway kind {kind!r}")
        try:
            yield gw
        finally:
            for p in reversed(gw.procs):
                p.stop()

    def _envoy(self, *, integration: str, lb_policy: str, kvgate_port: int, name: str) -> Gateway:
        listen = free_port()
        settings = EnvoySettings(
            fleet=[w.address for w in self.workers if w.role != "prefill"],  # a prefill node never serves a whole request
            ext_proc_address=f"127.0.0.1:{kvgate_port or 1}",
            ext_authz_address=f"127.0.0.1:{kvgate_port or 1}",
            listen_address=f"127.0.0.1:{listen}",
            admin_address=f"127.0.0.1:{free_port()}",
            max_body_bytes=self.options.max_body_bytes,
            message_timeout_ms=2000,
            integration=integration,  # type: ignore[arg-type]
            lb_policy=lb_policy or "LEAST_REQUEST",
        )
        cfg = self.workdir / f"{name}.yaml"
        cfg.write_text(render_yaml(settings))
        p = ManagedProcess(
            name,
            [envoy_binary(), "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"],
            self.workdir,
        )
        try:
            p.wait_port(listen)
        except BaseException:
            p.stop()
            raise
        return Gateway("envoy", f"http://127.0.0.1:{listen}", procs=[p])

    def _kvgate(self, policy: str, options: dict[str, object]) -> Gateway:
        o = self.options
        ext_proc, admin = free_port(), free_port()
        authz = free_port() if o.integration == "ext_authz" else 0  # then ext_proc is off: one wire per run
        config = {
            "listen_host": "127.0.0.1",
            "ext_proc_port": ext_proc,
            "admin_port": admin,
            **({"ext_authz_port": authz, "ext_proc_enabled": False} if authz else {}),
            "models": [o.model],
            "directory": {
                "url": o.directory_url,
                "key_prefix": f"kvgate-loadtest:{uuid.uuid4().hex[:12]}",
                "heartbeat_ttl_s": 5.0,
                "lookup_timeout_ms": 100,
            },
            "fleet": [
                {
                    "node_id": w.node_id,
                    "address": w.address,
                    "events_endpoint": f"tcp://127.0.0.1:{w.events_port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{w.replay_port}",
                    **({"role": w.role, "transfer_endpoint": f"127.0.0.1:{w.transfer_port}"} if w.transfer_port else {}),
                }
                for w in self.workers
            ],
            "policy": {"name": policy, "profile": o.profile, **({"link": o.link} if o.roles else {}), **options},
            "limits": {"max_body_bytes": o.max_body_bytes},
            "log": {"level": "WARNING"},
            **self.serve_settings(),
        }
        label = policy if not options else f"{policy}-" + "-".join(f"{k}={v}" for k, v in options.items())
        cfg = self.workdir / f"kvgate-{label}.yaml"
        cfg.write_text(yaml.safe_dump(config))
        serve = python_module(f"kvgate-{label}", "gateway.cli", ["serve", "--config", str(cfg)], self.workdir)
        try:
            serve.wait_port(admin, timeout_s=60)
            n = len(self.workers)
            wait_until(
                lambda: json.loads(http(f"http://127.0.0.1:{admin}/readyz")[1]).get("live_nodes") == n,
                timeout_s=60, what=f"kvgate sees {n} live nodes",
            )
            envoy = self._envoy(integration=o.integration, lb_policy="LEAST_REQUEST",
                                kvgate_port=authz or ext_proc, name=f"envoy-{label}")
        except BaseException:
            serve.stop()
            raise
        return Gateway("kvgate", envoy.url, f"http://127.0.0.1:{admin}/metrics", procs=[serve, *envoy.procs])

    def _sglang(self, policy: str) -> Gateway:
        check_prerequisites(["sglang"])
        port = free_port()
        args = [
            "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *[w.url for w in self.workers],
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn", "--request-timeout-secs", "600",
        ]
        p = ManagedProcess("sglang-router", [sys.executable, "-m", "sglang_router.launch_router", *args], self.workdir)
        try:
            p.wait_port(port, timeout_s=60)
            wait_until(lambda: http(f"http://127.0.0.1:{port}/v1/models")[0] == 200, timeout_s=60, what="sglang-router ready")
        except BaseException:
            p.stop()
            raise
        return Gateway("sglang", f"http://127.0.0.1:{port}", procs=[p])
