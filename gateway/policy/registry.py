"""Policies by name, so the gateway, the load test and the simulator build them the same way."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from gateway.policy.base import Policy
from gateway.policy.kvgate import KvgatePolicy
from gateway.policy.least_request import LeastRequestPolicy
from gateway.policy.prefix_only import PrefixOnlyPolicy
from gateway.policy.round_robin import RoundRobinPolicy


_NOT_FOR_NOPULL = ("allow_pull", "memory_value", "churn_window_s", "warmup_s", "warmup_credit", "warmup_link_share", "work_value")  # kvgate_nopull is the baseline: no pulls (so no warm-up), memory and the fleet's work free


def _kvgate_nopull(**options: Any) -> KvgatePolicy:
    for option in _NOT_FOR_NOPULL:
        if option in options:
            raise ValueError(
                f"kvgate_nopull never pulls and prices no memory: option {option!r} is not accepted (use policy 'kvgate')"
            )
    return KvgatePolicy(name="kvgate_nopull", allow_pull=False, memory_value=0.0, work_value=0.0, **options)


# name -> (factory, options it accepts). The option lists are what config and error messages show.
_FACTORIES: dict[str, Callable[..., Policy]] = {
    "kvgate": KvgatePolicy,
    "kvgate_nopull": _kvgate_nopull,
    "prefix_only": PrefixOnlyPolicy,
    "least_request": LeastRequestPolicy,
    "round_robin": RoundRobinPolicy,
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def policy_options(name: str) -> tuple[str, ...]:
    """Keyword options ``make_policy(name, ...)`` accepts."""
    if name == "kvgate_nopull":
        return tuple(o for o in policy_options("kvgate") if o not in _NOT_FOR_NOPULL)
    factory = _FACTORIES[name]
    params = inspect.signature(factory).parameters
    return tuple(p for p in params if p != "name")


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy. Unknown names or options raise ``ValueError`` naming them and the choices."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    accepted = policy_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no option {', '.join(map(repr, unknown))}; it accepts {', '.join(accepted)}"
        )
    return _FACTORIES[name](**options)
