"""Adversarial checks of the two per-chat memos: the tokenizer's kept chunks (``tokenizer.chunked``:
a long chunk's cut and its pieces' token IDs) and the in-process directory's remembered runs of
held keys (``directory_client.memory``).

Every answer is compared with one that cannot have come from a memo: the tokenizer's own
``encode`` of the rendered text, and a directory holding the same blocks whose remembered runs are
dropped before each lookup. The attacks: edited histories (same length, same head/middle/tail),
special-token text and its halves in content, tokens across chunk edges, identical chunks at
different places, other template options on the same memo, a memo bound smaller than a request,
threads, and a directory changed in every way a node's blocks can change.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from directory_client import InProcessDirectory, NodeInfo, Tier
from directory_client import memory as memory_directory
from tests.test_tokenizer_segments import VARIANTS
from tokenizer import PromptTokenizer
from tokenizer.chunked import LONG_CHUNK_CHARS, ChunkSplitter
from tokenizer.encoder import SegmentedEncoder
from tokenizer.errors import InvalidPrompt
from tokenizer.keys import block_keys, namespace_seed

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# text a history may carry: DeepSeek's chat markers, their halves, its other first character
# ("｜"), markup, non-ASCII of two and four bytes, combining marks, zero-width and line breaks
SNIPPETS = [
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>",
    "<｜tool▁sep｜>",
    "<｜end▁of▁",
    "sentence｜>",
    "｜",
    "｜>",
    "<｜",
    "<",
    "<think>",
    "</think>",
    "<div>",
    "日本語",
    "Δ",
    "😀",
    "e\u0301",
    "\u200b",
    "\r\n",
    "\t",
    "  ",
]
FILLER = "Shipment 4 left port 9 on time; the manifest was checked twice. "
HISTORY_CHARS = LONG_CHUNK_CHARS + 600  # a message long enough to be a kept chunk


# -- tokenizer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pt() -> PromptTokenizer:
    return PromptTokenizer()


def _engine_ids(tok: PromptTokenizer, path: str, body: dict[str, Any]) -> list[int]:
    """What the engine sees: the tokenizer's own encode of the whole rendered text (no memo)."""
    text, special = tok.prompt_text(tok.parse(path, body).prompt)
    return tok.hf_tokenizer.encode(text, add_special_tokens=special).ids


def _ours(tok: PromptTokenizer, path: str, body: dict[str, Any]) -> list[int]:
    return tok.tokenize_body(path, body).token_ids.tolist()


def _chat(history: str, question: str = "Which port shipped most?", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a careful analyst."},
            {"role": "user", "content": history},
            {"role": "assistant", "content": "Most shipments left on time."},
            {"role": "user", "content": question},
        ],
        **extra,
    }


@st.composite
def histories(draw: st.DrawFn) -> str:
    """A long message with adversarial snippets put anywhere, near its ends included."""
    text = list((FILLER * (HISTORY_CHARS // len(FILLER) + 1))[:HISTORY_CHARS])
    n = len(text)
    near = st.one_of(st.integers(0, 40), st.integers(n - 40, n), st.integers(n // 2 - 40, n // 2 + 40), st.integers(0, n))
    for _ in range(draw(st.integers(0, 8))):
        at = draw(near)
        text[at:at] = [draw(st.sampled_from(SNIPPETS))]
    return "".join(text)


@st.composite
def same_length_edits(draw: st.DrawFn, history: str) -> str:
    """``history`` with one character replaced: same length, and often the same head, middle and
    tail (what the memo is keyed by), so only comparing the text can tell them apart."""
    n = len(history)
    at = draw(st.one_of(st.integers(33, n // 2 - 1), st.integers(n // 2 + 33, n - 33), st.integers(0, n - 1)))
    ch = draw(st.sampled_from(["<", "｜", "x", "é", " ", "😀"]))
    if history[at] == ch:
        ch = "y"
    return history[:at] + ch + history[at + 1 :]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_continuing_chat_edited_in_place_tokenizes_as_the_engine_does(pt: PromptTokenizer, data: st.DataObject) -> None:
    """A client resending its history turn after turn, then one character of it changed (a
    corrected typo, a redacted name): every request's IDs equal the engine's, before and after the
    memo kept the history's cut and IDs, and the original again after the edit."""
    history = data.draw(histories())
    edited = data.draw(same_length_edits(history))
    for turn in range(4):  # unseen, seen once, kept, kept with IDs
        body = _chat(history, f"Question {turn}?")
        assert _ours(pt, CHAT, body) == _engine_ids(pt, CHAT, body)
    for h in (edited, history, edited):
        body = _chat(h, "And now?")
        assert _ours(pt, CHAT, body) == _engine_ids(pt, CHAT, body)


def test_a_long_completions_prompt_resent_and_edited_tokenizes_as_the_engine_does(pt: PromptTokenizer) -> None:
    """``/v1/completions`` sends one text (one chunk, encoded with the post-processor's tokens):
    resent, kept, edited by one character and resent, its IDs stay the engine's."""
    text = "<｜User｜>" + FILLER * 80 + "<｜end▁of▁"
    edited = text[:1500] + "<" + text[1501:]
    for prompt in (text, text, text, text, edited, text, edited):
        body = {"model": "m", "prompt": prompt}
        assert _ours(pt, COMPLETIONS, body) == _engine_ids(pt, COMPLETIONS, body)


def test_a_one_character_edit_outside_the_fingerprint_is_not_served_from_the_memo(pt: PromptTokenizer) -> None:
    """The memo is keyed by length and three 32-character windows: an edit between them hits the
    same slot, and only the text comparison keeps the old IDs from being served."""
    history = "<｜User｜>" + FILLER * 80
    n = len(history)
    at = n // 4  # outside the head, middle and tail windows
    for ch in ("<", "X", "｜", "Ω"):
        edited = history[:at] + ch + history[at + 1 :]
        for h in (history, history, history, edited, history, edited):
            body = _chat(h)
            assert _ours(pt, CHAT, body) == _engine_ids(pt, CHAT, body)


def test_an_edit_that_makes_a_chat_marker_out_of_text_is_seen(pt: PromptTokenizer) -> None:
    """Content quoting a chat marker with one character off ("<｜User｜x"), kept; then the character
    fixed so the content now holds a real added token at the same place: its ID must appear."""
    marker = "<｜User｜>"
    head = FILLER * 40
    tail = FILLER * 40
    broken = head + marker[:-1] + "x" + tail
    fixed = head + marker + tail
    for h in (broken, broken, broken, fixed, broken, fixed):
        body = _chat(h)
        assert _ours(pt, CHAT, body) == _engine_ids(pt, CHAT, body)
    marker_id = pt.hf_tokenizer.token_to_id(marker)
    assert _ours(pt, CHAT, _chat(fixed)).count(marker_id) == _ours(pt, CHAT, _chat(broken)).count(marker_id) + 1


CONCAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_an_added_token_across_message_edges_with_the_same_long_message_twice() -> None:
    """A template that emits contents back to back: one message ends with the head of an added
    token and the next (long, kept) message starts with its tail, so the token spans the edge;
    the same long message elsewhere in the prompt is preceded by plain text instead."""
    tok = PromptTokenizer(chat_template=CONCAT_TEMPLATE)
    long_msg = "sentence｜>" + FILLER * 80 + "<｜end▁of▁"
    messages = [
        {"role": "user", "content": "first <｜end▁of▁"},
        {"role": "assistant", "content": long_msg},
        {"role": "user", "content": "plain"},
        {"role": "assistant", "content": long_msg},
        {"role": "user", "content": "sentence｜> closing"},
    ]
    for rounds in range(5):
        body = {"model": "m", "messages": messages[: 3 + (rounds % 3)]}
        assert _ours(tok, CHAT, body) == _engine_ids(tok, CHAT, body)
    eos = tok.hf_tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    assert _ours(tok, CHAT, {"model": "m", "messages": messages}).count(eos) == 2
    assert tok._encoder.chunks.hits > 0


def test_template_options_on_one_memo_each_tokenize_as_the_engine_does(pt: PromptTokenizer) -> None:
    """The memo is filled by one rendering and read by others of the same history: generation
    prompt on and off, continuing the final message, and tools (a long tool schema and a long
    tool-call argument are chunks of their own)."""
    history = FILLER * 80
    big_tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "Looks a port up. " * 300, "parameters": {"type": "object", "properties": {}}},
    }
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "' + "port " * 1000 + '"}'}}
    bodies = [
        _chat(history),
        _chat(history, add_generation_prompt=False),
        _chat(history, add_generation_prompt=False, continue_final_message=True),
        _chat(history, tools=[big_tool]),
        _chat(history, chat_template_kwargs={"extra": "<｜User｜>"}),
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": history},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": history, "tool_call_id": "c1"},
            ],
            "tools": [big_tool],
        },
    ]
    hits = pt._encoder.chunks.hits
    for _ in range(4):
        for body in bodies:
            assert _ours(pt, CHAT, body) == _engine_ids(pt, CHAT, body)
    assert pt._encoder.chunks.hits > hits


def test_a_memo_smaller_than_one_request_evicts_mid_request_and_stays_exact() -> None:
    """A bound that holds one long chunk: a request with two different long histories (the first
    one twice) is served the kept first one, evicts it to keep the second, then evicts that to
    keep the first again; in both orders, turn after turn."""
    a = FILLER * 80
    b = "Überseehafen 港口 émission ➜ port 9. " * 130
    from tokenizer.chunked import _cost

    # a chunk is the marker (non-ASCII: two bytes a character) and the content, cut a few times at most
    cost_of_one = max(_cost("\uff5c" + a, 8), _cost("\uff5c" + b, 8)) + 1024
    tok = PromptTokenizer(chunk_memo_bytes=cost_of_one)
    for turn in range(8):
        first, second = (a, b) if turn < 4 else (b, a)  # each request evicts the chunk it began with
        body = {
            "model": "m",
            "messages": [
                {"role": "user", "content": first},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": second},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": first},
            ],
        }
        assert _ours(tok, CHAT, body) == _engine_ids(tok, CHAT, body)
        assert tok._encoder.chunks._bytes <= cost_of_one and len(tok._encoder.chunks._memo) <= 1
    assert tok._encoder.chunks.hits > 0  # kept chunks were served between the evictions


def test_concurrent_requests_from_threads_get_their_own_ids() -> None:
    """Many threads tokenizing continuing chats whose histories share a prefix or differ by one
    character: each gets the engine's IDs for its own body (the memo's dicts are filled from
    several threads at once)."""
    tok = PromptTokenizer()
    base = FILLER * 80
    variants = [base, base[:2000] + "<" + base[2001:], base[:2000] + "｜" + base[2001:], base + "<｜end▁of▁sentence｜>"]
    bodies = [_chat(v, f"Question {i}?") for v in variants for i in range(3)]
    expected = [_engine_ids(tok, CHAT, body) for body in bodies]
    start = threading.Barrier(8)

    def run(worker: int) -> list[tuple[int, bool]]:
        start.wait()
        out = []
        for k in range(60):
            i = (worker * 7 + k * 5) % len(bodies)
            out.append((i, _ours(tok, CHAT, bodies[i]) == expected[i]))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(run, range(8)) for r in rs]
    assert [i for i, ok in results if not ok] == []
    assert tok._encoder.chunks.hits > 0


def test_concurrent_async_requests_through_the_executor_get_their_own_ids() -> None:
    """The event loop's path: prepare inline, long fresh text encoded in the thread pool while
    other requests prepare (and fill the memo) meanwhile."""
    tok = PromptTokenizer(executor=ThreadPoolExecutor(4), offload_tokens=16)
    base = "Überseehafen shipments; port 9 " * 160
    bodies = [_chat(base[:k] + "<" + base[k + 1 :], f"q{k}") for k in (100, 1000, 2500, 4000)] + [_chat(base)] * 4
    expected = [_engine_ids(tok, CHAT, body) for body in bodies]

    async def main() -> list[list[int]]:
        out: list[list[int]] = []
        for _ in range(4):
            done = await asyncio.gather(*(tok.tokenize_body_async(CHAT, body) for body in bodies))
            out.extend(d.token_ids.tolist() for d in done)
        return out

    got = asyncio.run(main())
    assert got == expected * 4
    assert tok._encoder.chunks.hits > 0


def test_a_lone_surrogate_in_a_kept_chunk_is_refused_every_time(pt: PromptTokenizer) -> None:
    """A history with a lone surrogate (valid JSON, not valid Unicode) cannot be encoded: it must
    be refused on every turn, never answered from a kept chunk."""
    history = FILLER * 40 + "\ud83d" + FILLER * 40
    for _ in range(4):
        with pytest.raises(InvalidPrompt):
            pt.tokenize_body(CHAT, _chat(history))


def _plain_bpe(path: Path) -> Tokenizer:
    """A byte-level BPE tokenizer with no added tokens at all (a bare tokenizer.json)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "Hello, world! 12345 tokens and more tokens."]
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 3, trainer)
    tok.save(str(path))
    return tok


def test_a_tokenizer_without_added_tokens_tokenizes_a_long_prompt(tmp_path: Path) -> None:
    """A tokenizer.json with no added tokens (nothing to cut at): a completions prompt or a chat
    message of 4096+ characters must still tokenize. Before the fix it raised ``ValueError: max()
    arg is an empty sequence`` from ``ChunkSplitter._prev``: every long prompt failed open (no
    affinity), while short prompts worked."""
    hf = _plain_bpe(tmp_path / "tokenizer.json")
    tok = PromptTokenizer(tmp_path / "tokenizer.json", chat_template=CONCAT_TEMPLATE)
    text = "the quick brown fox jumps over the lazy dog. " * 120
    assert len(text) >= LONG_CHUNK_CHARS
    got = tok.tokenize_body(COMPLETIONS, {"model": "m", "prompt": text}).token_ids.tolist()
    assert got == hf.encode(text, add_special_tokens=True).ids
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    assert _ours(tok, CHAT, body) == hf.encode(text, add_special_tokens=True).ids


_BASE_BPE: list[str] = []


def _with_random_added_tokens(specs: list[tuple[str, bool, bool, bool, bool, bool]]) -> Tokenizer:
    """A small byte-level BPE plus the given added tokens (content, normalized, lstrip, rstrip,
    single_word, special)."""
    if not _BASE_BPE:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(["ab ba <a|> |<b a> abab <<>>"] * 5, trainer)
        _BASE_BPE.append(tok.to_str())
    tok = Tokenizer.from_str(_BASE_BPE[0])
    tok.add_tokens([AddedToken(c, normalized=n, lstrip=ls, rstrip=rs, single_word=sw, special=sp) for c, n, ls, rs, sw, sp in specs])
    return tok


ALPHABET = "ab<|> "
_flag = st.sampled_from([False, False, False, True])  # flags are the exception
added_specs = st.lists(
    st.tuples(st.text(ALPHABET[:5], min_size=1, max_size=6), st.booleans(), _flag, _flag, _flag, st.booleans()),
    min_size=1,
    max_size=6,
    unique_by=lambda t: t[0],
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=added_specs, chunks=st.lists(st.text(ALPHABET, max_size=40), min_size=1, max_size=6), long_chars=st.integers(1, 12))
def test_random_added_token_sets_cut_and_encode_chunk_by_chunk_as_whole(specs: list, chunks: list[str], long_chars: int) -> None:
    """Added tokens that are prefixes of each other, overlap, are one character long, share first
    characters or carry lstrip/rstrip/single_word/normalized flags, in text made of nothing but
    their characters: chunked, kept and reused cuts and IDs equal the tokenizer's whole encode."""
    enc = SegmentedEncoder(_with_random_added_tokens(specs), cache_bytes=1 << 20)
    enc.chunks = ChunkSplitter(enc.splitter, long_chars=long_chars)
    text = "".join(chunks)
    whole = enc.tokenizer.encode(text, add_special_tokens=False).ids
    for _ in range(4):  # unseen, seen once, kept, kept with IDs
        assert enc.chunks.split(chunks) == enc.splitter.split(text)
        assert enc.complete(enc.plan_chunks(chunks, add_special_tokens=False)).tolist() == whole


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kept_chunks_inside_the_post_processors_tokens(variant: str) -> None:
    """The post-processor's tokens (BOS/EOS) go around kept and reused chunks, for every small
    tokenizer of the segment tests: the IDs equal the tokenizer's own encode with them."""
    enc = SegmentedEncoder(VARIANTS[variant](), cache_bytes=1 << 20)
    enc.chunks = ChunkSplitter(enc.splitter, long_chars=24)
    body = "a word here <s> the quick brown fox <mask> jumps [RS] over the lazy dog " * 3
    chunks = ["<|im_start|>", "user " + body, "<|im_end|>", "<", "s>" + body + "<|im", "_end|>"]
    text = "".join(chunks)
    for special in (True, False, True, True):
        want = enc.tokenizer.encode(text, add_special_tokens=special).ids
        for _ in range(3):
            assert enc.complete(enc.plan_chunks(chunks, add_special_tokens=special)).tolist() == want


# -- directory ------------------------------------------------------------------------------------

SEED = namespace_seed("adversarial-memo")
_SHARED = list(range(200 * 16))  # three prompts sharing a 200-block prefix
CHAINS = [block_keys(_SHARED + [(j * 37 + c) % 50_000 for j in range(260 * 16)], block_size=16, seed=SEED) for c in range(3)]
CHAIN_LEN = len(CHAINS[0])
NODES = ["n0", "n1", "n2"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _node(nid: str) -> NodeInfo:
    return NodeInfo(nid, f"127.0.0.1:{8000 + NODES.index(nid)}")


def _observe(view: Any) -> list[tuple[str, int, Tier, int]]:
    return [(v.node.node_id, v.cached_blocks, v.tier, v.total_blocks) for v in view.nodes] + [("answerable", view.answerable_blocks, Tier.GPU, 0)]


def _memo_free(d: InProcessDirectory) -> InProcessDirectory:
    """The same directory with nothing remembered: every lookup tests its keys one by one."""
    for st_ in d._nodes.values():
        st_.forget_runs()
    return d


class MemoMatchesMemoFree(RuleBasedStateMachine):
    """Two in-process directories given the same writes; one keeps the runs its lookups found,
    the other forgets them before every lookup. Every lookup of every prefix must agree."""

    stride = 1

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        kw = {"index_stride": self.stride, "heartbeat_ttl_s": 30.0, "dead_node_retention_s": 60.0, "clock": self.clock}
        self.memo = InProcessDirectory(**kw)
        self.plain = InProcessDirectory(**kw)
        self.loop = asyncio.new_event_loop()
        for nid in NODES:
            self.both("register_node", _node(nid))

    def teardown(self) -> None:
        self.loop.close()

    def both(self, method: str, *args: Any) -> None:
        for d in (self.memo, self.plain):
            self.loop.run_until_complete(getattr(d, method)(*args))

    @rule(nid=st.sampled_from(NODES), c=st.integers(0, 2), a=st.integers(0, CHAIN_LEN), n=st.integers(0, CHAIN_LEN), tier=st.sampled_from(list(Tier)))
    def store(self, nid: str, c: int, a: int, n: int, tier: Tier) -> None:
        self.both("record_stored", nid, CHAINS[c][a : a + n], tier)

    @rule(nid=st.sampled_from(NODES), c=st.integers(0, 2), a=st.integers(0, CHAIN_LEN), n=st.integers(1, 40), tier=st.none() | st.sampled_from(list(Tier)))
    def remove(self, nid: str, c: int, a: int, n: int, tier: Tier | None) -> None:
        self.both("record_removed", nid, CHAINS[c][a : a + n], tier)

    @rule(nid=st.sampled_from(NODES))
    def clear(self, nid: str) -> None:
        self.both("clear_node", nid)

    @rule(nid=st.sampled_from(NODES), c=st.integers(0, 2), n=st.integers(0, CHAIN_LEN), cpu=st.integers(0, CHAIN_LEN))
    def replace(self, nid: str, c: int, n: int, cpu: int) -> None:
        self.both("replace_node", nid, {Tier.GPU: CHAINS[c][:n], Tier.CPU: CHAINS[c][:cpu]})

    @rule(nid=st.sampled_from(NODES))
    def deregister_and_back(self, nid: str) -> None:
        self.both("deregister_node", nid)
        self.both("register_node", _node(nid))

    @rule(nid=st.sampled_from(NODES))
    def retire(self, nid: str) -> None:
        self.both("retire_node", nid)

    @rule(nid=st.sampled_from(NODES))
    def register(self, nid: str) -> None:
        self.both("register_node", _node(nid))

    @rule(nid=st.sampled_from(NODES))
    def bridged_then_unwritten(self, nid: str) -> None:
        self.both("claim_writer", nid, "bridge", 5.0)
        self.clock.t += 6.0
        self.both("clear_if_unwritten", nid)

    @rule(dt=st.sampled_from([1.0, 35.0, 100.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.t += dt

    @invariant()
    def lookups_agree(self) -> None:
        for c in range(3):
            for n in (CHAIN_LEN, 200, 33 * 4, 97):
                for keys in (CHAINS[c][:n], np.asarray(CHAINS[c][:n], dtype=np.uint64)):
                    got = self.loop.run_until_complete(self.memo.lookup(keys))
                    want = self.loop.run_until_complete(_memo_free(self.plain).lookup(keys))
                    assert _observe(got) == _observe(want), (c, n)


class MemoMatchesMemoFreeStride3(MemoMatchesMemoFree):
    stride = 3


class MemoMatchesMemoFreeStride4(MemoMatchesMemoFree):
    stride = 4


_STATEFUL = settings(max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestMemoMatchesMemoFree = MemoMatchesMemoFree.TestCase
TestMemoMatchesMemoFree.settings = _STATEFUL
TestMemoMatchesMemoFreeStride3 = MemoMatchesMemoFreeStride3.TestCase
TestMemoMatchesMemoFreeStride3.settings = _STATEFUL
TestMemoMatchesMemoFreeStride4 = MemoMatchesMemoFreeStride4.TestCase
TestMemoMatchesMemoFreeStride4.settings = _STATEFUL


def _cached(view: Any) -> dict[str, tuple[int, Tier]]:
    return {v.node.node_id: (v.cached_blocks, v.tier) for v in view.nodes}


@pytest.mark.parametrize("stride", [1, 4])
async def test_every_change_to_a_held_history_shows_in_the_next_lookup(stride: int) -> None:
    """A chat's history held by n0 and looked up turn after turn (so its runs are remembered),
    then changed in each way an engine changes it; a second node storing the same prefix must
    not lend n0 its runs."""
    d = InProcessDirectory(index_stride=stride)
    keys = np.asarray(CHAINS[0], dtype=np.uint64)
    expect = InProcessDirectory(index_stride=stride)

    async def agree() -> dict[str, tuple[int, Tier]]:
        for _ in range(2):  # the second answer comes from what the first remembered
            got = _cached(await d.lookup(keys))
            assert got == _cached(await _memo_free(expect).lookup(keys))
        return got

    async def both(method: str, *args: Any) -> None:
        await getattr(d, method)(*args)
        await getattr(expect, method)(*args)

    for nid in ("n0", "n1"):
        await both("register_node", _node(nid))
    await both("record_stored", "n0", CHAINS[0])
    full = (await agree())["n0"]
    assert full[0] >= CHAIN_LEN - 4 * stride and d._nodes["n0"].runs
    await both("record_stored", "n1", CHAINS[0][:100])
    assert (await agree())["n1"][0] <= 100
    mid = CHAIN_LEN // 2
    for step in (
        ("record_removed", "n0", CHAINS[0][mid : mid + 8]),  # evicted from the middle
        ("record_stored", "n0", CHAINS[0][mid : mid + 8]),  # and back
        ("record_removed", "n0", CHAINS[0][5:6], Tier.GPU),  # a GPU-only block offloaded away
        ("record_stored", "n0", CHAINS[0][:50], Tier.CPU),  # offloaded, kept in GPU too
        ("record_removed", "n0", CHAINS[0][:50], Tier.GPU),  # then dropped from the GPU
        ("record_stored", "n0", CHAINS[0]),
        ("replace_node", "n0", {Tier.GPU: CHAINS[0][:300]}),
        ("record_stored", "n0", CHAINS[0]),
        ("clear_node", "n0"),
        ("record_stored", "n0", CHAINS[0][:64 * stride]),
        ("deregister_node", "n0"),
        ("register_node", _node("n0")),
    ):
        await both(*step)
        await agree()


async def test_the_run_bound_resets_without_losing_exactness(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound of remembered runs the set starts over: lookups of three prompts
    alternating (each filling the set) stay equal to a memo-free directory's."""
    monkeypatch.setattr(memory_directory, "_MAX_RUNS", 5)
    d = InProcessDirectory()
    expect = InProcessDirectory()
    for x in (d, expect):
        await x.register_node(_node("n0"))
        for c in range(3):
            await x.record_stored("n0", CHAINS[c][: 300 + 50 * c])
    for _ in range(3):
        for c in (0, 1, 2, 1):
            assert _cached(await d.lookup(CHAINS[c])) == _cached(await _memo_free(expect).lookup(CHAINS[c]))
            assert len(d._nodes["n0"].runs) <= 5 + (300 + 50 * 2) // memory_directory.RUN


def _kept_bytes(tok: PromptTokenizer) -> int:
    """What the kept chunks really hold: each text, the pieces sliced out of it, their IDs."""
    total = 0
    for layout in tok._encoder.chunks._memo.values():
        total += sys.getsizeof(layout.text) + sum(map(sys.getsizeof, layout.slices.values()))
        total += sum(ids.nbytes for ids in layout.ids.values())
    return total


@pytest.mark.parametrize(
    "sentence",
    ["港口的货物按时离港，清单核对了两次。第九号港口", "🚢📦✅ 港9 ⏱️😀🎉 "],
    ids=["chinese", "emoji"],
)
def test_the_kept_chunks_stay_within_their_byte_bound_for_non_ascii_chats(sentence: str) -> None:
    """``chunk_memo_bytes`` bounds what the kept chunks hold. Chinese chats (two bytes a character
    in Python, ~0.7 tokens a character) and emoji (four bytes a character, several tokens each)
    were accounted at 5 bytes a character: the memo really held ~1.3x (Chinese) and ~2.7x (emoji)
    its bound, so a gateway configured for 64 MiB kept ~85-170 MiB of chunks. Now a kept chunk is
    charged an upper bound of what it may hold."""
    bound = 1 << 20
    tok = PromptTokenizer(chunk_memo_bytes=bound)
    for i in range(40):
        content = f"{i} " + sentence * (6000 // len(sentence))
        body = _chat(content)
        for _ in range(3):  # kept from the second sighting, its IDs from the third
            tok.tokenize_body(CHAT, body)
    assert tok._encoder.chunks._bytes <= bound
    assert _kept_bytes(tok) <= bound
