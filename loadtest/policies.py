"""Policy names the load tests accept, and what runs each one.

In ``replay`` every policy is a real gateway in front of the same engines:

| name | gateway |
|---|---|
| ``round_robin``, ``least_request`` | Envoy's own balancing (no ext_proc): what a fleet gets without kvgate |
| ``prefix_only``, ``kvgate``, ``kvgate_nopull`` | Envoy + ext_proc + ``kvgate serve`` with that policy |
| ``kvgate_aggregated`` | the same with ``kvgate`` told never to split (``disaggregate: false``): a P:D fleet's aggregated baseline |
| ``sglang`` | the ``sglang-router`` package, ``--policy cache_aware`` (a real peer) |

In ``simulate`` the names are ``gateway.policy.POLICY_NAMES`` (the same classes ``kvgate serve``
runs; ``round_robin`` and ``least_request`` are then kvgate's implementations of them) plus
``oracle``: an infinite shared cache, every block computed before anywhere is a hit, and
``oracle_pool``: one LRU memory of the fleet's total KV capacity — the ceiling when memory binds
(reports show every policy's hit rate as % of it).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

from typing import Any

from gateway.policy import POLICY_NAMES, Policy, make_policy
from gateway.policy.kvgate import KvgatePolicy


@dataclass(frozen=True)
class ReplayGateway:
    kind: str  # envoy | kvgate | sglang
    lb_policy: str = ""
    policy: str = ""
    options: tuple[tuple[str, Any], ...] = ()  # kvgate: policy options in its config


KVGATE_AGGREGATED = "kvgate_aggregated"  # kvgate that never splits: the aggregated baseline of a P:D fleet


REPLAY_POLICIES: dict[str, ReplayGateway] = {
    "round_robin": ReplayGateway("envoy", lb_policy="ROUND_ROBIN"),
    "least_request": ReplayGateway("envoy", lb_policy="LEAST_REQUEST"),
    "prefix_only": ReplayGateway("kvgate", policy="prefix_only"),
    "kvgate": ReplayGateway("kvgate", policy="kvgate"),
    "kvgate_nopull": ReplayGateway("kvgate", policy="kvgate_nopull"),
    KVGATE_AGGREGATED: ReplayGateway("kvgate", policy="kvgate", options=(("disaggregate", False),)),
    "sglang": ReplayGateway("sglang", policy="cache_aware"),
}

SGLANG_MISSING = "the sglang peer needs the sglang-router package: pip install -e '.[loadtest]'"

ORACLE = "oracle"
ORACLE_POOL = "oracle_pool"
SIM_POLICIES: tuple[str, ...] = (*POLICY_NAMES, KVGATE_AGGREGATED, ORACLE, ORACLE_POOL)


def sim_policy(name: str, link: str | None, extra: dict[str, Any] | None = None) -> Policy:
    """The policy the simulator runs for ``name``: the oracles route as ``least_request``; the
    cost-model policies price transfers over ``link`` when nodes have transfer agents; ``extra``
    are further policy options (e.g. warm-up off for the no-drain baseline)."""
    if name in (ORACLE, ORACLE_POOL):
        return make_policy("least_request")
    options: dict[str, Any] = {"link": link} if link and name in ("kvgate", "kvgate_nopull", KVGATE_AGGREGATED) else {}
    options.update(extra or {})
    if name == KVGATE_AGGREGATED:
        return KvgatePolicy(name=KVGATE_AGGREGATED, disaggregate=False, **options)
    return make_policy(name, **options)


def parse_policies(text: str, allowed: tuple[str, ...] | list[str]) -> list[str]:
    """``"round_robin,kvgate"`` → a checked list, in the order given, without repeats."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"unknown policies {', '.join(unknown)}; choose from {', '.join(allowed)}")
    if not names:
        raise ValueError("no policy given")
    return list(dict.fromkeys(names))


def missing_prerequisites(kinds: Iterable[str]) -> list[str]:
    """What the given gateway kinds (``envoy``, ``kvgate``, ``sglang``) need and this machine lacks,
    one message each, so a run stops before its first policy rather than in the middle."""
    from loadtest.procs import envoy_binary

    problems: list[str] = []
    wanted = set(kinds)
    if wanted & {"envoy", "kvgate"}:
        try:
            envoy_binary()
        except FileNotFoundError as e:
            problems.append(str(e))
    if "sglang" in wanted and importlib.util.find_spec("sglang_router") is None:
        problems.append(SGLANG_MISSING)
    return problems


def check_prerequisites(kinds: Iterable[str]) -> None:
    """``missing_prerequisites`` as a ``RuntimeError`` naming every missing piece."""
    problems = missing_prerequisites(kinds)
    if problems:
        raise RuntimeError("; ".join(problems))
