"""The one interface both transports implement: register a buffer, let peers read it, read theirs.

A transfer is always a *one-sided read* by the puller: the owner only answers a small control
request (which slots, at which addresses) and keeps those blocks pinned; the bulk bytes then move
without the owner's CPU (RDMA) or through its transport's own threads (Mooncake over TCP). Every
failure of a transport — peer gone, refused read, bad address, device error, timeout — surfaces
as ``TransferError``, so the caller has one thing to catch before it falls back to recomputing.

Backends:

* ``kvgate-tcp`` (default) — the bytes come through the owner agent's own signed, lease-bound
  ``/kv/read``; no port but the agent's; ``workers.transfer.tcp_backend``.
* ``mooncake-tcp`` / ``mooncake-rdma`` — Mooncake Transfer Engine with P2P handshake (no
  metadata server); ``workers.transfer.mooncake_backend``. Its own ports (every interface) serve
  the registered slots to anyone who reaches them: only where the network admits no one else.
* ``verbs`` — direct RC queue pairs and RDMA READ through pyverbs; ``workers.transfer.verbs_backend``.

``read`` blocks (the transports are synchronous C++): callers run it in a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workers.transfer.auth import PeerAuth

BACKENDS = ("kvgate-tcp", "mooncake-tcp", "mooncake-rdma", "verbs")


class TransferError(Exception):
    """A pull could not move or verify its blocks; the caller recomputes instead.

    ``reason`` is a short metric label: ``unreachable`` (owner gone), ``refused``, ``timeout``,
    ``checksum``, ``no_slots``, ``mismatch`` (incompatible peers), ``transfer`` (the read failed),
    ``untrusted_source`` (not one of the fleet's transfer endpoints).
    """

    def __init__(self, message: str, reason: str = "transfer") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Copy ``length`` bytes at the peer's ``remote_addr`` to our ``local_addr``."""

    local_addr: int
    remote_addr: int
    length: int


class TransferBackend(Protocol):
    """A transport that can expose one local buffer and read from peers' buffers."""

    name: str

    def register(self, address: int, length: int) -> None:
        """Make ``[address, address + length)`` readable by peers and writable by our reads."""
        ...

    def descriptor(self) -> dict[str, Any]:
        """JSON-safe facts a peer needs to read from us (sent in every lease answer)."""
        ...

    def connect_request(self, peer: dict[str, Any]) -> dict[str, Any] | None:
        """What to send a peer before reading from it the first time (None: nothing to set up)."""
        ...

    def accept(self, request: dict[str, Any]) -> dict[str, Any]:
        """Owner side of ``connect_request``: set up our end, answer with what the peer needs."""
        ...

    def connected(self, peer: dict[str, Any], answer: dict[str, Any]) -> None:
        """Puller side: finish the connection with the owner's ``accept`` answer."""
        ...

    def read(self, peer: dict[str, Any], ops: Sequence[ReadOp]) -> None:
        """Perform every read (blocking); raise ``TransferError`` if any failed."""
        ...

    def close(self) -> None: ...


def coalesce(ops: Iterable[ReadOp]) -> list[ReadOp]:
    """Merge reads that are contiguous on both sides: fewer, larger transfers."""
    out: list[ReadOp] = []
    for op in ops:
        if out:
            last = out[-1]
            if last.local_addr + last.length == op.local_addr and last.remote_addr + last.length == op.remote_addr:
                out[-1] = ReadOp(last.local_addr, last.remote_addr, last.length + op.length)
                continue
        out.append(op)
    return out


def make_backend(name: str, *, host: str, auth: PeerAuth, device: str = "") -> TransferBackend:
    """Build a backend by name; raise ``TransferError`` if its library or device is missing."""
    if name == "kvgate-tcp":
        from workers.transfer.tcp_backend import AgentTcpBackend

        return AgentTcpBackend(auth)
    if name in ("mooncake-tcp", "mooncake-rdma"):
        from workers.transfer.mooncake_backend import MooncakeBackend

        return MooncakeBackend(host, protocol=name.removeprefix("mooncake-"), device=device)
    if name == "verbs":
        from workers.transfer.verbs_backend import VerbsBackend

        return VerbsBackend(device=device)
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
