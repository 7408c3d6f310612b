"""The transfer secret tests share: agents and workers of one test fleet sign with it."""

from __future__ import annotations

import json
from pathlib import Path

from workers.transfer.auth import PeerAuth

SECRET = b"kvgate-test-transfer-secret-0123456789"


def secret_file(directory: Path) -> str:
    path = directory / "transfer-secret"
    path.write_bytes(SECRET)
    return str(path)


def peer_auth(peer_id: str = "test-peer") -> PeerAuth:
    return PeerAuth(SECRET, peer_id)


KEY = peer_auth().checksum_key


def signed(session, method: str, endpoint: str, path: str, payload=None, *, raw: bytes | None = None, auth: PeerAuth | None = None):
    """``session.request`` to an agent, signed as a fleet peer (``raw``: send these bytes as the body)."""
    body = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
    headers = (auth or peer_auth()).sign(method, endpoint, path, body)
    return session.request(method, f"http://{endpoint}{path}", data=body or None, headers=headers)
