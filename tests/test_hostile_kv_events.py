"""KV-event input is untrusted: whatever arrives on the ZMQ socket, the bridge neither crashes nor
records a block it was not told about, and a flood is absorbed in bounded memory.

What an operator sees: malformed, oversized and junk batches are dropped and counted
(``kvgate_bridge_malformed_batches_total``, ``..._rejected_events_total``), the good batches
around them are applied, and after a flood the directory matches the engine.
"""

from __future__ import annotations

import asyncio
import resource
from collections import Counter

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import threading

import zmq
from prometheus_client import REGISTRY

from directory_client import open_directory
from directory_client.types import Directory
from tests.conftest import free_port
from tests.test_bridge import MODEL, Engine, connected, eventually, held, keys_of, live, make_bridge, stored, tokens
from workers.bridge import EngineSpec, KVEventBridge
from workers.kv_events import BlockRemoved, KVEventDecodeError, KVEventPublisher, decode_batch, encode_batch, encode_seq

CASES: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print(f"\nfuzzed decode_batch: {sum(CASES.values())} cases; {dict(CASES)}")


def _decode(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except KVEventDecodeError:
        CASES["refused"] += 1
        return
    CASES["decoded" if not batch.rejected else "decoded with dropped events"] += 1
    assert all(isinstance(r, str) for r in batch.rejected)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
    max_leaves=40,
)
event_like = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Bogus"])}, optional={
        "block_hashes": msgpack_values, "parent_block_hash": msgpack_values, "token_ids": msgpack_values,
        "block_size": msgpack_values, "medium": msgpack_values, "group_idx": msgpack_values, "lora_name": msgpack_values,
    }),  # fmt: skip
    st.lists(msgpack_values, max_size=10).map(lambda xs: ["BlockStored", *xs]),
    st.lists(msgpack_values, max_size=4).map(lambda xs: ["BlockRemoved", *xs]),
    msgpack_values,
)
FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(payload=st.binary(max_size=300))
def test_random_bytes_never_crash_the_decoder(payload: bytes) -> None:
    _decode(payload)


@FUZZ
@given(
    ts=st.one_of(st.floats(allow_nan=False), st.integers(min_value=-(2**63), max_value=2**64 - 1), msgpack_values),
    events=st.lists(event_like, max_size=6),
    rank=st.one_of(st.none(), st.integers(min_value=0, max_value=64), msgpack_values),
)
def test_malformed_batches_are_refused_or_trimmed(ts, events, rank) -> None:
    _decode(msgpack.packb([ts, events, rank], use_bin_type=True))


async def test_bad_batches_are_dropped_and_counted_good_ones_applied(node_id: str) -> None:
    directory = open_directory("memory://", heartbeat_ttl_s=5.0, index_stride=1)
    eng = Engine(node_id)
    first, second = tokens(0, 2), tokens(5000, 2)
    try:
        async with make_bridge(directory, eng, max_batch_bytes=64 << 10) as bridge:
            await connected(bridge, directory, node_id)
            eng.pub.publish([stored([1, 2], first)])
            eng.pub.publish_raw(b"\xc1 not msgpack")
            eng.pub.publish_raw(msgpack.packb({"no": "batch"}))
            eng.pub.publish_raw(encode_batch([stored(list(range(10, 10 + 2000)), tokens(100, 2000))]))  # ~700 KB: over the cap
            eng.pub.publish_raw(msgpack.packb([1.0, [["BlockStored", [3], None, [-1] * 16, 16], {"type": "Nope"}, 7]]))
            eng.pub.publish([stored([21, 22], second)])
            await eventually(lambda: _eq(held(directory, node_id, keys_of(second)), 2), what="batch after the junk applied")
            stats = bridge.stats(node_id)
            # a batch we cannot read may have removed blocks: what was known before it is dropped
            # (the node is routed by load for it) rather than claimed without proof
            assert await held(directory, node_id, keys_of(first)) == 0
            assert stats.malformed_batches == 3  # not msgpack, not a batch, over the size cap
            assert stats.resets >= 3 and REGISTRY.get_sample_value(
                "kvgate_bridge_node_resets_total", {"node": node_id, "reason": "malformed"}
            ) == 3
            assert stats.rejected_events == 3  # negative token IDs, unknown type, not an event
            assert stats.tracked_blocks == 2  # nothing of the junk was recorded
            assert await held(directory, node_id, keys_of(tokens(100, 2))) == 0
    finally:
        eng.pub.close()
        await directory.aclose()


async def _eq(value, expected: int) -> bool:
    return await value == expected


async def test_a_flood_of_events_is_absorbed_in_bounded_memory(redis_url: str, key_prefix: str, node_id: str) -> None:
    """20,000 batches as fast as the publisher can send them, each storing one block and evicting
    the one stored 256 batches earlier (a cache of 256 blocks churning), into a real Redis: the
    bridge keeps up through ZMQ's bounded queue and its per-key folding, its map never holds more
    than the engine does, and afterwards the directory holds exactly the engine's last 256."""
    directory: Directory = open_directory(redis_url, key_prefix=key_prefix, heartbeat_ttl_s=5.0, index_stride=1)
    eng = Engine(node_id, buffer_batches=30_000)
    n, window = 20_000, 256
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        async with make_bridge(directory, eng) as bridge:
            await connected(bridge, directory, node_id)
            peak = 0
            for i in range(n):
                events = [stored([1_000_000 + i], tokens(i * 16, 1))]
                if i >= window:
                    events.append(BlockRemoved(block_hashes=[1_000_000 + i - window]))
                eng.pub.publish(events)
                if i % 1000 == 0:
                    peak = max(peak, bridge.stats(node_id).tracked_blocks)
                    await eventually(lambda: _true(True))  # let the bridge run between bursts

            last = [keys_of(tokens(i * 16, 1))[0] for i in range(n - window, n)]

            async def caught_up() -> bool:
                return bridge.stats(node_id).next_seq == n and all(
                    [await held(directory, node_id, [k]) for k in last[:: window // 16]]
                )

            took = await eventually(caught_up, timeout=60, what="flood applied")
            stats = bridge.stats(node_id)
            print(f"\nflood of {n} batches: caught up {took:.1f} s after the last one; gaps repaired {stats.gaps_repaired}, "
                  f"peak tracked blocks {max(peak, stats.tracked_blocks)}")  # fmt: skip
            assert stats.tracked_blocks == window
            assert max(peak, stats.tracked_blocks) <= window + 1
            evicted = [keys_of(tokens(i * 16, 1))[0] for i in range(0, n - window, 997)]
            assert not any([await held(directory, node_id, [k]) for k in evicted])
    finally:
        eng.pub.close()
        await directory.aclose()
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grew_mib < 200, grew_mib


class HostileReplay:
    """A replay ROUTER that answers garbage, or nothing at all, until told to behave (then it
    answers an empty history, in current vLLM's form)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.requests = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            if not self._sock.poll(50):
                continue
            ident, *_ = self._sock.recv_multipart()
            self.requests += 1
            if self.mode == "garbage":
                self._sock.send_multipart([ident, b"", b"\x00" * 3, b"junk", b"more", b"frames"])
                self._sock.send_multipart([ident, b"", b"bad-seq", b"payload"])
            elif self.mode == "good":
                self._sock.send_multipart([ident, b"", b"", encode_seq(-1), b""])
            # "silent": never answers

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.mark.parametrize("mode", ["garbage", "silent"])
async def test_a_replay_socket_that_answers_garbage_or_never_degrades_the_node(node_id: str, mode: str) -> None:
    """What an operator sees: the node stays live and is routed by load only (its entries
    withheld), ``kvgate_bridge_replay_failures_total`` and ``kvgate_bridge_node_degraded`` say
    why, the bridge keeps consuming events, and once the replay socket answers again the node's
    entries come back. Never a crash, never a stall."""
    directory = open_directory("memory://", heartbeat_ttl_s=5.0, index_stride=1)
    replay = HostileReplay(mode)
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    pub.publish([stored([1], tokens(0, 1))])  # history the bridge will try to replay
    spec = EngineSpec(node_id=node_id, address="127.0.0.1:9", events=pub.endpoint, replay=replay.endpoint)
    bridge = KVEventBridge(
        directory, [spec], model=MODEL, block_size=16, heartbeat_interval_s=0.2, replay_timeout_s=0.3,
        replay_retry_s=0.5,
    )  # fmt: skip
    a = tokens(1000, 2)
    try:
        await bridge.start()
        await eventually(lambda: _true(bridge.stats(node_id).degraded.startswith("replay")), what="degraded")
        await eventually(lambda: live(directory, node_id), what="live, routed by load")
        pub.publish([stored([2, 3], a)])
        await eventually(lambda: _true(bridge.stats(node_id).tracked_blocks == 2), what="events still consumed")
        await asyncio.sleep(0.3)
        assert await held(directory, node_id, keys_of(a)) == 0  # withheld: routed by load
        reason = "garbage" if mode == "garbage" else "timeout"
        assert REGISTRY.get_sample_value("kvgate_bridge_replay_failures_total", {"node": node_id, "reason": reason}) >= 1
        assert REGISTRY.get_sample_value("kvgate_bridge_node_degraded", {"node": node_id, "reason": "replay"}) == 1
        replay.mode = "good"
        b = tokens(5000, 2)
        while bridge.stats(node_id).degraded:  # live events make the bridge try again
            pub.publish([stored([4, 5], b)])
            await asyncio.sleep(0.2)
        pub.publish([stored([6, 7], b)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(b)), 2), what="entries back")
        assert REGISTRY.get_sample_value("kvgate_bridge_node_degraded", {"node": node_id, "reason": "replay"}) == 0
    finally:
        await bridge.aclose()
        pub.close()
        replay.close()
        await directory.aclose()


async def _true(value: bool) -> bool:
    return value


@pytest.fixture
def node_id(key_prefix: str) -> str:
    return "hostile-" + key_prefix.rsplit(":", 1)[-1]


class SlowReplay:
    """A replay ROUTER that answers a real history, one batch every ``gap_s``: slow, but never
    silent for as long as the bridge's replay timeout (a busy gateway reading a full buffer)."""

    def __init__(self, batches: list[bytes], gap_s: float) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._batches, self._gap_s = batches, gap_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            ident, _, start = self._sock.recv_multipart()
            for seq in range(int.from_bytes(start, "big", signed=True), len(self._batches)):
                if self._stop.wait(self._gap_s):
                    return
                self._sock.send_multipart([ident, b"", b"topic", encode_seq(seq), self._batches[seq]])
            self._sock.send_multipart([ident, b"", b"", encode_seq(-1), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


async def test_a_slow_replay_that_keeps_answering_is_applied_whole(node_id: str) -> None:
    """A bridge catching up reads the engine's buffer batch by batch; each batch arrives within
    the replay timeout (0.3 s) but the whole takes ~1 s. Before: the timeout bounded the whole
    answer, so the replay "timed out", the node was degraded (its entries withheld, routed by
    load) until some later event made the bridge try again — and a quiet engine never sends one.
    Now each batch gets the timeout, the whole answer 15 of them: the history is applied."""
    directory = open_directory("memory://", heartbeat_ttl_s=5.0, index_stride=1)
    history = [encode_batch([stored([i + 1], tokens(1000 * i, 1))]) for i in range(10)]
    replay = SlowReplay(history, gap_s=0.1)
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    spec = EngineSpec(node_id=node_id, address="127.0.0.1:9", events=pub.endpoint, replay=replay.endpoint)
    bridge = KVEventBridge(directory, [spec], model=MODEL, block_size=16, heartbeat_interval_s=0.2, replay_timeout_s=0.3)
    try:
        await bridge.start()
        await eventually(lambda: _true(bridge.stats(node_id).tracked_blocks == 10), timeout=5, what="history applied")
        assert not bridge.stats(node_id).degraded
        await eventually(lambda: _eq(held(directory, node_id, keys_of(tokens(9000, 1))), 1), what="written")
    finally:
        await bridge.aclose()
        pub.close()
        replay.close()
        await directory.aclose()
