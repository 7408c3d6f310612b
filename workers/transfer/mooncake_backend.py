"""Mooncake Transfer Engine as a ``TransferBackend`` (``mooncake-transfer-engine-non-cuda``).

Mooncake runs its own RPC listener and TCP (or RDMA) transport in C++ threads. With the
``P2PHANDSHAKE`` metadata mode there is no metadata server: a peer is named by its session id,
``host:rpc_port``, which goes into our descriptor; Mooncake exchanges segment descriptors on the
first read. ``batch_transfer_sync_read`` releases the GIL and returns 0 or a negative code
(peer refused, connection lost, address outside a registered segment): any non-zero code is a
``TransferError``.

Mooncake's handshake and data ports listen on every interface and know nothing of the fleet's
secret: the handshake tells any caller where the registered slots are, the data port serves reads
and writes of them to whoever connects. Use it only where the network lets no one but the fleet
reach the nodes (the default ``kvgate-tcp`` needs no such fence); it logs a warning at start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from workers.transfer.backend import ReadOp, TransferError

log = logging.getLogger(__name__)


class MooncakeBackend:
    """One Mooncake ``TransferEngine`` per process, one registered buffer."""

    def __init__(self, host: str, *, protocol: str = "tcp", device: str = "") -> None:
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be tcp or rdma, got {protocol!r}")
        os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO/WARNING chatter, before the import
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the wheel, or libibverbs.so.1 it links against, is missing
            raise TransferError(f"Mooncake Transfer Engine unavailable: {e}") from e
        self.name = f"mooncake-{protocol}"
        self.protocol = protocol
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, {protocol!r}, {device!r}) failed with {rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        log.warning(
            "%s: Mooncake's handshake (%s) and data ports serve this node's KV blocks to anyone who reaches them, "
            "without the transfer secret; fence them off or use --transfer-backend kvgate-tcp", self.name, self.session,
        )
        self._registered: list[int] = []

    def register(self, address: int, length: int) -> None:
        rc = self._engine.register_memory(address, length)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {length} bytes failed with {rc}")
        self._registered.append(address)

    def descriptor(self) -> dict[str, Any]:
        return {"backend": self.name, "session": self.session}

    def connect_request(self, peer: dict[str, Any]) -> dict[str, Any] | None:
        return None  # Mooncake's P2P handshake happens inside the first read

    def accept(self, request: dict[str, Any]) -> dict[str, Any]:
        raise TransferError("Mooncake peers need no connection set-up")

    def connected(self, peer: dict[str, Any], answer: dict[str, Any]) -> None:
        return None

    def read(self, peer: dict[str, Any], ops: Sequence[ReadOp]) -> None:
        if self._engine is None:
            raise TransferError("the Mooncake engine is closed")
        if peer.get("backend") != self.name:
            raise TransferError(f"peer speaks {peer.get('backend')!r}, this node {self.name!r}")
        if not ops:
            return
        rc = self._engine.batch_transfer_sync_read(
            str(peer["session"]),
            [op.local_addr for op in ops],
            [op.remote_addr for op in ops],
            [op.length for op in ops],
        )
        if rc != 0:
            raise TransferError(f"Mooncake read of {len(ops)} ranges from {peer['session']} failed with {rc}")

    def close(self) -> None:
        """Unregister and destroy the engine now.

        Destroying a ``TransferEngine`` joins its threads while holding the GIL (~0.8 s here): done
        at a known moment (shutdown), not whenever the garbage collector happens to free it.
        """
        if self._engine is None:
            return
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
        self._engine = None
