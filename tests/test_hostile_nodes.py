"""A node that fails fast must not attract traffic (issue 15, item 12): real Envoy, `kvgate serve`
(ext_proc, observing response statuses) and three echo nodes, one answering every request 500
while passing its health checks.

Before: a node failing at once gives its load back at once, so it always looked the least busy:
it got 76 of 120 requests. What a client sees now: kvgate counts each node's 5xx answers
(``kvgate_node_failures_total{node}``); after 5 in a row it stops choosing the node for a while
(``kvgate_node_ejections_total{node}``), so at most a handful of requests meet the broken node.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.http import request
from tests.support.stack import MODEL, Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory, envoy_bin, redis_url):
    s = Stack(tmp_path_factory.mktemp("hostile-nodes"), envoy_bin, redis_url, f"kvgate-test:{uuid.uuid4().hex[:12]}",
              failing={"c": 500}, envoy_options={"observe_responses": True, "retries": 0})  # fmt: skip
    yield s
    s.stop()


def test_a_node_answering_500_at_once_gets_ejected_not_chosen(stack: Stack) -> None:
    statuses = []
    for i in range(120):
        body = {"model": MODEL, "prompt": f"Question {i}: what is {i} times {i * 7}? " * 4, "max_tokens": 4}
        status, _, _ = request(stack.url("/v1/completions"), method="POST", body=json.dumps(body).encode(),
                               headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        statuses.append(status)
    to_broken = stack.node_requests()["c"]
    print(f"\n120 requests: the broken node got {to_broken}; client statuses {sorted(set(statuses))}")
    assert to_broken <= 10, f"the broken node got {to_broken} of 120 requests"
    assert statuses.count(200) >= 110
    metrics = request(f"http://127.0.0.1:{stack.admin_port}/metrics")[2].decode()
    assert 'kvgate_node_ejections_total{node="c"}' in metrics


def test_ejections_last_longer_each_time_and_never_empty_a_view() -> None:
    from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Tier
    from gateway.node_health import NodeHealth

    now = [0.0]
    health = NodeHealth(consecutive=2, base_eject_s=10, max_eject_s=15, clock=lambda: now[0])
    view = DirectoryView(tuple(NodeView(NodeInfo(n, f"10.0.0.{i}:80"), 0, Tier.GPU, NodeLoad()) for i, n in enumerate("ab")))
    health.record("a", False)
    health.record("a", True)  # a success resets the count
    health.record("a", False)
    assert health.vet(view) is view
    health.record("a", False)
    assert [nv.node.node_id for nv in health.vet(view).nodes] == ["b"]
    now[0] = 10.0
    assert health.vet(view) is view  # back after 10 s
    health.record("a", False)
    health.record("a", False)
    now[0] = 24.0
    assert [nv.node.node_id for nv in health.vet(view).nodes] == ["b"]  # second time: 15 s (capped)
    for _ in range(2):
        health.record("b", False)
    assert health.vet(view) is view  # both ejected: nobody is left out
