"""Attacks on a running fleet under steady load: each fails closed and clients see nothing.

The fleet of tests/chaos/harness.py (workers with signed transfer agents, replicas answering
only Envoy's caller token), attacked from a process that is not part of it, while the steady
chat load runs. For each attack the test says what the attacker gets; the table row says what
the load saw meanwhile (nothing failed). The single-process versions of these attacks, with
what they got before each fix, are the hostile suites (tests/test_hostile_*.py,
tests/test_redis_acl.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from directory_client import open_directory
from directory_client.types import NodeInfo
from tests.chaos.conftest import ROWS
from tests.chaos.harness import ChaosFleet
from tests.chaos.load import Row, SteadyLoad, between, by_cache_ratio
from tests.chaos.test_chaos import WARM_S, finish
from tests.support.http import eventually, request
from tests.test_hostile_transfer import listening_ports
from workers.transfer.auth import PeerAuth

pytestmark = [pytest.mark.timeout(300), pytest.mark.chaos]


def metric(url: str, name: str) -> float:
    """A counter's value (summed over its samples) from a /metrics page."""
    _, _, raw = request(url)
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in raw.decode().splitlines() if ln.startswith(name) and not ln.startswith("#"))


async def ext_proc_without_token(port: int) -> bool:
    """A stream to a replica's ext_proc port as any pod could open it: True if kvgate routed it."""
    headers = pb.HttpHeaders(end_of_stream=False)
    for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")):
        headers.headers.headers.add(key=k, raw_value=v.encode())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda b: b, response_deserializer=pb.ProcessingResponse.FromString,
        )()  # fmt: skip
        await call.write(pb.ProcessingRequest(request_headers=headers).SerializeToString())
        first = await call.read()
        await call.done_writing()
    return bool(first.request_headers.response.header_mutation.set_headers) or not first.HasField("mode_override")


async def transfer_attacks(endpoint: str, secret: bytes) -> dict[str, int]:
    """Status codes a stranger and a replaying eavesdropper get from a worker's transfer agent."""
    out: dict[str, int] = {}
    hashes = {"hashes": [1, 2, 3], "start": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{endpoint}/kv/lease", json=hashes) as r:
            out["unsigned lease"] = r.status
        async with s.post(f"http://{endpoint}/kv/read", json={"lease": "l1", "ranges": [[0, 4096]]}) as r:
            out["unsigned read"] = r.status
        body = json.dumps(hashes).encode()
        captured = PeerAuth(secret, "w-peer").sign("POST", endpoint, "/kv/lease", body)
        async with s.post(f"http://{endpoint}/kv/lease", data=body, headers=captured) as r:
            out["signed lease"] = r.status
        async with s.post(f"http://{endpoint}/kv/lease", data=body, headers=captured) as r:
            out["replayed lease"] = r.status
        read = json.dumps({"lease": "l1", "ranges": [[0, 4096]]}).encode()
        async with s.post(f"http://{endpoint}/kv/read", data=read,
                          headers=PeerAuth(secret, "w-peer").sign("POST", endpoint, "/kv/read", read)) as r:  # fmt: skip
            out["read without a lease"] = r.status
    return out


def test_attacks_fail_closed_while_clients_see_nothing(fleet: ChaosFleet) -> None:
    eventually(fleet.all_live, timeout_s=30, show=fleet.live_counts)
    load = SteadyLoad(fleet.listen_port).start()
    time.sleep(WARM_S)
    t0 = time.monotonic()
    replica, worker = fleet.replicas[0], fleet.workers[0]
    admin = f"http://127.0.0.1:{replica.admin_port}/metrics"
    unauthenticated = metric(admin, "kvgate_ext_proc_unauthenticated_total")

    # 1. Ask kvgate where a prompt is cached without Envoy's token: passed through, nothing decided.
    assert asyncio.run(ext_proc_without_token(replica.ext_proc_port)) is False
    assert metric(admin, "kvgate_ext_proc_unauthenticated_total") == unauthenticated + 1

    # 2. The worker's transfer agent: no lease, no block, no replay; no Mooncake port to read from.
    endpoint = f"127.0.0.1:{worker.transfer_port}"
    got = asyncio.run(transfer_attacks(endpoint, fleet.transfer_secret.read_bytes()))
    assert got == {"unsigned lease": 401, "unsigned read": 401, "signed lease": 200, "replayed lease": 401,
                   "read without a lease": 403}, got  # fmt: skip
    worker_metrics = f"http://127.0.0.1:{worker.port}/metrics"
    assert metric(worker_metrics, "kvgate_transfer_replayed_requests_total") == 1
    assert worker.proc is not None
    assert listening_ports(worker.proc.popen.pid) == {worker.port, worker.transfer_port, worker.events_port, worker.replay_port}

    # 3. Spellings of the inference path that once reached an engine past kvgate: each is decided
    #    by kvgate (Envoy normalised it) or redirected, never served unrouted.
    body = json.dumps({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    spellings = ["/v1/%63hat/completions", "/v1//chat/completions", "/v1/./chat/completions", "/v1/chat%2Fcompletions"]
    for i, path in enumerate(spellings):
        status, _, _ = request(fleet.url(path), method="POST", body=body,
                               headers={"content-type": "application/json", "x-chaos-id": f"attack-path-{i}"})  # fmt: skip
        assert status in (200, 301, 307, 308), (path, status)

    # 4. A node registered straight into Redis at the metadata service's address: idle, so the
    #    least busy node of the fleet. Skipped by every lookup (counted), never a destination.
    rogue = asyncio.run(register_rogue(fleet))
    status, headers, _ = request(fleet.url("/v1/chat/completions"), method="POST", body=rogue,
                                 headers={"content-type": "application/json", "x-chaos-id": "attack-rogue"})  # fmt: skip
    assert status == 200 and headers.get("x-kvgate-node") in {w.name for w in fleet.workers}
    eventually(lambda: sum(metric(f"http://127.0.0.1:{r.admin_port}/metrics", "kvgate_untrusted_nodes_total")
                           for r in fleet.replicas) >= 1, timeout_s=10)  # fmt: skip

    time.sleep(WARM_S)  # the rogue stays registered (and idle) while the load goes on
    t1 = time.monotonic()
    samples = finish(fleet, load)
    records = fleet.access_records()
    for i, path in enumerate(spellings):
        rec = records.get(f"attack-path-{i}", {})
        assert rec.get("code") != "200" or rec.get("dest"), (path, rec)  # 200 only when kvgate decided it
    assert not any(str(rec.get(k) or "").startswith("169.254.") for rec in records.values() for k in ("dest", "upstream"))
    window = between(samples, t0, t1)
    ROWS.append(Row("attacks: token-less ext_proc, transfer, paths, rogue node", requests=len(window),
                    failed=sum(not s.ok for s in window), retried=sum(s.attempts > 1 for s in window),
                    by_cache_before=by_cache_ratio(between(samples, t0 - WARM_S, t0)),
                    by_cache_after=by_cache_ratio(window)))  # fmt: skip
    assert window and all(s.ok for s in window), [s for s in window if not s.ok][:5]


async def register_rogue(fleet: ChaosFleet) -> bytes:
    """Register ``rogue`` at 169.254.169.254:80 (no load at all); return a request to send."""
    directory = open_directory(fleet.redis.url, key_prefix=fleet.key_prefix, heartbeat_ttl_s=60)
    try:
        await directory.register_node(NodeInfo("rogue", "169.254.169.254:80", model="deepseek-chat"))
    finally:
        await directory.aclose()
    return json.dumps({"model": "deepseek-chat", "messages": [{"role": "user", "content": "rogue " * 200}], "max_tokens": 2}).encode()
