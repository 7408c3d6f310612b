"""OpenTelemetry traces of routing decisions: one span per decision, one child span per stage.

Why spans are built after the fact: the request path already times its stages with
``perf_counter`` (the metrics need them), so instead of opening a span around each await — which
costs on every request and leaks span state into the hot code — ``RoutingCore`` schedules
``DecisionTracer.record`` with the finished ``RouteResult`` and its start time, to run just after
the answer went back to Envoy, and the span tree is made with explicit timestamps: the trace shows
the same durations the histograms count.

Why the spans are OTLP protobuf messages rather than SDK ``Span`` objects: see ``gateway.otlp``
(the SDK's span pipeline cost ~0.3 ms a decision and caused p99 spikes). The SDK still supplies
what must follow the OpenTelemetry conventions: the resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``), the sampler (``OTEL_TRACES_SAMPLER[_ARG]``; the default,
parent-based always-on, follows an incoming ``traceparent``'s sampled flag) and the span IDs.

Off by default. When off, this module is never imported (``RoutingCore.tracer`` is None and
``gateway.core`` imports it only for type checking), so tracing costs nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway import otlp_schema as pb
from gateway.core import RouteResult
from gateway.otlp import OtlpConfigError, OtlpHttpSender, OtlpSettings, add_attributes, resource_proto
from gateway.prediction import predict

STAGE_ORDER = ("parse", "tokenize", "lookup", "score", "reserve")
"""Stages in the order they run; each becomes a child span laid end to end after the previous."""

_PROPAGATOR = TraceContextTextMapPropagator()
_SERVER = pb.Span.SpanKind.SPAN_KIND_SERVER
_INTERNAL = pb.Span.SpanKind.SPAN_KIND_INTERNAL
_ERROR = pb.Status.StatusCode.STATUS_CODE_ERROR


class TracingSetupError(RuntimeError):
    """The ``OTEL_*`` environment asks for something kvgate's exporter cannot do."""


def decision_attributes(result: RouteResult, *, path: str, request_id: str) -> dict[str, str | int | float | bool]:
    """What an operator filters traces by: model, sizes, best prefix, chosen node, outcome."""
    attrs: dict[str, str | int | float | bool] = {"kvgate.path": path, "kvgate.kind": result.kind}
    if request_id:
        attrs["kvgate.request_id"] = request_id
    req = result.request
    if req is not None:
        attrs["kvgate.model"] = req.model
        attrs["kvgate.prompt_tokens"] = req.prompt_tokens
        attrs["kvgate.prompt_blocks"] = req.total_blocks
    if result.kind == "rejected":
        attrs["kvgate.outcome"] = "rejected"
        attrs["http.response.status_code"] = result.status
        return attrs
    d = result.decision
    if result.kind == "fail_open":
        attrs["kvgate.outcome"] = "fail_open"
        attrs["kvgate.fail_open_reason"] = result.reason
    if d is None:
        return attrs
    attrs["kvgate.policy"] = d.policy
    attrs.setdefault("kvgate.outcome", d.outcome)
    attrs["kvgate.candidates"] = len(d.candidates)
    attrs["kvgate.expected_cached_tokens"] = d.expected_cached_tokens
    best = max(d.candidates, key=lambda c: c.cached_blocks, default=None)
    if best is not None:
        attrs["kvgate.best_cached_blocks"] = best.cached_blocks
        attrs["kvgate.best_cached_tokens"] = best.cached_blocks * (req.block_size if req is not None else 0)
        if best.cached_blocks:
            attrs["kvgate.best_cached_node"] = best.node_id
    if d.node is not None:
        attrs["kvgate.chosen_node"] = d.node.node_id
        attrs["kvgate.chosen_address"] = d.node.address
        chosen = next((c for c in d.candidates if c.node_id == d.node.node_id), None)
        if chosen is not None:
            attrs["kvgate.estimated_ttft_s"] = chosen.total_s
    prediction = predict(result)  # the figures of the prediction headers, when they are on
    if prediction is not None:
        attrs["kvgate.estimated_ttft_ms"] = prediction.estimated_ttft_ms
    if d.pull is not None:
        attrs["kvgate.pull.source_node"] = d.pull.source_node_id
        attrs["kvgate.pull.blocks"] = d.pull.blocks
    return attrs


class DecisionTracer:
    """Turns finished ``RouteResult``s into OTLP span trees and hands them to ``submit``."""

    def __init__(
        self,
        submit: Callable[[Sequence[pb.Span]], None],
        *,
        sampler: Sampler,
        ids: IdGenerator | None = None,
    ) -> None:
        self._submit = submit
        self._sampler = sampler
        self._ids = ids or RandomIdGenerator()

    def record(self, result: RouteResult, path: str, request_id: str, start_ns: int, traceparent: str = "") -> None:
        """Export ``result`` as a span tree; ``start_ns`` is the wall clock when routing began."""
        parent_ctx = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        parent = trace.get_current_span(parent_ctx).get_span_context() if parent_ctx is not None else None
        if parent is not None and not parent.is_valid:
            parent, parent_ctx = None, None
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        attrs = decision_attributes(result, path=path, request_id=request_id)
        sampling = self._sampler.should_sample(parent_ctx, trace_id, "kvgate.route", SpanKind.SERVER, attrs)
        if not sampling.decision.is_sampled():
            return
        tid = trace_id.to_bytes(16, "big")
        root_id = self._ids.generate_span_id().to_bytes(8, "big")
        spans: list[pb.Span] = []
        t = start_ns
        for stage in STAGE_ORDER:
            seconds = result.timings.get(stage)
            if seconds is None:
                continue
            end = t + int(seconds * 1e9)
            spans.append(
                pb.Span(
                    trace_id=tid, span_id=self._ids.generate_span_id().to_bytes(8, "big"), parent_span_id=root_id,
                    name=f"kvgate.{stage}", kind=_INTERNAL, start_time_unix_nano=t, end_time_unix_nano=end,
                )  # fmt: skip
            )
            t = end
        if not spans:  # rejected before any stage was timed, or an internal error
            t = time.time_ns()
        root = pb.Span(
            trace_id=tid,
            span_id=root_id,
            parent_span_id=parent.span_id.to_bytes(8, "big") if parent is not None else b"",
            trace_state=sampling.trace_state.to_header() if sampling.trace_state else "",
            name="kvgate.route",
            kind=_SERVER,
            start_time_unix_nano=start_ns,
            end_time_unix_nano=max(t, start_ns),
        )
        add_attributes(root.attributes, sampling.attributes or attrs)
        if result.kind == "fail_open":
            root.status.code = _ERROR
            root.status.message = result.reason
        spans.append(root)
        self._submit(spans)


def _check_exporter(env: Mapping[str, str]) -> bool:
    """True when spans should be sent (``OTEL_TRACES_EXPORTER`` otlp), False for ``none``."""
    kind = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if kind == "none":
        return False
    if kind != "otlp":
        raise TracingSetupError(f"OTEL_TRACES_EXPORTER={kind!r}: kvgate exports otlp (or none)")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol != "http/protobuf":
        raise TracingSetupError(
            f"OTLP protocol {protocol!r}: kvgate sends http/protobuf (OTLP's default; collectors accept it on :4318)"
        )
    return True


class Tracing:
    """Resource, sampler and OTLP sender behind a ``DecisionTracer``, all from ``OTEL_*``."""

    def __init__(self, service_name: str = "kvgate", env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        send = _check_exporter(env)
        resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": service_name}))
        # The provider is used only to read the sampler the OTEL_TRACES_SAMPLER* variables name.
        sampler = TracerProvider(resource=resource, shutdown_on_exit=False).sampler
        try:
            settings = OtlpSettings.from_env(env)
        except OtlpConfigError as e:
            raise TracingSetupError(str(e)) from None
        self.sender = OtlpHttpSender(settings, resource_proto(resource.attributes)) if send else None
        self.tracer = DecisionTracer(self.sender.submit if self.sender else _discard, sampler=sampler)

    async def start(self) -> None:
        if self.sender is not None:
            await self.sender.start()

    async def aclose(self) -> None:
        """Export what is queued (within the OTLP timeout), then stop."""
        if self.sender is not None:
            await self.sender.aclose()


def _discard(_: Sequence[pb.Span]) -> None:
    """``OTEL_TRACES_EXPORTER=none``: spans are built and sampled, then dropped."""


def tracing_disabled_by_env(env: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SDK_DISABLED=true`` turns tracing off whatever kvgate's config says (the OTel convention)."""
    env = os.environ if env is None else env
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
