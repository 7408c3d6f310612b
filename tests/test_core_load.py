"""How the routing core accounts a request's load: compare-and-reserve against the load its
decision saw, the prefill part ending at the estimated first token, and the whole request at its
release or, unseen, at its estimated end. In process, with the real tokenizer, policy and
in-process directory."""

from __future__ import annotations

import asyncio
import json

import pytest

from directory_client import InProcessDirectory, NodeInfo, NodeLoad, Tier
from gateway.core import RoutingCore, RoutingLimits
from gateway.metrics import REGISTRY
from gateway.policy import make_policy
from gateway.profile import load_profile
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed

MODEL = "load-model"
PROFILE = load_profile("llama-3.1-8b-h100")


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer()


def body(text: str, max_tokens: int = 32) -> bytes:
    return json.dumps({"model": MODEL, "prompt": text, "max_tokens": max_tokens}).encode()


class RacingDirectory(InProcessDirectory):
    """A real in-process directory, plus "another replica" that takes the node a lookup shows
    idle right after the lookup answered — the interleaving two replicas can produce."""

    def __init__(self, victim: str, **kw) -> None:
        super().__init__(**kw)
        self.victim = victim
        self.raced = False

    async def lookup(self, keys):
        view = await super().lookup(keys)
        if not self.raced:
            self.raced = True
            await self.reserve(self.victim, 1000)
        return view


async def core_over(directory, tok: PromptTokenizer) -> RoutingCore:
    for i in (1, 2):
        await directory.register_node(NodeInfo(f"n{i}", f"127.0.0.1:{9000 + i}"))
    return RoutingCore(tok, directory, make_policy("kvgate"), PROFILE, RoutingLimits(models=frozenset([MODEL])))


async def test_a_node_taken_by_another_replica_after_the_lookup_is_not_herded_onto(tok) -> None:
    text = "The quarterly report on harbour traffic. " * 200
    prompt = tok.tokenize_body("/v1/completions", json.loads(body(text)))
    keys = block_keys(prompt.token_ids, block_size=16, seed=namespace_seed(MODEL))
    directory = RacingDirectory("n1", index_stride=1)
    core = await core_over(directory, tok)
    await directory.record_stored("n1", keys, Tier.GPU)  # n1 owns the prompt: the first choice
    conflicts = REGISTRY.get_sample_value("kvgate_reservation_conflicts_total") or 0.0

    result = await core.route("/v1/completions", body(text))
    assert result.kind == "routed"
    assert REGISTRY.get_sample_value("kvgate_reservation_conflicts_total") == conflicts + 1
    # the first decision saw n1 idle and was refused; the second saw n1 busy with 1,000 queued
    # prefill tokens and still chose it only if that is cheaper — either way exactly one of our
    # reservations exists, and nothing was counted for the refused attempt
    loads = await directory.loads()
    ours = result.reservation
    assert ours is not None
    assert loads[ours.node_id].inflight == (2 if ours.node_id == "n1" else 1)
    other = "n2" if ours.node_id == "n1" else "n1"
    assert loads[other] == (NodeLoad(1, 1000) if other == "n1" else NodeLoad())
    await core.release(result)
    assert (await directory.loads())["n2"] == NodeLoad()


async def test_prefill_stops_counting_at_the_first_token_but_the_request_stays_in_flight(tok) -> None:
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    result = await core.route("/v1/completions", body("Explain the tides. " * 300))
    assert result.kind == "routed" and result.reservation is not None
    node = result.reservation.node_id
    prompt_tokens = result.request.prompt_tokens
    assert (await directory.loads())[node] == NodeLoad(1, prompt_tokens)
    assert 0 < result.ttft_s < result.service_s

    await asyncio.sleep(result.ttft_s + 0.05)
    assert (await directory.loads())[node] == NodeLoad(1, 0)  # decoding: busy, not queued

    await core.release(result)
    await core.release(result)  # a second release changes nothing
    assert (await directory.loads())[node] == NodeLoad()


async def test_a_response_that_ends_before_its_first_token_estimate_leaves_nothing_behind(tok) -> None:
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    result = await core.route("/v1/completions", body("Short answer please. " * 200))
    await core.release(result)  # e.g. the client went away at once
    await asyncio.sleep(result.ttft_s + 0.05)  # its first-token time must not resurrect the load
    assert set((await directory.loads()).values()) == {NodeLoad()}


async def test_a_request_whose_end_is_never_seen_leaves_at_its_estimated_end(tok) -> None:
    """ext_authz's accounting: nobody calls release, yet the node's load ends at the service
    estimate; this replica's in-flight gauge, which only counts ends it sees, never counts it."""
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    inflight = REGISTRY.get_sample_value("kvgate_inflight_requests")
    result = await core.route("/v1/completions", body("Estimate me. " * 100, max_tokens=4), sees_response_end=False)
    node = result.reservation.node_id
    assert (await directory.loads())[node].inflight == 1
    assert result.service_s < 1.0  # a short answer: the test need not wait long
    await asyncio.sleep(result.service_s + 0.05)
    assert (await directory.loads())[node] == NodeLoad()
    await core.release(result)  # a late release (the client went away) changes nothing
    assert (await directory.loads())[node] == NodeLoad()
    assert REGISTRY.get_sample_value("kvgate_inflight_requests") == inflight


async def test_service_estimate_grows_with_the_answer_budget(tok) -> None:
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    short = await core.route("/v1/completions", body("Same prompt. " * 100, max_tokens=8))
    long = await core.route("/v1/completions", body("Same prompt. " * 100, max_tokens=800))
    assert long.service_s - long.ttft_s > 50 * (short.service_s - short.ttft_s)
    for r in (short, long):
        await core.release(r)


def _doc(topic: str) -> str:
    return " ".join(f"Item {i} of the {topic} ledger moves {i * 37 % 1000} crates to dock {i % 9}." for i in range(900))


async def test_a_long_fresh_prompt_is_routed_on_its_head_and_tokenized_after(tok) -> None:
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    heads = REGISTRY.get_sample_value("kvgate_head_decisions_total") or 0.0
    chat = {"model": MODEL, "messages": [{"role": "user", "content": _doc("granary")}], "max_tokens": 8}
    result = await core.route("/v1/chat/completions", json.dumps(chat).encode())
    assert result.kind == "routed"
    assert REGISTRY.get_sample_value("kvgate_head_decisions_total") == heads + 1
    full = tok.tokenize_body("/v1/chat/completions", chat).token_ids
    assert result.request.prompt_tokens < len(full) * 1.5 and result.request.prompt_tokens > len(full) * 0.5
    # the whole prompt is tokenized after the answer, in the background: the next turn finds it
    for _ in range(300):
        if tok.tokenize_head("/v1/chat/completions", chat, fresh_chars=8192) is None:
            break
        await asyncio.sleep(0.05)
    assert tok.tokenize_head("/v1/chat/completions", chat, fresh_chars=8192) is None
    await core.release(result)


async def test_a_node_holding_the_head_makes_the_gateway_read_the_whole_prompt(tok) -> None:
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": _doc("quarry")}], "max_tokens": 8}
    ids = tok.tokenize_body("/v1/chat/completions", chat).token_ids
    tok.clear_cache()  # this replica has not seen the text, but node n2 holds all of it
    await directory.record_stored("n2", block_keys(ids, block_size=16, seed=namespace_seed(MODEL)), Tier.GPU)
    heads = REGISTRY.get_sample_value("kvgate_head_decisions_total") or 0.0
    result = await core.route("/v1/chat/completions", json.dumps(chat).encode())
    assert REGISTRY.get_sample_value("kvgate_head_decisions_total") == heads  # not decided on the head
    assert result.decision.node.node_id == "n2" and result.decision.outcome == "owner"
    assert result.request.prompt_tokens == len(ids)
    assert result.decision.expected_cached_tokens == (len(ids) // 16) * 16
    await core.release(result)


async def test_an_absurd_answer_budget_holds_a_node_no_longer_than_the_cap(tok) -> None:
    """Phantom load (issue 15, item 7): ext_authz never sees a response end, so a request's load is
    held for its estimated service, which grew with the client's ``max_tokens``: 20 requests asking
    for 10^12 tokens made a node look busy for the directory's 10-minute cap. What the attacker gets
    now: each request is routed (200), and its load is gone ``limits.max_hold_s`` later at the latest."""
    now = [1000.0]
    directory = InProcessDirectory(index_stride=1, heartbeat_ttl_s=10_000.0, clock=lambda: now[0])
    for i in (1, 2):
        await directory.register_node(NodeInfo(f"n{i}", f"127.0.0.1:{9000 + i}"))
    limits = RoutingLimits(models=frozenset([MODEL]), max_hold_s=2.0)
    core = RoutingCore(tok, directory, make_policy("kvgate"), PROFILE, limits)
    text = "An ordinary question about harbour traffic. " * 20
    attacks = [await core.route("/v1/completions", body(text, max_tokens=10**12), sees_response_end=False)
               for _ in range(20)]  # fmt: skip
    assert all(r.kind == "routed" for r in attacks)
    assert max(r.service_s for r in attacks) == limits.max_hold_s
    assert sum(load.inflight for load in (await directory.loads()).values()) == 20
    now[0] += limits.max_hold_s + 0.01
    assert all(load == NodeLoad() for load in (await directory.loads()).values())


async def test_an_absurd_answer_budget_is_estimated_as_the_ceiling(tok) -> None:
    """... and is estimated as if it had asked for ``limits.max_answer_tokens``."""
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    core.limits = RoutingLimits(models=frozenset([MODEL]), max_answer_tokens=1024)
    text = "An ordinary question about harbour traffic. " * 20
    ceiling = await core.route("/v1/completions", body(text, max_tokens=1024), sees_response_end=False)
    await core.release(ceiling)
    attack = await core.route("/v1/completions", body(text, max_tokens=10**12), sees_response_end=False)
    assert attack.kind == "routed" and attack.service_s == pytest.approx(ceiling.service_s, rel=0.05)


async def test_the_answer_budget_is_clamped_to_the_context_left(tok) -> None:
    directory = InProcessDirectory(index_stride=1)
    core = await core_over(directory, tok)
    core.limits = RoutingLimits(models=frozenset([MODEL]), max_prompt_tokens=4096, max_answer_tokens=100_000)
    text = "An ordinary question about harbour traffic. " * 20
    fits = await core.route("/v1/completions", body(text, max_tokens=3000), sees_response_end=False)
    await core.release(fits)
    huge = await core.route("/v1/completions", body(text, max_tokens=10**9), sees_response_end=False)
    # the prompt is ~180 tokens: what is left of a 4096-token context is at most ~3,900 tokens
    assert huge.service_s <= fits.service_s * 4096 / 3000


async def test_a_decision_made_again_after_a_conflict_is_routed_even_if_its_reserve_times_out(tok) -> None:
    """Redis: another replica takes the node right after our lookup (the conflict), and the
    reserve of the decision made again times out (Redis slow for that call). The request is
    still routed by that decision, like any request whose reserve failed, not failed open as an
    internal error; the lost reserve is given back."""
    import uuid

    from directory_client.redis_single import RedisDirectory
    from directory_client.scripts import scripts
    from tests.redis_servers import purge_prefix
    from tests.support.holding_proxy import HoldingProxy

    class RacingRedis(RedisDirectory):
        raced = False

        async def lookup(self, keys, session=""):
            view = await super().lookup(keys, session) if session else await super().lookup(keys)
            if not self.raced:
                self.raced = True
                await self.reserve("n1", 1000, if_inflight_at_most=99)  # "another replica" takes n1 after our lookup
            return view

    text = "The quarterly report on harbour traffic. " * 200
    prompt = tok.tokenize_body("/v1/completions", json.loads(body(text)))
    keys = block_keys(prompt.token_ids, block_size=16, seed=namespace_seed(MODEL))
    prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"
    # the unconditional reserve: its last argument (the in-flight limit) is empty
    proxy = await HoldingProxy(6379, scripts()["reserve"].sha.encode(), b"$0\r\n\r\n").start()
    directory = RacingRedis.from_url(f"redis://127.0.0.1:{proxy.port}/0", key_prefix=prefix, index_stride=1,
                                     heartbeat_ttl_s=600, op_timeout_s=0.3)  # fmt: skip
    try:
        core = await core_over(directory, tok)
        await directory.record_stored("n1", keys, Tier.GPU)
        proxy.armed = True
        result = await core.route("/v1/completions", body(text))
        assert proxy.held, "the second reserve was not held back"
        assert directory.raced
        assert (result.kind, result.reason) == ("routed", ""), result
        assert result.reservation is None  # the load accounting misses it, as for any failed reserve
        for _ in range(50):
            if not directory._lost:
                break
            await asyncio.sleep(0.1)
        await proxy.deliver()  # the lost reserve lands late: it takes nothing
        await asyncio.sleep(0.3)
        assert await directory.loads() == {"n1": NodeLoad(1, 1000), "n2": NodeLoad()}
    finally:
        await directory.aclose()
        await proxy.aclose()
        purge_prefix("redis://127.0.0.1:6379/0", prefix)
