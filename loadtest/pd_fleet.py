"""The disaggregated half of a local fleet (``replay --roles P:D``): roles, transfer agents, sidecars.

Engines ``n1..nP`` are prefill nodes, the rest decode nodes; every engine runs a transfer agent
(TCP, signed with one secret made for the fleet) modelling transfers over ``link``. Each decode
node gets a ``kvgate pd-sidecar`` in front of its engine, which may call only the fleet's prefill
nodes; the sidecar's address is the node's address in kvgate's fleet and Envoy's, so a split
request reaches it with ``x-prefiller-host-port`` and a whole one passes through.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.procs import ManagedProcess, free_ports, python_module

if TYPE_CHECKING:
    from loadtest.local_fleet import FleetOptions, Worker


def parse_roles(text: str | None, nodes: int | None = None) -> tuple[int, int] | None:
    """``"P:D"`` → (P, D): at least one of each, adding up to ``nodes`` when given; None → None."""
    if text is None:
        return None
    p, sep, d = text.partition(":")
    if not sep or not p.isdigit() or not d.isdigit():
        raise ValueError(f"--roles {text!r} is not P:D (e.g. 2:6)")
    roles = int(p), int(d)
    if min(roles) < 1 or (nodes is not None and sum(roles) != nodes):
        where = f" and add up to {nodes} nodes" if nodes is not None else ""
        raise ValueError(f"roles {text} must be at least one of each{where}")
    return roles


class PdFleet:
    """What a disaggregated fleet adds to ``LocalFleet``'s engines."""

    def __init__(self, options: FleetOptions, workdir: Path) -> None:
        assert options.roles is not None
        self.prefill_nodes = options.roles[0]
        self.link = options.link
        self.secret = workdir / "transfer-secret"
        self.secret.write_bytes(secrets.token_bytes(32))
        self.secret.chmod(0o600)

    def with_role(self, w: Worker, index: int, transfer_port: int) -> Worker:
        return replace(w, role="prefill" if index < self.prefill_nodes else "decode", transfer_port=transfer_port)

    def worker_args(self, w: Worker) -> list[str]:
        return ["--transfer-port", str(w.transfer_port), "--transfer-secret-file", str(self.secret),
                "--transfer-link", self.link]  # fmt: skip

    def start_sidecars(self, workers: list[Worker], procs: list[ManagedProcess]) -> list[Worker]:
        """A sidecar in front of every decode engine; the workers with their sidecar ports."""
        prefillers = [a for w in workers if w.role == "prefill" for a in ("--prefiller", f"127.0.0.1:{w.port}")]
        decoders = [w for w in workers if w.role == "decode"]
        ports = dict(zip((w.node_id for w in decoders), free_ports(len(decoders)), strict=True))
        started = []
        for w in decoders:
            p = python_module(
                f"pd-sidecar-{w.node_id}", "gateway.cli",
                ["pd-sidecar", "--port", str(ports[w.node_id]), "--engine", f"http://127.0.0.1:{w.port}", *prefillers],
                Path(self.secret.parent),
            )  # fmt: skip
            procs.append(p)
            started.append(p)
        for w, p in zip(decoders, started, strict=True):
            p.wait_port(ports[w.node_id], timeout_s=60)
        return [replace(w, sidecar_port=ports.get(w.node_id, 0)) for w in workers]
