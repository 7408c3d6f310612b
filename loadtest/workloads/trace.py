"""The Mooncake conversation trace (Kimi production traffic), replayed as token-ID prompts.

Each record has a ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``: one id
per 512-token block, chained, so two requests share a k-block prefix exactly when their first k
ids agree. We turn every id into a fixed block of 512 token IDs, a hash of (id, position) (the
memory-bound workloads' segment streams, one vectorised call per prompt: drawing a generator per
block took a sixth of a whole-trace simulation), concatenate the blocks and cut to ``input_length``: equal id prefixes give equal token
prefixes, different ids give different tokens, and the engine caches exactly what the trace says
could be cached. Replies are ``output_length`` tokens (``ignore_eos``). Timestamps are multiplied
by ``time_scale`` (0.1 = ten times the trace's rate).

The trace ships gzipped beside this package (``loadtest/data``, provenance and sha256 in its
README): ``load_trace()`` reads it with no path.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from loadtest.workloads.base import RequestSpec, Workload
from loadtest.workloads.memory_bound import SEGMENT_TOKENS, stream_tokens

TRACE_BLOCK_TOKENS = SEGMENT_TOKENS  # 512, as the trace says
TRACE_FILE = "mooncake_conversation_trace.jsonl.gz"


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _open(path: str | Path | None):  # type: ignore[no-untyped-def]
    if path is None:
        return gzip.open(resources.files("loadtest.data").joinpath(TRACE_FILE).open("rb"), "rt")
    p = Path(path)
    return gzip.open(p, "rt") if p.suffix == ".gz" else p.open()


def load_trace(path: str | Path | None = None, *, limit: int | None = None) -> list[TraceRecord]:
    """Records in file order (``limit`` first ones); ``path=None`` reads the shipped copy."""
    out: list[TraceRecord] = []
    with _open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(TraceRecord(int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), tuple(r["hash_ids"])))
    return out


def prompt_tokens(record: TraceRecord) -> np.ndarray:
    """The record's prompt: its blocks' tokens, concatenated and cut to ``input_length``."""
    need = -(-record.input_length // TRACE_BLOCK_TOKENS)
    if len(record.hash_ids) < need:
        raise ValueError(f"record has {len(record.hash_ids)} hash ids for {record.input_length} tokens")
    return stream_tokens(record.hash_ids[:need], record.input_length)


@dataclass(frozen=True)
class TraceSession:
    """One trace record as a one-turn session."""

    session_id: str
    start_s: float
    record: TraceRecord
    model: str
    max_output: int | None
    turns: int = 1

    def request(self, turn: int, replies: Sequence[str]) -> RequestSpec:
        if turn != 1:
            raise ValueError("a trace request has one turn")
        out = self.record.output_length
        if self.max_output is not None:
            out = min(out, self.max_output)
        body = {"model": self.model, "max_tokens": max(out, 1), "ignore_eos": True}
        return RequestSpec(self.session_id, 1, "/v1/completions", body, prompt_tokens(self.record))

    def think_s(self, turn: int) -> float:
        raise ValueError("a trace request has one turn")


def trace_workload(
    records: Sequence[TraceRecord],
    *,
    model: str,
    time_scale: float = 1.0,
    max_output: int | None = None,
    max_input: int | None = None,
) -> Workload:
    """Sessions for ``records``; ``max_input`` drops longer prompts (a fleet's context limit)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    kept = [r for r in records if max_input is None or r.input_length <= max_input]
    t0 = kept[0].timestamp_ms if kept else 0
    sessions = tuple(
        TraceSession(f"trace-{i:05d}", (r.timestamp_ms - t0) / 1000 * time_scale, r, model, max_output)
        for i, r in enumerate(kept)
    )
    desc = f"Mooncake conversation trace: {len(sessions)} requests, timestamps x{time_scale:g}"
    if max_output is not None:
        desc += f", outputs capped at {max_output}"
    return Workload("mooncake", desc, sessions, model, token_id_prompts=True)


def iter_block_ids(records: Sequence[TraceRecord]) -> Iterator[int]:
    for r in records:
        yield from r.hash_ids
