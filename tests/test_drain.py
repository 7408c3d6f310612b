"""The drain's copy loop (``gateway.drain.Drainer``) against the in-process directory, with a copy
function that plays the target engine (its KV events reach the directory), so the test can make
a target start draining while its copy runs, as nodes that leave together do."""

from __future__ import annotations

import asyncio

import numpy as np

from directory_client import InProcessDirectory
from directory_client.types import NodeInfo
from gateway.drain import CopyPlan, Drainer
from gateway.elastic import HOT_KEEP, HOT_TTL_S
from gateway.policy import make_policy
from gateway.profile import load_profile
from tokenizer.keys import block_keys

PROFILE = load_profile("llama-3.1-8b-h100")
BS = PROFILE.block_size
SEED = 1


def info(i: int) -> NodeInfo:
    return NodeInfo(f"n{i}", f"10.0.0.{i}:8000", f"10.0.0.{i}:9100")


async def fleet(nodes: int, prompt: np.ndarray) -> InProcessDirectory:
    """``nodes`` live nodes; n1 holds ``prompt`` and served it last (its hot record)."""
    d = InProcessDirectory()
    for i in range(1, nodes + 1):
        await d.register_node(info(i))
    await d.record_stored("n1", list(block_keys(prompt, block_size=BS, seed=SEED)))
    await d.record_hot("n1", "m", prompt.astype("<u4").tobytes(), keep=HOT_KEEP, ttl_s=HOT_TTL_S)
    return d


def drainer(d: InProcessDirectory, copies: list[tuple[str, str]], *, first_target_leaves: bool = False,
            first_fails: bool = False) -> Drainer:  # fmt: skip
    """A drainer whose copies land (the target's engine reports the blocks), listed as (source
    transfer endpoint, target); with ``first_target_leaves`` the first copy's target is marked
    draining (by its own drain) while that copy runs; with ``first_fails`` its target is gone."""

    async def copy(plan: CopyPlan, source: str) -> bool:
        copies.append((source, plan.target.node_id))
        if first_fails and len(copies) == 1:
            await d.deregister_node(plan.target.node_id)
            return False
        await d.record_stored(plan.target.node_id, list(block_keys(plan.token_ids, block_size=BS, seed=SEED)))
        if first_target_leaves and len(copies) == 1:
            await d.set_draining(plan.target.node_id, 60.0)
        return True

    return Drainer(d, make_policy("kvgate", link="rdma"), PROFILE, copy, seed_of=lambda _m: SEED, block_size=BS,
                   link="rdma", poll_s=0.01)  # fmt: skip


def test_a_copy_whose_target_starts_draining_meanwhile_is_made_again_on_a_node_that_stays() -> None:
    prompt = np.arange(64 * BS, dtype=np.uint32)

    async def go():
        d = await fleet(4, prompt)
        copies: list[tuple[str, str]] = []
        report = await drainer(d, copies, first_target_leaves=True).drain("n1", deadline_s=5.0)
        return d, copies, report

    d, copies, report = asyncio.run(go())
    assert [src for src, _ in copies] == ["10.0.0.1:9100"] * 2  # both pulled from the draining node
    assert copies[0][1] != copies[1][1], copies
    assert report.copied == 1 and report.retargeted == 1 and report.copies_planned == 1 and report.complete
    final = copies[1][1]
    view = asyncio.run(d.lookup(np.asarray(block_keys(prompt, block_size=BS, seed=SEED), dtype=np.uint64)))
    assert {nv.node.node_id: nv.cached_blocks for nv in view.nodes}[final] == 64
    assert final not in asyncio.run(d.draining())


def test_a_copy_that_failed_is_made_on_another_node() -> None:
    prompt = np.arange(64 * BS, dtype=np.uint32)

    async def go():
        d = await fleet(4, prompt)
        copies: list[tuple[str, str]] = []
        return copies, await drainer(d, copies, first_fails=True).drain("n1", deadline_s=5.0)

    copies, report = asyncio.run(go())
    assert len(copies) == 2 and copies[0][1] != copies[1][1]
    assert (report.copy_failures, report.retargeted, report.copied, report.copies_planned) == (1, 1, 1, 1)


def test_a_copy_is_noted_as_the_targets_hot_prompt_so_a_later_drain_carries_it_on() -> None:
    prompt = np.arange(40 * BS, dtype=np.uint32)

    async def go():
        d = await fleet(3, prompt)
        copies: list[tuple[str, str]] = []
        first = await drainer(d, copies).drain("n1", deadline_s=5.0)
        await d.deregister_node("n1")  # the first pod is gone; the next one drains
        hot = await d.hot_prefixes(copies[0][1], 10)
        second = await drainer(d, copies).drain(copies[0][1], deadline_s=5.0)
        return first, second, hot, copies

    first, second, hot, copies = asyncio.run(go())
    assert first.copied == 1 and [h.tokens for h in hot] == [prompt.astype("<u4").tobytes()]
    assert second.copied == 1 and len(copies) == 2  # carried on to the third node
    assert copies[1][0] == f"10.0.0.{copies[0][1][1:]}:9100" and copies[1][1] not in ("n1", copies[0][1])


def test_a_copy_in_progress_counts_its_blocks_on_its_target() -> None:
    """While a copy runs, its target's load carries the copy's blocks as queued prefill: the next
    copy's planning (the policy's memory and queue terms) sees them before the KV events do, so
    the copies of a drain spread over the fleet instead of filling the cheapest node."""
    prompt = np.arange(64 * BS, dtype=np.uint32)
    seen: list[tuple[int, int]] = []

    async def go():
        d = await fleet(3, prompt)

        async def copy(plan: CopyPlan, source: str) -> bool:
            load = (await d.loads())[plan.target.node_id]
            seen.append((load.prefill_tokens, plan.new_tokens))
            return True

        drainer = Drainer(d, make_policy("kvgate", link="rdma"), PROFILE, copy, seed_of=lambda _m: SEED,
                          block_size=BS, link="rdma", poll_s=0.01)  # fmt: skip
        await drainer.drain("n1", deadline_s=5.0)

    asyncio.run(go())
    assert seen == [(64 * BS, 64 * BS)]


def test_a_copy_whose_reservation_failed_does_not_abort_the_drain() -> None:
    """Redis is slow for one call (the copy's reserve times out): the drain still copies, waits for
    the node's requests and answers with its report; raising instead would let the pod go at once."""
    import uuid

    from directory_client import open_directory
    from directory_client.scripts import scripts
    from tests.redis_servers import purge_prefix
    from tests.support.holding_proxy import HoldingProxy

    prompt = np.arange(64 * BS, dtype=np.uint32)
    prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"

    async def go():
        proxy = await HoldingProxy(6379, scripts()["reserve"].sha.encode()).start()
        d = open_directory(f"redis://127.0.0.1:{proxy.port}/0", key_prefix=prefix, index_stride=1,
                           heartbeat_ttl_s=600, op_timeout_s=0.3)  # fmt: skip
        try:
            for i in range(1, 4):
                await d.register_node(info(i))
            await d.record_stored("n1", list(block_keys(prompt, block_size=BS, seed=SEED)))
            await d.record_hot("n1", "m", prompt.astype("<u4").tobytes(), keep=HOT_KEEP, ttl_s=HOT_TTL_S)
            copies: list[str] = []

            async def copy(plan: CopyPlan, source: str) -> bool:
                copies.append(plan.target.node_id)
                return True

            proxy.armed = True
            report = await Drainer(d, make_policy("kvgate", link="rdma"), PROFILE, copy, seed_of=lambda _m: SEED,
                                   block_size=BS, link="rdma", poll_s=0.01).drain("n1", deadline_s=5.0)  # fmt: skip
            return report, copies, bool(proxy.held)
        finally:
            await d.aclose()
            await proxy.aclose()
            purge_prefix("redis://127.0.0.1:6379/0", prefix)

    report, copies, held = asyncio.run(go())
    assert held, "the copy's reserve was not held back"
    assert report.copied == 1 and len(copies) == 1 and report.inflight_left == 0
