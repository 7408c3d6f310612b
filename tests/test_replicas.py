"""Active-active replicas: two `kvgate serve` processes behind one Envoy share load accounting
through the directory (Redis), so under concurrent load they spread requests over the nodes no
worse than one replica does: neither herds onto a node the other has just filled.

What a user sees: the busiest node holds about as many requests at once, and the request counts
are about as even, with two replicas as with one. Real Envoy (ext_proc cluster with one or two
endpoints), real kvgate processes, real Redis, four upstream nodes that hold each request 0.3 s.
"""

from __future__ import annotations

import json
import statistics
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.envoy_config import EnvoySettings
from tests.conftest import free_port
from tests.redis_servers import purge_prefix
from tests.support.http import eventually, get_json, request
from tests.support.procs import Proc, python_module, start_envoy, start_kvgate, wait_for_port

MODEL = "deepseek-chat"
NODES = 4
REQUESTS = 160
CONCURRENCY = 16


@dataclass
class Spread:
    replicas: int
    counts: list[int]
    peaks: list[int]

    @property
    def max_peak(self) -> int:
        return max(self.peaks)

    @property
    def imbalance(self) -> float:
        """Busiest node's requests over the mean (1.0 = perfectly even)."""
        return max(self.counts) / statistics.mean(self.counts)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replica-nodes")
    ports = [free_port() for _ in range(NODES)]
    procs = [
        python_module(f"node{i}", "tests.support.echo_upstream", ["--port", str(p), "--name", f"n{i}", "--delay", "0.3"], tmp)
        for i, p in enumerate(ports)
    ]
    for p, proc in zip(ports, procs):
        wait_for_port(p, proc=proc.popen)
    yield [f"127.0.0.1:{p}" for p in ports]
    for proc in procs:
        proc.stop()


def run_fleet(tmp: Path, envoy_bin: str, redis_url: str, nodes: list[str], replicas: int) -> Spread:
    """Start `replicas` kvgate processes sharing one key prefix, Envoy over them, send the load."""
    prefix = f"kvgate-test:{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []
    ports = []
    try:
        for r in range(replicas):
            ext_proc, admin = free_port(), free_port()
            ports.append((ext_proc, admin))
            cfg = {
                "listen_host": "127.0.0.1",
                "ext_proc_port": ext_proc,
                "admin_port": admin,
                "models": [MODEL],
                "directory": {"url": redis_url, "key_prefix": prefix, "heartbeat_ttl_s": 3.0, "lookup_timeout_ms": 500},
                "fleet": [{"node_id": f"n{i}", "address": a} for i, a in enumerate(nodes)],
                "log": {"level": "WARNING"},
            }
            procs.append(start_kvgate(cfg, tmp, name=f"kvgate-{replicas}-{r}"))
        listen = free_port()
        procs.append(
            start_envoy(
                envoy_bin,
                EnvoySettings(
                    fleet=nodes,
                    ext_proc_addresses=[f"127.0.0.1:{p}" for p, _ in ports],
                    listen_address=f"127.0.0.1:{listen}",
                    admin_address=f"127.0.0.1:{free_port()}",
                    message_timeout_ms=2000,
                ),
                tmp,
                name=f"envoy-{replicas}",
            )
        )
        for _, admin in ports:
            eventually(lambda a=admin: get_json(f"http://127.0.0.1:{a}/readyz")[1].get("live_nodes") == NODES, timeout_s=30)
        for n in nodes:
            request(f"http://{n}/_reset", method="POST")

        def send(i: int) -> tuple[int, str]:
            # unique prompts: nothing is cached anywhere, so only the load decides
            body = {"model": MODEL, "prompt": f"request {i} of {uuid.uuid4().hex}: " + "tell me more. " * 20, "max_tokens": 4}
            status, headers, raw = request(
                f"http://127.0.0.1:{listen}/v1/completions", method="POST", body=json.dumps(body).encode(),
                headers={"content-type": "application/json"}, timeout=30,
            )  # fmt: skip
            return status, headers.get("x-gateway-destination-endpoint", "")

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(send, range(REQUESTS)))
        assert all(s == 200 for s, _ in results), [r for r in results if r[0] != 200][:5]
        stats = [get_json(f"http://{n}/_stats")[1] for n in nodes]
        return Spread(replicas, [s["requests"] for s in stats], [s["peak"] for s in stats])
    finally:
        for p in reversed(procs):
            p.stop()
        purge_prefix(redis_url, prefix)


def test_two_replicas_spread_load_no_worse_than_one(tmp_path: Path, envoy_bin: str, redis_url: str, nodes: list[str]) -> None:
    one = run_fleet(tmp_path, envoy_bin, redis_url, nodes, replicas=1)
    two = run_fleet(tmp_path, envoy_bin, redis_url, nodes, replicas=2)
    for s in (one, two):
        print(f"\n{s.replicas} replica(s): requests per node {s.counts} (busiest/mean {s.imbalance:.2f}), "
              f"most held at once per node {s.peaks} (ideal {CONCURRENCY // NODES})", file=sys.stderr)  # fmt: skip
    assert sum(one.counts) == sum(two.counts) == REQUESTS  # every request reached a node, once
    # the two replicas see each other's reservations: no node gets a herd
    assert two.max_peak <= one.max_peak + 2, (one, two)
    assert two.imbalance <= one.imbalance + 0.25, (one, two)
    assert two.max_peak <= 2 * (CONCURRENCY // NODES), two
