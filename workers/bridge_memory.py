"""How much memory the KV-event bridge holds per tracked engine block (``python -m workers.bridge_memory``).

Feeds a ``NodeBlockMap`` chains of 64-block prompts (distinct tokens, engine hashes as vLLM's: 64-bit
ints) and prints the bytes tracemalloc attributes to the map per block, and what that makes at the
default bound of ``max_blocks_per_node``. Each gateway replica's embedded bridge holds one map per
node it follows, writer or not.
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc

from workers.bridge import DEFAULT_MAX_BLOCKS_PER_NODE, NodeBlockMap
from workers.kv_events import BlockStored

_CHAIN = 64  # blocks per prompt


def bytes_per_block(blocks: int, *, block_size: int = 16) -> float:
    """Bytes the map holds per tracked block after storing ``blocks`` blocks (rounded down to chains)."""
    events = []
    for p in range(max(blocks // _CHAIN, 1)):
        first = p * _CHAIN
        events.append(
            BlockStored(
                block_hashes=[(first + i + 1) * 0x9E3779B97F4A7C15 % (1 << 64) for i in range(_CHAIN)],
                parent_block_hash=None,
                token_ids=[(p * 1_000_003 + i) % 100_000 for i in range(_CHAIN * block_size)],
                block_size=block_size,
                medium="GPU",
            )
        )
    m = NodeBlockMap(model="m", block_size=block_size, max_blocks=len(events) * _CHAIN)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for ev in events:
            m.apply(ev)
        m.take_changes()  # what a flush leaves: the pending-change table emptied
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held / len(m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=200_000)
    args = parser.parse_args()
    per = bytes_per_block(args.blocks)
    print(f"{per:.0f} B per tracked block ({args.blocks} blocks); at the default bound of "
          f"{DEFAULT_MAX_BLOCKS_PER_NODE:,} blocks per node: {per * DEFAULT_MAX_BLOCKS_PER_NODE / 2**20:.0f} MiB "
          f"per followed node, per replica")  # fmt: skip


if __name__ == "__main__":
    main()
