"""The simulated engine over real sockets: OpenAI API, SSE, cache hits, eviction, errors, metrics,
KV events on ZMQ, and the ``kvgate worker`` CLI as a real process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestServer

from gateway.profile import load_profile
from tests.conftest import REPO, free_port
from tokenizer import PromptTokenizer, block_keys, namespace_seed
from workers.engine.events import EventPublisher
from workers.engine.server import CACHED_HEADER, NODE_HEADER, Engine, EngineConfig, create_app
from workers.kv_events import AllBlocksCleared, BlockStored, decode_batch, decode_seq

MODEL = "sim-8b"
BS = 16

Client = Callable[..., Awaitable[tuple[int, dict[str, str], Any]]]


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer()


@pytest.fixture
async def start_engine(tokenizer: PromptTokenizer) -> AsyncIterator[Callable[..., Awaitable[tuple[str, Engine]]]]:
    """Start engines on free loopback ports; returns (base URL, engine). All are closed at the end."""
    servers: list[TestServer] = []

    async def start(events: EventPublisher | None = None, **overrides: Any) -> tuple[str, Engine]:
        cfg = dict(model=MODEL, profile=load_profile("llama-3.1-8b-h100"), node_id="node-a", time_scale=0.01, debug_headers=True)
        cfg.update(overrides)
        engine = Engine(EngineConfig(**cfg), tokenizer, events)
        server = TestServer(create_app(engine), host="127.0.0.1", port=free_port())
        await server.start_server()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}", engine

    yield start
    for s in servers:
        await s.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def sse(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[dict[str, str], list[Any]]:
    """POST a streaming request; every event must be ``data: ...\\n\\n`` and the last ``[DONE]``."""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
        headers = dict(resp.headers)
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), raw
    assert events[-1] == "data: [DONE]"
    return headers, [json.loads(e[6:]) for e in events[:-1]]


def ids(n: int, salt: int) -> list[int]:
    return np.random.default_rng(salt).integers(1000, 100_000, size=n).tolist()


async def test_text_completion_then_identical_request_hits_every_full_block(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, engine = await start_engine()
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 20, "max_tokens": 12}
    status, headers, first = await post(http, f"{base}/v1/completions", body)
    assert status == 200, first
    n_prompt = first["usage"]["prompt_tokens"]
    assert n_prompt == len(engine.tokenizer.tokenize_body("/v1/completions", body).token_ids)
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
    assert first["model"] == MODEL and isinstance(first["created"], int)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["text"].strip()
    assert first["usage"]["completion_tokens"] == 12 and first["usage"]["total_tokens"] == n_prompt + 12
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert headers[NODE_HEADER] == "node-a" and headers[CACHED_HEADER] == "0"

    status, headers, second = await post(http, f"{base}/v1/completions", body)
    expected = ((n_prompt - 1) // BS) * BS
    assert expected > 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    assert headers[CACHED_HEADER] == str(expected)
    assert second["choices"][0]["text"] == choice["text"]  # deterministic reply


async def test_token_id_prompts_share_full_blocks_of_their_common_prefix(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, _ = await start_engine()
    shared = ids(100, 1)
    _, _, a = await post(http, f"{base}/v1/completions", {"model": MODEL, "prompt": shared + ids(40, 2), "max_tokens": 3})
    assert a["usage"]["prompt_tokens"] == 140 and a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, headers, b = await post(http, f"{base}/v1/completions", {"model": MODEL, "prompt": shared + ids(40, 3), "max_tokens": 3})
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 full blocks of the 100 shared
    assert headers[CACHED_HEADER] == "96"
    assert b["choices"][0]["text"] != a["choices"][0]["text"]


async def test_chat_streaming_matches_non_streaming_and_reports_usage(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, _ = await start_engine()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]
    status, headers, plain = await post(http, f"{base}/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 9})
    assert status == 200 and plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-")
    msg = plain["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"]

    body = {"model": MODEL, "messages": messages, "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    headers, chunks = await sse(http, f"{base}/v1/chat/completions", body)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == msg["content"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    assert usage["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == ((plain["usage"]["prompt_tokens"] - 1) // BS) * BS
    assert headers[CACHED_HEADER] == str(cached)


async def test_completion_stream_without_usage(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, _ = await start_engine()
    body = {"model": MODEL, "prompt": ids(50, 4), "max_tokens": 6, "stream": True}
    _, chunks = await sse(http, f"{base}/v1/completions", body)
    assert all("usage" not in c for c in chunks)
    _, _, plain = await post(http, f"{base}/v1/completions", {**body, "stream": False})
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]


async def test_small_cache_evicts_least_recently_used_prompt(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, engine = await start_engine(kv_blocks=12)  # 11 blocks of 16 token slots: one is vLLM's null block
    a, b = ids(80, 10), ids(80, 11)
    url = f"{base}/v1/completions"
    await post(http, url, {"model": MODEL, "prompt": a, "max_tokens": 2})
    await post(http, url, {"model": MODEL, "prompt": b, "max_tokens": 2})
    _, _, again_b = await post(http, url, {"model": MODEL, "prompt": b, "max_tokens": 2})
    assert again_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # b survived, and is now fresher
    await post(http, url, {"model": MODEL, "prompt": ids(120, 12), "max_tokens": 2})  # needs 8 blocks: a goes
    _, _, again_a = await post(http, url, {"model": MODEL, "prompt": a, "max_tokens": 2})
    assert again_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    async with http.get(f"{base}/debug/blocks") as resp:
        blocks = (await resp.json())["blocks"]
    assert 0 < len(blocks) <= 11
    status, _, err = await post(http, url, {"model": MODEL, "prompt": ids(170, 13), "max_tokens": 10})
    assert status == 400 and "maximum context length is 176" in err["message"]


async def test_debug_blocks_carry_kvgate_keys_and_reset_clears(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, _ = await start_engine()
    prompt = ids(70, 20)
    _, _, r = await post(http, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    async with http.get(f"{base}/debug/blocks") as resp:
        listing = await resp.json()
    assert listing["node_id"] == "node-a" and listing["block_size"] == BS
    keys = block_keys(prompt, block_size=BS, seed=namespace_seed(MODEL))
    assert [b["kvgate_key"] for b in listing["blocks"]] == keys  # 4 full blocks of the prompt
    assert all(b["medium"] == "GPU" and b["engine_hash"] not in keys for b in listing["blocks"])
    async with http.post(f"{base}/debug/reset") as resp:
        assert resp.status == 200 and (await resp.json())["cleared_blocks"] == 4
    async with http.get(f"{base}/debug/blocks") as resp:
        assert (await resp.json())["blocks"] == []
    _, _, again = await post(http, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", b"{not json", 400, "Invalid JSON"),
        ("/v1/completions", {"model": MODEL}, 400, "'prompt' is a required property"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "not a valid token ID"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "at least 1"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "maximum context length"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n must be"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "'messages'"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "The model `gpt-9` does not exist."),
    ],
)
async def test_bad_requests_get_vllm_errors(start_engine, http, path, body, status, fragment) -> None:  # type: ignore[no-untyped-def]
    base, engine = await start_engine()
    got, _, err = await post(http, base + path, body)
    assert got == status
    assert err["object"] == "error" and err["code"] == status and err["param"] is None
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert fragment in err["message"]
    assert not engine.scheduler.has_work() and engine.scheduler.counters.prompt_tokens == 0  # nothing queued


async def test_models_health_and_vllm_metric_names(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, _ = await start_engine()
    async with http.get(f"{base}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{base}/v1/models") as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    prompt = ids(64, 30)
    for _ in range(2):
        await post(http, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
    async with http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and 'finished_reason="' not in line and "_bucket" not in line
    }
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert values[name] == 0.0
    assert values["vllm:prefix_cache_queries_total"] == 128
    assert values["vllm:prefix_cache_hits_total"] == 48  # (64-1)//16 blocks on the second request
    assert values["vllm:generation_tokens_total"] == 8
    assert values["vllm:time_to_first_token_seconds_count"] == 2
    assert 'vllm:request_success_total{finished_reason="length",model_name="sim-8b"} 2.0' in text


async def test_kv_events_published_per_step_with_engine_hashes(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    base, _ = await start_engine(events=EventPublisher(endpoint, topic="kv@test"))
    sub.connect(endpoint)
    try:
        await asyncio.sleep(0.3)  # let the subscription reach the publisher (PUB drops before that)
        prompt = ids(50, 40)
        await post(http, f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert topic == b"kv@test" and decode_seq(seq) == 0
        events = decode_batch(payload).events
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert len(stored) == 1 and stored[0].parent_block_hash is None and stored[0].block_size == BS
        assert stored[0].token_ids == prompt[:48] and len(stored[0].block_hashes) == 3
        async with http.get(f"{base}/debug/blocks") as resp:
            listing = (await resp.json())["blocks"]
        assert [b["engine_hash"] for b in listing] == stored[0].block_hashes
        async with http.post(f"{base}/debug/reset") as resp:
            assert resp.status == 200
        _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert decode_seq(seq) == 1 and decode_batch(payload).events == [AllBlocksCleared()]
    finally:
        sub.close()


async def test_client_disconnect_mid_stream_frees_the_request(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, engine = await start_engine(time_scale=1.0)  # real time: 2000 tokens take ~18 s to decode
    body = {"model": MODEL, "prompt": ids(40, 50), "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # first token arrived
        assert engine.scheduler.has_work()
    # leaving the block closes the connection; the engine must drop the request
    for _ in range(100):
        if not engine.scheduler.has_work():
            break
        await asyncio.sleep(0.05)
    assert not engine.scheduler.has_work()
    assert engine.cache.stats().used_blocks == 0


def test_kvgate_worker_cli_serves_as_a_real_process(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--port", str(port), "--model", "cli-model",
         "--time-scale", "0.01", "--kv-blocks", "64", "--node-id", "cli-node", "--debug-headers"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 30
        body = json.dumps({"model": "cli-model", "prompt": list(range(1000, 1040)), "max_tokens": 5}).encode()
        import urllib.request

        while True:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body)
                with urllib.request.urlopen(req, timeout=5) as resp:
                    answer = json.loads(resp.read())
                    node = resp.headers[NODE_HEADER]
                break
            except OSError:
                assert time.monotonic() < deadline, "worker did not answer in 30 s"
                time.sleep(0.1)
        assert node == "cli-node" and answer["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        log.close()
    assert code == 0, (tmp_path / "worker.log").read_text()


def test_worker_cli_rejects_bad_arguments_clearly() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workers.engine", "--time-scale", "-1"], capture_output=True, text=True, cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2 and "--time-scale must be >= 0" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "workers.engine", "--profile", "no-such-profile", "--port", str(free_port())],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert out.returncode == 1 and "no hardware profile" in out.stderr


async def test_internal_headers_reach_nobody_unless_asked_for(start_engine) -> None:
    """Issue 15, item 14: the simulated engine told every client its node id, its cache hit and
    its pull outcome in ``x-kvgate-*`` headers. Now a client sees none of them unless the worker
    runs with ``--debug-headers`` (benchmarks and tests that attribute answers to nodes)."""
    import aiohttp

    body = {"model": MODEL, "prompt": list(range(1000, 1040)), "max_tokens": 3}
    for debug, expect in ((False, set()), (True, {NODE_HEADER, CACHED_HEADER})):
        base, _ = await start_engine(debug_headers=debug)
        async with aiohttp.ClientSession() as s, s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200
            assert {k.lower() for k in r.headers if k.lower().startswith("x-kvgate-")} == expect


async def test_streamed_answer_says_the_engines_share_of_the_ttft(start_engine) -> None:  # type: ignore[no-untyped-def]
    """Issue 14: a replay splits each request's TTFT into the engine's part (queue + prefill, the
    ``x-kvgate-engine-ttft-ms`` header, which leaves with the first token) and the path in front.
    The engine's part can never exceed what the client measured, and a second request sent while
    the first runs finds one request already in the engine."""
    from loadtest.client import send
    from loadtest.workloads.base import RequestSpec

    base, _ = await start_engine(time_scale=1.0)
    spec = RequestSpec(session_id="s", turn=1, path="/v1/completions",
                       body={"model": MODEL, "prompt": ids(60, 2000), "max_tokens": 40, "ignore_eos": True})
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(send(s, base, spec, sent_at=0.0, timeout_s=30))
        await asyncio.sleep(0.05)
        second = await send(s, base, spec, sent_at=0.0, timeout_s=30)
        rec = await first
    for r in (rec, second):
        assert r.ok and r.ttft_s is not None and r.engine_ttft_s is not None, r.error
        assert 0.0 < r.engine_ttft_s <= r.ttft_s
    assert rec.engine_inflight == 0 and second.engine_inflight == 1


async def test_n_answers_come_as_n_choices_counted_in_the_usage(start_engine, http) -> None:  # type: ignore[no-untyped-def]
    base, engine = await start_engine()
    body = {"model": MODEL, "prompt": "Three drafts of one sentence, please. " * 10, "max_tokens": 6, "n": 3}
    status, _, answer = await post(http, f"{base}/v1/completions", body)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and all(c["text"] for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 18  # 3 answers of 6 tokens
    assert engine.scheduler.counters.generation_tokens == 18 and engine.scheduler.counters.prompt_tokens == answer["usage"]["prompt_tokens"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "two answers"}], "max_tokens": 4, "n": 2, "stream": True}
    async with http.post(f"{base}/v1/chat/completions", json=chat) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
