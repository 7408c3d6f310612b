"""A cap on the connections a server holds before their client has proven to be a legitimate one.

Why: a port a stranger can reach (a transfer agent's, kvgate's ext_authz port) would otherwise
hold every connection opened to it until a timeout, and enough of them use up the process's file
descriptors: the legitimate client (a fleet peer, Envoy) then cannot connect at all. A connection
is *untrusted* from its opening until its client proves itself (a signed request, Envoy's caller
token); past ``cap`` untrusted connections, the oldest is closed. A legitimate client proves
itself with its first request, sent whole at once, so it is closed only if ``cap`` newer
connections arrive in that moment; an attacker must keep opening connections to keep any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, Hashable, TypeVar

C = TypeVar("C", bound=Hashable)


class UntrustedConnections(Generic[C]):
    """Untrusted connections in the order they opened; ``admit`` closes the oldest past ``cap``."""

    def __init__(self, cap: int, close: Callable[[C], None]) -> None:
        if cap < 1:
            raise ValueError("the cap on untrusted connections must be at least 1")
        self.cap = cap
        self.evicted = 0  # connections closed because the cap was reached
        self._close = close
        self._conns: dict[C, None] = {}  # insertion-ordered: the oldest first

    def admit(self, conn: C) -> None:
        """A new connection; closes the oldest untrusted ones while more than ``cap`` are open."""
        self._conns[conn] = None
        while len(self._conns) > self.cap:
            oldest = next(iter(self._conns))
            del self._conns[oldest]
            self.evicted += 1
            self._close(oldest)

    def trust(self, conn: C) -> None:
        """Its client proved itself: no longer counted, never closed by the cap."""
        self._conns.pop(conn, None)

    def forget(self, conn: C) -> None:
        """The connection closed."""
        self._conns.pop(conn, None)

    def __contains__(self, conn: object) -> bool:
        return conn in self._conns

    def __len__(self) -> int:
        return len(self._conns)

    def __iter__(self) -> Iterator[C]:
        return iter(list(self._conns))
