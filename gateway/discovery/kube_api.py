"""The two Kubernetes API calls discovery needs (list, watch), over aiohttp. Deliberately thin.

In a pod the API server is ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, trusted
through the service account's CA, and called with its token. The token file is read again on
every request because projected tokens rotate (the kubelet rewrites the file, about hourly).

A watch answers one JSON object per line for as long as ``timeoutSeconds``. Lines are split by
hand rather than with ``readline`` because a single object can exceed aiohttp's line limit.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from gateway.discovery.reconcile import GONE, WatchExpired

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ApiError(Exception):
    """The API server refused a request (RBAC, a bad selector, a server error)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def in_cluster_url() -> str:
    """The API server address Kubernetes injects into every pod."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise RuntimeError("not running in a pod (KUBERNETES_SERVICE_HOST is unset); set discovery.kubernetes.api_server")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def pod_namespace(sa_dir: Path = SA_DIR) -> str:
    """The namespace this pod runs in, from its service account."""
    try:
        return (sa_dir / "namespace").read_text().strip()
    except OSError:
        raise RuntimeError("no namespace given and none in the service account; set discovery.kubernetes.namespace") from None


class KubeApi:
    """List and watch one kind of object; owns its HTTP session."""

    def __init__(self, base_url: str, *, token_file: str | Path | None = None, ca_file: str | Path | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._token_file = Path(token_file) if token_file else None
        ssl_ctx: ssl.SSLContext | bool = True
        if ca_file and Path(ca_file).exists():
            ssl_ctx = ssl.create_default_context(cafile=str(ca_file))
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx))

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_file is not None and self._token_file.exists():
            headers["Authorization"] = f"Bearer {self._token_file.read_text().strip()}"
        return headers

    async def list(self, path: str, params: Mapping[str, str], *, timeout_s: float = 30.0) -> dict[str, Any]:
        """One list response: ``{"metadata": {"resourceVersion": …}, "items": [...]}``."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.get(self.base_url + path, params=dict(params), headers=self._headers(), timeout=timeout) as resp:
            if resp.status != 200:
                raise ApiError(resp.status, (await resp.text())[:500])
            body: dict[str, Any] = await resp.json(content_type=None)
            return body

    async def watch(
        self, path: str, params: Mapping[str, str], resource_version: str, *, timeout_s: int
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events after ``resource_version`` until the server ends the watch (``timeout_s``).

        Raises ``WatchExpired`` when the server answers 410 Gone to the request itself (the
        in-stream 410 arrives as an ERROR event, which ``WatchedSet.apply`` turns into the same).
        """
        query = {**params, "watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(timeout_s)}  # fmt: skip
        # sock_read guards against a silently dead connection; the server writes at least a bookmark a minute
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s + 60)
        async with self._session.get(self.base_url + path, params=query, headers=self._headers(), timeout=timeout) as resp:
            if resp.status == GONE:
                raise WatchExpired((await resp.text())[:500])
            if resp.status != 200:
                raise ApiError(resp.status, (await resp.text())[:500])
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
            if buffer.strip():
                yield json.loads(buffer)

    async def aclose(self) -> None:
        await self._session.close()
