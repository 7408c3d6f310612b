"""``open_directory(url)``: the one place that maps a URL to a backend."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

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
    tls_ca_file: str = "",
    tls_cert_file: str = "",
    tls_key_file: str = "",
    shard_timeout_s: float | None = None,
    username: str = "",
    password: str = "",
    **kw: Any,
) -> Directory:
    """A directory for ``url``; nothing connects until the first call.

    ``memory://`` → in-process (one gateway replica); ``redis://host:port/db`` or ``rediss://``
    → one Redis; ``redis+cluster://host:port[,host:port…]`` → Redis Cluster. Extra keywords:
    ``max_request_s`` (reservations older than this are dropped: a replica that died
    mid-request cannot leave a node looking busy), ``dead_node_retention_s`` (how long a dead
    node's blocks are kept in case it comes back), ``live_cache_s`` (cluster only), ``clock``
    (memory only). ``tls_*``: PEM files for ``rediss://`` (the CA to verify the server; a client
    certificate and key when the server requires one). ``shard_timeout_s`` (cluster only; other
    backends ignore it): how long a lookup waits for one shard before leaving its nodes out.
    ``username``/``password``: Redis ACL credentials kept out of the URL (a per-role user; a
    password alone authenticates the default user); a URL carrying credentials is then refused.
    """
    stride = DEFAULT_INDEX_STRIDE if index_stride is None else index_stride
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        return InProcessDirectory(heartbeat_ttl_s=heartbeat_ttl_s, index_stride=stride, **kw)
    common: dict[str, Any] = dict(
        key_prefix=key_prefix, heartbeat_ttl_s=heartbeat_ttl_s, index_stride=stride, op_timeout_s=op_timeout_s
    )
    options = tls_options(url, ca_file=tls_ca_file, cert_file=tls_cert_file, key_file=tls_key_file)
    options.update(credentials(url, username, password))
    if options:
        common["connection_options"] = options
    if scheme in ("redis", "rediss", "unix"):
        return RedisDirectory.from_url(url, **common, **kw)
    if scheme in ("redis+cluster", "rediss+cluster"):
        return RedisClusterDirectory.from_url(url, **common, shard_timeout_s=shard_timeout_s, **kw)
    raise ValueError(f"unknown directory URL {url!r}: use memory://, redis://host:port/db or redis+cluster://host:port,…")


def tls_options(url: str, *, ca_file: str = "", cert_file: str = "", key_file: str = "") -> dict[str, str]:
    """redis-py's TLS keywords for the given PEM files; only a TLS URL may carry them."""
    opts = {k: v for k, v in (("ssl_ca_certs", ca_file), ("ssl_certfile", cert_file), ("ssl_keyfile", key_file)) if v}
    if opts and not urlsplit(url).scheme.startswith("rediss"):
        raise ValueError(f"TLS files given for {redact_url(url)!r}: use rediss:// (or rediss+cluster://) to connect with TLS")
    return opts


def credentials(url: str, username: str, password: str) -> dict[str, str]:
    """redis-py's ``username``/``password`` keywords; only for a URL without credentials of its own."""
    if not username and not password:
        return {}
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise ValueError(f"{redact_url(url)!r} carries credentials and a username/password is set too: give them once")
    return {k: v for k, v in (("username", username), ("password", password)) if v}


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: directory URLs are logged, passwords must not be."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
