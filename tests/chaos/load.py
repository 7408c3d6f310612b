"""Steady multi-turn chat load through Envoy, recorded per request, and what a fault did to it.

A few client threads each keep several conversations going (a private document as the system
prompt, then growing turns), one request at a time at a fixed pace, so the offered load is
bounded in count and time. Each request carries ``x-chaos-id``; joined with Envoy's access log it
says whether kvgate routed the request (``x-gateway-destination-endpoint`` set) and where it went.

"Routed by cache" = kvgate chose the node and the node answered with cached tokens (its
``x-kvgate-cached-tokens``). Only follow-up turns count: a first turn has nothing cached anywhere.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

MODEL = "deepseek-chat"


@dataclass
class Sample:
    id: str
    conversation: str
    turn: int
    start: float
    end: float = 0.0
    status: int = 0  # 0: no HTTP answer at all (connection error)
    node: str = ""  # x-kvgate-node of the worker that answered
    cached_tokens: int = 0
    dest: str = ""  # kvgate's choice, from Envoy's access log ("" = fallback route)
    upstream: str = ""  # where Envoy sent it last, from the access log
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def by_cache(self) -> bool:
        return self.ok and bool(self.dest) and self.cached_tokens > 0


def document(conv: str, sentences: int = 50) -> str:
    return " ".join(f"Note {i} of file {conv}: item {i * 13 % 97} is filed under {conv}-{i % 7}." for i in range(sentences))


class SteadyLoad:
    """``threads`` clients × ``conversations`` each, one request per ``interval_s`` per client."""

    def __init__(self, port: int, *, threads: int = 4, conversations: int = 3, interval_s: float = 0.25, turns: int = 8) -> None:
        self.port = port
        self.threads = threads
        self.conversations = conversations
        self.interval_s = interval_s
        self.turns = turns
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:8]  # ids are unique across runs sharing one access log
        self._workers: list[threading.Thread] = []

    def start(self) -> "SteadyLoad":
        for t in range(self.threads):
            th = threading.Thread(target=self._client, args=(t,), daemon=True, name=f"chaos-load-{t}")
            th.start()
            self._workers.append(th)
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        for th in self._workers:
            th.join(timeout=30)
        return self.samples

    def _client(self, t: int) -> None:
        convs = [{"id": f"t{t}c{c}g0", "gen": 0, "turns": []} for c in range(self.conversations)]
        conn: http.client.HTTPConnection | None = None
        for i in itertools.count():
            if self._stop.is_set():
                break
            conv = convs[i % len(convs)]
            if len(conv["turns"]) >= self.turns:  # start over with a fresh document
                conv["gen"] += 1
                conv["id"] = conv["id"].rsplit("g", 1)[0] + f"g{conv['gen']}"
                conv["turns"] = []
            question = f"Question {len(conv['turns'])} about {conv['id']}?"
            messages = [{"role": "system", "content": document(conv["id"])}]
            for q, a in conv["turns"]:
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            messages.append({"role": "user", "content": question})
            sample = Sample(f"{self._run}-{next(self._ids)}", conv["id"], len(conv["turns"]) + 1, time.monotonic())
            body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
            answer = ""
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
                conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json", "x-chaos-id": sample.id})
                resp = conn.getresponse()
                raw = resp.read()
                sample.status = resp.status
                sample.node = resp.getheader("x-kvgate-node") or ""
                sample.cached_tokens = int(resp.getheader("x-kvgate-cached-tokens") or 0)
                if resp.status == 200:
                    answer = json.loads(raw)["choices"][0]["message"]["content"]
                if resp.getheader("connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException, ValueError):
                if conn is not None:
                    conn.close()
                conn = None
            sample.end = time.monotonic()
            with self._lock:
                self.samples.append(sample)
            if sample.ok:
                conv["turns"].append((question, answer))
            self._stop.wait(max(0.0, self.interval_s - (sample.end - sample.start)))
        if conn is not None:
            conn.close()


def join_access_log(samples: list[Sample], records: dict[str, dict]) -> None:
    for s in samples:
        rec = records.get(s.id)
        if rec is None:
            continue
        s.dest = rec.get("dest") or ""
        s.upstream = rec.get("upstream") or ""
        s.attempts = int(rec.get("attempts") or 0)


@dataclass
class Row:
    """One line of the chaos table: what one fault (or its repair) did to the load."""

    event: str
    requests: int = 0
    failed: int = 0
    failed_on_target: int = 0  # in flight on (or sent before anyone could know to) the faulted worker
    retried: int = 0
    by_cache_before: float = 0.0
    by_cache_after: float = 0.0
    resumed_s: float | None = None  # time from the event until routing by cache is back
    stale_after_ttl: int = 0
    notes: list[str] = field(default_factory=list)


def by_cache_ratio(samples: list[Sample]) -> float:
    follow = [s for s in samples if s.turn > 1]
    return sum(s.by_cache for s in follow) / len(follow) if follow else 0.0


def resumed_after(samples: list[Sample], t_event: float, *, window: int = 6, need: int = 5, target: str = "") -> float | None:
    """Seconds from ``t_event`` to the first run of ``window`` follow-up turns (by start time) of
    which ``need`` were routed by cache (and, with ``target``, landed on that node)."""
    follow = sorted((s for s in samples if s.turn > 1 and s.start >= t_event), key=lambda s: s.start)
    if target:
        follow = [s for s in follow if s.node == target or s.dest.endswith(target)]
        window, need = 2, 2
    for i in range(len(follow) - window + 1):
        run = follow[i : i + window]
        if sum(s.by_cache for s in run) >= need:
            return run[0].start - t_event
    return None


def between(samples: list[Sample], t0: float, t1: float) -> list[Sample]:
    return [s for s in samples if t0 <= s.start < t1]


def render_table(rows: list[Row]) -> str:
    head = ("event", "requests", "failed", "failed: on faulted worker", "retried", "by cache before→after", "cache routing back after", "stale uses after TTL")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        resumed = "—" if r.resumed_s is None else f"{r.resumed_s:.2f} s"
        lines.append(
            " | ".join(
                (
                    r.event,
                    str(r.requests),
                    str(r.failed),
                    str(r.failed_on_target),
                    str(r.retried),
                    f"{r.by_cache_before:.0%} → {r.by_cache_after:.0%}",
                    resumed,
                    str(r.stale_after_ttl),
                )
            )
        )
    return "\n".join("| " + line + " |" for line in lines)
