"""The global prefix directory: which node holds which block, which nodes are alive, how loaded."""

from directory_client.types import (
    Directory,
    DirectoryUnavailable,
    DirectoryView,
    NodeInfo,
    NodeLoad,
    NodeView,
    Reservation,
    Tier,
)

__all__ = [
    "Directory",
    "DirectoryUnavailable",
    "DirectoryView",
    "NodeInfo",
    "NodeLoad",
    "NodeView",
    "Reservation",
    "Tier",
]
