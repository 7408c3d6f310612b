"""``open_directory(url)``: the one place that maps a URL to a backend."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from directory_client.memory import InProcessDirectory
from directory_client.redis_cluster import RedisClusterDirectory
from directory_client.redis_single import RedisDirectory
from directory_client.sampling import DEFAULT_INDEX_STRIDE
from directory_client.types import Directory


def open_directory(
    url: str,
    *,
    key_prefix: str = "kvgate",
    heartbeat_ttl_s: float = 10.0,
    index_stride: int | None = None,
    op_timeout_s: float = 0.5,
    **kw: Any,
) -> Directory:
    """A directory for ``url``; nothing connects until the first call.

    ``memory://`` → in-process (one gateway replica); ``redis://host:port/db`` or ``rediss://``
    → one Redis; ``redis+cluster://host:port[,host:port…]`` → Redis Cluster. Extra keywords:
    ``max_request_s`` (reservations older than this are dropped: a replica that died
    mid-request cannot leave a node looking busy), ``dead_node_retention_s`` (how long a dead
    node's blocks are kept in case it comes back), ``live_cache_s`` (cluster only), ``clock``
    (memory only).
    """
    stride = DEFAULT_INDEX_STRIDE if index_stride is None else index_stride
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return InProcessDirectory(heartbeat_ttl_s=heartbeat_ttl_s, index_stride=stride, **kw)
    common = dict(key_prefix=key_prefix, heartbeat_ttl_s=heartbeat_ttl_s, index_stride=stride, op_timeout_s=op_timeout_s)
    if scheme in ("redis", "rediss", "unix"):
        return RedisDirectory.from_url(url, **common, **kw)
    if scheme in ("redis+cluster", "rediss+cluster"):
        return RedisClusterDirectory.from_url(url, **common, **kw)
    raise ValueError(f"unknown directory URL {url!r}: use memory://, redis://host:port/db or redis+cluster://host:port,…")
