"""Process logging: human lines by default, JSON lines (one object a line) for log pipelines.

Every line written while a request is being handled carries that request's ID — Envoy's
``x-request-id``, which Envoy also logs and forwards to the node — so one ID finds a request in
Envoy's access log, kvgate's log and ``/debug/decisions``. The ID travels in a ``ContextVar``:
each ext_proc stream runs in its own asyncio task, so setting it there scopes it to that request;
ext_authz answers a connection's checks one after another in one task and sets and resets it
around each. A record pays for it only when it is emitted.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar

REQUEST_ID: ContextVar[str] = ContextVar("kvgate_request_id", default="")
"""The ``x-request-id`` of the request the current task is handling ("" outside requests)."""

_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "request_id", "rid"}


class RequestIdFilter(logging.Filter):
    """Stamps ``record.request_id`` from the current context (a record made elsewhere keeps its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = REQUEST_ID.get()
        return True


class JsonLineFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, request_id (when set), extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "")
        if request_id:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():  # fields given with ``extra=``
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human lines; ``[request-id]`` after the logger name when the line belongs to a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", "")
        record.rid = f" [{request_id}]" if request_id else ""
        return super().format(record)


def setup_logging(level: str = "INFO", *, json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonLineFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
