"""Blocking HTTP helpers for tests (the servers under test run in other processes)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


def request(
    url: str, *, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 10
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def post_json(url: str, payload: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, _, raw = request(
        url, method="POST", body=json.dumps(payload).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def get_json(url: str) -> tuple[int, Any]:
    status, _, raw = request(url)
    return status, json.loads(raw) if raw else None


def eventually(
    check: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.1, show: Callable[[], Any] | None = None
) -> Any:
    """Poll ``check`` until it returns something truthy; fail with its last value or error."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # a server still starting refuses connections
            last = e
        if time.monotonic() > deadline:
            seen = f"; state: {show()!r}" if show is not None else ""
            raise AssertionError(f"condition not met within {timeout_s}s; last: {last!r}{seen}")
        time.sleep(interval_s)
