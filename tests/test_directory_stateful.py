"""Stateful property test: the in-process directory is the model; random sequences of the same
operations run against a real Redis and a real Redis Cluster, and every observable answer
(lookup per prefix, loads, live nodes) must equal the model's after every step."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from directory_client import InProcessDirectory, NodeInfo, Tier, open_directory
from tests.redis_servers import purge_prefix
from tokenizer.keys import block_keys, namespace_seed

SEED = namespace_seed("stateful")
CHAIN_LEN = 24
# three prompts sharing a 6-block prefix, so nodes hold overlapping chains
_BASE = list(range(6 * 16))
CHAINS = [
    block_keys(_BASE + [(j * 31 + c) % 997 for j in range((CHAIN_LEN - 6) * 16)], block_size=16, seed=SEED)
    for c in range(3)
]
NODE_IDS = ["n0", "n1", "n2", "n3"]

node_ids = st.sampled_from(NODE_IDS)
tiers = st.sampled_from(list(Tier))
chains = st.integers(0, len(CHAINS) - 1)
spans = st.tuples(st.integers(0, CHAIN_LEN), st.integers(0, CHAIN_LEN)).map(lambda ab: (min(ab), max(ab)))


def observe(view: Any) -> list[tuple[str, str, int, Tier, int, int]]:
    return [
        (v.node.node_id, v.node.address, v.cached_blocks, v.tier, v.load.inflight, v.load.prefill_tokens)
        for v in view.nodes
    ]


class DirectoryMatchesModel(RuleBasedStateMachine):
    url = ""
    stride = 1

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"
        # long TTLs: time does not pass inside one example (expiry has its own tests)
        self.model = InProcessDirectory(index_stride=self.stride, heartbeat_ttl_s=3600)
        self.sut = open_directory(
            self.url, key_prefix=self.prefix, index_stride=self.stride, heartbeat_ttl_s=3600, op_timeout_s=5.0
        )
        self.reservations: list[tuple[Any, Any]] = []

    def both(self, method: str, *args: Any) -> tuple[Any, Any]:
        model_result = self.loop.run_until_complete(getattr(self.model, method)(*args))
        sut_result = self.loop.run_until_complete(getattr(self.sut, method)(*args))
        return model_result, sut_result

    @rule(nid=node_ids, port=st.integers(1, 3))
    def register(self, nid: str, port: int) -> None:
        self.both("register_node", NodeInfo(nid, f"10.0.0.{port}:8000"))

    @rule(nid=node_ids)
    def deregister(self, nid: str) -> None:
        self.both("deregister_node", nid)
        self.reservations = [(m, s) for m, s in self.reservations if m.node_id != nid]

    @rule(nid=node_ids, chain=chains, span=spans, tier=tiers)
    def store(self, nid: str, chain: int, span: tuple[int, int], tier: Tier) -> None:
        self.both("record_stored", nid, CHAINS[chain][span[0] : span[1]], tier)

    @rule(nid=node_ids, chain=chains, span=spans, tier=st.none() | tiers)
    def remove(self, nid: str, chain: int, span: tuple[int, int], tier: Tier | None) -> None:
        self.both("record_removed", nid, CHAINS[chain][span[0] : span[1]], tier)

    @rule(nid=node_ids)
    def clear(self, nid: str) -> None:
        self.both("clear_node", nid)

    @rule(nid=node_ids, tokens=st.integers(0, 5000))
    def reserve(self, nid: str, tokens: int) -> None:
        self.reservations.append(self.both("reserve", nid, tokens))

    @precondition(lambda self: self.reservations)
    @rule(index=st.integers(0, 1000))
    def release(self, index: int) -> None:
        m, s = self.reservations.pop(index % len(self.reservations))
        self.loop.run_until_complete(self.model.release(m))
        self.loop.run_until_complete(self.sut.release(s))

    @invariant()
    def answers_agree(self) -> None:
        for keys in (*CHAINS, CHAINS[0][:7], CHAINS[1][3:]):
            model_view, sut_view = self.both("lookup", keys)
            assert observe(sut_view) == observe(model_view)
        model_loads, sut_loads = self.both("loads")
        assert sut_loads == model_loads
        model_live, sut_live = self.both("live_nodes")
        assert sut_live == model_live

    def teardown(self) -> None:
        self.loop.run_until_complete(self.sut.aclose())
        self.loop.close()
        purge_prefix(self.url, self.prefix)


@pytest.mark.parametrize(
    ("backend", "stride"), [("redis", 1), ("redis", 3), ("cluster", 1), ("cluster", 3)]
)
def test_backend_matches_in_process_model(request: pytest.FixtureRequest, redis_url: str, backend: str, stride: int) -> None:
    url = redis_url if backend == "redis" else request.getfixturevalue("redis_cluster_url")
    machine = type(
        f"Match_{backend}_{stride}", (DirectoryMatchesModel,), {"url": url, "stride": stride}
    )
    machine.TestCase.settings = settings(
        max_examples=15,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
