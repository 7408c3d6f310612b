"""kvgate's own ports under attack (issue 15, item 9): what a client can make them hold.

ext_authz (real sockets, the real core): a 128 MiB header value used to be buffered whole (128 MiB
and 21 s of CPU, a normal request failing open meanwhile), and a client could start a request and
never finish it. What the attacker gets now: 431 once the request line and headers pass
``MAX_HEAD_BYTES``, 408 when a begun request has not arrived within ``RECEIVE_TIMEOUT_S``, and an
idle connection closed after ``IDLE_TIMEOUT_S``; a normal request on another connection is routed
meanwhile. ext_proc (a real gRPC server): a STREAMED body is no longer buffered past
``limits.max_body_bytes``: the client gets 413 and kvgate stops reading it.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc import ext_authz
from ext_proc.server import build_server
from gateway.envoy_config import DESTINATION_HEADER
from gateway.metrics import REGISTRY
from tests.conftest import free_port
from tests.test_ext_authz_http import (  # noqa: F401  (fixtures)
    CHAT,
    MAX_BODY,
    NODES,
    chat,
    conn,
    core,
    directory,
    event_loop_policy,
    post,
    read_response,
    service,
    tok,
)

pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


async def send_until_answered(reader, writer, head: bytes, filler: bytes, limit: int) -> tuple[int, bytes]:
    """Send ``head`` then ``filler`` repeatedly (up to ``limit`` bytes) until the server answers or
    closes; returns (bytes sent, what it answered)."""
    writer.write(head)
    sent = len(head)
    read = asyncio.ensure_future(reader.read(4096))
    try:
        while sent < limit and not read.done():
            writer.write(filler)
            sent += len(filler)
            try:
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                break
            await asyncio.sleep(0)
        return sent, await asyncio.wait_for(read, 5)
    finally:
        read.cancel()


@pytest.mark.parametrize("where", ["header", "url"])
async def test_an_endless_header_or_url_gets_431_after_the_head_limit(conn, service, directory, where) -> None:
    reader, writer = conn
    head = b"POST /kvgate/authz/v1/chat/completions HTTP/1.1\r\nhost: kvgate\r\nx-big: " if where == "header" else b"POST /kvgate/authz/v1/" 
    sent, answer = await send_until_answered(reader, writer, head, b"a" * (64 << 10), 32 << 20)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    assert sent <= ext_authz.MAX_HEAD_BYTES + (1 << 20), f"{sent} bytes were read before the answer"
    # a normal check on another connection is decided meanwhile, not failed open
    r2, w2 = await asyncio.open_connection("127.0.0.1", service.port)
    w2.write(post(chat()))
    resp = await read_response(r2)
    assert resp is not None and resp.status == 200 and resp.headers[DESTINATION_HEADER] == NODES["b"]
    w2.close()


async def test_a_request_that_never_finishes_arriving_gets_408(conn, monkeypatch) -> None:
    monkeypatch.setattr(ext_authz, "RECEIVE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(ext_authz, "SWEEP_S", 0.05)
    reader, writer = conn
    await asyncio.sleep(0.1)  # the sweeper picks the new timings up on its next round
    writer.write(post(chat())[:200])  # headers and part of the body, then nothing
    answer = await asyncio.wait_for(reader.read(4096), 5)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]


async def test_an_idle_connection_is_closed(conn, monkeypatch) -> None:
    monkeypatch.setattr(ext_authz, "IDLE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(ext_authz, "SWEEP_S", 0.05)
    reader, writer = conn
    writer.write(post(chat()))
    resp = await read_response(reader)
    assert resp is not None and resp.status == 200  # in use, it stays open; idle, it is closed
    assert await asyncio.wait_for(reader.read(1), 5) == b""


async def test_pipelined_bodies_are_not_queued_past_the_body_limit(conn, service, monkeypatch) -> None:
    """A client pipelining large bodies without reading answers: reading pauses once the queued
    bodies reach ``max_body_bytes`` (before: up to 8 whole bodies a connection)."""
    gate = asyncio.Event()
    route = service.core.route

    async def stalled(*args, **kw):
        await gate.wait()
        return await route(*args, **kw)

    monkeypatch.setattr(service.core, "route", stalled)
    reader, writer = conn
    big = json.dumps({"model": "x", "prompt": "p" * (MAX_BODY - 100)}).encode()
    for _ in range(6):
        writer.write(post(big))
    await asyncio.sleep(0.3)
    (connection,) = service._connections
    assert connection._queued_bytes <= MAX_BODY + len(big)
    assert len(connection._queue) < 6
    gate.set()
    for _ in range(6):
        resp = await read_response(reader)
        assert resp is not None and resp.status in (200, 404)


def _headers_msg(path: str) -> bytes:
    hm = pb.HttpHeaders(end_of_stream=False)
    for k, v in ((":method", "POST"), (":path", path), ("content-type", "application/json")):
        hm.headers.headers.add(key=k, raw_value=v.encode())
    return pb.ProcessingRequest(request_headers=hm).SerializeToString()


async def test_ext_proc_stops_a_streamed_body_past_the_limit_with_413(core) -> None:
    port = free_port()
    server = build_server(core, f"127.0.0.1:{port}")
    await server.start()
    rejected = REGISTRY.get_sample_value("kvgate_rejected_requests_total", {"status": "413"}) or 0.0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=lambda b: b,
                response_deserializer=pb.ProcessingResponse.FromString,
            )()
            await call.write(_headers_msg(CHAT))
            await call.read()
            chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * (16 << 10))).SerializeToString()
            sent = 0
            answer = None
            while sent < 32 * MAX_BODY:  # the attack: 32 times the limit, in streamed parts
                await call.write(chunk)
                sent += 16 << 10
                answer = await call.read()
                if answer.HasField("immediate_response"):
                    break
            assert answer is not None and answer.immediate_response.status.code == 413
            assert sent <= MAX_BODY + (16 << 10)
            await call.done_writing()
    finally:
        await server.stop(None)
    assert REGISTRY.get_sample_value("kvgate_rejected_requests_total", {"status": "413"}) == rejected + 1


async def test_the_admin_port_refuses_an_endless_header_early(directory) -> None:
    """The admin port (aiohttp) bounds a header line at 8190 bytes: 431/400 before 1 MiB is read."""
    from aiohttp import web

    from gateway.admin import build_admin_app

    runner = web.AppRunner(build_admin_app(directory), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"GET /healthz HTTP/1.1\r\nhost: kvgate\r\nx-big: "
        sent, answer = await send_until_answered(reader, writer, head, b"a" * (64 << 10), 32 << 20)
        assert answer.split(b" ")[1] in (b"400", b"431"), answer[:100]
        assert sent <= 1 << 20
        writer.close()
    finally:
        await runner.cleanup()


async def test_an_ext_authz_check_without_envoys_token_is_passed_through_unrouted(core, directory, monkeypatch) -> None:
    """Issue 15, item 2: whoever reaches the ext_authz port could ask, for any prompt and any
    tenant's ``cache_salt``, which node holds it (the destination and pull-block headers). With
    a caller token configured, a check without it gets a bare 200 (nothing routed, nothing
    revealed, ``kvgate_ext_authz_unauthenticated_total``); Envoy's checks carry the token."""
    token = "envoy-caller-token-0123456789"
    svc = ext_authz.ExtAuthzService(core, caller_token=token)
    port = free_port()
    await svc.start("127.0.0.1", port, max_body_bytes=MAX_BODY)
    before = REGISTRY.get_sample_value("kvgate_ext_authz_unauthenticated_total") or 0.0
    try:
        for headers in ("", "x-kvgate-authz-token: guessed\r\n"):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(post(chat(), headers=headers))
            resp = await read_response(r)
            assert resp is not None and resp.status == 200 and DESTINATION_HEADER not in resp.headers
            w.close()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(post(chat(), headers=f"x-kvgate-authz-token: {token}\r\n"))
        resp = await read_response(r)
        assert resp is not None and resp.headers[DESTINATION_HEADER] == NODES["b"]
        w.close()
    finally:
        await svc.aclose()
    assert REGISTRY.get_sample_value("kvgate_ext_authz_unauthenticated_total") == before + 2


async def test_an_ext_proc_stream_without_envoys_token_is_passed_through_unrouted(core) -> None:
    """The same oracle over the ext_proc port: a stream without the caller token (gRPC metadata
    the rendered filter adds) is let through without routing headers (``kvgate_ext_proc_unauthenticated_total``)."""
    from ext_proc.server import CALLER_TOKEN_METADATA

    token = "envoy-caller-token-0123456789"
    port = free_port()
    server = build_server(core, f"127.0.0.1:{port}", caller_token=token)
    await server.start()
    before = REGISTRY.get_sample_value("kvgate_ext_proc_unauthenticated_total") or 0.0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for metadata, routed in (((), False), (((CALLER_TOKEN_METADATA, "guess"),), False),
                                     (((CALLER_TOKEN_METADATA, token),), True)):  # fmt: skip
                call = channel.stream_stream(
                    "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                    request_serializer=lambda b: b, response_deserializer=pb.ProcessingResponse.FromString,
                )(metadata=metadata)
                await call.write(_headers_msg(CHAT))
                first = await call.read()
                if routed:
                    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=chat(), end_of_stream=True))
                    await call.write(body.SerializeToString())
                    answer = await call.read()
                    keys = [h.header.key for h in answer.request_body.response.header_mutation.set_headers]
                    assert DESTINATION_HEADER in keys
                else:  # told not to send the body: nothing is decided, nothing revealed
                    assert first.HasField("mode_override") and first.HasField("request_headers")
                    assert not first.request_headers.response.header_mutation.set_headers
                await call.done_writing()
    finally:
        await server.stop(None)
    assert REGISTRY.get_sample_value("kvgate_ext_proc_unauthenticated_total") == before + 2


async def test_ext_proc_streams_dropped_mid_decision_leave_no_load(core, directory) -> None:
    """A client (or Envoy, on a client's reset) that cancels its stream while kvgate decides:
    whatever the decision reserved is given back, so no node looks busy afterwards."""
    port = free_port()
    server = build_server(core, f"127.0.0.1:{port}")
    await server.start()
    inflight = REGISTRY.get_sample_value("kvgate_inflight_requests") or 0.0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for i in range(40):
                call = channel.stream_stream(
                    "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                    request_serializer=lambda b: b, response_deserializer=pb.ProcessingResponse.FromString,
                )()
                await call.write(_headers_msg(CHAT))
                await call.read()
                body = pb.ProcessingRequest(request_body=pb.HttpBody(body=chat(f"topic {i}"), end_of_stream=True))
                await call.write(body.SerializeToString())
                await asyncio.sleep(0.001 * (i % 8))  # cancelled at different points of the decision
                call.cancel()
        loads: dict = {}
        for _ in range(100):
            loads = await directory.loads()
            if not any(load.inflight for load in loads.values()):
                break
            await asyncio.sleep(0.05)
        assert not any(load.inflight for load in loads.values()), loads
        assert (REGISTRY.get_sample_value("kvgate_inflight_requests") or 0.0) == inflight
    finally:
        await server.stop(None)


async def test_ext_proc_streams_that_route_nothing_are_ended_not_held(core, monkeypatch) -> None:
    """Before: a stream kvgate answered without routing (no caller token, a path it does not route)
    stayed open until the client closed it, and a stream that never sent a message stayed open
    for ever: a stranger without the token held 5,000 streams of a `kvgate serve` (+100 MiB of
    RSS, 20 KB each) for as long as it liked. Now: such a stream is ended as soon as it is
    answered (the same 5,000: no growth), a silent one after ``FIRST_MESSAGE_TIMEOUT_S``
    (``kvgate_ext_proc_streams_total{end="silent"}``)."""
    from ext_proc import server as ext_proc_server

    monkeypatch.setattr(ext_proc_server, "FIRST_MESSAGE_TIMEOUT_S", 0.3, raising=False)
    port = free_port()
    server = build_server(core, f"127.0.0.1:{port}", caller_token="envoy-caller-token-0123456789")
    await server.start()
    silent = REGISTRY.get_sample_value("kvgate_ext_proc_streams_total", {"end": "silent"}) or 0.0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            def open_stream():
                return channel.stream_stream(
                    "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                    request_serializer=lambda b: b, response_deserializer=pb.ProcessingResponse.FromString,
                )()  # fmt: skip

            strangers = [open_stream() for _ in range(50)]
            for call in strangers:  # the stranger never closes its side
                await call.write(_headers_msg(CHAT))
                assert (await call.read()).HasField("mode_override")  # passed through, nothing routed
            for call in strangers:  # ... and kvgate ends the stream all the same
                assert await asyncio.wait_for(call.read(), 2) is grpc.aio.EOF
                assert await call.code() == grpc.StatusCode.OK
            mute = open_stream()  # opens a stream and never sends anything
            assert await asyncio.wait_for(mute.read(), 2) is grpc.aio.EOF
            assert await mute.code() == grpc.StatusCode.OK
    finally:
        await server.stop(None)
    assert REGISTRY.get_sample_value("kvgate_ext_proc_streams_total", {"end": "silent"}) == silent + 1


async def test_crlfs_trickled_before_a_request_line_get_408(conn, monkeypatch) -> None:
    """HTTP parsers skip CRLFs before a request line, so the request never "began": before, two
    bytes every few seconds kept a connection open for ever (only an idle one was closed). Now the
    receive deadline runs from the first byte of whatever arrives."""
    monkeypatch.setattr(ext_authz, "RECEIVE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(ext_authz, "SWEEP_S", 0.05)
    reader, writer = conn
    await asyncio.sleep(0.1)  # the sweeper picks the new timings up on its next round
    read = asyncio.ensure_future(reader.read(4096))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        while not read.done() and loop.time() - t0 < 3.0:
            writer.write(b"\r\n")
            await asyncio.sleep(0.1)
        assert read.done(), "after 3 s of trickled CRLFs the connection is still open and unanswered"
        assert read.result().startswith(b"HTTP/1.1 408 "), read.result()[:100]
    finally:
        read.cancel()


async def test_connections_that_never_sent_a_request_are_capped_oldest_first(service, monkeypatch) -> None:
    """Before: every connection opened was held (until ``IDLE_TIMEOUT_S``, 300 s), as many as
    the process had file descriptors for. Now at most ``MAX_UNTRUSTED`` connections that have not
    yet carried a request (with Envoy's token, when one is set) are held, the oldest closed first;
    a connection that has is never closed by the cap."""
    monkeypatch.setattr(ext_authz, "MAX_UNTRUSTED", 8, raising=False)
    svc = ext_authz.ExtAuthzService(service.core)
    port = free_port()
    await svc.start("127.0.0.1", port, max_body_bytes=MAX_BODY)
    opened = []
    try:
        r0, w0 = await asyncio.open_connection("127.0.0.1", port)
        w0.write(post(chat()))
        assert (await read_response(r0)).status == 200
        for _ in range(20):
            opened.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0.01)
        closed = 0
        for reader, _ in opened[:12]:
            try:
                closed += await asyncio.wait_for(reader.read(1), 2) == b""
            except (TimeoutError, ConnectionError):
                pass
        assert closed == 12, f"{closed} of the 12 oldest silent connections were closed"
        assert len(svc._connections) <= 8 + 1, f"{len(svc._connections)} connections held"
        w0.write(post(chat()))  # the connection that carried a request is still served
        resp = await read_response(r0)
        assert resp is not None and resp.status == 200 and resp.headers[DESTINATION_HEADER] == NODES["b"]
    finally:
        for _, w in opened:
            w.close()
        w0.close()
        await svc.aclose()


async def test_without_a_caller_token_connections_are_capped_the_longest_idle_closed_first(service, monkeypatch) -> None:
    """Without ``caller_token_file`` any client's whole request makes its connection look like
    Envoy's, so the cap on untrusted connections alone does not bound them: before, 20 clients
    each sending one request then idling were all held (for ``IDLE_TIMEOUT_S``, 300 s). Now at
    most ``MAX_CONNECTIONS`` are held: past it the one idle the longest is closed, so a client in
    use (Envoy's pooled connections) keeps its connection."""
    monkeypatch.setattr(ext_authz, "MAX_CONNECTIONS", 8, raising=False)
    svc = ext_authz.ExtAuthzService(service.core)  # no caller token
    port = free_port()
    await svc.start("127.0.0.1", port, max_body_bytes=MAX_BODY)
    idle = []
    try:
        for _ in range(20):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(post(chat()))
            assert (await read_response(r)).status == 200
            idle.append((r, w))
        await asyncio.sleep(0.2)
        assert len(svc._connections) <= 8, f"{len(svc._connections)} idle connections held"
        r, w = idle[-1]  # the newest is still served
        w.write(post(chat()))
        resp = await read_response(r)
        assert resp is not None and resp.status == 200 and resp.headers[DESTINATION_HEADER] == NODES["b"]
    finally:
        for _, w in idle:
            w.close()
        await svc.aclose()
