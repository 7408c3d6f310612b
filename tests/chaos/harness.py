"""A whole fleet as real processes, for chaos tests: a private redis-server, simulated workers
(`kvgate worker`, publishing vLLM KV events, each with a transfer agent signing with the fleet's
secret), one `kvgate bridge` per worker, two `kvgate serve` replicas sharing the directory and
answering only Envoy (the caller token), and Envoy with both replicas as endpoints of its ext_proc
cluster.

Everything binds 127.0.0.1 on free ports; every process is a child that the harness kills by its
own handle. Envoy writes a JSON access log per request (chosen destination, upstream host,
attempts), which is how a test tells "routed by kvgate" from "fell through to the fallback".
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from gateway.envoy_config import EnvoySettings, render_bootstrap
from tests.conftest import free_ports
from tests.redis_servers import RedisProcess
from tests.support.http import eventually, get_json
from tests.support.procs import Proc, wait_for_port

MODEL = "deepseek-chat"
TTL_S = 2.0  # directory heartbeat TTL (bridges write it, every replica reads it)
ENGINE_TIMEOUT_S = 1.5  # a paused worker is dropped after this many seconds of silent ZMTP heartbeats
ROUTE_TIMEOUT_S = 3.0  # Envoy gives up on a request after this (a paused worker's requests)
HEALTH_INTERVAL_MS = 500
_FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


@dataclass
class Worker:
    name: str
    port: int
    events_port: int
    replay_port: int
    transfer_port: int = 0
    proc: Proc | None = None
    bridge: Proc | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def engine_spec(self) -> str:
        return (
            f"node_id={self.name},address={self.address},events=tcp://127.0.0.1:{self.events_port},"
            f"replay=tcp://127.0.0.1:{self.replay_port}"
        )


@dataclass
class Replica:
    name: str
    ext_proc_port: int
    admin_port: int
    config_path: Path
    proc: Proc | None = None


class ChaosFleet:
    """Start with ``start()``, stop with ``stop()``; the fault methods act on single processes."""

    def __init__(self, workers: int = 3, replicas: int = 2, *, time_scale: float = 0.05) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
        self.key_prefix = f"kvgate-chaos:{uuid.uuid4().hex[:10]}"
        self.time_scale = time_scale
        ports = iter(free_ports(1 + 4 * workers + 2 * replicas + 2))  # distinct: no two servers on one port
        self.redis = RedisProcess(next(ports), self.tmp / "redis")
        self.workers = [Worker(f"w{i + 1}", next(ports), next(ports), next(ports), next(ports)) for i in range(workers)]
        self.caller_token = f"chaos-caller-{uuid.uuid4().hex}"  # Envoy → kvgate
        (self.tmp / "caller-token").write_text(self.caller_token)
        self.transfer_secret = self.tmp / "transfer-secret"  # the workers' agents sign with it
        self.transfer_secret.write_text(f"chaos-transfer-{uuid.uuid4().hex}")
        self.replicas = [
            Replica(f"r{i + 1}", next(ports), next(ports), self.tmp / f"r{i + 1}.yaml") for i in range(replicas)
        ]
        self.listen_port = next(ports)
        self.envoy_admin_port = next(ports)
        self.access_log = self.tmp / "access.log"
        self.envoy: Proc | None = None
        self._starts: dict[str, int] = {}

    def _name(self, base: str) -> str:
        """A fresh log name per start, so a restarted process keeps its predecessor's log."""
        n = self._starts[base] = self._starts.get(base, 0) + 1
        return base if n == 1 else f"{base}.{n}"

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> "ChaosFleet":
        self.redis.start()
        for w in self.workers:
            self.start_worker(w, wait=False)
        for r in self.replicas:
            r.config_path.write_text(yaml.safe_dump(self._replica_config(r)))
            self.start_replica(r, wait=False)
        for w in self.workers:
            assert w.proc is not None
            wait_for_port(w.port, proc=w.proc.popen, timeout_s=60)
            self.start_bridge(w)
        for r in self.replicas:
            assert r.proc is not None
            wait_for_port(r.admin_port, proc=r.proc.popen, timeout_s=60)
        self._start_envoy()
        eventually(self.all_live, timeout_s=30, show=self.live_counts)
        return self

    def stop(self) -> None:
        procs = [self.envoy] + [r.proc for r in self.replicas] + [w.bridge for w in self.workers]
        procs += [w.proc for w in self.workers]
        for p in procs:
            if p is not None:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGCONT)  # a paused child cannot act on SIGTERM
                p.stop()
        self.redis.kill()

    # -- parts --------------------------------------------------------------------------------

    def _replica_config(self, r: Replica) -> dict:
        return {
            "listen_host": "127.0.0.1",
            "ext_proc_port": r.ext_proc_port,
            "admin_port": r.admin_port,
            "models": [MODEL],
            "directory": {
                "url": self.redis.url,
                "key_prefix": self.key_prefix,
                "heartbeat_ttl_s": TTL_S,
                "lookup_timeout_ms": 150,
                "op_timeout_s": 0.15,
            },
            "limits": {"max_body_bytes": 1 << 20},
            "log": {"level": "WARNING"},
            "caller_token_file": str(self.tmp / "caller-token"),
            # what may be routed to (the bridges' registrations alone are not trusted), as the chart renders it
            "fleet": [
                {"node_id": w.name, "address": w.address, "transfer_endpoint": f"127.0.0.1:{w.transfer_port}"}
                for w in self.workers
            ],
        }

    def start_worker(self, w: Worker, *, wait: bool = True) -> None:
        w.proc = Proc(
            self._name(f"worker-{w.name}"),
            [
                sys.executable, "-m", "workers.engine",
                "--port", str(w.port), "--model", MODEL, "--node-id", w.name,
                "--time-scale", str(self.time_scale),
                "--events-endpoint", f"tcp://127.0.0.1:{w.events_port}",
                "--replay-endpoint", f"tcp://127.0.0.1:{w.replay_port}",
                "--transfer-port", str(w.transfer_port), "--transfer-secret-file", str(self.transfer_secret),
                "--transfer-peers", ",".join(f"127.0.0.1:{o.transfer_port}" for o in self.workers if o is not w),
                "--debug-headers",  # the load attributes answers to workers
            ],
            self.tmp,
        )  # fmt: skip
        if wait:
            wait_for_port(w.port, proc=w.proc.popen, timeout_s=60)

    def start_bridge(self, w: Worker) -> None:
        w.bridge = Proc(
            self._name(f"bridge-{w.name}"),
            [
                sys.executable, "-m", "gateway.cli", "bridge",
                "--directory", self.redis.url, "--key-prefix", self.key_prefix, "--model", MODEL,
                "--heartbeat-ttl", str(TTL_S), "--engine-timeout", str(ENGINE_TIMEOUT_S),
                "--replay-timeout", "1.0", "--log-level", "WARNING", "--engine", w.engine_spec(),
            ],
            self.tmp,
        )  # fmt: skip

    def start_replica(self, r: Replica, *, wait: bool = True) -> None:
        r.proc = Proc(self._name(r.name), [sys.executable, "-m", "gateway.cli", "serve", "--config", str(r.config_path)], self.tmp)
        if wait:
            wait_for_port(r.ext_proc_port, proc=r.proc.popen, timeout_s=60)

    def _start_envoy(self) -> None:
        settings = EnvoySettings(
            fleet=[w.address for w in self.workers],
            ext_proc_addresses=[f"127.0.0.1:{r.ext_proc_port}" for r in self.replicas],
            listen_address=f"127.0.0.1:{self.listen_port}",
            admin_address=f"127.0.0.1:{self.envoy_admin_port}",
            max_body_bytes=1 << 20,
            message_timeout_ms=1000,
            route_timeout_s=ROUTE_TIMEOUT_S,
            health_check_interval_ms=HEALTH_INTERVAL_MS,
            caller_token=self.caller_token,
        )
        boot = render_bootstrap(settings)
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": _FILE_LOG,
                    "path": str(self.access_log),
                    "log_format": {
                        "json_format": {
                            "id": "%REQ(x-chaos-id)%",
                            "code": "%RESPONSE_CODE%",
                            "flags": "%RESPONSE_FLAGS%",
                            "upstream": "%UPSTREAM_HOST%",
                            "dest": "%REQ(x-gateway-destination-endpoint)%",
                            "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
                        }
                    },
                },
            }
        ]
        cfg = self.tmp / "envoy.yaml"
        cfg.write_text(yaml.safe_dump(boot, sort_keys=False))
        envoy_bin = str(Path(sys.executable).with_name("envoy"))
        self.envoy = Proc(
            "envoy",
            [envoy_bin, "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"],
            self.tmp,
        )
        wait_for_port(self.listen_port, proc=self.envoy.popen)

    # -- observation --------------------------------------------------------------------------

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen_port}{path}"

    def live_counts(self) -> dict[str, object]:
        """Live nodes as each replica sees them (for failure messages)."""
        out: dict[str, object] = {}
        for r in self.replicas:
            try:
                out[r.name] = get_json(f"http://127.0.0.1:{r.admin_port}/readyz")[1].get("live_nodes")
            except Exception as e:  # a replica that is down right now
                out[r.name] = repr(e)
        return out

    def all_live(self) -> bool:
        return all(
            get_json(f"http://127.0.0.1:{r.admin_port}/readyz")[1].get("live_nodes") == len(self.workers)
            for r in self.replicas
        )

    def access_records(self) -> dict[str, dict]:
        """Envoy's access log by chaos id (the file logger flushes about once a second)."""
        out: dict[str, dict] = {}
        if not self.access_log.exists():
            return out
        for line in self.access_log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[rec.get("id") or ""] = rec
        return out

    def by_address(self) -> dict[str, str]:
        return {w.address: w.name for w in self.workers}
