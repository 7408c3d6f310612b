"""Names a client chooses, kept where they cost the fleet memory: the model name.

With no ``models`` allow-list (kvgate accepts any model name), a request's ``model`` is whatever
the client sends, up to the body limit, and kvgate keeps it: in each node's hot-prefix notes in
the directory (128 a node, what a drain copies first) and in the decision log. The attack, over
real Redis: 20 routed requests whose model name is 4 MiB grew node ``a``'s hot-prefix key to 100
MiB (up to 128 × 8 MiB = 1 GiB a node at the default body limit). What the attacker gets now:
a model name past ``MAX_MODEL_NAME_CHARS`` is answered 404 as vLLM answers a model it does not
serve, and nothing of it is kept.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from directory_client import NodeInfo, open_directory
from gateway.core import MAX_MODEL_NAME_CHARS, RoutingCore, RoutingLimits
from gateway.policy import make_policy
from gateway.profile import load_profile
from tokenizer import PromptTokenizer

PROMPT = " ".join(f"w{j}" for j in range(200))  # well over one block of tokens


@pytest.fixture
async def routing(redis_url: str, key_prefix: str):
    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=60)
    await directory.register_node(NodeInfo("a", "127.0.0.1:8000", model="m"))
    core = RoutingCore(
        PromptTokenizer(), directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"), RoutingLimits(lookup_timeout_s=1.0)
    )
    try:
        yield core, directory
    finally:
        await directory.aclose()


async def route(core: RoutingCore, model: str):
    result = await core.route("/v1/completions", json.dumps({"model": model, "prompt": PROMPT}).encode(), "hostile")
    await core.release(result)
    return result


async def test_a_model_name_of_megabytes_is_refused_and_nothing_of_it_is_kept(routing) -> None:
    core, directory = routing
    for i in range(5):
        result = await route(core, "m" * (4 << 20) + str(i))
        assert (result.kind, result.status) == ("rejected", 404)
        error = json.loads(result.body)
        assert error["code"] == 404 and f"longer than {MAX_MODEL_NAME_CHARS}" in error["message"]
        assert len(error["message"]) < 512  # the answer does not echo the name back whole
    await asyncio.sleep(0.3)  # hot-prefix notes are written off the request path
    assert await directory.hot_prefixes("a", 128) == []


async def test_a_long_but_plausible_model_name_is_still_routed_and_noted(routing) -> None:
    core, directory = routing
    name = "org/" + "x" * (MAX_MODEL_NAME_CHARS - 4)
    result = await route(core, name)
    assert result.kind == "routed"
    for _ in range(50):  # the note is written off the request path
        notes = await directory.hot_prefixes("a", 128)
        if notes:
            break
        await asyncio.sleep(0.02)
    assert [n.model for n in notes] == [name]
