"""The KV-event bridge: the per-node map on its own, then the bridge against a real publisher over
real ZMQ sockets and a real directory (in-process, and Redis under a private key prefix)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as hst
from prometheus_client import REGISTRY

from directory_client import open_directory
from directory_client.types import Directory, DirectoryUnavailable, NodeInfo, Tier
from tests.conftest import REPO, free_port
from tokenizer.keys import BlockKey, block_keys, namespace_seed, request_seed
from workers.bridge import (
    COLLECTOR,
    BlockMapOverflow,
    EngineSpec,
    KVEventBridge,
    NodeBlockMap,
    TierChange,
    parse_engine_spec,
)
from workers.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    encode_batch,
    encode_seq,
)

MODEL = "test-model"
BS = 16
SEED = namespace_seed(MODEL)


def tokens(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def keys_of(toks: Sequence[int], *, lora: str | None = None) -> list[BlockKey]:
    return block_keys(toks, block_size=BS, seed=namespace_seed(MODEL, lora=lora))


def stored(hashes: list[int], toks: list[int], parent: int | None = None, **kw: object) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=BS, medium="GPU", **kw)  # type: ignore[arg-type]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 5.0, what: str = "condition") -> float:
    """Poll ``check`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.01)


async def held(directory: Directory, node_id: str, keys: Sequence[BlockKey]) -> int:
    """Leading blocks of ``keys`` the directory says ``node_id`` holds (0 if not live)."""
    view = await directory.lookup(keys)
    return next((n.cached_blocks for n in view.nodes if n.node.node_id == node_id), 0)


async def live(directory: Directory, node_id: str) -> bool:
    return any(n.node_id == node_id for n in await directory.live_nodes())


# ---------------------------------------------------------------------------------------------
# the per-node map, pure


def new_map(max_blocks: int = 1000) -> NodeBlockMap:
    return NodeBlockMap(model=MODEL, block_size=BS, max_blocks=max_blocks)


def test_map_keys_chain_through_parent_hashes() -> None:
    m = new_map()
    prompt = tokens(0, 5)
    expected = keys_of(prompt)
    assert m.apply(stored([101, 102], prompt[:32])) is None
    assert m.apply(stored([103, 104, 105], prompt[32:], parent=102)) is None
    assert [m.key_of(h) for h in (101, 102, 103, 104, 105)] == expected
    cleared, changes = m.take_changes()
    assert not cleared
    assert changes == [TierChange(k, (Tier.GPU,), ()) for k in expected]


def test_map_lora_name_changes_the_seed_of_root_blocks() -> None:
    m = new_map()
    m.apply(stored([1], tokens(0, 1), lora_name="adapter-a"))
    assert m.key_of(1) == keys_of(tokens(0, 1), lora="adapter-a")[0]
    assert m.key_of(1) != keys_of(tokens(0, 1))[0]


def salted_keys(toks: Sequence[int], salt: str | None, *, lora: str | None = None) -> list[BlockKey]:
    """The gateway's keys for a prompt sent with body ``cache_salt`` (and model = the adapter)."""
    adapters = {lora: MODEL} if lora else {}
    return block_keys(toks, block_size=BS, seed=request_seed(lora or MODEL, cache_salt=salt, adapters=adapters))


def test_map_keys_salted_blocks_as_the_gateway_keys_salted_prompts() -> None:
    """vLLM 0.32 puts ``cache_salt`` in block 0's ``extra_keys`` only (after the LoRA name, which
    every block of a LoRA request carries). Before: the bridge ignored it, so a tenant's salted
    blocks were recorded under the unsalted key: its prompts never hit, and anyone's unsalted
    guess of them was routed to the owner (a cross-tenant prefix oracle)."""
    prompt = tokens(0, 3)
    m = new_map()
    m.apply(stored([1, 2], prompt[:32], extra_keys=[["tenant-a"], None]))
    m.apply(stored([3], prompt[32:], parent=2))
    assert [m.key_of(h) for h in (1, 2, 3)] == salted_keys(prompt, "tenant-a")
    # salted and unsalted twins never share a key, nor do two salts
    unsalted, other = salted_keys(prompt, None), salted_keys(prompt, "tenant-b")
    assert not set(salted_keys(prompt, "tenant-a")) & (set(unsalted) | set(other))
    # LoRA: every block carries the adapter name first, block 0 then the salt
    m.apply(stored([11, 12], prompt[:32], lora_name="ad", extra_keys=[["ad", "tenant-a"], ["ad"]]))
    assert [m.key_of(h) for h in (11, 12)] == salted_keys(prompt, "tenant-a", lora="ad")[:2]
    m.apply(stored([21], prompt[:16], lora_name="ad", extra_keys=[["ad"]]))
    assert m.key_of(21) == salted_keys(prompt, None, lora="ad")[0] != m.key_of(11)


def test_map_drops_blocks_whose_content_tokens_do_not_decide() -> None:
    """Multimodal placeholders (``(mm_identifier, offset)``), prompt embeddings, an unnamed LoRA
    (deprecated ``lora_id`` only) or a salt past block 0: their keys from token IDs alone would
    claim what the node does not hold, so they are dropped and counted, with their descendants."""
    m = new_map()
    assert m.apply(stored([1, 2], tokens(0, 2), extra_keys=[None, [["img-sha", 0]]])) == ("extra_keys", 1)
    assert m.key_of(1) is not None and m.key_of(2) is None
    assert m.apply(stored([3], tokens(0, 1), extra_keys=[[b"embeds-digest"]])) == ("extra_keys", 1)
    assert m.apply(stored([4], tokens(0, 1), lora_id=7)) == ("lora_unnamed", 1)
    assert m.apply(stored([5], tokens(16, 1), parent=1, extra_keys=[["late-salt"]])) == ("extra_keys", 1)
    assert m.apply(stored([6, 7], tokens(0, 2), extra_keys=[None])) == ("extra_keys", 2)  # one entry short
    # an unknown engine's tagged form is understood too
    m.apply(stored([8], tokens(0, 1), extra_keys=[[["cache_salt", "tenant-a"]]]))
    assert m.key_of(8) == salted_keys(tokens(0, 1), "tenant-a")[0]


def test_map_offload_events_without_tokens_add_a_tier_to_blocks_it_knows() -> None:
    """vLLM's CPU-offload connector may announce a block with no token IDs (it lacks the metadata):
    such a block cannot be keyed from its tokens, but if its engine hash is one we keyed when it
    was stored on the GPU, its CPU copy is that same key; otherwise it is dropped and counted."""
    m = new_map()
    m.apply(stored([1, 2], tokens(0, 2)))
    m.take_changes()
    offload = BlockStored(block_hashes=[2, 77], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU")
    assert m.apply(offload) == ("no_tokens", 1)
    assert m.take_changes() == (False, [TierChange(keys_of(tokens(0, 2))[1], (Tier.CPU,), ())])
    m.apply(BlockRemoved(block_hashes=[2], medium="GPU"))  # evicted from the GPU: the CPU copy stays
    assert m.key_of(2) == keys_of(tokens(0, 2))[1]


def test_map_unknown_parent_drops_the_blocks_and_their_descendants() -> None:
    m = new_map()
    assert m.apply(stored([7, 8], tokens(0, 2), parent=999)) == ("unknown_parent", 2)
    assert m.apply(stored([9], tokens(32, 1), parent=8)) == ("unknown_parent", 1)
    assert len(m) == 0 and m.take_changes() == (False, [])


def test_map_rejects_foreign_block_sizes_and_short_token_lists() -> None:
    m = new_map()
    assert m.apply(BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens(0, 2)[:32], block_size=32)) == (
        "block_size",
        1,
    )
    assert m.apply(stored([1, 2], tokens(0, 1))) == ("token_count", 2)
    assert len(m) == 0


def test_map_removal_and_shared_keys() -> None:
    m = new_map()
    prompt = tokens(0, 2)
    k1, k2 = keys_of(prompt)
    m.apply(stored([1, 2], prompt))
    m.apply(stored([51, 52], prompt, group_idx=1))  # same tokens, another KV-cache group
    m.take_changes()
    m.apply(BlockRemoved(block_hashes=[2]))
    assert m.take_changes() == (False, [])  # group 1 still holds k2
    m.apply(BlockRemoved(block_hashes=[52], group_idx=1))
    assert m.take_changes() == (False, [TierChange(k2, (), (Tier.GPU,))])
    m.apply(BlockRemoved(block_hashes=[12345]))  # never announced: ignored
    assert m.key_of(1) == k1 and m.key_of(2) is None and len(m) == 2


def test_map_tiers_are_tracked_separately() -> None:
    m = new_map()
    prompt = tokens(0, 1)
    (k,) = keys_of(prompt)
    m.apply(stored([1], prompt))
    m.apply(BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=prompt, block_size=BS, medium="CPU"))
    assert m.take_changes() == (False, [TierChange(k, (Tier.GPU, Tier.CPU), ())])
    m.apply(BlockRemoved(block_hashes=[1], medium="GPU"))
    assert m.take_changes() == (False, [TierChange(k, (), (Tier.GPU,))])
    assert m.snapshot() == {Tier.CPU: [k]}


def test_map_folds_changes_between_flushes() -> None:
    m = new_map()
    m.apply(stored([1], tokens(0, 1)))
    m.apply(BlockRemoved(block_hashes=[1]))
    assert m.take_changes() == (False, [])
    m.apply(stored([1], tokens(0, 1)))
    m.apply(AllBlocksCleared())
    m.apply(stored([2], tokens(100, 1)))
    cleared, changes = m.take_changes()
    assert cleared and [c.key for c in changes] == keys_of(tokens(100, 1))


def test_map_reused_engine_hash_rekeys_the_block() -> None:
    m = new_map()
    m.apply(stored([1], tokens(0, 1)))
    m.take_changes()
    m.apply(stored([1], tokens(500, 1)))
    (old,), (new,) = keys_of(tokens(0, 1)), keys_of(tokens(500, 1))
    _, changes = m.take_changes()
    assert set(changes) == {TierChange(old, (), (Tier.GPU,)), TierChange(new, (Tier.GPU,), ())}


def test_map_is_bounded() -> None:
    m = new_map(max_blocks=3)
    m.apply(stored([1, 2, 3], tokens(0, 3)))
    with pytest.raises(BlockMapOverflow):
        m.apply(stored([4], tokens(48, 1), parent=3))


def test_map_applies_a_long_run_in_slices_that_chain_like_one() -> None:
    """A long prompt's blocks applied a slice at a time (the bridge yields to the event loop
    between slices): each pause leaves a prefix of the run, and the keys are the run's own."""
    prompt = tokens(0, 600)
    m = new_map(max_blocks=10_000)
    steps = m.apply_steps(stored(list(range(1, 601)), prompt), 256)
    sizes = []
    with pytest.raises(StopIteration):
        while True:
            next(steps)
            sizes.append(len(m))
    assert sizes == [256, 512]
    whole = new_map(max_blocks=10_000)
    whole.apply(stored(list(range(1, 601)), prompt))
    assert m.snapshot() == whole.snapshot() == {Tier.GPU: keys_of(prompt)}
    removal = m.apply_steps(BlockRemoved(block_hashes=list(range(1, 601))), 256)
    next(removal)
    assert len(m) == 600 - 256
    assert list(removal) == [None] and len(m) == 0


@settings(max_examples=200, deadline=None)
@given(
    hst.lists(
        hst.tuples(hst.sampled_from(["stored", "removed", "cleared", "flush"]), hst.integers(1, 6), hst.integers(0, 40),
                   hst.sampled_from(["GPU", "CPU", None]), hst.sampled_from([None, 1])),
        max_size=30,
    )
)
def test_map_writes_are_its_changes_grouped_per_tier(ops: list) -> None:
    """``take_writes`` (what the bridge flushes) says exactly what ``take_changes`` says."""
    a, b = new_map(), new_map()
    for kind, n, start, medium, group in ops:
        if kind == "flush":
            cleared, changes = a.take_changes()
            writes = b.take_writes()
            expect_stored: dict[Tier, set[int]] = {}
            expect_removed: dict[Tier, set[int]] = {}
            for c in changes:
                for t in c.stored:
                    expect_stored.setdefault(t, set()).add(c.key)
                for t in c.removed:
                    expect_removed.setdefault(t, set()).add(c.key)
            if writes is None:
                assert not cleared and not changes
            else:
                assert writes.cleared == cleared
                assert {t: set(k) for t, k in writes.stored.items()} == expect_stored
                assert {t: set(k) for t, k in writes.removed.items()} == expect_removed
                assert all(len(k) == len(set(k)) for k in [*writes.stored.values(), *writes.removed.values()])
            continue
        ev: BlockStored | BlockRemoved | AllBlocksCleared
        if kind == "stored":  # hashes start..start+n name tokens from a few distinct runs: keys get shared and reused
            ev = BlockStored(
                block_hashes=list(range(start, start + n)), parent_block_hash=None, token_ids=tokens(1000 * (start % 3), n),
                block_size=BS, medium=medium, group_idx=group,
            )  # fmt: skip
        elif kind == "removed":
            ev = BlockRemoved(block_hashes=list(range(start, start + n)), medium=medium, group_idx=group)
        else:
            ev = AllBlocksCleared()
        assert a.apply(ev) == b.apply(ev)


def test_map_memory_per_tracked_block() -> None:
    """What each replica pays per engine block it follows (issue: 361 B as objects, 4M blocks per
    node by default = 1.4 GB): now plain ints, bounded by max_blocks_per_node (default 1M)."""
    from workers.bridge_memory import bytes_per_block

    per = bytes_per_block(64_000)
    print(f"\nbridge map: {per:.0f} B per tracked block")
    assert per < 260


def test_engine_spec_parsing() -> None:
    spec = parse_engine_spec("node_id=n1,address=127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,capacity=64")
    assert spec == EngineSpec("n1", "127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", capacity=64)
    for bad in ("node_id=n1,address=a:1", "node_id=n1,address=a:1,events=x,color=red", "node_id={x},address=a:1,events=x", "node_id=n1,address=a:1,events=x,capacity=lots", "junk"):
        with pytest.raises(ValueError):
            parse_engine_spec(bad)


# ---------------------------------------------------------------------------------------------
# the bridge, over real sockets


class Engine:
    """A real publisher on free loopback ports, plus the spec a bridge needs to follow it."""

    def __init__(
        self, node_id: str, *, buffer_batches: int = 10_000, wire_format: str = "map", replay: bool = True,
        replay_form: str = "topic",
    ) -> None:  # fmt: skip
        self.node_id = node_id
        self.replay_form = replay_form
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}" if replay else None
        self.buffer_batches = buffer_batches
        self.wire_format = wire_format
        self.pub = self.start()

    def start(self) -> KVEventPublisher:
        return KVEventPublisher(
            self.events, replay_endpoint=self.replay, buffer_batches=self.buffer_batches, wire_format=self.wire_format,  # type: ignore[arg-type]
            replay_form=self.replay_form, topic=f"kv@{self.node_id}@{MODEL}",  # type: ignore[arg-type]
        )

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(node_id=self.node_id, address=f"127.0.0.1:{free_port()}", events=self.events, replay=self.replay)


@pytest.fixture
async def directory():
    d = open_directory("memory://", heartbeat_ttl_s=1.0, index_stride=1)
    yield d
    await d.aclose()


@pytest.fixture
def node_id(key_prefix: str) -> str:
    return "n-" + key_prefix.rsplit(":", 1)[-1]


def make_bridge(directory: Directory, *engines: Engine, **kw: object) -> KVEventBridge:
    kw.setdefault("heartbeat_interval_s", 0.2)
    kw.setdefault("replay_timeout_s", 1.0)
    return KVEventBridge(directory, [e.spec for e in engines], model=MODEL, block_size=BS, **kw)  # type: ignore[arg-type]


async def connected(bridge: KVEventBridge, directory: Directory, node_id: str) -> None:
    await eventually(lambda: live(directory, node_id), what="node registered")
    await eventually(lambda: _true(bridge.stats(node_id).next_seq is not None), what="bridge in step")


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("wire_format", ["map", "array"])
async def test_bridge_mirrors_stores_and_removals(directory: Directory, node_id: str, wire_format: str) -> None:
    eng = Engine(node_id, wire_format=wire_format)
    prompt = tokens(1000, 6)
    keys = keys_of(prompt)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.publish([stored([11, 12, 13], prompt[:48])])
        eng.pub.publish([stored([14, 15, 16], prompt[48:], parent=13)])
        await eventually(lambda: _eq(held(directory, node_id, keys), 6), what="6 blocks recorded")
        eng.pub.publish([BlockRemoved(block_hashes=[16, 15], medium="GPU")])
        await eventually(lambda: _eq(held(directory, node_id, keys), 4), what="2 blocks removed")
        assert await held(directory, node_id, keys[4:]) == 0
        assert bridge.stats(node_id).tracked_blocks == 4
        # each applied batch's age is measured: three batches, each seconds-fresh at most
        lag_count = REGISTRY.get_sample_value("kvgate_bridge_event_lag_seconds_count", {"node": node_id})
        lag_sum = REGISTRY.get_sample_value("kvgate_bridge_event_lag_seconds_sum", {"node": node_id})
        assert lag_count == 3 and 0 <= lag_sum < 3 * 5.0
    eng.pub.close()
    assert not await live(directory, node_id)  # aclose deregistered it


async def test_a_long_batch_is_applied_with_the_event_loop_running_between_slices(directory: Directory, node_id: str) -> None:
    """The bridges share kvgate serve's event loop with the decisions: a batch of thousands of
    blocks (a long prompt stored, a big eviction) is applied STEP_BLOCKS at a time, and a task
    that only runs when the loop is free sees it half applied, a prefix at each step."""
    eng = Engine(node_id)
    n = 3 * KVEventBridge.STEP_BLOCKS + 10
    prompt = tokens(5000, n)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.publish([stored(list(range(1, n + 1)), prompt)])
        seen: list[int] = []
        deadline = time.monotonic() + 10
        while not seen or seen[-1] != n:  # one look per turn of the loop
            assert time.monotonic() < deadline, f"only {seen[-1:]} of {n} blocks applied"
            tracked = bridge.stats(node_id).tracked_blocks
            if not seen or tracked != seen[-1]:
                seen.append(tracked)
            await asyncio.sleep(0)
        step = KVEventBridge.STEP_BLOCKS
        assert seen == [0, step, 2 * step, 3 * step, n]
        await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), n), what="every block recorded")
        eng.pub.publish([BlockRemoved(block_hashes=list(range(1, n + 1)))])
        seen = []
        while not seen or seen[-1] != 0:
            assert time.monotonic() < deadline, "removal not applied"
            tracked = bridge.stats(node_id).tracked_blocks
            if not seen or tracked != seen[-1]:
                seen.append(tracked)
            await asyncio.sleep(0)
        assert seen == [n, n - step, n - 2 * step, n - 3 * step, 0]
    eng.pub.close()


async def _eq(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


@pytest.mark.parametrize("how", ["catch_up", "gap_repair"])
async def test_a_long_replayed_history_lets_the_loop_run_and_is_written_whole(
    directory: Directory, node_id: str, how: str
) -> None:
    """A bridge that (re)connects, or repairs a gap, applies up to the engine's 10,000 buffered
    batches; it did so without yielding (~0.14 s of loop at 4 blocks a batch, every decision of
    kvgate serve waiting). Now the loop runs between slices of it, yet nothing of a half-applied
    history reaches the directory: the first batch's blocks appear only once the last is applied."""
    eng = Engine(node_id)
    n, per = 3000, 4
    first, last = tokens(0, per), tokens(1000 * (n - 1), per)

    def publish_history() -> None:
        for i in range(n):
            eng.pub.publish([stored([i * per + j + 1 for j in range(per)], tokens(1000 * i, per))])

    if how == "catch_up":
        publish_history()
    async with make_bridge(directory, eng) as bridge:
        if how == "gap_repair":
            await connected(bridge, directory, node_id)
            eng.pub.drop_next(n)
            publish_history()  # lost on the wire, kept for replay
            eng.pub.publish([stored([10**6], tokens(10**7, 1))])  # the gap shows
        total = n * per + (1 if how == "gap_repair" else 0)
        midway: list[int] = []
        deadline = time.monotonic() + 30
        while bridge.stats(node_id).tracked_blocks < total:  # one look per turn of the loop
            assert time.monotonic() < deadline, f"{bridge.stats(node_id).tracked_blocks} of {total} blocks applied"
            tracked = bridge.stats(node_id).tracked_blocks
            if 0 < tracked < n * per:
                midway.append(tracked)
                assert await held(directory, node_id, keys_of(first)) == 0, "half a history was written"
            await asyncio.sleep(0)
        assert midway, "the history was applied without the loop running in between"
        await eventually(lambda: _eq(held(directory, node_id, keys_of(first)), per), what="history written")
        assert await held(directory, node_id, keys_of(last)) == per
        if how == "gap_repair":
            assert bridge.stats(node_id).gaps_repaired == 1
    eng.pub.close()


@pytest.mark.parametrize("replay_form", ["topic", "plain"])
async def test_bridge_catches_up_on_history_published_before_it_started(
    directory: Directory, node_id: str, replay_form: str
) -> None:
    """Current vLLM answers replay with a topic frame (4 frames at the bridge), older vLLM and
    SGLang without: the history published before the bridge started is in the directory either
    way (before: `replay answer of 4 frames` logged, the directory held 0 blocks)."""
    eng = Engine(node_id, replay_form=replay_form)
    prompt = tokens(0, 3)
    eng.pub.publish([stored([1], prompt[:16])])
    eng.pub.publish([stored([2, 3], prompt[16:], parent=1)])
    eng.pub.publish([stored([9], tokens(900, 1)), BlockRemoved(block_hashes=[9])])
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), 3), what="history replayed")
        assert await held(directory, node_id, keys_of(tokens(900, 1))) == 0
        assert bridge.stats(node_id).next_seq == 3
    eng.pub.close()


async def test_all_blocks_cleared_clears_the_node(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id)
    a, b = tokens(0, 2), tokens(5000, 2)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.publish([stored([1, 2], a)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 2))
        eng.pub.publish([AllBlocksCleared(), stored([3, 4], b)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(b)), 2))
        assert await held(directory, node_id, keys_of(a)) == 0
        eng.pub.publish([BlockRemoved(block_hashes=[1, 2])])  # hashes from before the reset: no effect
        eng.pub.publish([stored([5], tokens(7000, 1), parent=2)])  # parent forgotten with the reset
        await eventually(lambda: _true(bridge.stats(node_id).dropped_blocks == 1))
        assert await held(directory, node_id, keys_of(b)) == 2
    eng.pub.close()


async def test_sequence_reset_clears_the_node(directory: Directory, node_id: str) -> None:
    """A publisher whose sequence goes back to 0 on the same connection restarted: clear."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    spec = EngineSpec(node_id=node_id, address="127.0.0.1:1", events=endpoint)  # no replay socket
    bridge = KVEventBridge(directory, [spec], model=MODEL, block_size=BS, heartbeat_interval_s=0.2)
    await bridge.start()
    try:
        seq = 0

        def send(*events: object) -> None:
            nonlocal seq
            pub.send_multipart([b"", encode_seq(seq), encode_batch(list(events))])  # type: ignore[arg-type]
            seq += 1

        while bridge.stats(node_id).batches == 0:  # until the subscription has joined
            send()
            await asyncio.sleep(0.02)
        a, b = tokens(0, 2), tokens(3000, 2)
        send(stored([1, 2], a))
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 2))
        seq = 0
        send(stored([3, 4], b))
        await eventually(lambda: _eq(held(directory, node_id, keys_of(b)), 2))
        assert await held(directory, node_id, keys_of(a)) == 0
        assert bridge.stats(node_id).resets >= 2  # the connect, then the sequence reset
    finally:
        await bridge.aclose()
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_gap_without_a_replay_socket_clears_the_node(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id, replay=False)
    a, b = tokens(0, 2), tokens(3000, 1)
    async with make_bridge(directory, eng) as bridge:
        await eventually(lambda: live(directory, node_id))
        while bridge.stats(node_id).batches == 0:  # until the subscription has joined
            eng.pub.publish([])
            await asyncio.sleep(0.02)
        eng.pub.publish([stored([1, 2], a)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 2))
        eng.pub.drop_next(1)
        eng.pub.publish([BlockRemoved(block_hashes=[2])])  # lost: the directory must not keep claiming 2
        eng.pub.publish([stored([3], b)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(b)), 1))
        assert await held(directory, node_id, keys_of(a)) == 0
        s = bridge.stats(node_id)
        assert (s.gaps_unrecoverable, s.gaps_repaired, s.tracked_blocks) == (1, 0, 1)
    eng.pub.close()


async def test_gap_is_repaired_through_replay(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id)
    prompt = tokens(0, 4)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.drop_next(1)
        eng.pub.publish([stored([1, 2], prompt[:32])])  # lost on the wire
        eng.pub.publish([stored([3, 4], prompt[32:], parent=2)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), 4), what="gap repaired")
        s = bridge.stats(node_id)
        assert (s.gaps_repaired, s.gaps_unrecoverable, s.dropped_blocks) == (1, 0, 0)
        assert REGISTRY.get_sample_value("kvgate_bridge_gaps_total", {"node": node_id, "outcome": "repaired"}) == 1
    eng.pub.close()


async def test_unreplayable_gap_clears_and_rebuilds_from_the_buffer(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id, buffer_batches=2)
    a, b, c = tokens(0, 2), tokens(4000, 2), tokens(8000, 1)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.publish([stored([1, 2], a)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 2))
        eng.pub.drop_next(3)
        eng.pub.publish([stored([10], b[:16])])  # lost, and pushed out of the buffer
        eng.pub.publish([stored([11], b[16:], parent=10)])  # lost, and pushed out of the buffer
        eng.pub.publish([stored([12], tokens(9000, 1), parent=11)])  # lost, still replayable
        eng.pub.publish([stored([20], c)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(c)), 1), what="rebuilt")
        # a is still cached by the engine but unknowable after the reset: under-reported, never
        # wrong; 12 chains to a parent we never saw: dropped
        assert await held(directory, node_id, keys_of(a)) == 0
        assert await held(directory, node_id, keys_of(b)) == 0
        s = bridge.stats(node_id)
        assert (s.gaps_unrecoverable, s.dropped_blocks, s.tracked_blocks) == (1, 1, 1)
    eng.pub.close()


async def test_malformed_batch_is_skipped_and_the_bridge_goes_on(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id)
    prompt = tokens(0, 2)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.publish_raw(b"\xc1\x00garbage")
        eng.pub.publish_raw(encode_batch([])[:3])  # truncated
        eng.pub.publish([stored([1, 2], prompt), BlockRemoved(block_hashes=["bad"])])  # type: ignore[list-item]
        await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), 2))
        s = bridge.stats(node_id)
        assert (s.malformed_batches, s.rejected_events, s.gaps_repaired) == (2, 1, 0)
        assert REGISTRY.get_sample_value("kvgate_bridge_malformed_batches_total", {"node": node_id}) == s.malformed_batches
    eng.pub.close()


async def test_engine_block_size_mismatch_is_flagged_and_the_node_routed_by_load(
    directory: Directory, node_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine whose block size differs from kvgate's (vLLM forces 64 for MLA models) has every
    block dropped: before, silently (a counter); now the bridge learns the engine's size from its
    events, logs the node and both sizes, exports them and marks the node degraded (its entries
    dropped, so it is chosen by load alone) while it stays live."""
    eng = Engine(node_id)
    a = tokens(0, 2)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.publish([stored([1, 2], a)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 2))
        eng.pub.publish([BlockStored(block_hashes=[3], parent_block_hash=None, token_ids=tokens(500, 4), block_size=64)])
        await eventually(lambda: _true(bridge.stats(node_id).degraded != ""), what="node degraded")
        s = bridge.stats(node_id)
        assert s.engine_block_size == 64 and "block_size" in s.degraded
        assert REGISTRY.get_sample_value("kvgate_bridge_engine_block_size", {"node": node_id}) == 64
        assert REGISTRY.get_sample_value("kvgate_bridge_node_degraded", {"node": node_id, "reason": "block_size"}) == 1
        assert any(node_id in r.message and "64" in r.message and "16" in r.message for r in caplog.records)
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 0), what="entries dropped")
        assert await live(directory, node_id)  # still routed, by load
        ready = await readyz(directory, bridge)
        assert ready["ready"] and "engine block size 64, configured 16" in ready["degraded_nodes"][node_id]
        eng.pub.publish([stored([4], tokens(900, 1))])  # a right-sized block changes nothing now
        await asyncio.sleep(0.2)
        assert await held(directory, node_id, keys_of(tokens(900, 1))) == 0
    eng.pub.close()


async def test_engines_whose_pub_connects_to_the_collector_are_followed_by_topic(directory: Directory, node_id: str) -> None:
    """vLLM binds its PUB only for ``tcp://*:P``; given ``tcp://kvgate:P`` it connects. The bridge
    then binds one collector socket and tells engines apart by topic ``kv@<address>@<model>``
    (or ``kv@<host>@<model>``, as in ``kv@$(POD_IP)@model``); replay still goes to each engine.
    A topic naming no configured node is counted and ignored: nobody registers a node by sending."""
    collector = f"tcp://127.0.0.1:{free_port()}"
    a_addr, b_addr = f"127.0.0.1:{free_port()}", "127.0.0.2:8000"
    pubs = {
        "a": KVEventPublisher(collector, connect=True, topic=f"kv@{a_addr}@{MODEL}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}"),
        # b's engine lives at 127.0.0.2: its PUB connects from there (the collector checks)
        "b": KVEventPublisher(f"tcp://127.0.0.2:0;{collector.removeprefix('tcp://')}", connect=True, topic=f"kv@127.0.0.2@{MODEL}",
                              replay_endpoint=f"tcp://127.0.0.1:{free_port()}"),
        "x": KVEventPublisher(collector, connect=True, topic=f"kv@10.9.9.9:1@{MODEL}"),
    }  # fmt: skip
    ids = {"a": node_id + "-a", "b": node_id + "-b"}
    specs = [
        EngineSpec(ids["a"], a_addr, COLLECTOR, replay=pubs["a"].replay_endpoint),
        EngineSpec(ids["b"], b_addr, COLLECTOR, replay=pubs["b"].replay_endpoint),
    ]
    history, a, b = tokens(0, 2), tokens(3000, 1), tokens(6000, 2)
    pubs["a"].publish([stored([1, 2], history)])  # before the bridge: reaches it through replay
    unknown_before = REGISTRY.get_sample_value("kvgate_bridge_unknown_topic_messages_total") or 0.0
    for n in ids.values():  # the static fleet's health checks register them (the keeper's job)
        await directory.register_node(NodeInfo(n, a_addr if n.endswith("-a") else b_addr, model=MODEL))
    bridge = KVEventBridge(directory, specs, model=MODEL, block_size=BS, heartbeat_interval_s=0.2, collector=collector)
    await bridge.start()
    try:
        while bridge.stats(ids["a"]).next_seq is None or bridge.stats(ids["b"]).next_seq is None:
            for p in pubs.values():  # until each connection has joined
                p.publish([])
            await asyncio.sleep(0.05)
        pubs["a"].publish([stored([3], a)])
        pubs["b"].publish([stored([4, 5], b)])
        await eventually(lambda: _eq(held(directory, ids["a"], keys_of(history)), 2), what="a's history")
        await eventually(lambda: _eq(held(directory, ids["a"], keys_of(a)), 1), what="a's live block")
        await eventually(lambda: _eq(held(directory, ids["b"], keys_of(b)), 2), what="b's blocks")
        assert await held(directory, ids["b"], keys_of(a)) == 0

        async def unknown_counted() -> bool:
            pubs["x"].publish([stored([9], tokens(9000, 1))])
            return REGISTRY.get_sample_value("kvgate_bridge_unknown_topic_messages_total") > unknown_before

        await eventually(unknown_counted, what="unknown topic counted")
        assert {n.node_id for n in await directory.live_nodes()} == set(ids.values())
    finally:
        await bridge.aclose(deregister=False)
        for p in pubs.values():
            p.close()


async def readyz(directory: Directory, bridge: KVEventBridge) -> dict:
    """The admin app's ``/readyz`` over real HTTP, with this bridge in its fleet monitor."""
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.admin import build_admin_app
    from gateway.fleet_status import FleetMonitor

    app = build_admin_app(directory, monitor=FleetMonitor(directory, bridges=lambda: [bridge]))
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/readyz")
        return await r.json()


async def test_dead_engine_stops_being_returned_within_the_ttl(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id)
    a, b = tokens(0, 2), tokens(6000, 1)
    async with make_bridge(directory, eng) as bridge:
        await connected(bridge, directory, node_id)
        eng.pub.publish([stored([1, 2], a)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 2))
        eng.pub.close()  # the engine's sockets go away, as on kill -9
        gone_after = await eventually(lambda: _not(live(directory, node_id)), timeout=3.0, what="node expired")
        assert gone_after < 1.0 + 0.5  # the memory directory's TTL is 1 s
        assert await held(directory, node_id, keys_of(a)) == 0
        # the engine comes back (a restart: empty cache, fresh sequence)
        eng.pub = eng.start()
        eng.pub.publish([stored([7], b)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(b)), 1), what="node back")
        assert await held(directory, node_id, keys_of(a)) == 0  # cleared on reconnect
    eng.pub.close()


async def _not(value: Awaitable[bool]) -> bool:
    return not await value


class FlakyDirectory:
    """A real directory behind a switch that makes every call fail as an outage would."""

    def __init__(self, inner: Directory) -> None:
        self.inner = inner
        self.down = False

    def __getattr__(self, name: str) -> object:
        target = getattr(self.inner, name)

        async def call(*args: object, **kw: object) -> object:
            if self.down:
                raise DirectoryUnavailable("switched off")
            return await target(*args, **kw)

        return call


async def test_directory_outage_is_survived_and_the_node_rewritten(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id)
    flaky = FlakyDirectory(directory)
    a, b = tokens(0, 3), tokens(2000, 2)
    async with make_bridge(flaky, eng) as bridge:  # type: ignore[arg-type]
        await connected(bridge, directory, node_id)
        eng.pub.publish([stored([1, 2, 3], a)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(a)), 3))
        flaky.down = True
        eng.pub.publish([BlockRemoved(block_hashes=[3])])
        eng.pub.publish([stored([4, 5], b)])
        await eventually(lambda: _true(bridge.stats(node_id).directory_errors > 0))
        await asyncio.sleep(0.3)
        flaky.down = False
        await eventually(lambda: _eq(held(directory, node_id, keys_of(b)), 2), what="rewritten after the outage")
        assert await held(directory, node_id, keys_of(a)) == 2
        assert bridge.stats(node_id).tracked_blocks == 4
    eng.pub.close()


async def test_one_bridge_follows_several_engines(directory: Directory, node_id: str) -> None:
    engines = [Engine(f"{node_id}-{i}") for i in range(3)]
    prompt = tokens(0, 3)
    async with make_bridge(directory, *engines) as bridge:
        for e in engines:
            await connected(bridge, directory, e.node_id)
        for i, e in enumerate(engines):
            e.pub.publish([stored([1, 2, 3][: i + 1], prompt[: (i + 1) * BS])])
        for i, e in enumerate(engines):
            await eventually(lambda e=e, i=i: _eq(held(directory, e.node_id, keys_of(prompt)), i + 1))
    for e in engines:
        e.pub.close()


async def test_bridge_with_redis(redis_url: str, key_prefix: str, node_id: str) -> None:
    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=2.0, index_stride=1)
    eng = Engine(node_id)
    prompt = tokens(0, 4)
    try:
        async with make_bridge(directory, eng) as bridge:
            await connected(bridge, directory, node_id)
            eng.pub.publish([stored([1, 2, 3, 4], prompt)])
            await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), 4))
            eng.pub.publish([BlockRemoved(block_hashes=[2])])
            await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), 1))
            eng.pub.publish([AllBlocksCleared()])
            await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), 0))
        assert not await live(directory, node_id)
    finally:
        eng.pub.close()
        await directory.aclose()


async def test_kvgate_bridge_command(redis_url: str, key_prefix: str, node_id: str) -> None:
    """The real command in its own process: follows an engine, deregisters on SIGTERM."""
    eng = Engine(node_id)
    prompt = tokens(0, 2)
    eng.pub.publish([stored([1, 2], prompt)])
    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=3.0, index_stride=1)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "bridge",
        "--directory", redis_url, "--key-prefix", key_prefix, "--index-stride", "1",
        "--model", MODEL, "--heartbeat-ttl", "3",
        "--engine", f"node_id={node_id},address=127.0.0.1:9,events={eng.events},replay={eng.replay}",
        cwd=REPO, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await eventually(lambda: _eq(held(directory, node_id, keys_of(prompt)), 2), timeout=15, what="bridge process")
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()
        assert not await live(directory, node_id)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        eng.pub.close()
        await directory.aclose()


def test_kvgate_bridge_command_rejects_bad_engine_specs() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bridge", "--model", "m", "--engine", "node_id=n1"],
        cwd=REPO, capture_output=True, text=True, timeout=30, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 2
    assert "lacks address, events" in out.stderr
