"""KV transfer between nodes: serve the blocks a node holds, pull blocks from a peer (README.md)."""

from workers.transfer.agent import AgentStats, BlockHolder, PulledBlocks, TransferAgent
from workers.transfer.backend import BACKENDS, ReadOp, TransferBackend, TransferError, make_backend
from workers.transfer.payload import BlockCorrupt, block_payload, slot_bytes, verify_slot
from workers.transfer.slots import SlotTable

__all__ = [
    "BACKENDS", "AgentStats", "BlockCorrupt", "BlockHolder", "PulledBlocks", "ReadOp", "SlotTable",
    "TransferAgent", "TransferBackend", "TransferError", "block_payload", "make_backend", "slot_bytes", "verify_slot",
]
