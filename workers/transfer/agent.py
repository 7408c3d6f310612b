"""The KV transfer agent: serves the blocks this node holds and pulls blocks from peers.

Control channel (HTTP/JSON on the agent's port, the node's ``transfer_endpoint``); every request
but ``/kv/health`` must be signed by a peer holding the fleet's transfer secret (``auth.py``),
else 401::

    POST   /kv/lease        {"hashes": [h0, h1, ...], "start": k}
           → {"lease": id | null, "held": m, "addrs": [addr(h_k) .. addr(h_m-1)],
              "slot_size": bytes, "backend": {...}, "ttl_s": s}
    DELETE /kv/lease/{id}   → {"released": bool}
    POST   /kv/read         {"lease": id, "ranges": [[addr, length], ...]}  → the bytes, in order
                            (``kvgate-tcp``; only the lease's holder, only its slots, else 403)
    POST   /kv/connect      backend-specific connection set-up (verbs: QP exchange)
    GET    /kv/health       → {"backend": {...}, "slots": ..., "leases": ...}

Hashes are the engine's block hashes, which every engine of the same model computes identically
from a prompt's tokens, so a puller can name blocks it has never held. The owner answers with
the longest prefix of ``hashes`` it holds (``held``) and *pins* those blocks (``BlockHolder.hold``:
in the engine, a reference in its prefix cache) until the puller releases the lease or ``ttl_s``
passes: a pinned block is never evicted, so its slot is never reused while a peer reads it. A
peer holds at most ``max_leases_per_peer`` leases at once (429 past it), so one peer cannot fill
the table for everyone; only the peer that took a lease can release it. A node pulls only from
the transfer endpoints it was given (``peers``: the fleet's), and uses a block only if its MAC
verifies under the fleet's key.

A pull: lease → reserve local slots → one-sided read of every missing block (contiguous runs
coalesced) in a worker thread → verify each slot (block hash + checksum, ``payload.verify_slot``)
→ release the lease. Any failure (owner gone, refused, timeout, corrupt block, no free slot)
raises ``TransferError`` and leaves nothing behind; the caller recomputes. Slots a read may still
write into after a timeout stay reserved until that read returns.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.conn_gate import ConnectionGuard
from workers.transfer.auth import SIGNATURE, AuthError, PeerAuth, ReplayCache, ReplayCacheFull
from workers.transfer.backend import ReadOp, TransferBackend, TransferError, coalesce
from workers.transfer.payload import BlockCorrupt, verify_slot
from workers.transfer.slots import SlotTable

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 10.0
DEFAULT_MAX_LEASES = 1024
DEFAULT_MAX_LEASES_PER_PEER = 64
MAX_LEASE_BLOCKS = 1 << 16
BODY_TIMEOUT_S = 10.0  # a signed request's body must have arrived by then (408)
HEAD_TIMEOUT_S = 10.0  # a request head must have arrived by then on an unauthenticated connection (408)
MAX_UNAUTHENTICATED = 256  # connections held before a signed request came on them; the oldest closed past it
KEEPALIVE_S = 75.0  # a peer's idle connection (aiohttp's client closes its own after 15 s)


class BlockHolder(Protocol):
    """What the agent needs from the node's cache: which blocks it holds, and pinning them."""

    def hold(self, hashes: Sequence[int]) -> int:
        """Pin the longest prefix of ``hashes`` that is held; return its length."""
        ...

    def unhold(self, hashes: Sequence[int]) -> None:
        """Drop the pins ``hold`` took on ``hashes``."""
        ...


@dataclass(frozen=True, slots=True)
class PulledBlocks:
    """Verified blocks read into reserved local slots; ``adopt`` or ``discard`` them."""

    hashes: tuple[int, ...]
    slots: tuple[int, ...]
    bytes: int
    wall_s: float


@dataclass(slots=True)
class AgentStats:
    """Monotonic counters for /metrics."""

    leases: int = 0  # leases granted to peers
    served_blocks: int = 0  # blocks offered to peers under a lease
    expired_leases: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    corrupt_blocks: int = 0
    unauthenticated: int = 0  # control requests refused 401
    replayed: int = 0  # of which: a signed request seen before (also in ``unauthenticated``)
    over_quota: int = 0  # lease requests refused 429 (the peer holds its quota)
    refused_reads: int = 0  # /kv/read refused 403: not the reader's lease, or outside it
    head_timeouts: int = 0  # unauthenticated connections answered 408: no request head in time
    evicted_connections: int = 0  # unauthenticated connections closed: too many were open
    failures: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Lease:
    hashes: list[int]
    expires: float
    peer: str
    addrs: frozenset[int]  # the slot addresses the lease lets its peer read


def transfer_counters(s: AgentStats) -> list[tuple[str, str, int]]:
    """(metric name, help, value) of the owner-side counters the engine exports."""
    return [
        ("kvgate_transfer_leases", "Leases granted to pulling peers.", s.leases),
        ("kvgate_transfer_served_blocks", "Blocks offered to pulling peers.", s.served_blocks),
        ("kvgate_transfer_expired_leases", "Leases dropped because the peer never released them.", s.expired_leases),
        ("kvgate_transfer_corrupt_blocks", "Pulled blocks that failed verification.", s.corrupt_blocks),
        ("kvgate_transfer_unauthenticated_requests", "Control requests refused 401: not signed with the fleet's secret, or replayed.", s.unauthenticated),
        ("kvgate_transfer_replayed_requests", "Control requests refused 401 because their signature was already used.", s.replayed),
        ("kvgate_transfer_over_quota_leases", "Lease requests refused 429: the peer held its quota of leases.", s.over_quota),
        ("kvgate_transfer_refused_reads", "Block reads refused 403: not under a lease the reader holds.", s.refused_reads),
        ("kvgate_transfer_head_timeouts", "Unauthenticated connections answered 408: no request head within the deadline.", s.head_timeouts),
        ("kvgate_transfer_evicted_connections", "Unauthenticated connections closed, the oldest first, because too many were open.", s.evicted_connections),
    ]


class LeaseQuotaExceeded(TransferError):
    """The asking peer already holds its quota of leases (answered 429)."""


def _endpoint_url(endpoint: str, path: str) -> str:
    return f"http://{endpoint}{path}"


class TransferAgent:
    """One per node: an HTTP control server, a slot table and a transfer backend."""

    def __init__(
        self,
        backend: TransferBackend,
        slots: SlotTable,
        holder: BlockHolder,
        *,
        auth: PeerAuth,
        peers: Collection[str] | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        max_leases: int = DEFAULT_MAX_LEASES,
        max_leases_per_peer: int = DEFAULT_MAX_LEASES_PER_PEER,
    ) -> None:
        """``auth``: the fleet's secret; ``peers``: the transfer endpoints this node may pull from
        (None: any, still signed and MAC-checked). ``slots`` must be keyed with ``auth.checksum_key``."""
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        if slots.checksum_key != auth.checksum_key:
            raise ValueError("the slot table's checksum key is not the transfer secret's")
        self.backend = backend
        self.slots = slots
        self.holder = holder
        self.lease_ttl_s = lease_ttl_s
        self.max_leases = max_leases
        self.max_leases_per_peer = max_leases_per_peer
        self.auth = auth
        self.peers = None if peers is None else frozenset(peers)
        self._per_peer: dict[str, int] = {}
        self._replays = ReplayCache()
        self.stats = AgentStats()
        self.endpoint = ""
        self.inflight_pulls = 0
        self._leases: dict[str, _Lease] = {}
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-transfer")
        self._guard = ConnectionGuard(self._guard_closed, head_timeout_s=HEAD_TIMEOUT_S, max_untrusted=MAX_UNAUTHENTICATED)
        backend.register(slots.base_address, slots.nbytes)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        app = web.Application(client_max_size=16 << 20, middlewares=[self._guard.middleware])
        app.router.add_post("/kv/lease", self._handle_lease)
        app.router.add_delete("/kv/lease/{lease}", self._handle_release)
        app.router.add_post("/kv/read", self._handle_read)
        app.router.add_post("/kv/connect", self._handle_connect)
        app.router.add_get("/kv/health", self._handle_health)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await self._runner.setup()
        await self._guard.listen(self._runner, host, port)
        self.endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._reaper = asyncio.create_task(self._reap(), name="kv-lease-reaper")

    async def close(self) -> None:
        """Stop serving, drop every lease, close the client and the backend (in that order)."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await self._guard.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for lease in list(self._leases):
            self._drop(lease)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self._executor.shutdown(wait=True)
        self.backend.close()

    def _guard_closed(self, reason: str) -> None:
        if reason == "head_timeout":
            self.stats.head_timeouts += 1
        else:
            self.stats.evicted_connections += 1

    # -- owner side ------------------------------------------------------------------------------

    def grant(self, hashes: Sequence[int], start: int, peer: str) -> dict[str, Any]:
        """Pin the held prefix of ``hashes`` for ``peer`` and say where blocks ``start..held-1`` live."""
        if len(self._leases) >= self.max_leases or self._per_peer.get(peer, 0) >= self.max_leases_per_peer:
            self._expire(time.monotonic())
            if self._per_peer.get(peer, 0) >= self.max_leases_per_peer:
                self.stats.over_quota += 1
                raise LeaseQuotaExceeded(f"peer {peer} holds {self.max_leases_per_peer} leases; release some first")
            if len(self._leases) >= self.max_leases:
                raise TransferError(f"{len(self._leases)} leases open; try later")
        held = self.holder.hold(hashes)
        addrs: list[int] = []
        for h in hashes[start:held]:
            slot = self.slots.slot_of(h)
            if slot is None:  # cached but never given a slot (table full): cannot be served
                break
            addrs.append(self.slots.address(slot))
        servable = start + len(addrs) if held > start else held
        if servable < held:
            self.holder.unhold(hashes[servable:held])
            held = servable
        lease_id: str | None = None
        if held > start:
            lease_id = f"l{next(self._ids)}"
            self._leases[lease_id] = _Lease(list(hashes[:held]), time.monotonic() + self.lease_ttl_s, peer, frozenset(addrs))
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            self.stats.leases += 1
            self.stats.served_blocks += len(addrs)
        elif held:
            self.holder.unhold(hashes[:held])  # nothing the puller lacks: no lease to keep
        return {
            "lease": lease_id,
            "held": held,
            "addrs": addrs,
            "slot_size": self.slots.slot_size,
            "backend": self.backend.descriptor(),
            "ttl_s": self.lease_ttl_s,
        }

    def release(self, lease_id: str, peer: str) -> bool:
        """Drop a lease ``peer`` took (another peer's lease is left alone)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.peer != peer:
            return False
        return self._drop(lease_id)

    def _drop(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        left = self._per_peer[lease.peer] - 1
        if left:
            self._per_peer[lease.peer] = left
        else:
            del self._per_peer[lease.peer]
        self.holder.unhold(lease.hashes)
        return True

    def _expire(self, now: float) -> None:
        for lease_id in [i for i, lease in self._leases.items() if lease.expires <= now]:
            self._drop(lease_id)
            self.stats.expired_leases += 1

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 4)
            self._expire(time.monotonic())

    async def _authenticated(self, request: web.Request) -> tuple[str, bytes]:
        """(peer id, body) of a signed request; raises a 401 answer otherwise.

        The head is verified before any of the body is read, so a stranger gets its 401 at once
        and the agent buffers nothing of its body; a signed body must arrive within
        ``BODY_TIMEOUT_S`` (408) and be the one signed.
        """
        try:
            peer = self.auth.verify(request.method, self.endpoint, request.path, request.headers)
            if not self._replays.admit(request.headers[SIGNATURE]):
                self.stats.replayed += 1
                raise AuthError(f"replayed request (this signature of {peer} was already used)")
            self._guard.trust(request)
            try:
                async with asyncio.timeout(BODY_TIMEOUT_S):
                    body = await request.read()
            except TimeoutError:
                raise web.HTTPRequestTimeout(
                    text=json.dumps({"error": f"request body not received within {BODY_TIMEOUT_S:g} s"}),
                    content_type="application/json",
                ) from None
            self.auth.check_body(request.headers, body)
            return peer, body
        except AuthError as e:
            self.stats.unauthenticated += 1
            log.warning("refused a transfer control request from %s: %s", request.remote, e)
            raise web.HTTPUnauthorized(text=json.dumps({"error": str(e)}), content_type="application/json") from None
        except ReplayCacheFull as e:
            raise web.HTTPServiceUnavailable(text=json.dumps({"error": str(e)}), content_type="application/json") from None

    async def _handle_lease(self, request: web.Request) -> web.Response:
        peer, raw = await self._authenticated(request)
        try:
            body = json.loads(raw)
            hashes = [int(h) for h in body["hashes"]]
            start = int(body.get("start", 0))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad lease request: {e!r}"}, status=400)
        if not 0 <= start <= len(hashes) or len(hashes) > MAX_LEASE_BLOCKS or any(h < 0 or h >> 64 for h in hashes):
            return web.json_response(
                {"error": f"need 0 <= start <= len(hashes) <= {MAX_LEASE_BLOCKS} and unsigned 64-bit hashes"}, status=400
            )
        try:
            return web.json_response(self.grant(hashes, start, peer))
        except LeaseQuotaExceeded as e:
            return web.json_response({"error": str(e)}, status=429)
        except TransferError as e:
            return web.json_response({"error": str(e)}, status=503)

    async def _handle_release(self, request: web.Request) -> web.Response:
        peer, _ = await self._authenticated(request)
        return web.json_response({"released": self.release(request.match_info["lease"], peer)})

    async def _handle_read(self, request: web.Request) -> web.StreamResponse:
        """The bytes of slots under a lease the signing peer holds (``kvgate-tcp``'s data path)."""
        peer, raw = await self._authenticated(request)
        try:
            body = json.loads(raw)
            lease_id = str(body["lease"])
            ranges = [(int(a), int(n)) for a, n in body["ranges"]]
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad read request: {e!r}"}, status=400)
        lease, size = self._leases.get(lease_id), self.slots.slot_size
        if lease is None or lease.peer != peer or lease.expires <= time.monotonic():
            self.stats.refused_reads += 1
            return web.json_response({"error": f"{peer} holds no open lease {lease_id}"}, status=403)
        total = sum(n for _, n in ranges)
        if total > len(lease.addrs) * size or not all(
            n > 0 and n % size == 0 and all(a + k * size in lease.addrs for k in range(n // size)) for a, n in ranges
        ):
            self.stats.refused_reads += 1
            return web.json_response({"error": f"a range is not made of slots under lease {lease_id}"}, status=403)
        resp = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        resp.content_length = total
        await resp.prepare(request)
        base = self.slots.base_address
        for a, n in ranges:  # copied in 1 MiB pieces: the loop serves other requests in between
            for off in range(a - base, a - base + n, 1 << 20):
                await resp.write(self.slots.buffer[off : min(off + (1 << 20), a - base + n)].tobytes())
        await resp.write_eof()
        return resp

    async def _handle_connect(self, request: web.Request) -> web.Response:
        _, raw = await self._authenticated(request)
        try:
            body = json.loads(raw)
            return web.json_response(self.backend.accept(body))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad connect request: {e!r}"}, status=400)
        except TransferError as e:
            return web.json_response({"error": str(e)}, status=503)

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "backend": self.backend.descriptor(),
                "slot_size": self.slots.slot_size,
                "slots": {"capacity": self.slots.capacity, "stored": self.slots.stored_slots, "free": self.slots.free_slots},
                "leases": len(self._leases),
            }
        )

    # -- puller side -----------------------------------------------------------------------------

    async def pull(self, source: str, hashes: Sequence[int], have: int, *, timeout_s: float) -> PulledBlocks:
        """Read blocks ``have..`` of ``hashes`` (as many as ``source`` holds) into local slots, verified.

        Raises ``TransferError`` on any failure; on success the caller must ``adopt`` or
        ``discard`` the result. An owner holding nothing beyond ``have`` gives an empty result.
        """
        if self.peers is not None and source not in self.peers:
            self._failed("untrusted_source")
            raise TransferError(f"{source} is not a transfer endpoint of this fleet: not pulling from it", "untrusted_source")
        t0 = time.perf_counter()
        self.inflight_pulls += 1
        try:
            async with asyncio.timeout(timeout_s):
                pulled = await self._pull(source, list(hashes), have, t0)
        except TimeoutError:
            self._failed("timeout")
            raise TransferError(f"pull from {source} timed out after {timeout_s}s", "timeout") from None
        except TransferError as e:
            self._failed(e.reason)
            raise
        except (aiohttp.ClientError, OSError) as e:
            self._failed("unreachable")
            raise TransferError(f"pull from {source}: {e!r}", "unreachable") from e
        except (ValueError, KeyError, TypeError) as e:
            self._failed("refused")
            raise TransferError(f"pull from {source}: malformed answer: {e!r}", "refused") from e
        finally:
            self.inflight_pulls -= 1
        self.stats.pulls_ok += 1
        self.stats.pulled_blocks += len(pulled.hashes)
        self.stats.pulled_bytes += pulled.bytes
        return pulled

    def _failed(self, reason: str) -> None:
        self.stats.pulls_failed += 1
        self.stats.failures[reason] = self.stats.failures.get(reason, 0) + 1

    async def _pull(self, source: str, hashes: list[int], have: int, t0: float) -> PulledBlocks:
        async with self._signed("POST", source, "/kv/lease", {"hashes": hashes, "start": have}) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                raise TransferError(f"{source} refused the lease ({resp.status}): {answer.get('error', answer)}", "refused")
        lease_id, held, addrs = answer["lease"], int(answer["held"]), [int(a) for a in answer["addrs"]]
        try:
            if int(answer["slot_size"]) != self.slots.slot_size:
                raise TransferError(
                    f"{source} has {answer['slot_size']}-byte slots, this node {self.slots.slot_size}", "mismatch"
                )
            if held <= have or not addrs:
                return PulledBlocks((), (), 0, time.perf_counter() - t0)
            if len(addrs) != held - have:
                raise TransferError(f"{source} gave {len(addrs)} addresses for {held - have} blocks", "refused")
            peer = {**answer["backend"], "endpoint": source, "lease": lease_id}
            await self._connect(source, peer)
            wanted = hashes[have:held]
            slots = self.slots.reserve(len(wanted))
            if slots is None:
                raise TransferError(f"no {len(wanted)} free slots for a pull", "no_slots")
            await self._read_verified(source, peer, wanted, slots, addrs)
            return PulledBlocks(tuple(wanted), tuple(slots), len(slots) * self.slots.slot_size, time.perf_counter() - t0)
        finally:
            if lease_id is not None:
                self._spawn(self._release_remote(source, lease_id))

    async def _connect(self, source: str, peer: dict[str, Any]) -> None:
        request = self.backend.connect_request(peer)
        if request is None:
            return
        async with self._signed("POST", source, "/kv/connect", request) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                raise TransferError(f"{source} refused the connection ({resp.status}): {answer.get('error', answer)}", "refused")
        self.backend.connected(peer, answer)

    async def _read_verified(
        self, source: str, peer: dict[str, Any], wanted: list[int], slots: list[int], addrs: list[int]
    ) -> None:
        """Read into reserved ``slots`` and verify every block; on failure the slots are freed.

        If the wait ends (timeout, cancellation) while the read still runs in its thread, the
        slots are freed only when the read returns: it may still write into them.
        """
        size = self.slots.slot_size
        ops = coalesce(ReadOp(self.slots.address(s), a, size) for s, a in zip(slots, addrs))
        fut = asyncio.get_running_loop().run_in_executor(self._executor, self.backend.read, peer, ops)
        owned = True
        try:
            try:
                await asyncio.shield(fut)
            except BaseException:
                if not fut.done():
                    owned = False
                    fut.add_done_callback(lambda f: (f.cancelled() or f.exception(), self.slots.release(slots)))
                raise
            for h, slot in zip(wanted, slots):
                try:
                    verify_slot(self.slots.view(slot), h, self.auth.checksum_key)
                except BlockCorrupt as e:
                    self.stats.corrupt_blocks += 1
                    raise TransferError(f"from {source}: {e}", "checksum") from e
        except BaseException:
            if owned:
                self.slots.release(slots)
            raise

    def adopt(self, pulled: PulledBlocks) -> None:
        """The blocks are committed to the node's cache: their slots become servable copies."""
        self.slots.adopt(zip(pulled.hashes, pulled.slots))

    def discard(self, pulled: PulledBlocks) -> None:
        """The blocks were not used after all."""
        self.slots.release(pulled.slots)

    async def _release_remote(self, source: str, lease_id: str) -> None:
        try:
            async with asyncio.timeout(2.0):
                async with self._signed("DELETE", source, f"/kv/lease/{lease_id}") as resp:
                    await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            log.debug("releasing lease %s at %s failed (it expires by itself): %r", lease_id, source, e)

    def _signed(self, method: str, source: str, path: str, payload: Any = None):
        """A request to ``source`` signed with the fleet's secret (a context manager, like aiohttp's)."""
        body = b"" if payload is None else json.dumps(payload).encode()
        headers = self.auth.sign(method, source, path, body)
        if payload is not None:
            headers["content-type"] = "application/json"
        return self._client().request(method, _endpoint_url(source, path), data=body or None, headers=headers)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0))
        return self._session
