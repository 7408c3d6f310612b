"""The pure core of discovery: watch events in → the set of ready nodes out → what to change.

``WatchedSet`` holds the objects of one list+watch exactly as the API server would show them now
(a list replaces everything; ADDED/MODIFIED replace one object; DELETED drops it; BOOKMARK only
moves the resource version). ``ready_nodes`` turns their endpoints into serving nodes and
``diff`` says which nodes arrive, leave or were replaced. No I/O and no clock, so every
transition can be tested against recorded objects and events.

Merging rule (why): during a rollout or a slice rebalance the same pod can appear in two
EndpointSlices at once, one stale. A pod counts as ready if any record of it says so; among
several ready records the one changed last wins, because the API delivers changes in order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from directory_client.types import NodeInfo, NodeRole
from gateway.discovery.objects import Endpoint

GONE = 410


class WatchExpired(Exception):
    """The resource version we watch from is too old (HTTP 410 Gone): list again."""


class WatchFailed(Exception):
    """The API server ended the watch with an error other than 410."""


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class WatchedSet:
    """The current objects of one list+watch, and the resource version to resume from."""

    def __init__(self, parse: Callable[[Mapping[str, Any]], list[Endpoint]]) -> None:
        self._parse = parse
        self._objects: dict[str, list[Endpoint]] = {}  # insertion order = order of last change
        self.resource_version = ""

    def replace(self, listing: Mapping[str, Any]) -> None:
        """Take a list response (``{"metadata": {"resourceVersion"}, "items": [...]}``) as the truth."""
        self._objects = {}
        for item in listing.get("items") or ():
            self._objects[_key(item)] = self._parse(item)
        self.resource_version = str((listing.get("metadata") or {}).get("resourceVersion", ""))

    def apply(self, event: Mapping[str, Any]) -> bool:
        """Apply one watch event; True when the set of endpoints may have changed.

        Raises ``WatchExpired`` on a 410 ERROR event and ``WatchFailed`` on any other ERROR.
        """
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            message = obj.get("message") or obj.get("reason") or "unknown error"
            if code == GONE or obj.get("reason") in ("Expired", "Gone"):
                raise WatchExpired(message)
            raise WatchFailed(f"watch error {code}: {message}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.resource_version = str(rv)
        if kind in ("ADDED", "MODIFIED"):
            key = _key(obj)
            self._objects.pop(key, None)  # re-insert: it is now the most recently changed
            self._objects[key] = self._parse(obj)
            return True
        if kind == "DELETED":
            return self._objects.pop(_key(obj), None) is not None
        return False  # BOOKMARK, or a type a newer API server invented

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint, oldest change first."""
        return [ep for eps in self._objects.values() for ep in eps]

    def __len__(self) -> int:
        return len(self._objects)


@dataclass(frozen=True, slots=True)
class PortPlan:
    """Which ports of an engine pod kvgate uses: numbers, or names looked up per endpoint."""

    serving: int | str
    events: int | str | None = None
    replay: int | str | None = None
    transfer: int | str | None = None


def _port_number(ep: Endpoint, port: int | str | None) -> int | None:
    return port if isinstance(port, int) or port is None else ep.port(port)


@dataclass(frozen=True, slots=True)
class DiscoveredNode:
    """A ready engine pod, as the directory and the KV-event bridge need it."""

    node_id: str
    uid: str
    address: str  # ip:port Envoy routes to ([v6]:port for IPv6)
    events_endpoint: str = ""  # tcp://ip:port of its KV-event publisher; "" = it publishes none we follow
    replay_endpoint: str = ""
    transfer_endpoint: str = ""
    role: NodeRole = "both"

    def node_info(self, model: str) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id, address=self.address, transfer_endpoint=self.transfer_endpoint, model=model, role=self.role
        )


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def node_of(ep: Endpoint, plan: PortPlan) -> DiscoveredNode | None:
    """The node an endpoint stands for, or None if a port it must have is not declared on it."""
    serving = _port_number(ep, plan.serving)
    if serving is None:
        return None
    numbers = {}
    for role in ("events", "replay", "transfer"):
        wanted = getattr(plan, role)
        number = _port_number(ep, wanted)
        if wanted is not None and number is None:
            return None
        numbers[role] = number
    zmq = {r: f"tcp://{_host_port(ep.ip, n)}" if n else "" for r, n in numbers.items() if r != "transfer"}
    return DiscoveredNode(
        node_id=ep.name,
        uid=ep.uid,
        address=_host_port(ep.ip, serving),
        events_endpoint=zmq["events"],
        replay_endpoint=zmq["replay"] if zmq["events"] else "",
        transfer_endpoint=_host_port(ep.ip, numbers["transfer"]) if numbers["transfer"] else "",
        role=ep.role,
    )


def ready_nodes(endpoints: Iterable[Endpoint], plan: PortPlan) -> dict[str, DiscoveredNode]:
    """Ready endpoints as nodes by node_id (merging rule in the module doc); sorted by node_id."""
    chosen: dict[str, DiscoveredNode] = {}
    for ep in endpoints:  # oldest change first, so a later ready record overwrites an earlier one
        if not ep.ready:
            continue
        node = node_of(ep, plan)
        if node is not None:
            chosen[node.node_id] = node
    return dict(sorted(chosen.items()))


@dataclass(frozen=True, slots=True)
class FleetChange:
    """What to do to the directory so its nodes equal the discovered ones."""

    added: tuple[DiscoveredNode, ...] = ()
    removed: tuple[str, ...] = ()  # node ids: deregister (drops their entries)
    replaced: tuple[DiscoveredNode, ...] = ()  # same id, another pod or address: drop, then add anew

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.replaced)


def diff(before: Mapping[str, DiscoveredNode], after: Mapping[str, DiscoveredNode]) -> FleetChange:
    """The change from ``before`` to ``after``, each list in node_id order.

    A node whose pod uid, address or ports changed is *replaced*, not updated: a new pod starts
    with an empty KV cache, so nothing the old one held may keep counting.
    """
    return FleetChange(
        added=tuple(after[n] for n in sorted(after.keys() - before.keys())),
        removed=tuple(sorted(before.keys() - after.keys())),
        replaced=tuple(after[n] for n in sorted(after.keys() & before.keys()) if after[n] != before[n]),
    )
