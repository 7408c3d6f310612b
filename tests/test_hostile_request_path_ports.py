"""Slow and many connections against the ports on the request path: the P/D sidecar's (``kvgate
pd-sidecar``) and the simulated engine's (``kvgate worker``), real processes over loopback.

Before: both were plain aiohttp servers, which wait for a request's head with no deadline but the
idle keep-alive (3630 s) and take any number of connections: a client trickling a head a byte at
a time held its connection for ever, and 1,000 half-heads used up a process allowed 512
descriptors, so Envoy's next request (a new upstream connection) was never answered. Now both
serve through ``gateway.conn_gate.ConnectionGuard(whole_requests=True)``: a request's head and
body within 10 s (else 408), at most 256 connections waiting for one (the oldest closed), and a
connection whose request is being served is never closed for it, so a flood does not cut
Envoy's generations in progress.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time

import pytest

from tests.conftest import free_port
from tests.support.http import request
from tests.support.procs import Proc, start_echo, wait_for_port
from tests.test_hostile_slow_clients import _open_sockets

MODEL = "kvgate-sim"


def _flood(port: int, n: int) -> list[socket.socket]:
    """``n`` connections, each sent the first line and a header of a request that never ends."""
    held = []
    for _ in range(4):
        for _ in range(n // 4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            held.append(c)
        time.sleep(0.3)
    for c in held:
        try:
            c.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        except OSError:
            pass
    time.sleep(0.5)
    return held


def _trickle(port: int, out: dict[str, object], body: bool = False) -> None:
    """A head (or, with ``body``, a whole head and then its body) sent a byte every 0.25 s for at
    most 25 s; ``out``: what came back, after how long."""
    c = socket.create_connection(("127.0.0.1", port))
    c.settimeout(0.25)
    t0 = time.monotonic()
    slow = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 1000
    if body:
        c.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
        slow = b'{"prompt": "' + b"a" * 99_000
    try:
        for byte in slow:
            if time.monotonic() - t0 > 25:
                break
            try:
                c.send(bytes([byte]))
                answer = c.recv(4096)
                out.update(answer=answer, after=time.monotonic() - t0)
                return
            except TimeoutError:
                continue
            except OSError:
                out.update(answer=b"", after=time.monotonic() - t0)
                return
        out.update(answer=b"still open", after=time.monotonic() - t0)
    finally:
        c.close()


def _counter(url: str, name: str, reason: str) -> float:
    raw = request(url)[2].decode()
    m = re.search(rf'^{name}_total{{reason="{reason}"}} (\S+)$', raw, re.M)
    return float(m.group(1)) if m else 0.0


def _server(kind: str, tmp_path, port: int, procs: list[Proc]) -> tuple[str, str]:
    """The server under attack in its own process allowed 512 descriptors; (metrics URL, counter)."""
    limit = ["prlimit", "--nofile=512", sys.executable, "-m", "gateway.cli"]
    if kind == "sidecar":
        engine = free_port()
        procs.append(start_echo("slow-engine", engine, tmp_path, delay_s=4.0))  # a generation in progress
        procs.append(Proc("pd-sidecar", [*limit, "pd-sidecar", "--port", str(port), "--engine", f"http://127.0.0.1:{engine}",
                                         "--any-prefiller"], tmp_path))  # fmt: skip
        metrics, counter = f"http://127.0.0.1:{port}/pd-sidecar/metrics", "kvgate_pd_sidecar_closed_connections"
    else:
        procs.append(Proc("worker", [*limit, "worker", "--port", str(port), "--model", MODEL, "--time-scale", "1"], tmp_path))
        metrics, counter = f"http://127.0.0.1:{port}/metrics", "kvgate_engine_closed_connections"
    wait_for_port(port, proc=procs[-1].popen, timeout_s=30)
    return metrics, counter


@pytest.mark.parametrize("kind", ["sidecar", "engine"])
def test_trickled_heads_and_a_flood_of_half_heads_never_keep_envoys_requests_out(tmp_path, kind: str) -> None:
    """A generation is in progress; 1,000 connections each send half a head; one more trickles its
    head a byte every 0.25 s, another a body after a whole head. Before: the server held every connection it could accept, ran out of
    descriptors and a new request was never answered; the trickled head was still open after 25 s.
    Now: at most 256 of the half-heads are held, a new request is answered at once, the one in
    progress completes, and the trickled head and body are answered 408 after the 10 s deadline."""
    port = free_port()
    procs: list[Proc] = []
    held: list[socket.socket] = []
    try:
        metrics, counter = _server(kind, tmp_path, port, procs)
        body = {"model": MODEL, "prompt": "in progress " * 50, "max_tokens": 300, "ignore_eos": True}
        in_progress: dict[str, object] = {}

        def generate() -> None:
            try:
                status, _, raw = request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                         body=json.dumps(body).encode(), headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
                in_progress.update(status=status, raw=raw)
            except OSError as e:
                in_progress.update(status=repr(e))

        generation = threading.Thread(target=generate)
        generation.start()
        time.sleep(0.5)  # its request has arrived whole: it is being served
        held = _flood(port, 1000)
        trickled: dict[str, object] = {}
        trickler = threading.Thread(target=_trickle, args=(port, trickled))
        trickler.start()
        trickled_body: dict[str, object] = {}
        body_trickler = threading.Thread(target=_trickle, args=(port, trickled_body, True))
        body_trickler.start()
        t0 = time.monotonic()
        try:
            status = request(metrics, timeout=5)[0]
        except OSError as e:
            status = repr(e)
        took = time.monotonic() - t0
        sockets = _open_sockets(procs[-1].popen.pid)
        generation.join(60)
        trickler.join(30)
        body_trickler.join(30)
        print(f"\n{kind}: a new request {status} in {took:.2f} s with 1,000 half-heads; sockets held {sockets}; "
              f"the request in progress: {in_progress.get('status')}; trickled head: {trickled.get('answer', b'')[:12]!r} "
              f"after {trickled.get('after', 0):.1f} s; trickled body: {trickled_body.get('answer', b'')[:12]!r} "
              f"after {trickled_body.get('after', 0):.1f} s")  # fmt: skip
        assert status == 200 and took < 2.0, f"a new request got {status} after {took:.1f} s"
        assert sockets < 256 + 32, f"{sockets} sockets held"
        assert in_progress.get("status") == 200, f"the request in progress got {in_progress.get('status')}"
        answer = trickled.get("answer", b"")
        assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 408"), f"trickled head: {answer[:40]!r}"
        answer = trickled_body.get("answer", b"")  # a whole head, then a body trickled: the same deadline
        assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 408"), f"trickled body: {answer[:40]!r}"
        assert _counter(metrics, counter, "head_timeout") >= 1 and _counter(metrics, counter, "evicted") >= 500
        assert procs[-1].alive()
    finally:
        for c in held:
            c.close()
        for p in reversed(procs):
            p.stop()


def test_a_keep_alive_connection_between_requests_is_not_cut_at_the_head_deadline(tmp_path) -> None:
    """Envoy keeps an idle upstream connection an hour and sends the next request on it whenever:
    closing it at the 10 s head deadline would race that request. The engine's guard leaves an
    answered connection to the server's keep-alive: 12 s after its first answer, a second request
    on the same connection is answered."""
    import http.client

    port = free_port()
    procs: list[Proc] = []
    try:
        _server("engine", tmp_path, port, procs)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        time.sleep(12)
        conn.request("GET", "/health")
        second = conn.getresponse()
        second.read()
        assert first.status == 200 and second.status == 200
        assert conn.sock is sock, "the connection was reopened"
    finally:
        for p in reversed(procs):
            p.stop()
