"""The faster ``__init__`` of the request path's frozen values builds exactly what ``@dataclass`` would."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from directory_client.frozen import fast_frozen_init
from directory_client.types import DirectoryView, NodeInfo, NodeLoad, NodeView, Reservation, Tier
from gateway.decision_round import Round
from gateway.types import CandidateCost, Decision, PrefillPlan, PullPlan, RoutingRequest

HOT = (NodeInfo, NodeLoad, NodeView, DirectoryView, Reservation, RoutingRequest, PullPlan, PrefillPlan, CandidateCost, Decision, Round)


@dataclasses.dataclass(frozen=True, slots=True)
class _Plain:
    a: int
    b: str = "x"
    c: tuple = ()
    d: list = dataclasses.field(default_factory=list)


@fast_frozen_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Fast:
    a: int
    b: str = "x"
    c: tuple = ()
    d: list = dataclasses.field(default_factory=list)


def test_same_values_defaults_and_factories_as_dataclass() -> None:
    for args, kwargs in [((1,), {}), ((1, "y"), {}), ((1,), {"c": (2,)}), ((), {"a": 3, "d": [4]})]:
        plain, fast = _Plain(*args, **kwargs), _Fast(*args, **kwargs)
        assert dataclasses.astuple(plain) == dataclasses.astuple(fast)
    assert _Fast(1).d is not _Fast(1).d  # a fresh list each time, as default_factory promises
    with pytest.raises(TypeError):
        _Fast()  # a field without default stays required
    with pytest.raises(TypeError):
        _Fast(1, "y", (), [], 5)


def test_hot_values_stay_frozen_hashable_and_replaceable() -> None:
    node = NodeInfo("n1", "10.0.0.1:8000", "10.0.0.1:9000", 100, "m", "decode")
    assert (node.node_id, node.address, node.transfer_endpoint, node.capacity_blocks, node.model, node.role) == (
        "n1", "10.0.0.1:8000", "10.0.0.1:9000", 100, "m", "decode",
    )  # fmt: skip
    view = NodeView(node, 3, Tier.CPU, NodeLoad(2, 50))
    assert view.total_blocks == 0 and view.load == NodeLoad(inflight=2, prefill_tokens=50)
    assert dataclasses.replace(view, cached_blocks=4).cached_blocks == 4
    assert hash(view) == hash(NodeView(node, 3, Tier.CPU, NodeLoad(2, 50)))
    assert pickle.loads(pickle.dumps(view)) == view
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.cached_blocks = 5  # type: ignore[misc]
    cost = CandidateCost("n1", "a:1", 3, Tier.GPU, 4, 0.1, 0.2, 0.3, 0.6)
    assert (cost.via_pull, cost.memory_s, cost.survival, cost.score) == (False, 0.0, 1.0, 0.6)
    assert Reservation("n1").token == "" and DirectoryView(()).answerable_blocks == -1


@pytest.mark.parametrize("cls", HOT, ids=lambda c: c.__name__)
def test_every_hot_value_uses_the_fast_init(cls) -> None:
    assert cls.__init__.__module__ == cls.__module__ and "_set_" in " ".join(cls.__init__.__code__.co_names)
    assert [f.name for f in dataclasses.fields(cls)] == list(cls.__init__.__code__.co_varnames[1 : len(dataclasses.fields(cls)) + 1])


def test_refuses_what_it_cannot_build() -> None:
    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    with pytest.raises(TypeError):
        fast_frozen_init(Mutable)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            pass

    with pytest.raises(TypeError):
        fast_frozen_init(Checked)
