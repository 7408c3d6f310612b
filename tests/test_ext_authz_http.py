"""kvgate's ext_authz check server over real sockets: the real ``RoutingCore`` (real tokenizer, the
in-process directory, the kvgate policy) behind ``ExtAuthzService``, spoken to byte by byte as
Envoy (or a misbehaving client) would — keep-alive, pipelining, chunked bodies, limits, garbage,
disconnects — and the node load it holds and gives back."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvloop

from directory_client import NodeInfo, Tier, open_directory
from ext_proc.ext_authz import ExtAuthzService
from gateway.core import RoutingCore, RoutingLimits
from gateway.envoy_config import DESTINATION_HEADER
from gateway.policy import make_policy
from gateway.profile import load_profile
from tests.conftest import free_port
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed

MODEL = "authz-model"
CHAT = "/v1/chat/completions"
NODES = {"a": "10.0.0.1:8000", "b": "10.0.0.2:8000"}
MAX_BODY = 64 << 10  # small, so the limits are cheap to cross
SLACK = 1 << 20  # bodies up to MAX_BODY + this still reach the core


def chat(topic: str = "harbour", max_tokens: int = 8) -> bytes:
    doc = " ".join(f"Line {i} of the {topic} log says value {i * 31 % 97}." for i in range(160))
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": "Summarise it."}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens}).encode()


def post(body: bytes, *, path: str = CHAT, headers: str = "", version: str = "1.1") -> bytes:
    head = f"POST /kvgate/authz{path} HTTP/{version}\r\nhost: kvgate\r\ncontent-length: {len(body)}\r\n{headers}\r\n"
    return head.encode() + body


def chunked(body: bytes, size: int = 1000) -> bytes:
    head = f"POST /kvgate/authz{CHAT} HTTP/1.1\r\nhost: kvgate\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    parts = [b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)]
    return head + b"".join(parts) + b"0\r\n\r\n"


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


async def read_response(reader: asyncio.StreamReader) -> Response | None:
    """One HTTP/1.1 response (content-length framed, as ours always are); None at end of stream."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except asyncio.IncompleteReadError as e:
        assert e.partial == b"", f"truncated response head: {e.partial!r}"
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:] if line))
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Response(status, headers, body)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionResetError:
        return True


# Every test runs on both loops: ``kvgate serve`` runs on uvloop, whose transports differ from
# asyncio's in small ways (a first version of the server failed on uvloop only). pytest-asyncio
# deprecates this fixture in favour of a conftest-wide hook that would parametrize every test of
# the suite; the ``service`` fixture checks the loop really is the one asked for.
pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def event_loop_policy(request) -> asyncio.AbstractEventLoopPolicy:
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


@pytest.fixture
async def directory(tok):
    d = open_directory("memory://", heartbeat_ttl_s=600, index_stride=1)
    for node_id, address in NODES.items():
        await d.register_node(NodeInfo(node_id=node_id, address=address, model=MODEL))
    # node b holds the cached prefix of chat("harbour"): the decision depends on the body's content
    prompt = tok.tokenize_body(CHAT, json.loads(chat("harbour")))
    keys = block_keys(prompt.token_ids, block_size=16, seed=namespace_seed(MODEL))
    await d.record_stored("b", keys, Tier.GPU)
    yield d
    await d.aclose()


@pytest.fixture
def core(tok, directory) -> RoutingCore:
    limits = RoutingLimits(block_size=16, max_body_bytes=MAX_BODY, models=frozenset([MODEL]))
    return RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), limits)


@pytest.fixture
async def service(core, event_loop_policy):
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop) == isinstance(event_loop_policy, uvloop.EventLoopPolicy)
    svc = ExtAuthzService(core)
    svc.port = free_port()  # type: ignore[attr-defined]
    await svc.start("127.0.0.1", svc.port, max_body_bytes=MAX_BODY)  # type: ignore[attr-defined]
    yield svc
    await svc.aclose()


@pytest.fixture
async def conn(service):
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    yield reader, writer
    writer.close()


async def inflight(directory) -> int:
    return sum(load.inflight for load in (await directory.loads()).values())


async def test_a_chat_completion_is_routed_to_the_node_holding_its_prefix(conn, directory) -> None:
    reader, writer = conn
    writer.write(post(chat(), headers="x-request-id: r-1\r\ncontent-type: application/json\r\n"))
    resp = await read_response(reader)
    # Envoy sees 200 + the destination header, copies it onto the request and re-routes to node b
    assert resp is not None and resp.status == 200
    assert resp.headers[DESTINATION_HEADER] == NODES["b"]
    assert resp.body == b""
    assert await inflight(directory) == 1  # the load is held until the estimated end of service


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(conn, core, monkeypatch) -> None:
    reader, writer = conn
    route = core.route

    async def slow_route(*args, **kw):
        await asyncio.sleep(0.05)  # the first answer takes longer than the second would
        return await route(*args, **kw)

    monkeypatch.setattr(core, "route", slow_route)
    # two requests one after the other on one connection: both answered, the connection stays open
    for _ in range(2):
        writer.write(post(chat()))
        resp = await read_response(reader)
        assert resp is not None and resp.headers.get(DESTINATION_HEADER) == NODES["b"]
    # pipelined in one write: a slow routed check, then a pass-through that needs no decision;
    # Envoy matches answers to requests by order, so the routed answer must come first
    writer.write(post(chat()) + post(b"", path="/v1/models"))
    first, second = await read_response(reader), await read_response(reader)
    assert first is not None and first.headers.get(DESTINATION_HEADER) == NODES["b"]
    assert second is not None and second.status == 200 and DESTINATION_HEADER not in second.headers
    # far deeper than the per-connection queue, and more than one read (~450 KB): reading pauses
    # and resumes, nothing is lost or reordered
    monkeypatch.setattr(core, "route", route)
    bodies = [chat(), b"{bad"] * 50
    writer.write(b"".join(post(b) for b in bodies))
    statuses = [(await read_response(reader)).status for _ in bodies]  # type: ignore[union-attr]
    assert statuses == [200, 400] * 50


async def test_a_chunked_body_is_decided_like_a_content_length_one(conn) -> None:
    reader, writer = conn
    writer.write(post(chat()))
    plain = await read_response(reader)
    writer.write(chunked(chat(), size=777))
    chunks = await read_response(reader)
    # the chunk framing is removed before the core sees the body: same node, not a 400
    assert plain is not None and chunks is not None
    assert chunks.status == plain.status == 200
    assert chunks.headers[DESTINATION_HEADER] == plain.headers[DESTINATION_HEADER] == NODES["b"]


@pytest.mark.parametrize(
    "ask", [{"headers": "connection: close\r\n"}, {"version": "1.0"}], ids=["connection-close", "http-1.0"]
)
async def test_a_client_that_asks_to_close_is_answered_then_closed(conn, ask) -> None:
    reader, writer = conn
    writer.write(post(chat(), **ask))
    resp = await read_response(reader)
    # the client gets its answer, told the connection ends, and then the end of the stream
    assert resp is not None and resp.status == 200 and resp.headers[DESTINATION_HEADER] == NODES["b"]
    assert resp.headers.get("connection") == "close"
    assert await closed_by_server(reader)


async def test_http_1_0_keep_alive_is_honoured(conn) -> None:
    reader, writer = conn
    for _ in range(2):  # an HTTP/1.0 client asking for keep-alive gets both answers on one connection
        writer.write(post(chat(), version="1.0", headers="connection: keep-alive\r\n"))
        resp = await read_response(reader)
        assert resp is not None and resp.status == 200 and resp.headers.get("connection") == "keep-alive"


async def test_a_body_beyond_the_slack_is_refused_413_and_the_connection_closed(conn, directory) -> None:
    reader, writer = conn
    huge = b'{"model": "authz-model", "prompt": "' + b"x" * (MAX_BODY + SLACK + 200_000) + b'"}'
    writer.write(post(huge))
    resp = await read_response(reader)
    # the client sees kvgate's own JSON error (not a reset), then the end of the connection
    assert resp is not None and resp.status == 413
    assert resp.headers["content-type"] == "application/json"
    err = json.loads(resp.body)
    assert err["object"] == "error" and err["code"] == 413
    assert f"exceeds the limit of {MAX_BODY} bytes" in err["message"] and "at least" in err["message"]
    assert await closed_by_server(reader)
    assert await inflight(directory) == 0


async def test_a_body_over_the_limit_but_within_the_slack_gets_the_cores_413(conn, core) -> None:
    reader, writer = conn
    big = b'{"model": "authz-model", "prompt": "' + b"y" * (MAX_BODY + 1000) + b'"}'
    writer.write(post(big))
    resp = await read_response(reader)
    # the client sees the same 413 the ext_proc path gives, naming the exact size
    expected = await core.route(CHAT, big)
    assert resp is not None and resp.status == 413 and expected.status == 413
    assert resp.body == expected.body and f"{len(big)} bytes" in json.loads(resp.body)["message"]
    writer.write(post(chat()))  # and the connection is still good for the next check
    nxt = await read_response(reader)
    assert nxt is not None and nxt.status == 200


async def test_malformed_json_is_the_clients_400_with_kvgates_error(conn, core) -> None:
    reader, writer = conn
    writer.write(post(b'{"model": "authz-model", "messages": ['))
    resp = await read_response(reader)
    # Envoy hands this 4xx to the client as a denial: the same JSON error ext_proc would send
    expected = await core.route(CHAT, b'{"model": "authz-model", "messages": [')
    assert resp is not None and resp.status == 400 and resp.headers["content-type"] == "application/json"
    assert resp.body == expected.body
    assert json.loads(resp.body)["message"].startswith("request body is not valid JSON")


@pytest.mark.parametrize(
    "request_bytes",
    [
        f"GET /kvgate/authz{CHAT} HTTP/1.1\r\nhost: kvgate\r\n\r\n".encode(),
        post(chat(), path="/v1/models"),
        post(b"", path=""),
    ],
    ids=["GET-inference-path", "POST-other-path", "bare-prefix"],
)
async def test_what_is_not_an_inference_post_passes_through(conn, directory, request_bytes) -> None:
    reader, writer = conn
    writer.write(request_bytes)
    resp = await read_response(reader)
    # Envoy sees 200 with no kvgate header: the request goes to its ordinary route, untouched
    assert resp is not None and resp.status == 200 and resp.body == b""
    assert not any(h.startswith("x-gateway") or h.startswith("x-kv") for h in resp.headers)
    assert await inflight(directory) == 0


async def test_a_query_string_does_not_hide_an_inference_path(conn) -> None:
    reader, writer = conn
    writer.write(post(chat(), path=CHAT + "?trace=1"))
    resp = await read_response(reader)
    assert resp is not None and resp.headers.get(DESTINATION_HEADER) == NODES["b"]  # still routed


async def test_garbage_bytes_get_400_and_a_closed_connection(conn) -> None:
    reader, writer = conn
    writer.write(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n")
    resp = await read_response(reader)
    # a TLS hello or line noise: a short plain 400, then the end of the connection
    assert resp is not None and resp.status == 400 and resp.body.startswith(b"malformed HTTP request")
    assert await closed_by_server(reader)


async def test_an_internal_error_is_a_500_never_a_4xx(conn, core, monkeypatch) -> None:
    async def broken(*args, **kw):
        raise RuntimeError("a bug in the decision path")

    monkeypatch.setattr(core, "route", broken)
    reader, writer = conn
    writer.write(post(chat()))
    resp = await read_response(reader)
    # Envoy's failure_mode_allow passes a 5xx through to its fallback route; a 4xx would deny the client
    assert resp is not None and resp.status == 500
    writer.write(post(b"", path="/v1/models"))  # the connection is still served afterwards
    nxt = await read_response(reader)
    assert nxt is not None and nxt.status == 200


async def test_a_client_gone_during_the_decision_gives_its_load_back_at_once(
    service, core, directory, monkeypatch
) -> None:
    decided, proceed, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()
    route = core.route

    async def held_route(*args, **kw):
        result = await route(*args, **kw)  # reserved: the node counts one more request
        decided.set()
        await proceed.wait()
        finished.set()
        return result

    monkeypatch.setattr(core, "route", held_route)
    released: list = []
    release = core.release

    async def spy_release(result) -> None:
        released.append(result)
        await release(result)

    monkeypatch.setattr(core, "release", spy_release)
    reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
    writer.write(post(chat()))
    await asyncio.wait_for(decided.wait(), 10)
    assert await inflight(directory) == 1
    writer.close()  # Envoy gave up on the check (its client went away)
    await asyncio.sleep(0.1)
    assert not finished.is_set()  # the decision was not cancelled half-way
    proceed.set()
    await asyncio.wait_for(finished.wait(), 5)
    await asyncio.sleep(0.05)
    # nobody will use that route: the node's load is back at once, not after the service estimate
    assert len(released) == 1 and released[0].kind == "routed"
    assert await inflight(directory) == 0


async def test_routed_load_ends_at_the_service_estimate_and_outlives_a_stopping_replica(
    service, conn, core, directory, monkeypatch
) -> None:
    results: list = []
    route = core.route

    async def spy_route(*args, **kw):
        results.append(await route(*args, **kw))
        return results[-1]

    monkeypatch.setattr(core, "route", spy_route)
    reader, writer = conn
    writer.write(post(chat(max_tokens=1)))
    assert (await read_response(reader)).status == 200  # type: ignore[union-attr]
    (result,) = results
    assert await inflight(directory) == 1
    await asyncio.sleep(result.service_s + 0.2)
    assert await inflight(directory) == 0  # the estimated end of the answer: the node is free again

    for topic in ("tides", "comets"):
        writer.write(post(chat(topic, max_tokens=4096)))
        assert (await read_response(reader)).status == 200  # type: ignore[union-attr]
    assert await inflight(directory) == 2
    await service.aclose()
    # those two still run on their node: their load stays until their estimated end, whoever
    # routed them; the stopped replica accepts no more checks
    assert await inflight(directory) == 2
    assert await closed_by_server(reader)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", service.port)
