"""Directory node records vetted against the configured and discovered fleet (real in-process
directory): a record cannot choose where requests go or where engines pull from."""

from __future__ import annotations

import numpy as np

from directory_client import InProcessDirectory, NodeInfo, Tier
from gateway.metrics import REGISTRY
from gateway.trusted_fleet import TrustedDirectory, TrustedFleet


async def test_records_at_unknown_addresses_are_dropped_and_transfer_endpoints_come_from_config() -> None:
    d = InProcessDirectory(index_stride=1)
    await d.register_node(NodeInfo("a", "10.0.0.1:8000", transfer_endpoint="10.6.6.6:9100"))  # forged agent
    await d.register_node(NodeInfo("b", "10.0.0.2:8000"))  # discovered
    await d.register_node(NodeInfo("evil", "169.254.169.254:80", transfer_endpoint="169.254.169.254:9100"))
    keys = np.arange(1, 9, dtype=np.uint64) * 1000
    await d.record_stored("evil", keys.tolist(), Tier.GPU)
    discovered = [("10.0.0.2:8000", "10.0.0.2:9100")]
    trusted = TrustedDirectory(d, TrustedFleet([("10.0.0.1:8000", "10.0.0.1:9100")], lambda: discovered))
    before = REGISTRY.get_sample_value("kvgate_untrusted_nodes_total") or 0.0
    view = await trusted.lookup(keys)
    assert {nv.node.node_id: nv.node.transfer_endpoint for nv in view.nodes} == {"a": "10.0.0.1:9100", "b": "10.0.0.2:9100"}
    assert REGISTRY.get_sample_value("kvgate_untrusted_nodes_total") == before + 1
    assert await trusted.live_nodes() == await d.live_nodes()  # everything else is the directory's


async def test_a_view_of_known_nodes_passes_unchanged() -> None:
    d = InProcessDirectory(index_stride=1)
    await d.register_node(NodeInfo("a", "10.0.0.1:8000", transfer_endpoint="10.0.0.1:9100"))
    view = await d.lookup(np.arange(1, 3, dtype=np.uint64))
    assert TrustedFleet([("10.0.0.1:8000", "10.0.0.1:9100")]).vet(view) is view
