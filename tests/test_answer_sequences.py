"""A request asking for n answers (``n``) is priced as the n sequences the engine
decodes at once: in its answer budget, in its service time, in the memory its answers take, and
in the load every replica sees (a reservation counting n requests in flight, on every directory
backend).

What the engine does, measured on a real ``vllm serve`` (0.32, CPU, /v1/completions): ``n`` of
``3``, ``"3"``, ``3.0`` and ``true`` are served (3, 3, 3, 1 choices); ``"x"`` and ``2.5`` are a 400
validation error; ``0`` and ``-1`` a 400 "n must be at least 1, got 0."; ``10**9`` and ``16385`` a
400 "n must be at most 16384" (its VLLM_MAX_N_SEQUENCES: configurable, so kvgate bounds the
estimate instead of refusing); ``null`` a 400 on completions, 1 on chat; ``best_of`` is ignored
(one choice), and kvgate does not price it either."""

from __future__ import annotations

import pytest

from directory_client import ReservationConflict
from tests.test_directory_behaviour import Backend, backend, node  # noqa: F401 (the fixture)


# -- a request generating n answers counts n in flight ------------------------------------------------


async def test_a_reservation_counting_n_requests_is_given_back_whole(backend: Backend) -> None:
    d, other = backend.make(), backend.make()
    await d.register_node(node("d1"))
    r = await d.reserve("d1", 100, requests=8, first_token_s=0.2)
    assert r.requests == 8
    assert (await other.loads())["d1"].inflight == 8  # every replica sees the 8 sequences
    with pytest.raises(ReservationConflict):  # compare-and-reserve compares against all of them
        await other.reserve("d1", 0, if_inflight_at_most=7)
    await other.reserve("d1", 0, if_inflight_at_most=8, hold_s=0.3)
    await d.release(r)
    assert (await other.loads())["d1"].inflight == 1
    await d.release(r)  # idempotent
    assert (await other.loads())["d1"].inflight == 1
    await d.reserve("d1", 0, requests=5, hold_s=0.3)
    await backend.sleep(0.4)  # both ended by themselves: all 6 go
    assert (await other.loads()).get("d1") is None or (await other.loads())["d1"].inflight == 0


@pytest.mark.parametrize("bad", [0, -3, 1025, 2.0, True, "4"])
async def test_a_reservation_counts_between_1_and_1024_requests(backend: Backend, bad: object) -> None:
    d = backend.make()
    await d.register_node(node("d1"))
    with pytest.raises(ValueError):
        await d.reserve("d1", 0, requests=bad)  # type: ignore[arg-type]
    assert (await d.loads())["d1"].inflight == 0


# -- the answer budget and the request path ------------------------------------------------------------

import json  # noqa: E402

from directory_client import InProcessDirectory, NodeInfo  # noqa: E402
from gateway.core import RoutingCore, RoutingLimits  # noqa: E402
from gateway.decision_round import MAX_ANSWERS, InvalidAnswerCount, answer_budget, answer_count  # noqa: E402
from gateway.policy import make_policy  # noqa: E402
from gateway.profile import load_profile  # noqa: E402
from tokenizer import PromptTokenizer  # noqa: E402

PROFILE = load_profile("llama-3.1-8b-h100")


@pytest.mark.parametrize(
    ("fields", "answers"),
    [
        ({}, 1), ({"n": None}, 1), ({"n": 1}, 1), ({"n": 8}, 8), ({"n": "8"}, 8), ({"n": 8.0}, 8), ({"n": True}, 1),
        ({"n": 2, "best_of": 5}, 2), ({"n": 5, "best_of": 2}, 5), ({"best_of": "x"}, 1), ({"best_of": -4}, 1),
        ({"n": 10**9}, 10**9),
    ],
)
def test_the_answers_a_request_asks_for_are_read_as_vllm_reads_them(fields: dict, answers: int) -> None:
    assert answer_count({"model": "m", "prompt": "hi", **fields}) == answers


@pytest.mark.parametrize("n", ["x", 2.5, 0, -1, False, [], {}, "", "1e3", float("nan")])
def test_an_n_the_engine_refuses_is_refused(n: object) -> None:
    with pytest.raises(InvalidAnswerCount):
        answer_count({"model": "m", "prompt": "hi", "n": n})


def test_the_ceiling_bounds_the_whole_budget_answers_first() -> None:
    assert answer_budget({"max_tokens": 500}) == (500, 1)
    assert answer_budget({"max_tokens": 500, "n": 8}) == (500, 8)  # 4000 tokens in all: within the ceiling
    per, answers = answer_budget({"max_tokens": 8192, "n": 100})
    assert answers == 100 and per * answers <= 8192 and per == 81
    assert answer_budget({"max_tokens": 10**12, "n": 10**9}) == (8192 // MAX_ANSWERS, MAX_ANSWERS)
    assert answer_budget({"n": 4}, ceiling=2) == (1, 2)  # a ceiling below the answers: one token each


def core(directory: InProcessDirectory, policy: str = "kvgate") -> RoutingCore:
    return RoutingCore(PromptTokenizer(), directory, make_policy(policy), PROFILE, RoutingLimits(models=frozenset(["m"])))


def body(prompt: str, **fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 256, **fields}).encode()


@pytest.mark.parametrize(
    ("n", "message"),
    [("x", "n must be an integer"), (2.5, "n must be an integer"), (0, "n must be at least 1, got 0."),
     (-1, "n must be at least 1, got -1.")],
)
async def test_a_request_with_an_n_the_engine_refuses_gets_a_400_and_loads_nothing(n: object, message: str) -> None:
    directory = InProcessDirectory(index_stride=1)
    await directory.register_node(NodeInfo("a", "127.0.0.1:9001"))
    result = await core(directory).route("/v1/completions", body("hello there", n=n))
    assert result.kind == "rejected" and result.status == 400 and message in json.loads(result.body)["message"]
    assert (await directory.loads())["a"].inflight == 0


async def test_a_request_for_n_answers_counts_n_in_flight_and_decodes_longer() -> None:
    directory = InProcessDirectory(index_stride=1)
    await directory.register_node(NodeInfo("a", "127.0.0.1:9001"))
    gw = core(directory)
    one = await gw.route("/v1/completions", body("one answer, please"))
    many = await gw.route("/v1/completions", body("sixteen answers, please", n=16))
    assert one.reservation is not None and one.reservation.requests == 1
    assert many.reservation is not None and many.reservation.requests == 16
    assert (await directory.loads())["a"].inflight == 17
    assert many.service_s - many.ttft_s > one.service_s - one.ttft_s  # 16 more sequences in each step, 256 tokens each
    await gw.release(many)
    assert (await directory.loads())["a"].inflight == 1
    await gw.release(one)


async def test_a_node_decoding_many_answers_looks_busier_to_the_next_decision() -> None:
    async def second_choice(n: int) -> str:
        directory = InProcessDirectory(index_stride=1)
        for nid, port in (("a", 9001), ("b", 9002)):
            await directory.register_node(NodeInfo(nid, f"127.0.0.1:{port}"))
        for _ in range(10):
            await directory.reserve("b", 0)  # b decodes 10 answers
        gw = core(directory, "least_request")
        first = await gw.route("/v1/completions", body("The first request of the day. " * 20, n=n))
        assert first.decision is not None and first.decision.node is not None and first.decision.node.node_id == "a"
        nxt = await gw.route("/v1/completions", body("Something else entirely, and long. " * 20))
        assert nxt.decision is not None and nxt.decision.node is not None
        return nxt.decision.node.node_id

    assert await second_choice(1) == "a"  # one answer on a against ten on b
    assert await second_choice(64) == "b"  # sixty-four answers on a


def test_a_split_prices_its_answers_in_the_decode_nodes_batch() -> None:
    from directory_client.types import DirectoryView
    from gateway.decision_round import decide_round
    from tests.test_disagg import node as pd_node, request, warmed

    fleet = DirectoryView((pd_node(1, "prefill"), pd_node(2, "decode", inflight=8)))

    def rnd(answers: int):  # type: ignore[no-untyped-def]
        policy = warmed(make_policy("kvgate", link="rdma"))
        return decide_round(policy, request(16_000), fleet, PROFILE, now=0.0, answer_tokens=256, answers=answers)

    one, many = rnd(1), rnd(32)
    assert many.answers == 32 and one.answers == 1
    assert many.service_s - many.ttft_s > one.service_s - one.ttft_s  # 32 sequences join the decode node's batch of 8


def test_the_memory_many_answers_take_keeps_them_off_a_node_that_would_evict_for_them() -> None:
    from directory_client.types import DirectoryView, NodeLoad, NodeView, Tier
    from gateway.decision_round import decide_round
    from gateway.types import RoutingRequest

    def view(nid: str, cached: int, held: int) -> NodeView:  # 3000 blocks of memory each
        return NodeView(NodeInfo(nid, f"10.0.0.{ord(nid[0])}:8000", capacity_blocks=3000), cached, Tier.GPU, NodeLoad(), held)

    fleet = DirectoryView((view("a", 100, 2000), view("b", 0, 200)))  # a holds 100 blocks of the prompt, 1000 free
    bs = PROFILE.block_size
    req = RoutingRequest(model="m", prompt_tokens=250 * bs, total_blocks=250, block_size=bs, affinity=3)

    def chosen(answers: int):  # type: ignore[no-untyped-def]
        return decide_round(make_policy("kvgate"), req, fleet, PROFILE, now=0.0, answer_tokens=512, answers=answers).decision

    one, many = chosen(1), chosen(32)
    assert one.node is not None and one.node.node_id == "a", one.reason  # the prompt fits beside what a holds
    # 31 more answers of 512 tokens: 992 blocks more, which a would evict for
    assert many.node is not None and many.node.node_id == "b", many.reason
    assert "memory" in many.reason
