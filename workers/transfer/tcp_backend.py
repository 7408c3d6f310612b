"""``kvgate-tcp``: block bytes over the agent's own signed control channel (the default transport).

Mooncake's TCP transport listens on two more ports of every interface: a handshake port that
tells any caller where the registered buffer lives, and a data port that serves reads (and
accepts writes) of it to whoever connects. Nothing there knows the fleet's secret, so every block
a node holds was one connection away for anyone reaching the node. Here the bytes come from the
owner's agent port only, through ``POST /kv/read``, which the owner answers only when the request
is signed with the fleet's secret (and not replayed) by the very peer that holds the lease, and
only for slot addresses under that lease (``TransferAgent._handle_read``). No other port is
opened, so the engines' NetworkPolicy (only the transfer port between engines) covers it.

The read is a plain blocking HTTP request (the backend API is synchronous; the agent calls it in
a worker thread) whose body lands directly in the reserved local slots.
"""

from __future__ import annotations

import ctypes
import http.client
import json
from collections.abc import Sequence
from typing import Any

from workers.transfer.auth import PeerAuth
from workers.transfer.backend import ReadOp, TransferError

READ_PATH = "/kv/read"
NAME = "kvgate-tcp"


class AgentTcpBackend:
    """Reads a peer's leased slots through its agent's ``/kv/read``; serves nothing itself."""

    name = NAME

    def __init__(self, auth: PeerAuth, *, timeout_s: float = 30.0) -> None:
        self._auth = auth
        self._timeout_s = timeout_s
        self._local: list[tuple[int, int]] = []

    def register(self, address: int, length: int) -> None:
        self._local.append((address, address + length))  # where reads may write, nothing else

    def descriptor(self) -> dict[str, Any]:
        return {"backend": self.name}

    def connect_request(self, peer: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def accept(self, request: dict[str, Any]) -> dict[str, Any]:
        raise TransferError(f"{self.name} peers need no connection set-up")

    def connected(self, peer: dict[str, Any], answer: dict[str, Any]) -> None:
        return None

    def read(self, peer: dict[str, Any], ops: Sequence[ReadOp]) -> None:
        """One signed ``/kv/read`` of every range under ``peer["lease"]``, into the local slots."""
        if peer.get("backend") != self.name:
            raise TransferError(f"peer speaks {peer.get('backend')!r}, this node {self.name!r}", "mismatch")
        if not ops:
            return
        for op in ops:
            if not any(lo <= op.local_addr and op.local_addr + op.length <= hi for lo, hi in self._local):
                raise TransferError(f"local range {op.local_addr:#x}+{op.length} is not in a registered buffer")
        endpoint = str(peer["endpoint"])
        body = json.dumps({"lease": peer["lease"], "ranges": [[op.remote_addr, op.length] for op in ops]}).encode()
        headers = self._auth.sign("POST", endpoint, READ_PATH, body) | {"content-type": "application/json"}
        conn = http.client.HTTPConnection(endpoint, timeout=self._timeout_s)
        try:
            conn.request("POST", READ_PATH, body, headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise TransferError(f"{endpoint} refused the read ({resp.status}): {resp.read(512)!r}", "refused")
            if resp.length != sum(op.length for op in ops):
                raise TransferError(f"{endpoint} answered {resp.length} bytes for {len(ops)} ranges", "refused")
            for op in ops:
                view = memoryview((ctypes.c_char * op.length).from_address(op.local_addr)).cast("B")
                got = 0
                while got < op.length:
                    n = resp.readinto(view[got:])
                    if not n:
                        raise TransferError(f"{endpoint} closed the read after {got} of {op.length} bytes")
                    got += n
        except (OSError, http.client.HTTPException) as e:
            raise TransferError(f"read from {endpoint}: {e!r}") from e
        finally:
            conn.close()

    def close(self) -> None:
        self._local.clear()
