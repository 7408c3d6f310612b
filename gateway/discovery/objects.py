"""Kubernetes objects → serving endpoints. Pure: dicts exactly as the API returns them in, values out.

Two sources describe the same pods differently, and both are read here so the rest of discovery
sees one shape:

- an **EndpointSlice** (``discovery.k8s.io/v1``) lists the pods behind a Service. Readiness is
  ``conditions.ready``, where *absent means ready* (the API documents nil as "unknown, treat as
  ready"); a terminating endpoint is never ready to us even if ``ready`` says so, because it is
  draining. Ports are the Service's, by name.
- a **Pod** is ready when it runs, is not being deleted, has an IP and its ``Ready`` condition is
  ``"True"`` (a string in the API). Ports are its containers' named ports; its ``kvgate.io/role``
  label (``prefill``, ``decode``, ``both``) is its disaggregated-serving role, ``both`` without
  one. EndpointSlices carry no pod labels: their endpoints are ``both``.

Objects from a list response carry no ``kind``/``apiVersion`` (only the list does), so nothing
here relies on them. Malformed parts are skipped, never guessed: an endpoint we cannot read is
one kvgate does not route to.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from directory_client.types import ROLES, NodeRole

ROLE_LABEL = "kvgate.io/role"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One pod as one watched object reports it."""

    name: str  # pod name: becomes the node_id
    uid: str  # pod uid: a pod recreated under the same name (StatefulSet) is a new node, cache empty
    ip: str
    ready: bool
    ports: tuple[tuple[str, int], ...] = ()  # named ports, (name, number)
    role: NodeRole = "both"

    def port(self, name: str) -> int | None:
        for port_name, number in self.ports:
            if port_name == name:
                return number
        return None


def _is_ip(text: object) -> bool:
    if not isinstance(text, str):
        return False
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _named_ports(entries: Any, number_field: str) -> tuple[tuple[str, int], ...]:
    out = []
    for entry in entries or ():
        if not isinstance(entry, Mapping):
            continue
        name, number = entry.get("name"), entry.get(number_field)
        if isinstance(name, str) and name and isinstance(number, int) and 0 < number < 65536:
            out.append((name, number))
    return tuple(out)


def endpoints_of_slice(obj: Mapping[str, Any]) -> list[Endpoint]:
    """Every IP endpoint of an EndpointSlice (FQDN slices name no pod IP and are skipped)."""
    if obj.get("addressType") not in ("IPv4", "IPv6"):
        return []
    ports = _named_ports(obj.get("ports"), "port")
    out = []
    for ep in obj.get("endpoints") or ():
        if not isinstance(ep, Mapping):
            continue
        addresses = ep.get("addresses") or ()
        ip = addresses[0] if addresses else None
        if not _is_ip(ip):
            continue
        cond = ep.get("conditions") or {}
        ready = cond.get("ready") is not False and cond.get("terminating") is not True
        ref = ep.get("targetRef") or {}
        is_pod = ref.get("kind") == "Pod" and isinstance(ref.get("name"), str) and ref["name"]
        name = ref["name"] if is_pod else (ep.get("hostname") or ip)
        uid = ref.get("uid", "") if is_pod else ""
        out.append(Endpoint(name=name, uid=str(uid), ip=ip, ready=ready, ports=ports))
    return out


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def endpoints_of_pod(obj: Mapping[str, Any]) -> list[Endpoint]:
    """The pod as an endpoint, or nothing while it has no IP yet."""
    meta = obj.get("metadata") or {}
    ip = (obj.get("status") or {}).get("podIP")
    name = meta.get("name")
    if not _is_ip(ip) or not isinstance(name, str) or not name:
        return []
    role = (meta.get("labels") or {}).get(ROLE_LABEL, "both")
    if role not in ROLES:
        return []  # a role we cannot read: never guess what the pod serves
    ports: tuple[tuple[str, int], ...] = ()
    for container in (obj.get("spec") or {}).get("containers") or ():
        if isinstance(container, Mapping):
            ports += _named_ports(container.get("ports"), "containerPort")
    return [Endpoint(name=name, uid=str(meta.get("uid", "")), ip=ip, ready=_pod_ready(obj), ports=ports, role=role)]
