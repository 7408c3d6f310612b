"""The global prefix directory: which node holds which block, which nodes are alive, how loaded."""

from directory_client.factory import open_directory
from directory_client.memory import InProcessDirectory
from directory_client.redis_base import DirectoryConfigError
from directory_client.redis_cluster import RedisClusterDirectory
from directory_client.redis_single import RedisDirectory
from directory_client.types import (
    Directory,
    DirectoryUnavailable,
    DirectoryView,
    NodeInfo,
    NodeLoad,
    NodeView,
    Reservation,
    ReservationConflict,
    Tier,
    UnknownNode,
    WriterLease,
)

__all__ = [
    "Directory",
    "DirectoryConfigError",
    "DirectoryUnavailable",
    "DirectoryView",
    "InProcessDirectory",
    "NodeInfo",
    "NodeLoad",
    "NodeView",
    "RedisClusterDirectory",
    "RedisDirectory",
    "Reservation",
    "ReservationConflict",
    "Tier",
    "UnknownNode",
    "WriterLease",
    "open_directory",
]
