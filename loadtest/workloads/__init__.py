"""Workloads: deterministic, bounded request schedules (real trace, multi-turn chat, shared prefixes).

Every workload is a list of ``Session`` objects (``base.py``); the replay client and the simulator
drive the same sessions, so both see exactly the same traffic.
"""

from loadtest.workloads.base import RequestSpec, Session, Workload

__all__ = ["RequestSpec", "Session", "Workload"]
