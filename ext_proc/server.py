"""Envoy External Processor (ext_proc) gRPC service in front of ``RoutingCore``.

One gRPC stream per HTTP request. Envoy sends the request headers, waits for our answer, then
sends the whole buffered body; we answer the body with the routing headers and
``clear_route_cache`` so Envoy re-matches the route on ``x-gateway-destination-endpoint``. Envoy
keeps the stream open until the HTTP exchange ends (measured: the stream's EOF arrives after the
upstream response completes, or when the client goes away), so the end of the stream is where
the node's load reservation is released — no response phase is needed, which would cost
~0.5 ms a request (measured here with Envoy 1.40). A stream that routes nothing (a path kvgate
does not route, a caller without the token, a rejected or failed-open request) is ended as soon
as it is answered, and one that sends no message within ``FIRST_MESSAGE_TIMEOUT_S`` is ended
unanswered: Envoy takes a server's end of the stream as "done processing", and nobody else can
hold streams open. Only a sampled share of requests
(``usage_sample``) asks Envoy, for itself alone, for its answer's body, to read the engine's
``cached_tokens`` (``ext_proc.usage``).

Why the server is written this way (measured against grpc.aio with async iterators, a threaded
server and grpclib, each slower): the gRPC per-stream overhead dominates, so the handler uses
``context.read()/write()`` rather than async iterators, writes responses that were serialized
once at import time where they do not vary, and registers a generic handler with no response
serializer (it writes bytes).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
from functools import cache, lru_cache

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from prometheus_client import Counter

from ext_proc import responses
from ext_proc.usage import UsageTail, record_usage
from gateway import metrics
from gateway.core import RouteResult, RoutingCore, error_body
from gateway.envoy_config import CALLER_TOKEN_HEADER, DESTINATION_HEADER, INFERENCE_PATHS
from gateway.logs import REQUEST_ID
from gateway.node_health import NodeHealth
from gateway.prediction import predict
from gateway.sessions import RETENTION_HEADER, SESSION_HEADER

log = logging.getLogger("kvgate.ext_proc")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
CALLER_TOKEN_METADATA = CALLER_TOKEN_HEADER
UNAUTHENTICATED = Counter(
    "kvgate_ext_proc_unauthenticated",
    "ext_proc streams without Envoy's caller token, passed through unrouted",
    registry=metrics.REGISTRY,
)
MESSAGE_SLACK = 1 << 20  # a message may exceed the body limit by this (headers, framing)
FIRST_MESSAGE_TIMEOUT_S = 5.0  # Envoy sends the request headers as it opens a stream; a stream silent this long is ended
TOKENLESS_FIRST_MESSAGE_S = 0.1  # the same for a stream without Envoy's token: Envoy sends its first message with the stream
HANDSHAKE_TIMEOUT_S = 10.0  # a new connection must have finished its HTTP/2 handshake by then
MAX_CONNECTIONS = 512  # connections held at once (Envoy keeps a few long-lived ones); newer ones are refused


@cache
def _streams(end: str) -> Counter:
    """The bound ``EXT_PROC_STREAMS`` child (``labels`` costs a lock and a dict lookup per call)."""
    return metrics.EXT_PROC_STREAMS.labels(end)


class _Silent(Exception):
    """No message came within ``FIRST_MESSAGE_TIMEOUT_S`` of the stream's start."""


def _header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    # Envoy ≥1.27 fills raw_value; older ones fill value.
    return {h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in headers.headers.headers}


def routed_response(result: RouteResult) -> bytes:
    """Body-phase answer: set the routing headers, clear the route cache, fill envoy.lb."""
    return _routed_message(result.headers)


@lru_cache(maxsize=4096)
def _routed_message(headers: tuple[tuple[str, str], ...]) -> bytes:
    """The serialized answer for these routing headers: a pure function of them, and a fleet
    routes to few distinct ones (a node, or a node pulling from another), so it is built once
    (~5 µs of protobuf building a request otherwise)."""
    common = pb.CommonResponse(clear_route_cache=True)
    add = common.header_mutation.set_headers.add
    for key, value in headers:
        add(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    resp = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    lb = struct_pb2.Struct()
    lb.update({DESTINATION_HEADER: dict(headers)[DESTINATION_HEADER]})
    resp.dynamic_metadata.fields["envoy.lb"].struct_value.CopyFrom(lb)
    return resp.SerializeToString()


def prediction_response(result: RouteResult | None) -> bytes:
    """Response-header phase: add the prediction headers to a routed request whose keys are its
    tenant's alone (it carried a cache_salt); anything else passes unchanged."""
    salted = result is not None and result.request is not None and result.request.salted
    prediction = predict(result) if salted else None
    if prediction is None:
        return responses.RESPONSE_HEADERS_CONTINUE
    resp = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    add = resp.response_headers.response.header_mutation.set_headers.add
    for key, value in prediction.headers():
        add(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    return resp.SerializeToString()


def immediate_response(status: int, body: bytes) -> bytes:
    """Answer the client directly (a rejected request): the request never reaches a node."""
    imm = pb.ImmediateResponse(status=http_status_pb2.HttpStatus(code=status), body=body, details="kvgate_rejected")
    imm.headers.set_headers.add(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))
    return pb.ProcessingResponse(immediate_response=imm).SerializeToString()


class ExtProcService:
    """The ``Process`` bidi stream; stateless across streams.

    ``health`` counts the nodes' answers when Envoy sends the response headers; ``caller_token``:
    streams without it in their metadata are passed through unrouted; ``prediction_headers``: ask
    Envoy for each inference response's headers and add the prediction headers there
    (``prediction.response_headers``); costs a message per request.
    """

    def __init__(
        self, core: RoutingCore, health: NodeHealth | None = None, caller_token: str = "", *, prediction_headers: bool = False,
        usage_sample: float = 0.0,
    ) -> None:
        self.core = core
        self.usage_sample = usage_sample  # share of requests whose answer's cached_tokens is read (ext_proc.usage)
        self.health = health
        self.caller_token = caller_token
        self.observing = False  # Envoy sends response headers (seen once): a stream without them was reset
        self.headers_continue = (
            responses.HEADERS_CONTINUE_SEND_RESPONSE_HEADERS if prediction_headers else responses.HEADERS_CONTINUE
        )

    async def process(self, _request_iterator, context: grpc.aio.ServicerContext) -> None:
        result: RouteResult | None = None
        end = "ok"
        seen_status = False
        tail = UsageTail() if self.usage_sample and random.random() < self.usage_sample else None
        sampled = tail is not None
        try:
            result = await self._exchange(context, observe_usage=sampled)
            if result is None or result.kind != "routed":
                # Nothing held, nothing to watch: end the stream now (Envoy goes on without it)
                # rather than keep it, a task and ~20 KB, until the HTTP exchange ends.
                return
            # Wait for Envoy to close the stream: that is the end of the HTTP exchange. With
            # response headers sent (EnvoySettings.observe_responses, or asked for the prediction
            # headers) the node's answer is seen.
            while (msg := await context.read()) is not grpc.aio.EOF:
                if msg.HasField("response_headers"):
                    seen_status = True
                    if not sampled:  # not asked for by this stream's own override: Envoy's config sends them
                        self.observing = True
                    self._outcome(result, _header_map(msg.response_headers).get(":status", ""))
                    await context.write(prediction_response(result))
                elif msg.HasField("response_body"):
                    if tail is not None:
                        tail.feed(msg.response_body.body)
                        if msg.response_body.end_of_stream:
                            record_usage(result, tail)
                            tail = None
                    await context.write(responses.RESPONSE_BODY_CONTINUE)
                else:
                    await context.write(responses.EMPTY)
        except _Silent:
            end = "silent"
        except asyncio.CancelledError:
            end = "cancelled"
            raise
        except Exception:
            end = "error"
            log.exception("ext_proc stream failed")
        finally:
            _streams(end).inc()
            if tail is not None and tail.fed:  # Envoy ended the stream without marking the body's end
                record_usage(result, tail)
            asked = sampled or self.observing  # the response headers were due on this stream
            if end == "ok" and result is not None and self.health is not None and asked and not seen_status:
                self._outcome(result, "reset")  # routed, but no answer ever came back
            if result is not None and result.kind == "routed":  # nothing else holds load
                release = self.core.release(result)
                # Shielded: the release must happen even when Envoy cancels the stream. An
                # in-process directory never suspends, so nothing can interrupt it: no task needed.
                await (release if self.core.in_process else asyncio.shield(release))

    def _from_envoy(self, context: grpc.aio.ServicerContext) -> bool:
        given = next((v for k, v in context.invocation_metadata() or () if k == CALLER_TOKEN_METADATA), "")
        return hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.caller_token.encode())

    def _outcome(self, result: RouteResult | None, status: str) -> None:
        """Count a routed request's answer for its node (5xx and resets are failures)."""
        if self.health is None or result is None or result.kind != "routed" or result.decision is None:
            return
        node = result.decision.node
        if node is not None:
            self.health.record(node.node_id, status.isdigit() and int(status) < 500)

    async def _exchange(self, context: grpc.aio.ServicerContext, *, observe_usage: bool = False) -> RouteResult | None:
        # a stranger opening streams and sending nothing must not hold each for seconds
        wait = TOKENLESS_FIRST_MESSAGE_S if self.caller_token and not self._from_envoy(context) else FIRST_MESSAGE_TIMEOUT_S
        try:
            async with asyncio.timeout(wait):
                msg = await context.read()
        except TimeoutError:
            raise _Silent from None
        if msg is grpc.aio.EOF:
            return None
        if not msg.HasField("request_headers"):
            await context.write(responses.EMPTY)
            return None
        headers = _header_map(msg.request_headers)
        request_id = headers.get("x-request-id", "")
        REQUEST_ID.set(request_id)  # this stream's task only: every log line of it carries the ID
        path = headers.get(":path", "").split("?", 1)[0]
        if headers.get(":method") != "POST" or path not in INFERENCE_PATHS:
            await context.write(responses.HEADERS_CONTINUE_NO_BODY)
            return None
        if self.caller_token and not self._from_envoy(context):  # else: an oracle of who holds which prompt
            UNAUTHENTICATED.inc()
            await context.write(responses.HEADERS_CONTINUE_NO_BODY)
            return None
        if msg.request_headers.end_of_stream:
            await context.write(immediate_response(400, responses.EMPTY_BODY_ERROR))
            metrics.REJECTED.labels("400").inc()
            return None
        await context.write(responses.HEADERS_CONTINUE_OBSERVE_USAGE if observe_usage else self.headers_continue)

        body = bytearray()
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return None
            if not msg.HasField("request_body"):
                await context.write(responses.EMPTY)
                continue
            body += msg.request_body.body
            if len(body) > self.core.limits.max_body_bytes:  # a STREAMED body: stop buffering it now
                limit = self.core.limits.max_body_bytes
                message = f"request body of at least {len(body)} bytes exceeds the limit of {limit} bytes"
                await context.write(immediate_response(413, error_body(413, message)))
                metrics.REJECTED.labels("413").inc()
                return None
            if msg.request_body.end_of_stream:
                break
            # Only a STREAMED body arrives in parts; acknowledge each part without changes.
            await context.write(responses.BODY_CONTINUE)

        result = await self.core.route(
            path, bytes(body), request_id, headers.get("traceparent", ""),
            session_header=headers.get(SESSION_HEADER, ""), retention_header=headers.get(RETENTION_HEADER, ""),
        )
        try:
            if result.kind == "routed":
                await context.write(routed_response(result))
            elif result.kind == "rejected":
                await context.write(immediate_response(result.status, result.body))
            else:
                await context.write(responses.BODY_CONTINUE)
        except BaseException:  # Envoy dropped the stream: the caller never sees this result
            await asyncio.shield(self.core.release(result))
            raise
        return result


def build_server(
    core: RoutingCore,
    address: str,
    health: NodeHealth | None = None,
    *,
    caller_token: str = "",
    prediction_headers: bool = False,
    usage_sample: float = 0.0,
) -> grpc.aio.Server:
    """A grpc.aio server with the ext_proc service bound to ``address`` (host:port); the other
    arguments are ``ExtProcService``'s."""
    service = ExtProcService(core, health, caller_token, prediction_headers=prediction_headers, usage_sample=usage_sample)
    max_message = core.limits.max_body_bytes + MESSAGE_SLACK  # one message never carries more than a body
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                service.process, request_deserializer=pb.ProcessingRequest.FromString
            )
        },
    )
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.so_reuseport", 0),
            # a connection must finish its HTTP/2 handshake within this, and past so many the
            # newest are refused: a flood of half-open connections cannot use up the descriptors
            # the process needs (Redis, the admin port); Envoy's established connections go on
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
            ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
        ]
    )
    server.add_generic_rpc_handlers([handler])
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind the ext_proc server to {address}")
    return server
