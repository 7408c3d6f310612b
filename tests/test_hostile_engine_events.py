"""KV events from a hostile or broken engine, through a real ZMQ socket into a real bridge and a
real Redis (unique key prefix): what the bridge keeps of fields the engine chooses.

Before: the bridge cached the key seed of every ``lora_name`` it saw (up to 1,024 names), keeping
each name as the cache's key, whatever its length: an engine announcing 48 blocks, each under its
own 4 MiB adapter name (within the 16 MiB batch limit), kept ~192 MiB of Python objects in the
bridge's process (``kvgate serve`` when bridged in-process), held until 1,024 more names came. No gateway
request can name such an adapter (model names past 1,024 characters are refused with 404), so
the blocks were useless too. Now: blocks under a ``lora_name`` longer than that are dropped and
counted (``kvgate_bridge_dropped_blocks_total{reason="lora_name"}``), nothing of the name kept.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from directory_client import open_directory
from tests.test_bridge import Engine, connected, eventually, held, keys_of, make_bridge, node_id, stored, tokens  # noqa: F401  (node_id: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def _eq(value, expected: int) -> bool:
    return await value == expected


async def test_huge_adapter_names_from_an_engine_are_not_kept(redis_url: str, key_prefix: str, node_id: str) -> None:
    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=5.0, index_stride=1)
    eng = Engine(node_id, buffer_batches=1)  # the engine's own replay buffer must not hold them either
    good = tokens(7000, 2)
    try:
        async with make_bridge(directory, eng) as bridge:
            await connected(bridge, directory, node_id)
            gc.collect()
            tracemalloc.start()  # what Python objects keep (RSS would also count freed heap not returned)
            before = tracemalloc.get_traced_memory()[0]
            for i in range(48):
                name = f"adapter-{i}-" + "x" * (3 << 19)  # 1.5 MiB: an event over 2 MiB is rejected undecoded
                eng.pub.publish([stored([10_000 + i], tokens(100 * i, 1), lora_id=i + 1, lora_name=name)])
                del name
            eng.pub.publish([stored([1, 2], good)])
            await eventually(lambda: _eq(held(directory, node_id, keys_of(good)), 2), timeout=30, what="the good batch applied")
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            print(f"\nthe bridge keeps {grown / (1 << 20):.1f} MiB after 48 blocks under 1.5 MiB adapter names")
            stats = bridge.stats(node_id)
            assert grown < 24 << 20, f"the bridge keeps {grown >> 20} MiB of adapter names"
            assert stats.dropped_blocks == 48 and stats.tracked_blocks == 2
    finally:
        eng.pub.close()
        await directory.aclose()


async def test_the_collector_takes_a_nodes_events_only_from_the_nodes_host(redis_url: str, key_prefix: str, node_id: str) -> None:
    """With ``events_collector`` kvgate binds a SUB socket that engines' PUB sockets connect to,
    and a message's topic names its node. Before: anyone reaching the port could publish under a
    node's topic: a stranger at 127.0.0.2 claimed node ``a`` (at 127.0.0.1) held a prompt it
    never saw (recorded in Redis), then the engine's next batch, whose sequence number the
    stranger had taken, looked like a restart and cleared the node. Now: a message from a host
    other than the node's is dropped and counted (``kvgate_bridge_foreign_messages_total``),
    and the node's entries are exactly what its engine published."""
    import asyncio

    import zmq
    from prometheus_client import REGISTRY

    from directory_client.types import NodeInfo
    from tests.conftest import free_port
    from tests.test_bridge import BS, MODEL
    from workers.bridge import COLLECTOR, EngineSpec, KVEventBridge
    from workers.kv_events import KVEventPublisher, encode_batch, encode_seq

    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=5.0, index_stride=1)
    collector = f"tcp://127.0.0.1:{free_port()}"
    address = f"127.0.0.1:{free_port()}"
    topic = f"kv@{address}@{MODEL}"
    engine = KVEventPublisher(collector, connect=True, topic=topic, replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    stranger = zmq.Context.instance().socket(zmq.PUB)
    stranger.connect(f"tcp://127.0.0.2:0;{collector.removeprefix('tcp://')}")  # another host of the network
    history, forged, later = tokens(0, 2), tokens(5000, 2), tokens(9000, 1)
    await directory.register_node(NodeInfo(node_id, address, model=MODEL))
    bridge = KVEventBridge(directory, [EngineSpec(node_id, address, COLLECTOR, replay=engine.replay_endpoint)],
                           model=MODEL, block_size=BS, heartbeat_interval_s=0.2, collector=collector)  # fmt: skip
    foreign_before = REGISTRY.get_sample_value("kvgate_bridge_foreign_messages_total", {"node": node_id}) or 0.0
    await bridge.start()
    try:
        while bridge.stats(node_id).next_seq is None:
            engine.publish([])
            await asyncio.sleep(0.05)
        engine.publish([stored([1, 2], history)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(history)), 2), what="the engine's blocks")
        for _ in range(20):  # the stranger's PUB joins at some point: it sends the next sequence number
            stranger.send_multipart([topic.encode(), encode_seq(engine.next_seq), encode_batch([stored([70, 71], forged)])])
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # flushed to Redis by now
        claimed, kept = await held(directory, node_id, keys_of(forged)), await held(directory, node_id, keys_of(history))
        print(f"\nafter the stranger's messages: forged blocks held {claimed}, the engine's {kept} of 2")
        assert claimed == 0 and kept == 2, f"a stranger's messages: forged blocks held {claimed}, the engine's {kept} of 2"
        engine.publish([stored([3], later, parent=2)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(history + later)), 3), what="the engine's next batch")
        assert await held(directory, node_id, keys_of(forged)) == 0, "a stranger's claim was recorded"
        foreign = (REGISTRY.get_sample_value("kvgate_bridge_foreign_messages_total", {"node": node_id}) or 0.0) - foreign_before
        assert foreign >= 1
    finally:
        await bridge.aclose(deregister=False)
        engine.close()
        stranger.close(0)
        await directory.aclose()


def test_an_offload_announcement_of_many_blocks_is_applied_in_slices() -> None:
    """Inside ``kvgate serve`` the bridges share the decisions' event loop, and a batch of more
    than ``STEP_BLOCKS`` blocks is applied that many per turn (docs/kv-events.md). An offload copy
    announced without tokens (vLLM's CPU offloading) was applied at once: 1.8 M hashes in one
    16 MiB-bounded batch held the loop ~140 ms here on top of its decoding. Now it pauses every
    ``step`` blocks like the other events, and the result is the same."""
    import time

    from workers.bridge import KVEventBridge, NodeBlockMap
    from workers.kv_events import BlockStored

    step = KVEventBridge.STEP_BLOCKS
    n = 3 * step + 10
    stepped, whole = NodeBlockMap(model="m", block_size=16, max_blocks=10_000), NodeBlockMap(model="m", block_size=16, max_blocks=10_000)
    for m in (stepped, whole):
        m.apply(stored(list(range(1, n + 1)), tokens(0, n)))
    copy = BlockStored(block_hashes=list(range(1, n + 1)) + [999_999], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU")
    steps = stepped.apply_steps(copy, step)
    pauses = 0
    while True:
        try:
            next(steps)
            pauses += 1
        except StopIteration as done:
            result = done.value
            break
    assert pauses == n // step, f"{pauses} pauses for {n + 1} blocks, {step} a slice"
    assert result == whole.apply(copy) == ("no_tokens", 1)
    assert stepped.snapshot() == whole.snapshot()
    big = NodeBlockMap(model="m", block_size=16, max_blocks=10)
    flood = BlockStored(block_hashes=list(range(1_800_000)), parent_block_hash=None, token_ids=[], block_size=0, medium="CPU")
    longest, steps = 0.0, big.apply_steps(flood, step)
    while True:
        t0 = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            break
        finally:
            longest = max(longest, time.perf_counter() - t0)
    print(f"\nlongest uninterrupted slice of a 1.8 M-block offload announcement: {longest * 1000:.2f} ms")
    assert longest < 0.02


async def test_a_batch_near_the_size_limit_never_holds_the_event_loop(redis_url: str, key_prefix: str, node_id: str) -> None:
    """Inside ``kvgate serve`` the bridges share the decisions' event loop. An engine publishes a
    15.7 MiB batch (within the 16 MiB limit) of 360,000 one-block removals whose last event is
    malformed. Before: it was decoded in one call, and the malformed event sent the whole batch to
    the field-by-field decoder: the loop was held ~2 s at once (~0.28 s without the bad event).
    Now the batch is decoded a slice of events at a time (``EVENT_CHUNK_BYTES``), pausing
    between slices like the bridge's catch-up; the longest hold is the events' outer array
    (~35 ms), the bad event alone is dropped and counted, and the batch's removals apply."""
    import asyncio
    import time

    import msgspec

    from workers.kv_events import BlockRemoved, encode_batch

    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=5.0, index_stride=1)
    eng = Engine(node_id, buffer_batches=4)
    kept, gone = tokens(8000, 2), tokens(9000, 2)
    try:
        async with make_bridge(directory, eng) as bridge:
            await connected(bridge, directory, node_id)
            resets = bridge.stats(node_id).resets
            eng.pub.publish([stored([1, 2], kept), stored([3, 4], gone)])
            await eventually(lambda: _eq(held(directory, node_id, keys_of(gone)), 2), what="the engine's blocks applied")
            raw = msgspec.msgpack.decode(encode_batch([BlockRemoved(block_hashes=[4]), BlockRemoved(block_hashes=[3])]
                                                      + [BlockRemoved(block_hashes=[10**6 + i]) for i in range(360_000)]))  # fmt: skip
            raw[1].append({"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1], "block_size": -5})
            payload = msgspec.msgpack.encode(raw)
            longest, stop = 0.0, False

            async def ticker() -> None:  # the loop's thread's CPU time between two turns: what it did at once
                nonlocal longest  # (CPU, not wall, time: other processes on a busy machine do not count)
                last = time.thread_time()
                while not stop:
                    await asyncio.sleep(0.001)
                    now = time.thread_time()
                    longest, last = max(longest, now - last), now

            gc.collect()
            gc.freeze()  # as ``kvgate serve`` does once started (settle_heap): a full collection then walks only newer objects
            ticking = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            eng.pub.publish_raw(payload)
            await eventually(lambda: _eq(held(directory, node_id, keys_of(gone)), 0), timeout=30, what="the removals applied")
            stop = True
            await ticking
            stats = bridge.stats(node_id)
            print(f"\n{len(payload) / (1 << 20):.1f} MiB batch: the loop held at most {longest * 1000:.0f} ms of CPU at once; rejected {stats.rejected_events}")
            assert await held(directory, node_id, keys_of(kept)) == 2 and stats.rejected_events == 1 and stats.resets == resets
            assert longest < 0.15, f"the event loop was held {longest * 1000:.0f} ms at once"
    finally:
        gc.unfreeze()
        eng.pub.close()
        await directory.aclose()


async def test_an_event_over_the_size_an_event_may_take_is_dropped_and_counted(redis_url: str, key_prefix: str, node_id: str) -> None:
    """One stored event of 600,000 tokens (~3 MiB: no vLLM step stores that many) would be decoded
    in one call; it is rejected undecoded (counted in ``kvgate_bridge_rejected_events_total``) and
    its neighbours in the batch are applied."""
    from workers.kv_events import MAX_EVENT_BYTES, encode_batch

    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=5.0, index_stride=1)
    eng = Engine(node_id, buffer_batches=4)
    good, huge = tokens(100, 2), tokens(200_000, 600_000 // 16)
    try:
        async with make_bridge(directory, eng) as bridge:
            await connected(bridge, directory, node_id)
            resets = bridge.stats(node_id).resets
            payload = encode_batch([stored(list(range(10**6, 10**6 + len(huge) // 16)), huge), stored([1, 2], good)])
            assert len(payload) > MAX_EVENT_BYTES
            eng.pub.publish_raw(payload)
            await eventually(lambda: _eq(held(directory, node_id, keys_of(good)), 2), timeout=30, what="the neighbour applied")
            stats = bridge.stats(node_id)
            assert stats.rejected_events == 1 and stats.tracked_blocks == 2 and stats.resets == resets
    finally:
        eng.pub.close()
        await directory.aclose()


async def test_a_multi_homed_engine_is_heard_from_the_addresses_its_node_lists(redis_url: str, key_prefix: str, node_id: str) -> None:
    """An engine serving on 127.0.0.1 publishes to the collector from another interface's address
    (127.0.0.2). Before: its events were dropped as a stranger's, with no way to say otherwise.
    Now the node's ``events_sources: [127.0.0.2]`` (config → ``kvgate serve``'s collector bridge)
    lets them in, and a sender at any other address (127.0.0.3) is still dropped and counted."""
    import asyncio

    import zmq
    from prometheus_client import REGISTRY

    from directory_client.types import NodeInfo
    from gateway.config import load_config
    from gateway.serve_cmd import embedded_bridges
    from tests.conftest import free_port
    from tests.test_bridge import MODEL
    from workers.kv_events import KVEventPublisher, encode_batch, encode_seq

    directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=5.0, index_stride=1)
    port = free_port()
    address = f"127.0.0.1:{free_port()}"
    topic = f"kv@{address}@{MODEL}"
    cfg = load_config(fleet=[{"node_id": node_id, "address": address, "events_sources": ["127.0.0.2"]}], models=[MODEL],
                      events_collector=f"tcp://127.0.0.1:{port}", block_size=16)  # fmt: skip
    (bridge,) = embedded_bridges(cfg, directory)
    engine = KVEventPublisher(f"tcp://127.0.0.2:0;127.0.0.1:{port}", connect=True, topic=topic)  # from its other interface
    stranger = zmq.Context.instance().socket(zmq.PUB)
    stranger.connect(f"tcp://127.0.0.3:0;127.0.0.1:{port}")
    history, forged = tokens(0, 2), tokens(5000, 2)
    await directory.register_node(NodeInfo(node_id, address, model=MODEL))
    foreign_before = REGISTRY.get_sample_value("kvgate_bridge_foreign_messages_total", {"node": node_id}) or 0.0
    await bridge.start()
    try:
        for _ in range(100):
            if bridge.stats(node_id).next_seq is not None:
                break
            engine.publish([])
            await asyncio.sleep(0.05)
        engine.publish([stored([1, 2], history)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(history)), 2), what="the multi-homed engine's blocks")
        for _ in range(20):
            stranger.send_multipart([topic.encode(), encode_seq(engine.next_seq), encode_batch([stored([70, 71], forged)])])
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert await held(directory, node_id, keys_of(forged)) == 0, "a stranger's claim was recorded"
        assert (REGISTRY.get_sample_value("kvgate_bridge_foreign_messages_total", {"node": node_id}) or 0.0) > foreign_before
    finally:
        await bridge.aclose(deregister=False)
        engine.close()
        stranger.close(0)
        await directory.aclose()
