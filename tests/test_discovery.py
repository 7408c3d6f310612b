"""Kubernetes discovery: the pure core against recorded EndpointSlice/Pod objects and watch
events, the membership against a real directory (and real KV-event bridges over ZMQ), and the
list/watch loop against an HTTP server that replays the recordings as the API server would."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from directory_client import open_directory
from directory_client.memory import InProcessDirectory
from directory_client.types import Directory
from gateway.config import ConfigError, load_config
from gateway.discovery import (
    FleetMembership,
    KubeApi,
    KubernetesDiscovery,
    PortPlan,
    WatchedSet,
    WatchTarget,
    build_discovery,
    diff,
    ready_nodes,
)
from gateway.discovery.membership import bridge_followers
from gateway.discovery.objects import endpoints_of_pod, endpoints_of_slice
from gateway.discovery.reconcile import DiscoveredNode, WatchExpired, WatchFailed
from tests.conftest import free_port
from tokenizer.keys import block_keys, namespace_seed
from workers.kv_events import BlockStored, KVEventPublisher

REC = Path(__file__).with_name("test_discovery_recordings")
NAMED = PortPlan(serving="http", events="kv-events", replay="kv-replay")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def recording(name: str) -> Any:
    text = (REC / name).read_text()
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def slices() -> WatchedSet:
    return WatchedSet(endpoints_of_slice)


def ready_ids(state: WatchedSet, plan: PortPlan = NAMED) -> list[str]:
    return list(ready_nodes(state.endpoints(), plan))


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


# --- the recordings are what the API server sends -------------------------------------------------


def _recorded_objects() -> list[dict]:
    out = []
    for name, kind, api in (
        ("endpointslices-list.json", "EndpointSlice", "discovery.k8s.io/v1"),
        ("endpointslices-relist.json", "EndpointSlice", "discovery.k8s.io/v1"),
        ("pods-list.json", "Pod", "v1"),
    ):
        for item in recording(name)["items"]:  # list items carry no kind/apiVersion
            assert "kind" not in item
            out.append({"apiVersion": api, "kind": kind, **item})
    for name in ("endpointslices-watch.jsonl", "pods-watch.jsonl"):
        out += [e["object"] for e in recording(name) if e["type"] in ("ADDED", "MODIFIED", "DELETED")]
    return out


def test_recorded_objects_are_valid_kubernetes_objects() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="install the helm-test extra (make test does)")
    objects = _recorded_objects()
    assert len(objects) == 14
    for obj in objects:
        kv.validate(obj, "1.30.0", strict=True)
    broken = copy.deepcopy(objects[0])
    broken["endpoints"][0]["conditons"] = {"ready": True}  # a misspelt field must not pass
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.30.0", strict=True)


# --- reading objects ------------------------------------------------------------------------------


def test_endpoint_slice_endpoints_carry_pod_identity_readiness_and_named_ports() -> None:
    eps = endpoints_of_slice(recording("endpointslices-list.json")["items"][0])
    assert [(e.name, e.ip, e.ready) for e in eps] == [
        ("vllm-0", "10.244.1.17", True),
        ("vllm-1", "10.244.2.9", True),
        ("vllm-2", "10.244.3.21", False),
    ]
    assert eps[0].uid == "8a6d2f1e-3b4c-4d5e-9f60-7a8b9c0d1e01"
    assert eps[0].port("http") == 8000 and eps[0].port("kv-events") == 5557 and eps[0].port("nope") is None


def test_endpoint_slice_readiness_rules() -> None:
    obj = copy.deepcopy(recording("endpointslices-list.json")["items"][0])
    del obj["endpoints"][2]["conditions"]["ready"]  # nil ready means ready (API docs)
    obj["endpoints"][1]["conditions"] = {"ready": True, "serving": True, "terminating": True}  # draining
    del obj["endpoints"][0]["targetRef"]  # a hand-made slice: no pod behind it
    eps = endpoints_of_slice(obj)
    assert [(e.name, e.ready) for e in eps] == [("10.244.1.17", True), ("vllm-1", False), ("vllm-2", True)]
    assert eps[0].uid == ""
    obj["addressType"] = "FQDN"
    assert endpoints_of_slice(obj) == []


def test_pod_readiness_follows_the_ready_condition_phase_and_deletion() -> None:
    pods = recording("pods-list.json")["items"]
    assert [(e.name, e.ready) for p in pods for e in endpoints_of_pod(p)] == [("vllm-0", True), ("vllm-1", False)]
    assert endpoints_of_pod(pods[2]) == []  # pending, no IP yet
    deleting = next(e["object"] for e in recording("pods-watch.jsonl") if e["object"]["metadata"].get("deletionTimestamp"))
    ready_condition = next(c for c in deleting["status"]["conditions"] if c["type"] == "Ready")
    assert ready_condition["status"] == "True"  # still passing its probe, yet on its way out
    assert [e.ready for e in endpoints_of_pod(deleting)] == [False]
    assert endpoints_of_pod(pods[0])[0].port("kv-replay") == 5558



def test_a_pods_role_label_becomes_its_nodes_role() -> None:
    pod = copy.deepcopy(recording("pods-list.json")["items"][0])
    assert endpoints_of_pod(pod)[0].role == "both"  # no label
    pod["metadata"].setdefault("labels", {})["kvgate.io/role"] = "prefill"
    (node,) = ready_nodes(endpoints_of_pod(pod), NAMED).values()
    assert node.role == "prefill" and node.node_info("m").role == "prefill"  # what the directory records
    pod["metadata"]["labels"]["kvgate.io/role"] = "prefil"
    assert endpoints_of_pod(pod) == []  # a role kvgate cannot read: the pod is not routed to, never guessed


# --- the reconcile core: events in, ready nodes out ----------------------------------------------


def test_endpoint_slice_list_and_watch_replayed_event_by_event() -> None:
    state = slices()
    state.replace(recording("endpointslices-list.json"))
    assert state.resource_version == "481522"
    seen = [ready_ids(state)]
    changed = []
    for event in recording("endpointslices-watch.jsonl"):
        changed.append(state.apply(event))
        seen.append(ready_ids(state))
    assert seen == [
        ["vllm-0", "vllm-1"],  # listed; vllm-2 still loading
        ["vllm-0", "vllm-1", "vllm-2"],  # vllm-2 ready
        ["vllm-0", "vllm-1", "vllm-2"],  # bookmark
        ["vllm-1", "vllm-2"],  # vllm-0 terminating: no new requests
        ["vllm-1", "vllm-2", "vllm-3"],  # scale-up in a second slice
        ["vllm-1", "vllm-3"],  # vllm-0 gone, vllm-2 failed its probe
    ]
    assert changed == [True, False, True, True, True]
    assert state.resource_version == "481815"
    with pytest.raises(WatchExpired, match="too old resource version"):
        state.apply(recording("watch-expired.jsonl")[0])
    before = ready_nodes(state.endpoints(), NAMED)
    state.replace(recording("endpointslices-relist.json"))
    after = ready_nodes(state.endpoints(), NAMED)
    assert list(after) == ["vllm-0", "vllm-1", "vllm-2"]  # the relist drops vllm-3's deleted slice
    change = diff(before, after)
    assert [n.node_id for n in change.added] == ["vllm-0", "vllm-2"]
    assert change.removed == ("vllm-3",)
    assert change.replaced == ()


def test_nodes_get_addresses_and_event_endpoints_from_named_or_numbered_ports() -> None:
    state = slices()
    state.replace(recording("endpointslices-list.json"))
    node = ready_nodes(state.endpoints(), NAMED)["vllm-0"]
    assert node == DiscoveredNode(
        node_id="vllm-0",
        uid="8a6d2f1e-3b4c-4d5e-9f60-7a8b9c0d1e01",
        address="10.244.1.17:8000",
        events_endpoint="tcp://10.244.1.17:5557",
        replay_endpoint="tcp://10.244.1.17:5558",
    )
    numbered = ready_nodes(state.endpoints(), PortPlan(serving=8001, transfer=7000))["vllm-1"]
    assert (numbered.address, numbered.events_endpoint, numbered.transfer_endpoint) == ("10.244.2.9:8001", "", "10.244.2.9:7000")
    # a named port the endpoint does not declare: the endpoint is not routable, never guessed
    assert ready_nodes(state.endpoints(), PortPlan(serving="grpc")) == {}
    assert ready_nodes(state.endpoints(), PortPlan(serving="http", events="zmq")) == {}


def test_ipv6_endpoints_are_bracketed() -> None:
    obj = copy.deepcopy(recording("endpointslices-list.json")["items"][0])
    obj["addressType"] = "IPv6"
    obj["endpoints"][0]["addresses"] = ["fd00:10:244::11"]
    node = ready_nodes(endpoints_of_slice(obj), NAMED)["vllm-0"]
    assert node.address == "[fd00:10:244::11]:8000" and node.events_endpoint == "tcp://[fd00:10:244::11]:5557"


def test_a_pod_recreated_under_the_same_name_is_replaced() -> None:
    state = slices()
    state.replace(recording("endpointslices-list.json"))
    state.apply(recording("endpointslices-watch.jsonl")[0])
    before = ready_nodes(state.endpoints(), NAMED)
    state.replace(recording("endpointslices-relist.json"))
    change = diff(before, ready_nodes(state.endpoints(), NAMED))
    assert [n.node_id for n in change.replaced] == ["vllm-0"]
    assert change.replaced[0].address == "10.244.2.44:8000"
    assert change.added == () and change.removed == ()
    assert not diff(before, before)


def test_a_pod_in_two_slices_counts_as_ready_if_the_latest_record_says_so() -> None:
    state = slices()
    state.replace(recording("endpointslices-list.json"))
    events = recording("endpointslices-watch.jsonl")
    moved = copy.deepcopy(events[3])  # slice 2 now also lists vllm-2 (moved there), ready
    moved["object"]["endpoints"].append(copy.deepcopy(recording("endpointslices-list.json")["items"][0]["endpoints"][2]))
    moved["object"]["endpoints"][-1]["conditions"] = {"ready": True, "serving": True, "terminating": False}
    state.apply(moved)
    assert "vllm-2" in ready_ids(state)  # the stale not-ready record in slice 1 does not hide it
    slice2 = {"type": "DELETED", "object": moved["object"]}
    assert state.apply(slice2) is True
    assert "vllm-2" not in ready_ids(state)
    assert state.apply(slice2) is False  # deleting twice changes nothing


def test_pod_list_and_watch_replayed_event_by_event() -> None:
    state = WatchedSet(endpoints_of_pod)
    state.replace(recording("pods-list.json"))
    seen = [ready_ids(state)]
    for event in recording("pods-watch.jsonl"):
        state.apply(event)
        seen.append(ready_ids(state))
    assert seen == [
        ["vllm-0"],
        ["vllm-0", "vllm-1"],
        ["vllm-0", "vllm-1"],  # vllm-2 has an IP but is still loading
        ["vllm-1"],  # vllm-0's deletion started: it gets no new requests
        ["vllm-1", "vllm-2"],
        ["vllm-1", "vllm-2"],  # vllm-0 deleted for good
    ]
    assert len(state) == 2 and state.resource_version == "502101"


def test_watch_errors_other_than_gone_are_failures() -> None:
    state = slices()
    error = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                         "message": "internal error", "reason": "InternalError", "code": 500}}  # fmt: skip
    with pytest.raises(WatchFailed, match="500"):
        state.apply(error)


# --- membership: the directory follows the ready set ----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _keys(start: int, blocks: int) -> list:
    return block_keys(list(range(start, start + 16 * blocks)), block_size=16, seed=namespace_seed(MODEL))


async def _cached(directory: Directory, node_id: str, keys: list) -> int | None:
    view = await directory.lookup(keys)
    return next((n.cached_blocks for n in view.nodes if n.node.node_id == node_id), None)


async def test_membership_registers_ready_nodes_and_drops_leaving_ones_with_their_entries() -> None:
    clock = Clock()
    directory = InProcessDirectory(heartbeat_ttl_s=10.0, clock=clock)
    membership = FleetMembership(directory, model=MODEL, heartbeat_interval_s=3.0)
    state = slices()
    state.replace(recording("endpointslices-list.json"))
    await membership.update(ready_nodes(state.endpoints(), PortPlan(serving="http")))
    assert [n.node_id for n in await directory.live_nodes()] == ["vllm-0", "vllm-1"]
    info = next(n for n in await directory.live_nodes() if n.node_id == "vllm-0")
    assert (info.address, info.model) == ("10.244.1.17:8000", MODEL)

    keys = _keys(0, 4)
    await directory.record_stored("vllm-0", keys)  # what vllm-0's bridge would have written
    assert await _cached(directory, "vllm-0", keys) == 4
    for event in recording("endpointslices-watch.jsonl")[:3]:  # … vllm-0 starts terminating
        state.apply(event)
        await membership.update(ready_nodes(state.endpoints(), PortPlan(serving="http")))
    assert [n.node_id for n in await directory.live_nodes()] == ["vllm-1", "vllm-2"]
    assert await _cached(directory, "vllm-0", keys) is None  # no traffic, entries gone at once

    # the relist brings vllm-0 back as a new pod: it starts with nothing cached
    state.replace(recording("endpointslices-relist.json"))
    change = await membership.update(ready_nodes(state.endpoints(), PortPlan(serving="http")))
    assert [n.node_id for n in change.added] == ["vllm-0"]
    assert await _cached(directory, "vllm-0", keys) == 0

    # heartbeats keep nodes alive, and restore one the directory forgot (e.g. a Redis restart)
    clock.now += 8
    await directory.deregister_node("vllm-1")
    await membership.heartbeat()
    clock.now += 8
    assert [n.node_id for n in await directory.live_nodes()] == ["vllm-0", "vllm-1", "vllm-2"]

    # shutdown leaves them to the other replicas; without any, the TTL retires them
    await membership.aclose()
    assert len(await directory.live_nodes()) == 3
    clock.now += 10.5
    assert await directory.live_nodes() == []


async def test_membership_replaces_a_recreated_pod_and_forgets_what_the_old_one_held() -> None:
    directory = InProcessDirectory(heartbeat_ttl_s=10.0)
    membership = FleetMembership(directory, model=MODEL, heartbeat_interval_s=3.0)
    state = slices()
    state.replace(recording("endpointslices-list.json"))
    await membership.update(ready_nodes(state.endpoints(), NAMED))
    keys = _keys(100, 3)
    await directory.record_stored("vllm-0", keys)
    state.replace(recording("endpointslices-relist.json"))
    change = await membership.update(ready_nodes(state.endpoints(), NAMED))
    assert [n.node_id for n in change.replaced] == ["vllm-0"]
    assert await _cached(directory, "vllm-0", keys) == 0
    live = {n.node_id: n.address for n in await directory.live_nodes()}
    assert live["vllm-0"] == "10.244.2.44:8000"
    await membership.aclose()


def _local_slice(events_port: int, replay_port: int) -> dict:
    """The recorded slice, as if vllm-0 ran on this machine with these KV-event ports."""
    listing = copy.deepcopy(recording("endpointslices-list.json"))
    obj = listing["items"][0]
    obj["endpoints"] = obj["endpoints"][:1]
    obj["endpoints"][0]["addresses"] = ["127.0.0.1"]
    obj["ports"] = [{"name": "http", "protocol": "TCP", "port": free_port()},
                    {"name": "kv-events", "protocol": "TCP", "port": events_port},
                    {"name": "kv-replay", "protocol": "TCP", "port": replay_port}]  # fmt: skip
    return listing


async def test_followed_node_gets_its_kv_events_and_loses_them_when_it_turns_unready() -> None:
    events_port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{events_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    directory = open_directory("memory://", heartbeat_ttl_s=2.0, index_stride=1)
    follow = bridge_followers(directory, model=MODEL, block_size=16, heartbeat_interval_s=0.2)
    membership = FleetMembership(directory, model=MODEL, heartbeat_interval_s=0.2, follow=follow)
    try:
        state = slices()
        state.replace(_local_slice(events_port, replay_port))
        await membership.update(ready_nodes(state.endpoints(), NAMED))
        assert membership.followed == {"vllm-0"}

        async def live() -> bool:
            return [n.node_id for n in await directory.live_nodes()] == ["vllm-0"]

        await eventually(live, what="the bridge registered vllm-0")
        tokens = list(range(5000, 5000 + 48))
        keys = block_keys(tokens, block_size=16, seed=namespace_seed(MODEL))
        pub.publish([BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=tokens, block_size=16, medium="GPU")])

        async def held_three() -> bool:
            return await _cached(directory, "vllm-0", keys) == 3

        await eventually(held_three, what="vllm-0's blocks in the directory")

        obj = _local_slice(events_port, replay_port)["items"][0]  # the same slice, vllm-0 now failing its probe
        obj["endpoints"][0]["conditions"] = {"ready": False, "serving": False, "terminating": False}
        state.apply({"type": "MODIFIED", "object": {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", **obj}})
        await membership.update(ready_nodes(state.endpoints(), NAMED))
        assert membership.followed == frozenset()
        assert await directory.live_nodes() == []
        assert await _cached(directory, "vllm-0", keys) is None
    finally:
        await membership.aclose()
        pub.close()
        await directory.aclose()


# --- the list/watch loop against a server replaying the recordings --------------------------------


class FakeApiServer:
    """Answers list and watch requests from the recordings, in order, and remembers the requests."""

    def __init__(self, lists: list[Any], watches: list[Any], *, after_request: Callable[[], None] = lambda: None) -> None:
        self.after_request = after_request
        self.lists = lists  # bodies, or an int HTTP status to answer instead
        self.watches = watches  # event lists, or an int HTTP status
        self.requests: list[dict[str, str]] = []
        self.idle = asyncio.Event()
        self.closing = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append({**request.query, "path": request.path, "auth": request.headers.get("Authorization", "")})
        self.after_request()
        queue = self.watches if request.query.get("watch") == "1" else self.lists
        if not queue:  # nothing more recorded: hold the watch open, as a quiet API server does
            self.idle.set()
            await self.closing.wait()
            raise web.HTTPServiceUnavailable()
        answer = queue.pop(0)
        if isinstance(answer, int):
            return web.json_response({"kind": "Status", "code": answer, "message": "recorded failure"}, status=answer)
        if request.query.get("watch") != "1":
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for event in answer:  # split across writes on purpose: lines must be reassembled
            line = json.dumps(event).encode() + b"\n"
            await resp.write(line[: len(line) // 2])
            await resp.write(line[len(line) // 2 :])
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.closing.set()
        await self.runner.cleanup()


async def test_discovery_lists_watches_and_relists_after_410(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("token-1\n")
    server = FakeApiServer(
        lists=[recording("endpointslices-list.json"), recording("endpointslices-relist.json")],
        watches=[recording("endpointslices-watch.jsonl"), recording("watch-expired.jsonl")],
        after_request=lambda: token.write_text("token-2\n"),  # the kubelet rotates the projected token
    )
    directory = InProcessDirectory(heartbeat_ttl_s=10.0)
    async with server as url:
        api = KubeApi(url, token_file=token)
        membership = FleetMembership(directory, model=MODEL, heartbeat_interval_s=3.0)
        disco = KubernetesDiscovery(api, WatchTarget.endpoint_slices("llm", service="vllm"), NAMED, membership, backoff_s=0.01)
        await disco.start()
        try:
            await asyncio.wait_for(server.idle.wait(), 5)
            assert [n.node_id for n in await directory.live_nodes()] == ["vllm-0", "vllm-1", "vllm-2"]
        finally:
            await disco.aclose()
    assert disco.lists == 2
    reqs = server.requests
    assert [r["path"] for r in reqs] == ["/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"] * 5
    assert all(r["labelSelector"] == "kubernetes.io/service-name=vllm" for r in reqs)
    assert [(r.get("watch"), r.get("resourceVersion")) for r in reqs] == [
        (None, None),  # list
        ("1", "481522"),  # watch from the list's version
        ("1", "481815"),  # the watch ended: resume from the last event's version → 410
        (None, None),  # relist
        ("1", "495010"),
    ]
    assert reqs[1]["allowWatchBookmarks"] == "true"
    assert [r["auth"] for r in reqs[:2]] == ["Bearer token-1", "Bearer token-2"]


async def test_discovery_keeps_the_fleet_through_api_failures_and_a_410_answer() -> None:
    server = FakeApiServer(
        lists=[recording("pods-list.json"), 500, recording("pods-list.json")],
        watches=[recording("pods-watch.jsonl")[:2], 410],
    )
    directory = InProcessDirectory(heartbeat_ttl_s=10.0)
    async with server as url:
        membership = FleetMembership(directory, model=MODEL, heartbeat_interval_s=3.0)
        target = WatchTarget.pods("llm", label_selector="app=vllm")
        disco = KubernetesDiscovery(KubeApi(url), target, PortPlan(serving=8000), membership, backoff_s=0.01)
        await disco.start()
        try:
            await asyncio.wait_for(server.idle.wait(), 5)
            assert [n.node_id for n in await directory.live_nodes()] == ["vllm-0"]
        finally:
            await disco.aclose()
    # list, watch (2 events), watch → HTTP 410, list → 500 (fleet kept), list, watch
    kinds = [("watch" if r.get("watch") else "list") for r in server.requests]
    assert kinds == ["list", "watch", "watch", "list", "list", "watch"]
    assert server.requests[0]["path"] == "/api/v1/namespaces/llm/pods"
    assert server.requests[0]["labelSelector"] == "app=vllm"
    assert disco.lists == 2


# --- configuration and wiring into kvgate serve ---------------------------------------------------


def test_discovery_config_is_validated_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_DISCOVERY__KUBERNETES__ENABLED", "true")
    with pytest.raises(ConfigError, match="needs `service`"):
        load_config(None)
    monkeypatch.setenv("KVGATE_DISCOVERY__KUBERNETES__SOURCE", "pods")
    with pytest.raises(ConfigError, match="needs a `label_selector`"):
        load_config(None)
    monkeypatch.setenv("KVGATE_DISCOVERY__KUBERNETES__LABEL_SELECTOR", "app=vllm")
    monkeypatch.setenv("KVGATE_DISCOVERY__KUBERNETES__PORT", "HTTP_PORT")
    with pytest.raises(ConfigError, match="discovery.kubernetes.port"):
        load_config(None)
    monkeypatch.setenv("KVGATE_DISCOVERY__KUBERNETES__PORT", "8000")  # digits from the environment are a number
    monkeypatch.setenv("KVGATE_DISCOVERY__KUBERNETES__EVENTS_PORT", "kv-events")
    with pytest.raises(ConfigError, match="no model"):
        load_config(None)
    cfg = load_config(None, models=[MODEL])
    k8s = cfg.discovery.kubernetes
    assert (k8s.port, k8s.events_port, k8s.source) == (8000, "kv-events", "pods")


async def test_build_discovery_follows_the_config(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        models=[MODEL],
        discovery={"kubernetes": {"enabled": True, "service": "vllm", "namespace": "llm", "port": "http",
                                  "events_port": 5557, "api_server": "http://127.0.0.1:1"}},  # fmt: skip
    )
    directory = InProcessDirectory()
    disco = build_discovery(cfg, directory)
    assert disco is not None
    try:
        assert disco.target.path == "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
        assert disco.target.label_selector == "kubernetes.io/service-name=vllm"
        assert disco.plan == PortPlan(serving="http", events=5557)
        assert disco.api.base_url == "http://127.0.0.1:1"
    finally:
        await disco.api.aclose()
    assert build_discovery(load_config(None), directory) is None


async def test_kvgate_serve_routes_to_the_pods_discovery_finds() -> None:
    """``kvgate serve`` with discovery on: the admin API counts the ready pods as live nodes."""
    import aiohttp

    from gateway.serve_cmd import serve

    server = FakeApiServer(lists=[recording("endpointslices-list.json")], watches=[recording("endpointslices-watch.jsonl")[:1]])
    async with server as url:
        admin = free_port()
        cfg = load_config(
            None,
            listen_host="127.0.0.1",
            ext_proc_port=free_port(),
            admin_port=admin,
            models=[MODEL],
            discovery={"kubernetes": {"enabled": True, "service": "vllm", "namespace": "llm", "port": "http",
                                      "api_server": url}},  # fmt: skip
        )
        stop = asyncio.Event()
        task = asyncio.create_task(serve(cfg, stop=stop))
        try:
            async with aiohttp.ClientSession() as http:

                async def three_live() -> bool:
                    try:
                        async with http.get(f"http://127.0.0.1:{admin}/readyz") as resp:
                            return (await resp.json()).get("live_nodes") == 3
                    except aiohttp.ClientError:
                        return False

                await eventually(three_live, timeout=30, what="vllm-0..2 live through /readyz")
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
    assert [r.get("watch") for r in server.requests[:2]] == [None, "1"]
