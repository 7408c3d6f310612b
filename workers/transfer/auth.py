"""Who may use a transfer agent: peers holding the fleet's shared secret.

An agent pins and serves the KV of every prompt its node has seen, so its control channel must
not answer strangers: anyone reaching it could learn whether the node holds a prompt (a lease
says how many blocks it holds), read the blocks, or fill the lease table. Every control request
is signed with an HMAC-SHA256 over its method, the endpoint it is sent to, its path, a timestamp
and its body's SHA-256, under a secret read from a file (a Kubernetes Secret in the chart):

    x-kv-peer: <peer id>   x-kv-time: <unix ms>   x-kv-nonce: <random hex>   x-kv-signature: <hex HMAC>
    x-kv-body-sha256: <hex SHA-256 of the body>

The body's digest travels in its own header so that the head alone can be verified: a stranger
is refused before a byte of its body is read (the agent would otherwise buffer up to its body
limit for anyone who connects), and the body, once read, must match the digest signed.

The agent accepts a request only if the signature verifies, the timestamp is within
``MAX_SKEW_S`` of its clock, and the endpoint signed for is its own, so a request captured by
(or sent to) one agent cannot be replayed against another; and only once (``ReplayCache``: the
signatures it accepted while they could still verify), so it cannot be replayed against the same
agent either. The same secret keys the checksum
in every block's trailer (``checksum_key``): a block read from a peer is used only if the peer
knew the secret when it wrote it.

Why an HMAC rather than mTLS: the bytes themselves move over Mooncake's or verbs' one-sided
reads, which TLS does not cover; the keyed checksum does. The HMAC needs one Secret, no
certificates to issue and rotate, and costs microseconds a request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

MAX_SKEW_S = 30.0
MIN_SECRET_BYTES = 16
REPLAY_CACHE_ENTRIES = 1 << 16  # signatures remembered (~1,000 signed requests/s); ~230 B each, ~15 MiB at most
PEER, TIME, NONCE, SIGNATURE = "x-kv-peer", "x-kv-time", "x-kv-nonce", "x-kv-signature"
BODY_DIGEST = "x-kv-body-sha256"


class AuthError(Exception):
    """A control request that is not from a peer holding the secret (answered 401)."""


class PeerAuth:
    """Signs this node's control requests and verifies its peers'."""

    def __init__(self, secret: bytes, peer_id: str) -> None:
        secret = secret.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the transfer secret must have at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        if not peer_id or any(c.isspace() for c in peer_id):
            raise ValueError(f"peer id must be non-empty without spaces, got {peer_id!r}")
        self._secret = secret
        self.peer_id = peer_id
        self.checksum_key = hmac.new(secret, b"kvgate block checksum", hashlib.sha256).digest()[:32]

    @classmethod
    def from_file(cls, path: str | Path, peer_id: str) -> PeerAuth:
        return cls(Path(path).read_bytes(), peer_id)

    def _mac(self, method: str, endpoint: str, path: str, peer: str, stamp: str, nonce: str, digest: str) -> str:
        message = "\n".join((method.upper(), endpoint, path, peer, stamp, nonce, digest))
        return hmac.new(self._secret, _raw(message), hashlib.sha256).hexdigest()

    def sign(self, method: str, endpoint: str, path: str, body: bytes = b"") -> dict[str, str]:
        """Headers authenticating a request of ``method`` to ``http://endpoint/path``."""
        stamp, nonce, digest = str(int(time.time() * 1000)), secrets.token_hex(12), hashlib.sha256(body).hexdigest()
        signature = self._mac(method, endpoint, path, self.peer_id, stamp, nonce, digest)
        return {PEER: self.peer_id, TIME: stamp, NONCE: nonce, BODY_DIGEST: digest, SIGNATURE: signature}

    def verify(self, method: str, endpoint: str, path: str, headers: Mapping[str, str]) -> str:
        """The signing peer's id, from the request's head alone; ``AuthError`` unless signed with
        the secret, for ``endpoint``, lately. The body, once read, must pass ``check_body``."""
        peer, stamp, nonce, digest, signature = (headers.get(h) for h in (PEER, TIME, NONCE, BODY_DIGEST, SIGNATURE))
        if not peer or not stamp or not nonce or not digest or not signature:
            raise AuthError(f"unsigned request: {PEER}, {TIME}, {NONCE}, {BODY_DIGEST} and {SIGNATURE} are required")
        try:
            age = abs(time.time() - int(stamp) / 1000)
        except (ValueError, OverflowError):  # OverflowError: digits no float holds
            raise AuthError(f"x-kv-time {stamp[:40]!r} is not a timestamp") from None
        if age > MAX_SKEW_S:
            raise AuthError(f"request signed {age:.0f} s away from this agent's clock (at most {MAX_SKEW_S:g})")
        if not hmac.compare_digest(_raw(signature), self._mac(method, endpoint, path, peer, stamp, nonce, digest).encode()):
            raise AuthError("bad signature (another secret, or signed for another agent)")
        return peer

    @staticmethod
    def check_body(headers: Mapping[str, str], body: bytes) -> None:
        """``AuthError`` unless ``body`` is the one whose digest a verified head carries."""
        if not hmac.compare_digest(hashlib.sha256(body).hexdigest().encode(), _raw(headers.get(BODY_DIGEST, ""))):
            raise AuthError("the body is not the one signed (its SHA-256 differs from x-kv-body-sha256)")


def _raw(value: str) -> bytes:
    """A header's bytes as received: ``hmac.compare_digest`` refuses non-ASCII str (TypeError), and
    headers that are not UTF-8 arrive with surrogates, which a plain ``encode`` refuses."""
    return value.encode("utf-8", "surrogateescape")


class ReplayCacheFull(Exception):
    """Every remembered signature could still be replayed: refuse rather than forget one (503)."""


class ReplayCache:
    """The signatures an agent accepted, each kept until its request could no longer verify.

    A signed request verifies for ``MAX_SKEW_S`` either side of its timestamp, and one accepted now
    carries a timestamp at most ``MAX_SKEW_S`` ahead: remembering it ``2 × MAX_SKEW_S`` from its
    arrival covers its whole window. Arrival order is expiry order, so a deque drops the stale.
    Only verified signatures enter, so only a peer holding the secret can fill it.
    """

    def __init__(self, capacity: int = REPLAY_CACHE_ENTRIES, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self._clock = clock
        self._seen: set[str] = set()
        self._order: deque[tuple[float, str]] = deque()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, signature: str) -> bool:
        """True the first time ``signature`` is seen within its window; False for a replay."""
        now = self._clock()
        while self._order and self._order[0][0] <= now:
            self._seen.discard(self._order.popleft()[1])
        if signature in self._seen:
            return False
        if len(self._seen) >= self.capacity:
            raise ReplayCacheFull(f"{self.capacity} signed requests in the last {2 * MAX_SKEW_S:g} s; try later")
        self._seen.add(signature)
        self._order.append((now + 2 * MAX_SKEW_S, signature))
        return True
