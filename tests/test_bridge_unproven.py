"""A bridge that starts after the engine's replay window: what it cannot prove does not stay forever.

A first bridge writes the node, then stops (a ``kvgate serve`` restart: entries kept). While
nobody listens, the engine evicts a block and its replay buffer moves past seq 0. The new bridge
cannot tell what the old entries still mean, so it keeps them beside what it replays (the node is
*partially known*: a stale entry costs at worst one misrouted request, a wiped one every hit until
the engine stores it again) — but only for ``unproven_ttl_s``: the evicted block's removal can
never reach it (it never saw that block stored, so it cannot key its hash), and before, such an
entry stayed until the engine restarted. After the TTL the node holds exactly what the bridge has
seen. Real publisher sockets, in-process directory.
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from directory_client.types import Directory
from tests.test_bridge import Engine, _eq, connected, directory, eventually, held, keys_of, make_bridge, node_id, stored, tokens
from workers.kv_events import BlockRemoved

__all__ = ["directory", "node_id"]  # fixtures


async def test_entries_from_before_the_replay_window_expire_after_the_unproven_ttl(directory: Directory, node_id: str) -> None:
    eng = Engine(node_id, buffer_batches=2)
    old, evicted, new = tokens(0, 2), tokens(4000, 1), tokens(8000, 1)
    async with make_bridge(directory, eng) as first:
        await connected(first, directory, node_id)
        eng.pub.publish([stored([1, 2], old)])
        eng.pub.publish([stored([5], evicted)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(evicted)), 1))
        await first.aclose(deregister=False)  # as `kvgate serve` stops: the entries stay
    eng.pub.publish([stored([9], tokens(9000, 1))])  # nobody listens: the buffer (2 batches) moves past seq 0
    eng.pub.publish([BlockRemoved(block_hashes=[5], medium="GPU")])  # ... and the engine evicts a block
    async with make_bridge(directory, eng, unproven_ttl_s=1.5) as second:
        await connected(second, directory, node_id)
        eng.pub.publish([stored([20], new)])
        await eventually(lambda: _eq(held(directory, node_id, keys_of(new)), 1), what="new block written")
        assert not second.stats(node_id).authoritative
        assert REGISTRY.get_sample_value("kvgate_bridge_node_partially_known", {"node": node_id}) == 1
        # the old entries are kept for now, the evicted one too: nothing can prove it gone yet
        assert await held(directory, node_id, keys_of(old)) == 2
        assert await held(directory, node_id, keys_of(evicted)) == 1
        t0 = time.monotonic()
        await eventually(lambda: _eq(held(directory, node_id, keys_of(evicted)), 0), timeout=10, what="stale entry dropped")
        took = time.monotonic() - t0
        print(f"\nunproven entries dropped {took:.1f} s after the check began (TTL 1.5 s)")
        assert await held(directory, node_id, keys_of(old)) == 0  # unprovable too: under-reported, never stale
        assert await held(directory, node_id, keys_of(new)) == 1  # what the bridge saw stays
        assert second.stats(node_id).authoritative
        assert REGISTRY.get_sample_value("kvgate_bridge_node_partially_known", {"node": node_id}) == 0
    eng.pub.close()
