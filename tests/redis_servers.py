"""Private redis-server processes for tests: a single server that a test may kill and restart,
and a 3-primary Redis Cluster (with replicas, for a test that fails a primary over). All bound to 127.0.0.1 on free ports, in a temp dir, and killed
at the end — the machine's shared Redis at :6379 is never stopped or reconfigured.

Its fixtures (``private_redis``, ``redis_cluster_url``) are registered for every test by ``tests/conftest.py``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import free_port

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server for port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} did not start within {timeout_s}s")


class RedisProcess:
    """One redis-server in the foreground (a child we can kill), no persistence."""

    def __init__(self, port: int, workdir: Path, *extra: str) -> None:
        self.port = port
        self.workdir = workdir
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def private_redis() -> Iterator[RedisProcess]:
    """A redis-server only this test uses (it may kill and restart it)."""
    with tempfile.TemporaryDirectory(prefix="kvgate-redis-") as tmp:
        server = RedisProcess(free_port(), Path(tmp)).start()
        try:
            yield server
        finally:
            server.kill()


@contextmanager
def redis_cluster(primaries: int = 3, replicas: int = 0) -> Iterator[tuple[str, list[RedisProcess]]]:
    """Start a Redis Cluster; yield its ``redis+cluster://`` URL and its processes; kill them after.
    With ``replicas`` per primary it returns once every slot range has them (a failover can follow)."""
    with tempfile.TemporaryDirectory(prefix="kvgate-cluster-") as tmp:
        servers: list[RedisProcess] = []
        try:
            for i in range(primaries * (1 + replicas)):
                port = free_port()
                servers.append(
                    RedisProcess(
                        port,
                        Path(tmp) / str(i),
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", f"nodes-{port}.conf",
                        # the default bus port (port + 10000) may be taken or out of range
                        "--cluster-port", str(free_port()),
                    ).start()
                )
            addrs = [f"127.0.0.1:{s.port}" for s in servers]
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
            )
            _wait_cluster_ok(servers[0].port, replicas)
            yield "redis+cluster://" + ",".join(addrs), servers
        finally:
            for s in servers:
                s.kill()


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A real 3-primary Redis Cluster shared by the whole session."""
    with redis_cluster() as (url, _):
        yield url


def _wait_cluster_ok(port: int, replicas: int = 0, timeout_s: float = 15.0) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(
            [REDIS_CLI, "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=5
        ).stdout
        if "cluster_state:ok" in out:
            if not replicas:
                return
            with redis.Redis(port=port) as c:
                if all(len(row) >= 3 + replicas for row in c.execute_command("CLUSTER", "SLOTS")):
                    return
        time.sleep(0.1)
    raise RuntimeError("redis cluster did not reach cluster_state:ok")


def purge_prefix(url: str, prefix: str) -> int:
    """Delete every key a directory with ``prefix`` wrote, on a single Redis or every cluster seed
    (our clusters have no replicas, so the seeds are all the primaries). Returns keys deleted."""
    import redis

    if url.startswith("redis+cluster://"):
        addrs = [hp.rsplit(":", 1) for hp in url.removeprefix("redis+cluster://").split(",")]
        clients = [redis.Redis(host=h, port=int(p)) for h, p in addrs]
    else:
        clients = [redis.Redis.from_url(url)]
    deleted = 0
    for c in clients:
        try:
            for pattern in (f"{prefix}:*", f"{{{prefix}}}:*"):
                for key in c.scan_iter(match=pattern, count=1000):
                    deleted += c.delete(key)
        finally:
            c.close()
    return deleted
