"""ext_proc answers that never vary, serialized once: the hot path writes bytes, not messages."""

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.core import error_body

HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
"""Headers seen, send the body (the decision needs it)."""

HEADERS_CONTINUE_NO_BODY = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
        response_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
    ),
).SerializeToString()
"""Not an inference request: pass it through untouched; send us neither its body nor its answer."""


def _headers_continue_observing(response_body_mode: int) -> bytes:
    """Headers seen, send the body, and show us the response's headers (and its body, as given)."""
    mode = processing_mode_pb2.ProcessingMode
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(),
        mode_override=mode(
            request_header_mode=mode.SEND,
            response_header_mode=mode.SEND,
            request_body_mode=mode.BUFFERED,
            response_body_mode=response_body_mode,
            request_trailer_mode=mode.SKIP,
            response_trailer_mode=mode.SKIP,
        ),
    ).SerializeToString()


HEADERS_CONTINUE_SEND_RESPONSE_HEADERS = _headers_continue_observing(processing_mode_pb2.ProcessingMode.NONE)
"""Headers seen, send the body, and show us the response's headers (to add the prediction headers)."""

HEADERS_CONTINUE_OBSERVE_USAGE = _headers_continue_observing(processing_mode_pb2.ProcessingMode.STREAMED)
"""Headers seen, send the body, and show us the response's headers and body chunk by chunk (a
sampled request whose ``usage.cached_tokens`` is read: ``ext_proc.usage``)."""

RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
"""A response body chunk seen, no change."""

BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()
"""Body seen, no change: Envoy's fallback route balances it (fail open)."""

RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
"""The node's response headers seen (to add the prediction headers, or to count the node's status
for EnvoySettings.observe_responses), no change."""

EMPTY = pb.ProcessingResponse().SerializeToString()

EMPTY_BODY_ERROR = error_body(400, "request body is empty: an inference request needs a JSON body")
