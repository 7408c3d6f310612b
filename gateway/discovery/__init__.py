"""Kubernetes discovery: the fleet from ready pods, watched (see README.md in this folder).

``objects`` reads Pods and EndpointSlices, ``reconcile`` is the pure core (events in, ready nodes
and changes out), ``membership`` applies changes to the directory, ``kube_api`` and ``runner``
are the thin network part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.discovery.kube_api import KubeApi, in_cluster_url, pod_namespace
from gateway.discovery.membership import FleetMembership, bridge_followers
from gateway.discovery.reconcile import DiscoveredNode, FleetChange, PortPlan, WatchedSet, diff, ready_nodes
from gateway.discovery.runner import KubernetesDiscovery, WatchTarget

if TYPE_CHECKING:
    from directory_client.types import Directory
    from gateway.config import KvgateConfig

__all__ = [
    "DiscoveredNode",
    "FleetChange",
    "FleetMembership",
    "KubeApi",
    "KubernetesDiscovery",
    "PortPlan",
    "WatchTarget",
    "WatchedSet",
    "build_discovery",
    "diff",
    "ready_nodes",
]


def build_discovery(cfg: KvgateConfig, directory: Directory) -> KubernetesDiscovery | None:
    """The discovery ``cfg.discovery`` asks for, or None when it is off."""
    k8s = cfg.discovery.kubernetes
    if not k8s.enabled:
        return None
    namespace = k8s.namespace or pod_namespace()
    if k8s.source == "pods":
        target = WatchTarget.pods(namespace, label_selector=k8s.label_selector)
    else:
        target = WatchTarget.endpoint_slices(namespace, service=k8s.service, label_selector=k8s.label_selector)
    model = k8s.model or (cfg.models[0] if cfg.models else "")
    interval = max(cfg.directory.heartbeat_ttl_s / 3, 0.1)
    follow = None
    if k8s.events_port is not None:
        follow = bridge_followers(directory, model=model, block_size=cfg.block_size, heartbeat_interval_s=interval)
    membership = FleetMembership(directory, model=model, heartbeat_interval_s=interval, follow=follow)
    plan = PortPlan(serving=k8s.port, events=k8s.events_port, replay=k8s.replay_port, transfer=k8s.transfer_port)
    api = KubeApi(k8s.api_server or in_cluster_url(), token_file=k8s.token_file, ca_file=k8s.ca_file)
    return KubernetesDiscovery(api, target, plan, membership, watch_timeout_s=k8s.watch_timeout_s)
