"""The OTLP trace messages kvgate sends, defined here rather than imported from
``opentelemetry-proto``.

Why: ``xds-protos`` (which kvgate needs for Envoy's ext_proc stubs) ships its own, older copy of
the ``opentelemetry/proto/...`` modules in the same import path, and whichever package pip
installs last wins — on a fresh install the old copy (no ``InstrumentationScope``, no
``ScopeSpans``) won and tracing failed at start. Protobuf's wire format depends only on field
numbers and types, so these messages, built from the OTLP v1 specification's field numbers in a
private descriptor pool and package, encode exactly what a collector expects and cannot collide.

Only what kvgate emits is defined: spans with attributes, status, parent and kind.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "kvgate.otlp.v1"


def _message(file: descriptor_pb2.FileDescriptorProto, name: str, *fields: tuple) -> descriptor_pb2.DescriptorProto:
    msg = file.message_type.add(name=name)
    for spec in fields:
        number, fname, ftype = spec[:3]
        label = _F.LABEL_REPEATED if "repeated" in spec[3:] else _F.LABEL_OPTIONAL
        field = msg.field.add(name=fname, number=number, type=ftype, label=label)
        type_name = next((s for s in spec[3:] if s not in ("repeated", "oneof")), None)
        if type_name:
            field.type_name = f".{_PACKAGE}.{type_name}"
        if "oneof" in spec[3:]:
            if not msg.oneof_decl:
                msg.oneof_decl.add(name="value")
            field.oneof_index = 0
    return msg


def _enum(parent: descriptor_pb2.DescriptorProto, name: str, values: list[str]) -> None:
    enum = parent.enum_type.add(name=name)
    for number, value in enumerate(values):
        enum.value.add(name=value, number=number)


def _build() -> descriptor_pool.DescriptorPool:
    f = descriptor_pb2.FileDescriptorProto(name="kvgate/otlp_trace.proto", package=_PACKAGE, syntax="proto3")
    _message(
        f, "AnyValue",
        (1, "string_value", _F.TYPE_STRING, "oneof"), (2, "bool_value", _F.TYPE_BOOL, "oneof"),
        (3, "int_value", _F.TYPE_INT64, "oneof"), (4, "double_value", _F.TYPE_DOUBLE, "oneof"),
        (5, "array_value", _F.TYPE_MESSAGE, "ArrayValue", "oneof"), (7, "bytes_value", _F.TYPE_BYTES, "oneof"),
    )  # fmt: skip
    _message(f, "ArrayValue", (1, "values", _F.TYPE_MESSAGE, "AnyValue", "repeated"))
    _message(f, "KeyValue", (1, "key", _F.TYPE_STRING), (2, "value", _F.TYPE_MESSAGE, "AnyValue"))
    _message(f, "Resource", (1, "attributes", _F.TYPE_MESSAGE, "KeyValue", "repeated"), (2, "dropped_attributes_count", _F.TYPE_UINT32))
    _message(f, "InstrumentationScope", (1, "name", _F.TYPE_STRING), (2, "version", _F.TYPE_STRING))
    status = _message(f, "Status", (2, "message", _F.TYPE_STRING), (3, "code", _F.TYPE_ENUM, "Status.StatusCode"))
    _enum(status, "StatusCode", ["STATUS_CODE_UNSET", "STATUS_CODE_OK", "STATUS_CODE_ERROR"])
    span = _message(
        f, "Span",
        (1, "trace_id", _F.TYPE_BYTES), (2, "span_id", _F.TYPE_BYTES), (3, "trace_state", _F.TYPE_STRING),
        (4, "parent_span_id", _F.TYPE_BYTES), (5, "name", _F.TYPE_STRING), (6, "kind", _F.TYPE_ENUM, "Span.SpanKind"),
        (7, "start_time_unix_nano", _F.TYPE_FIXED64), (8, "end_time_unix_nano", _F.TYPE_FIXED64),
        (9, "attributes", _F.TYPE_MESSAGE, "KeyValue", "repeated"), (15, "status", _F.TYPE_MESSAGE, "Status"),
        (16, "flags", _F.TYPE_FIXED32),
    )  # fmt: skip
    _enum(span, "SpanKind", [
        "SPAN_KIND_UNSPECIFIED", "SPAN_KIND_INTERNAL", "SPAN_KIND_SERVER",
        "SPAN_KIND_CLIENT", "SPAN_KIND_PRODUCER", "SPAN_KIND_CONSUMER",
    ])  # fmt: skip
    _message(
        f, "ScopeSpans",
        (1, "scope", _F.TYPE_MESSAGE, "InstrumentationScope"), (2, "spans", _F.TYPE_MESSAGE, "Span", "repeated"),
        (3, "schema_url", _F.TYPE_STRING),
    )  # fmt: skip
    _message(
        f, "ResourceSpans",
        (1, "resource", _F.TYPE_MESSAGE, "Resource"), (2, "scope_spans", _F.TYPE_MESSAGE, "ScopeSpans", "repeated"),
        (3, "schema_url", _F.TYPE_STRING),
    )  # fmt: skip
    _message(f, "ExportTraceServiceRequest", (1, "resource_spans", _F.TYPE_MESSAGE, "ResourceSpans", "repeated"))
    _message(f, "ExportTraceServiceResponse")  # a collector's answer (its partial_success is not read)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return pool


_POOL = _build()


def _cls(name: str):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


AnyValue = _cls("AnyValue")
ArrayValue = _cls("ArrayValue")
KeyValue = _cls("KeyValue")
Resource = _cls("Resource")
InstrumentationScope = _cls("InstrumentationScope")
Status = _cls("Status")
Span = _cls("Span")
ScopeSpans = _cls("ScopeSpans")
ResourceSpans = _cls("ResourceSpans")
ExportTraceServiceRequest = _cls("ExportTraceServiceRequest")
ExportTraceServiceResponse = _cls("ExportTraceServiceResponse")
