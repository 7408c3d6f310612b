"""Kubernetes discovery, wired: list, then watch from the list's resource version, and after every
change hand the ready nodes to ``FleetMembership``.

The loop follows the API's contract for clients: a watch that ends normally (its
``timeoutSeconds`` ran out) resumes from the last resource version seen, bookmarks included;
a 410 Gone (the version was compacted away) lists again, which replaces the whole set, so a
pod deleted while we were not watching disappears too; any other failure (API server down,
RBAC, network) is retried with capped exponential backoff while the last known fleet stays
in place: an API outage must not empty the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.discovery.kube_api import ApiError, KubeApi
from gateway.discovery.membership import FleetMembership
from gateway.discovery.objects import Endpoint, endpoints_of_pod, endpoints_of_slice
from gateway.discovery.reconcile import PortPlan, WatchedSet, WatchExpired, WatchFailed, ready_nodes

log = logging.getLogger("kvgate.discovery")


@dataclass(frozen=True, slots=True)
class WatchTarget:
    """What to list and watch: an API path, a label selector, and how to read the objects."""

    path: str
    label_selector: str
    parse: Callable[[Mapping[str, Any]], list[Endpoint]]

    @classmethod
    def endpoint_slices(cls, namespace: str, *, service: str = "", label_selector: str = "") -> WatchTarget:
        selector = label_selector or f"kubernetes.io/service-name={service}"
        return cls(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", selector, endpoints_of_slice)

    @classmethod
    def pods(cls, namespace: str, *, label_selector: str) -> WatchTarget:
        return cls(f"/api/v1/namespaces/{namespace}/pods", label_selector, endpoints_of_pod)


class KubernetesDiscovery:
    """Keeps ``membership`` equal to the ready pods ``target`` selects (see the module doc)."""

    def __init__(
        self,
        api: KubeApi,
        target: WatchTarget,
        plan: PortPlan,
        membership: FleetMembership,
        *,
        watch_timeout_s: int = 240,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.api = api
        self.target = target
        self.plan = plan
        self.membership = membership
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.state = WatchedSet(target.parse)
        self.synced = asyncio.Event()  # set after the first successful list
        self.lists = 0  # how many times we listed (1 + re-lists); for tests and logs
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.membership.start()
        self._task = asyncio.create_task(self._run(), name="kubernetes-discovery")

    async def _sync(self) -> None:
        await self.membership.update(ready_nodes(self.state.endpoints(), self.plan))

    async def _list(self) -> None:
        listing = await self.api.list(self.target.path, {"labelSelector": self.target.label_selector})
        self.state.replace(listing)
        self.lists += 1
        await self._sync()
        self.synced.set()

    async def _watch(self) -> None:
        """One watch request, applied event by event; returns when the server ends it."""
        events = self.api.watch(
            self.target.path,
            {"labelSelector": self.target.label_selector},
            self.state.resource_version,
            timeout_s=self.watch_timeout_s,
        )
        async for event in events:
            if self.state.apply(event):
                await self._sync()

    async def _run(self) -> None:
        delay = self.backoff_s
        must_list = True
        while True:
            try:
                if must_list:
                    await self._list()
                    must_list = False
                await self._watch()
                delay = self.backoff_s
            except WatchExpired as e:
                log.info("watch of %s expired (%s); listing again", self.target.path, e)
                must_list = True
            except (ApiError, WatchFailed, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                log.warning("kubernetes discovery: %s; retrying in %.1fs (the fleet stays as it was)", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                must_list = must_list or isinstance(e, WatchFailed)
            except Exception:  # a supervisor must outlive surprises: log, back off, start from a fresh list
                log.exception("kubernetes discovery failed unexpectedly; listing again in %.1fs", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                must_list = True

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.membership.aclose()
        await self.api.aclose()
