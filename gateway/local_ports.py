"""Free loopback ports for the processes a bench, a load test or a test suite starts.

The kernel may hand the same port to two ``bind(0)`` calls in a row once the first socket is
closed, so a caller asking for a server's port and then for another it binds at once could point
the server at a port already taken: a readiness probe then succeeds against the wrong socket and
the first request hangs. Hence no port is handed out twice by one process.
"""

from __future__ import annotations

import socket
import threading

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now and this process never handed out."""
    with _lock:
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("no loopback port left that was not handed out already")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]
