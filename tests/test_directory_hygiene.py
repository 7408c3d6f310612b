"""Directory hygiene on real Redis: what an operator sees in Redis and in the logs.

- Nodes that die without a goodbye (and the reservations of replicas that died mid-request)
  leave no keys behind once their retention passes: Redis memory is bounded under churn.
- A password-protected Redis works (and its password never appears in kvgate's log); a TLS
  Redis works with a CA file, and refuses a client that cannot verify it.
- The memory one indexed block costs is measured (directory_client/README.md, "Memory").
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import redis

from directory_client import NodeInfo, Tier, open_directory
from directory_client.factory import redact_url
from directory_client.types import DirectoryUnavailable
from gateway.config import ConfigError, load_config
from tests.conftest import free_port
from tests.redis_servers import RedisProcess
from tests.support.http import eventually, get_json
from tests.support.procs import python_module, start_kvgate
from tokenizer.keys import block_keys, namespace_seed


def _keys(n: int, salt: int) -> list[int]:
    return block_keys([(i * 31 + salt) % 100_000 for i in range(n * 16)], block_size=16, seed=namespace_seed("m"))


async def test_dead_nodes_and_leaked_reservations_expire(redis_url: str, key_prefix: str) -> None:
    """40 nodes register, write blocks, take load, and vanish (no deregister, no release); one
    node stays alive. After the heartbeat TTL + retention (and the reservation deadline) only the
    live node's keys and the two shared keys are left."""
    kw = dict(key_prefix=key_prefix, heartbeat_ttl_s=0.3, index_stride=1, dead_node_retention_s=0.6, max_request_s=0.8)
    d = open_directory(redis_url, **kw)
    r = redis.Redis.from_url(redis_url)
    try:
        await d.register_node(NodeInfo("survivor", "10.0.0.1:8000"))
        for i in range(40):
            node = f"churn-{i}"
            await d.register_node(NodeInfo(node, f"10.0.1.{i}:8000"))
            await d.record_stored(node, _keys(64, i), Tier.GPU)
            await d.reserve(node, 1000)  # never released: its replica "died"
        everything = {k.decode() for k in r.scan_iter(match=f"*{key_prefix}*", count=1000)}
        assert len(everything) > 40 * 3

        async def only_survivor_left() -> set[str] | None:
            await d.heartbeat("survivor")  # a live node's heartbeat also prunes the registry
            left = {k.decode() for k in r.scan_iter(match=f"*{key_prefix}*", count=1000)}
            registry = {m.decode() for m in r.zrange(f"{{{key_prefix}}}:registry", 0, -1)}
            return left if not any("churn" in k for k in left) and registry == {"survivor"} else None

        deadline = asyncio.get_running_loop().time() + 5
        while (left := await only_survivor_left()) is None:
            assert asyncio.get_running_loop().time() < deadline, "dead nodes' keys are still in Redis"
            await asyncio.sleep(0.1)
        assert left <= {f"{key_prefix}:{{survivor}}:meta", f"{{{key_prefix}}}:registry", f"{{{key_prefix}}}:config"}
        assert [n.node_id for n in await d.live_nodes()] == ["survivor"]
    finally:
        await d.aclose()
        for k in r.scan_iter(match=f"*{key_prefix}*"):
            r.delete(k)
        r.close()


def test_memory_per_million_indexed_blocks(redis_url: str, key_prefix: str) -> None:
    """200k blocks in one node's hash, measured with MEMORY USAGE, extrapolated to a million."""
    d = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=30, index_stride=1)
    r = redis.Redis.from_url(redis_url)
    n = 200_000
    keys = [(i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for i in range(1, n + 1)]

    async def fill() -> None:
        await d.register_node(NodeInfo("mem", "10.0.0.1:8000"))
        for i in range(0, n, 8192):
            await d.record_stored("mem", keys[i : i + 8192], Tier.GPU)
        await d.aclose()

    try:
        asyncio.run(fill())
        used = r.memory_usage(f"{key_prefix}:{{mem}}:blocks", samples=0)
        per_block = used / n
        print(f"\ndirectory memory: {per_block:.1f} B per indexed block = {per_block:.1f} MB per million "
              f"(= {per_block / 4:.1f} B per engine block at the default stride 4)")  # fmt: skip
        assert r.hlen(f"{key_prefix}:{{mem}}:blocks") == n
        assert 16 < per_block < 100  # 8-byte field + 1-byte value + hashtable entry
    finally:
        for k in r.scan_iter(match=f"*{key_prefix}*"):
            r.delete(k)
        r.close()


# -- AUTH -----------------------------------------------------------------------------------


@pytest.fixture
def auth_redis():
    with tempfile.TemporaryDirectory(prefix="kvgate-auth-") as tmp:
        server = RedisProcess(free_port(), Path(tmp), "--requirepass", "s3cret-pw").start()
        try:
            yield server
        finally:
            server.kill()


async def test_password_protected_redis(auth_redis: RedisProcess) -> None:
    """The password in the URL opens it; no password or a wrong one is an outage (fail open)."""
    good = f"redis://:s3cret-pw@127.0.0.1:{auth_redis.port}/0"
    d = open_directory(good, key_prefix="auth", heartbeat_ttl_s=5, index_stride=1)
    await d.register_node(NodeInfo("a", "10.0.0.1:8000"))
    await d.record_stored("a", _keys(4, 1), Tier.GPU)
    view = await d.lookup(_keys(4, 1))
    assert [(v.node.node_id, v.cached_blocks) for v in view.nodes] == [("a", 4)]
    await d.aclose()
    for bad in (f"redis://127.0.0.1:{auth_redis.port}/0", f"redis://:wrong@127.0.0.1:{auth_redis.port}/0"):
        d = open_directory(bad, key_prefix="auth", heartbeat_ttl_s=5, index_stride=1)
        with pytest.raises(DirectoryUnavailable):
            await d.lookup(_keys(4, 1))
        await d.aclose()
    assert redact_url(good) == f"redis://:***@127.0.0.1:{auth_redis.port}/0"


def test_kvgate_serve_with_a_password_never_logs_it(auth_redis: RedisProcess, tmp_path: Path) -> None:
    admin = free_port()
    cfg = {
        "listen_host": "127.0.0.1",
        "ext_proc_port": free_port(),
        "admin_port": admin,
        "directory": {"url": f"redis://:s3cret-pw@127.0.0.1:{auth_redis.port}/0", "key_prefix": "auth-serve"},
        "log": {"level": "DEBUG"},
    }
    proc = start_kvgate(cfg, tmp_path)
    try:
        eventually(lambda: get_json(f"http://127.0.0.1:{admin}/readyz")[1].get("directory") == "ok", timeout_s=20)
    finally:
        proc.stop()
    out = proc.output()
    assert "kvgate serving" in out
    assert "s3cret-pw" not in out
    assert ":***@" in out


# -- TLS ------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_redis():
    """A redis-server speaking only TLS, with a certificate from a CA of this test's own."""
    with tempfile.TemporaryDirectory(prefix="kvgate-tls-") as tmp:
        d = Path(tmp)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=kvgate-test-ca", cwd=d)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
        (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)
        port = free_port()
        server = RedisProcess(
            port, d / "data", "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(d / "server.crt"),
            "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
        )  # fmt: skip
        server.start()
        try:
            yield port, d / "ca.crt"
        finally:
            server.kill()


async def test_tls_redis_with_a_ca_file(tls_redis) -> None:
    port, ca = tls_redis
    d = open_directory(f"rediss://127.0.0.1:{port}/0", key_prefix="tls", heartbeat_ttl_s=5, index_stride=1, tls_ca_file=str(ca))
    await d.register_node(NodeInfo("t", "10.0.0.1:8000"))
    assert [n.node_id for n in await d.live_nodes()] == ["t"]
    await d.aclose()
    # the same through the URL alone (what `kvgate bridge --directory` takes)
    d = open_directory(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", key_prefix="tls", heartbeat_ttl_s=5, index_stride=1)
    assert [n.node_id for n in await d.live_nodes()] == ["t"]
    await d.aclose()


def test_the_bridge_verifies_tls_redis_with_the_ca_named_in_its_environment(tls_redis, tmp_path: Path) -> None:
    """`kvgate bridge` reads KVGATE_DIRECTORY__TLS_CA_FILE (what the chart sets beside the mounted
    Secret): with it the directory answers at start; without it the bridge says it cannot reach it."""
    port, ca = tls_redis
    args = ["--directory", f"rediss://127.0.0.1:{port}/0", "--model", "m", "--key-prefix", f"tls-{uuid.uuid4().hex[:8]}",
            "--engine", f"node_id=n1,address=127.0.0.1:{free_port()},events=tcp://127.0.0.1:{free_port()}"]  # fmt: skip
    for env, reachable in (({"KVGATE_DIRECTORY__TLS_CA_FILE": str(ca)}, True), ({}, False)):
        proc = python_module("bridge", "gateway.cli", ["bridge", *args], tmp_path, env=env)
        try:
            eventually(lambda: "following 1 engine" in proc.output(), timeout_s=30)
        finally:
            proc.stop()
        assert ("directory unavailable at start" not in proc.output()) is reachable, proc.output()


async def test_tls_redis_refuses_what_cannot_verify_it(tls_redis) -> None:
    port, _ = tls_redis
    for url in (f"rediss://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):  # unknown CA; plain text
        d = open_directory(url, key_prefix="tls", heartbeat_ttl_s=5, index_stride=1, op_timeout_s=1.0)
        with pytest.raises(DirectoryUnavailable):
            await d.live_nodes()
        await d.aclose()


def test_tls_config_is_validated(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = load_config(None, directory={"url": "rediss://redis:6380/0", "tls_ca_file": str(ca)})
    assert cfg.directory.tls_ca_file == str(ca)
    with pytest.raises(ConfigError, match="rediss"):
        load_config(None, directory={"url": "redis://redis:6379/0", "tls_ca_file": str(ca)})
    with pytest.raises(ConfigError, match="not found"):
        load_config(None, directory={"url": "rediss://redis:6380/0", "tls_ca_file": str(tmp_path / "missing.crt")})
    with pytest.raises(ConfigError) as e:
        load_config(None, directory={"url": "user:hunter2@redis:6379"})
    assert "hunter2" not in str(e.value)
    with pytest.raises(ValueError, match="rediss"):
        open_directory("redis://redis:6379/0", tls_ca_file=str(ca))
