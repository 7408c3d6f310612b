"""``kvgate doctor`` inside ``kvgate serve``: each node checked at start and every ``interval_s``.

A node whose cache does not speak kvgate's keys (another model name, block size, tokenizer, chat
template or salt placement) is never hit, and nothing fails. The serving process runs the very
checks of ``kvgate doctor`` (``gateway.doctor.NodeDoctor``) against each configured node, off the
event loop, and a node that fails one is **degraded**: its cached prefixes are hidden from the
policy (``vet`` sets them to 0), so it is routed by load only, until a later run passes. It says
so: one log line naming the node and the first thing that differs,
``kvgate_node_doctor_degraded{node,check}`` = 1, ``/readyz`` under ``degraded_nodes`` and
``/debug/nodes`` (``doctor``).

A node that does not answer (``reachable``) is not degraded: it is down or still starting, which
liveness already handles; it is checked again after ``retry_s``. Each run sends the node four
one-token requests (the canary and a salted canary, twice each), so keep ``interval_s`` long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import TypeVar

from prometheus_client import Counter, Gauge

from directory_client.types import DirectoryView, Tier
from gateway.config import KvgateConfig, NodeConfig
from gateway.doctor import Finding, NodeDoctor
from gateway.metrics import REGISTRY
from tokenizer import PromptTokenizer

log = logging.getLogger("kvgate.doctor")
T = TypeVar("T")

DOCTOR_DEGRADED = Gauge(
    "kvgate_node_doctor_degraded",
    "1 while the node failed the doctor's canary check (check: the first that failed) and is routed by load only",
    ["node", "check"],
    registry=REGISTRY,
)
DOCTOR_RUNS = Counter(
    "kvgate_node_doctor_runs", "Canary checks of a node by outcome (ok, degraded, unreachable)", ["node", "outcome"],
    registry=REGISTRY,
)  # fmt: skip

NOT_DEGRADING = frozenset({"reachable"})
"""Checks whose failure says the node is down or starting, not that its keys differ."""


class NodeVerdicts:
    """The latest finding per node; ``vet`` hides degraded nodes' cached prefixes from lookups."""

    def __init__(self) -> None:
        self.findings: dict[str, Finding] = {}
        self._degraded: dict[str, str] = {}  # node id -> the failed check
        self.checked_at: dict[str, float] = {}  # node id -> wall clock of the finding

    def record(self, finding: Finding) -> None:
        node = finding.node_id
        was = self._degraded.get(node)
        self.findings[node] = finding
        self.checked_at[node] = time.time()
        if finding.ok:
            DOCTOR_RUNS.labels(node, "ok").inc()
            if was is not None:
                del self._degraded[node]
                DOCTOR_DEGRADED.labels(node, was).set(0)
                log.info("node %s: the doctor's canary check passes again; routed on its cache", node)
            return
        if finding.check in NOT_DEGRADING:
            DOCTOR_RUNS.labels(node, "unreachable").inc()
            log.info("node %s: canary check not run: %s", node, finding.detail)
            return
        DOCTOR_RUNS.labels(node, "degraded").inc()
        if was is not None and was != finding.check:
            DOCTOR_DEGRADED.labels(node, was).set(0)
        self._degraded[node] = finding.check
        DOCTOR_DEGRADED.labels(node, finding.check).set(1)
        log.error("node %s: degraded, routed by load only: canary check %r failed: %s", node, finding.check, finding.detail)

    def degraded(self) -> dict[str, str]:
        """Degraded nodes and why (``check: detail``)."""
        return {n: f"doctor {c}: {self.findings[n].detail}" for n, c in self._degraded.items()}

    def view(self, node_id: str) -> dict[str, object] | None:
        """What ``/debug/nodes`` shows of the node's last check."""
        finding = self.findings.get(node_id)
        if finding is None:
            return None
        return {**asdict(finding), "degraded": node_id in self._degraded, "checked_at": self.checked_at[node_id]}

    def vet(self, view: DirectoryView) -> DirectoryView:
        """``view`` with degraded nodes holding nothing of the prompt (chosen by load alone)."""
        if not self._degraded or not any(nv.node.node_id in self._degraded and nv.cached_blocks for nv in view.nodes):
            return view
        nodes = tuple(
            replace(nv, cached_blocks=0, tier=Tier.GPU) if nv.node.node_id in self._degraded else nv for nv in view.nodes
        )
        return replace(view, nodes=nodes)


class PeriodicDoctor:
    """Run ``NodeDoctor`` against every node at start and every ``interval_s`` (in a thread)."""

    def __init__(
        self,
        cfg: KvgateConfig,
        tokenizer: PromptTokenizer,
        verdicts: NodeVerdicts,
        *,
        nodes: Sequence[NodeConfig] | None = None,
        interval_s: float,
        timeout_s: float = 10.0,
        retry_s: float = 30.0,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.verdicts = verdicts
        self.nodes = [n for n in (cfg.fleet if nodes is None else nodes) if cfg.node_model(n)]
        for n in cfg.fleet if nodes is None else nodes:
            if not cfg.node_model(n):
                log.warning("node %s: not checked by the doctor: no model to key it with (set its `model` or `models`)", n.node_id)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.retry_s = min(retry_s, interval_s)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(n), name=f"doctor-{n.node_id}") for n in self.nodes]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def check(self, node: NodeConfig) -> Finding:
        """One run of the node's checks, recorded."""
        doctor = NodeDoctor(self.cfg, node, self.tokenizer, timeout_s=self.timeout_s)
        try:
            finding = await _in_daemon_thread(doctor.run, f"doctor-{node.node_id}")
        except Exception as e:  # a bug in a check must not stop the others, nor degrade the node
            log.exception("node %s: canary check crashed", node.node_id)
            finding = Finding(node.node_id, False, "reachable", f"the check crashed: {type(e).__name__}: {e}")
        self.verdicts.record(finding)
        return finding

    async def _follow(self, node: NodeConfig) -> None:
        while True:
            finding = await self.check(node)
            unreached = not finding.ok and finding.check in NOT_DEGRADING
            await asyncio.sleep(self.retry_s if unreached else self.interval_s)


async def _in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` in a daemon thread: a check still waiting on a node never holds up shutdown."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (fn(), None)
        except BaseException as e:  # handed to the awaiting task
            outcome = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await done
