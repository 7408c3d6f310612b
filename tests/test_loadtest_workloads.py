"""Workloads are deterministic and bounded, and the trace keeps its prefix structure."""

from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from loadtest.workloads.chat import chat_workload
from loadtest.workloads.shared_prefix import shared_prefix_workload
from loadtest.workloads.trace import TRACE_BLOCK_TOKENS, TraceRecord, load_trace, prompt_tokens, trace_workload
from tokenizer import PromptTokenizer

DATA = Path(__file__).resolve().parents[1] / "loadtest" / "data"


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


def _count(tok: PromptTokenizer):
    return lambda s: len(tok.encode_text(s, add_special_tokens=False))


def test_chat_workload_is_deterministic_and_sized(tok: PromptTokenizer) -> None:
    kw = dict(conversations=4, turns=3, count_tokens=_count(tok), model="m", rate_per_s=2.0,
              doc_tokens=(1500, 2500), seed=7)
    a, b = chat_workload(**kw), chat_workload(**kw)
    assert a.max_requests == 12
    assert [s.start_s for s in a.sessions] == [s.start_s for s in b.sessions]
    assert [s.document for s in a.sessions] == [s.document for s in b.sessions]
    assert len({s.document for s in a.sessions}) == 4  # every conversation has its own document
    for s in a.sessions:
        n = _count(tok)(s.document)
        assert 1500 <= n <= 2500 + 200
    other = chat_workload(**{**kw, "seed": 8})
    assert other.sessions[0].document != a.sessions[0].document


def test_chat_turns_append_the_actual_reply_and_a_new_question(tok: PromptTokenizer) -> None:
    w = chat_workload(conversations=1, turns=3, count_tokens=_count(tok), model="m", doc_tokens=(800, 900))
    s = w.sessions[0]
    first = s.request(1, [])
    third = s.request(3, ["answer one", "answer two"])
    msgs = third.body["messages"]
    assert msgs[: len(first.body["messages"])] == first.body["messages"]
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == ["answer one", "answer two"]
    assert third.turn == 3 and s.think_s(2) >= 1.0
    with pytest.raises(ValueError):
        s.request(3, ["only one reply"])
    # the prompt of turn 3 extends turn 1's token for token: a node holding turn 1 hits it
    a = tok.tokenize_body(first.path, first.body).token_ids
    c = tok.tokenize_body(third.path, third.body).token_ids
    assert len(c) > len(a) and np.array_equal(c[: len(a)], a)


def test_shared_prefix_groups_share_their_system_prompt(tok: PromptTokenizer) -> None:
    w = shared_prefix_workload(groups=3, prompts_per_group=4, count_tokens=_count(tok), model="m",
                               prefix_tokens=500, seed=1)
    assert w.max_requests == 12
    by_group: dict[int, set[str]] = {}
    questions = set()
    for s in w.sessions:
        body = s.request(1, []).body
        by_group.setdefault(s.group, set()).add(body["messages"][0]["content"])
        questions.add(body["messages"][1]["content"])
    assert all(len(v) == 1 for v in by_group.values()) and len(by_group) == 3
    assert len({next(iter(v)) for v in by_group.values()}) == 3
    assert len(questions) == 12
    again = shared_prefix_workload(groups=3, prompts_per_group=4, count_tokens=_count(tok), model="m",
                                   prefix_tokens=500, seed=1)
    assert [s.session_id for s in again.sessions] == [s.session_id for s in w.sessions]


def test_trace_hash_id_prefixes_become_token_prefixes() -> None:
    a = TraceRecord(0, 3 * TRACE_BLOCK_TOKENS + 100, 10, (0, 1, 2, 3))
    b = TraceRecord(0, 2 * TRACE_BLOCK_TOKENS + 7, 10, (0, 1, 9))
    c = TraceRecord(0, 2 * TRACE_BLOCK_TOKENS, 10, (5, 1))
    ta, tb, tc = prompt_tokens(a), prompt_tokens(b), prompt_tokens(c)
    assert len(ta) == a.input_length and len(tb) == b.input_length
    shared = 2 * TRACE_BLOCK_TOKENS
    assert np.array_equal(ta[:shared], tb[:shared])  # ids 0, 1 agree
    assert not np.array_equal(ta[shared : shared + 100], tb[shared : shared + 100])  # id 2 vs 9
    assert not np.array_equal(ta[:TRACE_BLOCK_TOKENS], tc[:TRACE_BLOCK_TOKENS])  # first ids differ
    assert np.array_equal(prompt_tokens(a), ta)  # deterministic
    assert ta.min() >= 1000


def test_shipped_trace_matches_its_documented_checksum() -> None:
    readme = (DATA / "README.md").read_text()
    documented = re.search(r"uncompressed\) \| `([0-9a-f]{64})`", readme).group(1)
    raw = gzip.decompress((DATA / "mooncake_conversation_trace.jsonl.gz").read_bytes())
    assert hashlib.sha256(raw).hexdigest() == documented
    assert "Apache-2.0" in readme


def test_trace_workload_scales_time_and_bounds_inputs() -> None:
    records = load_trace(limit=200)
    assert len(records) == 200
    w = trace_workload(records, model="m", time_scale=0.5, max_input=8000, max_output=32)
    assert all(s.record.input_length <= 8000 for s in w.sessions)
    t_last = (w.sessions[-1].record.timestamp_ms - w.sessions[0].record.timestamp_ms) / 1000
    assert w.sessions[-1].start_s == pytest.approx(t_last * 0.5)
    spec = w.sessions[0].request(1, [])
    assert spec.body["max_tokens"] <= 32 and spec.body["ignore_eos"] is True
    assert len(spec.wire_body()["prompt"]) == w.sessions[0].record.input_length
    assert w.token_id_prompts


def test_memory_bound_workloads_are_deterministic_streams() -> None:
    from loadtest.workloads.memory_bound import agentic_workload, live_tokens_peak, memchat_workload

    for make, kw in ((memchat_workload, {"conversations": 40}), (agentic_workload, {"agents": 40})):
        a, b = make(seed=3, **kw), make(seed=3, **kw)
        assert a.token_id_prompts and a.max_requests == b.max_requests
        assert [s.start_s for s in a.sessions] == [s.start_s for s in b.sessions]
        for s in a.sessions[:10]:
            prev = s.request(1, []).prompt_ids
            assert np.array_equal(prev, b.sessions[a.sessions.index(s)].request(1, []).prompt_ids)
            for turn in range(2, s.turns + 1):
                cur = s.request(turn, []).prompt_ids
                # each turn extends the previous prompt token for token: its node hits all of it
                assert len(cur) > len(prev) and np.array_equal(cur[: len(prev)], prev)
                assert s.think_s(turn) > 0
                prev = cur
        assert make(seed=4, **kw).sessions[0].request(1, []).prompt_ids.tolist() != \
            a.sessions[0].request(1, []).prompt_ids.tolist()
        assert f"live_tokens_peak {live_tokens_peak(a.sessions):,}" in a.description


def test_memchat_conversations_share_only_the_system_prompt_and_revisit_after_minutes() -> None:
    from loadtest.workloads.memory_bound import memchat_workload

    w = memchat_workload(conversations=200, system_tokens=1024, revisit_frac=0.3, revisit_s=(180.0, 600.0), seed=1)
    firsts = [s.request(1, []).prompt_ids for s in w.sessions[:2]]
    assert np.array_equal(firsts[0][:1024], firsts[1][:1024])  # the common system prompt
    assert not np.array_equal(firsts[0][1024:1536], firsts[1][1024:1536])  # then each its own document
    pauses = [p for s in w.sessions for p in s.pauses]
    assert sum(p >= 180 for p in pauses) >= 0.2 * len(pauses)  # revisits after minutes (plus long exponential thinks)


def test_agentic_prompts_follow_zipf_popularity() -> None:
    from loadtest.workloads.memory_bound import SEGMENT_TOKENS, agentic_workload

    w = agentic_workload(agents=600, prompts=8, zipf_s=1.2, seed=2)
    heads = [s.segments[0] for s in w.sessions]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    assert len(counts) <= 8 and counts[0] > 2.5 * counts[-1]  # one hot prompt, a tail of rare ones
    s = w.sessions[0]
    steps = np.diff(s.lengths)
    assert s.lengths[0] >= 6000 and ((steps >= 50) & (steps <= 400)).all()  # long prompt, short steps
    assert len(s.segments) * SEGMENT_TOKENS >= s.lengths[-1]


def test_mixed_workload_mixes_documents_writers_and_chats() -> None:
    from loadtest.workloads.mixed import mixed_workload

    w = mixed_workload(sessions=300, seed=5)
    assert w.name == "mixed" and w.token_id_prompts
    by_kind: dict[str, list] = {"doc": [], "gen": [], "chat": []}
    for s in w.sessions:
        by_kind[s.session_id.split("-")[0]].append(s)
    assert all(len(v) >= 50 for v in by_kind.values())  # 0.3/0.4/0.3 of 300
    for s in by_kind["doc"]:  # long prompts, short answers, one turn
        spec = s.request(1, [])
        assert s.turns == 1 and len(spec.prompt_ids) >= 8000 and spec.body["max_tokens"] <= 64
    for s in by_kind["gen"]:  # short prompts, long answers
        spec = s.request(1, [])
        assert s.turns == 1 and len(spec.prompt_ids) <= 600 and spec.body["max_tokens"] >= 400
    firsts = [s.request(1, []).prompt_ids for s in by_kind["chat"][:2]]
    assert np.array_equal(firsts[0][:1024], firsts[1][:1024])  # chats share the system prompt
    for s in by_kind["chat"]:  # and each turn extends the last one
        assert 3 <= s.turns <= 6
        prev = s.request(1, []).prompt_ids
        for turn in range(2, s.turns + 1):
            cur = s.request(turn, []).prompt_ids
            assert np.array_equal(cur[: len(prev)], prev) and s.think_s(turn) >= 1.0
            prev = cur
    again = mixed_workload(sessions=300, seed=5)
    assert [s.session_id for s in again.sessions] == [s.session_id for s in w.sessions]
    assert mixed_workload(sessions=300, seed=6).sessions[0].request(1, []).prompt_ids.tolist() != \
        w.sessions[0].request(1, []).prompt_ids.tolist()
    with pytest.raises(ValueError, match="shares"):
        mixed_workload(shares=(0, 0, 0))


def test_agentic_as_text_is_the_same_token_stream_in_chat_messages(tok: PromptTokenizer) -> None:
    """Sent as text, an agent's turn tokenizes to its token-ID prompt's length plus the template's
    tokens (one a user message, BOS and the generation prompt); each turn extends the last one's prefix;
    agents behind one system prompt share exactly its tokens, and others share nothing."""
    from loadtest.workloads.as_text import as_text
    from loadtest.workloads.memory_bound import SEGMENT_TOKENS, agentic_workload

    ids_w = agentic_workload(agents=12, prompts=3, prompt_tokens=(1000, 1500), task_tokens=(100, 200),
                             steps=(3, 4), step_tokens=(20, 60), seed=5)
    text_w = as_text(ids_w, tok)
    assert not text_w.token_id_prompts and ids_w.token_id_prompts
    assert [s.session_id for s in text_w.sessions] == [s.session_id for s in ids_w.sessions]
    tokens: dict[str, list[np.ndarray]] = {}
    for ids_s, text_s in zip(ids_w.sessions, text_w.sessions, strict=True):
        assert text_s.start_s == ids_s.start_s and text_s.turns == ids_s.turns
        for turn in range(1, ids_s.turns + 1):
            spec = text_s.request(turn, [])
            assert spec.prompt_ids is None and spec.path == "/v1/chat/completions"
            got = tok.tokenize_body(spec.path, spec.body).token_ids
            users = sum(m["role"] == "user" for m in spec.body["messages"])  # each behind <｜User｜>
            assert len(got) == len(ids_s.request(turn, []).prompt_ids) + users + 2  # + BOS, <｜Assistant｜>
            tokens.setdefault(ids_s.session_id, []).append(got)
        turns = tokens[ids_s.session_id]
        for a, b in zip(turns, turns[1:]):
            assert np.array_equal(a[:-1], b[: len(a) - 1])  # all but the generation prompt
    by_prompt: dict[tuple[int, ...], list[str]] = {}
    for s in ids_w.sessions:
        by_prompt.setdefault(s.segments[: s.shared_segments], []).append(s.session_id)
    groups = [g for g in by_prompt.values() if len(g) > 1]
    assert groups and len(by_prompt) > 1
    first = {sid: t[0] for sid, t in tokens.items()}
    for shared, group in by_prompt.items():
        n = len(shared) * SEGMENT_TOKENS + 1  # BOS + the system prompt
        for sid in group[1:]:
            assert np.array_equal(first[sid][:n], first[group[0]][:n])
        others = [sid for g in by_prompt.values() if g is not group for sid in g]
        assert all(not np.array_equal(first[sid][1:17], first[group[0]][1:17]) for sid in others)


def test_a_share_of_mixed_sessions_asks_several_answers_and_zero_leaves_the_rest_as_it_was() -> None:
    from dataclasses import replace

    from loadtest.workloads.mixed import mixed_workload

    w = mixed_workload(sessions=400, seed=3)
    plain = mixed_workload(sessions=400, seed=3, multi_share=0.0)
    asking = [s for s in w.sessions if s.answers > 1]
    assert 20 <= len(asking) <= 60 and {s.answers for s in asking} <= {2, 3, 4}  # ~10% of 400
    assert {s.session_id.split("-")[0] for s in asking} == {"doc", "gen", "chat"}
    for s in asking:
        assert all(s.request(t, []).body["n"] == s.answers for t in range(1, s.turns + 1))
    assert all("n" not in s.request(1, []).body for s in plain.sessions)
    assert [replace(s, answers=1) for s in w.sessions] == list(plain.sessions)  # the same sessions otherwise
    with pytest.raises(ValueError, match="multi_share"):
        mixed_workload(multi_share=1.5)
