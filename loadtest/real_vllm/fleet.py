"""N real vLLM engines (CPU build) on this machine, with the same gateways as the simulated fleet.

``VllmFleet`` is a ``LocalFleet`` whose engines are ``vllm serve`` processes: one per core (each
pinned to it), ``--load-format dummy`` over the tiny model directory (``model_dir``), prefix
caching, KV events on a ZMQ PUB with a replay socket, and ``cached_tokens`` in every response
(``--enable-prompt-tokens-details``). The gateways (plain Envoy, Envoy + ``kvgate serve``,
``sglang-router``) are ``LocalFleet``'s; ``kvgate serve`` is told the engines' block size and the
model directory's tokenizer.

Facts this depends on (vLLM 0.32, CPU backend):

- ``VLLM_TARGET_DEVICE=cpu`` is required ("Failed to infer device type" otherwise);
  ``VLLM_CPU_KVCACHE_SPACE`` is the KV cache in GiB; ``VLLM_CPU_OMP_THREADS_BIND`` pins the engine.
- The CPU attention backend takes block sizes that are multiples of 32 only (16 fails at start).
- The KV-event PUB binds wildcard endpoints only (``tcp://*:P``); ``tcp://host:P`` would make it
  *connect* to a collector there. So the engines' event ports listen on every interface.
- ``--num-gpu-blocks-override N`` sizes the cache in blocks (the CPU build too; its
  ``cache_config_info`` then reports N); ``--max-model-len`` must then fit in N − 1 blocks.
- ``POST /reset_prefix_cache`` exists with ``VLLM_SERVER_DEV_MODE=1``; it answers
  ``{"success": false}`` while requests still hold blocks.
- Start-up takes ~40 s an engine. Each engine is a process group (API server + engine core),
  stopped as a group by its pid.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from loadtest.local_fleet import FleetOptions, LocalFleet, Worker, http, wait_until
from loadtest.procs import ManagedProcess, free_ports
from prometheus_client.parser import text_string_to_metric_families
from loadtest.real_vllm.install import DEFAULT_VENV, vllm_binary
from loadtest.real_vllm.model_dir import write_model_dir

BLOCK_SIZE = 32
VLLM_COUNTERS = {
    "requests": "vllm:request_success_total", "hit_tokens": "vllm:prefix_cache_hits_total",
    "query_tokens": "vllm:prefix_cache_queries_total", "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "decode_s": "vllm:request_decode_time_seconds_sum",
}  # sample names, summed over their label sets (finish reasons, DP ranks)


def sample_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each sample name's sum over its label sets in a Prometheus text exposition."""
    wanted = set(names)
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] += sample.value
    return out


@dataclass(frozen=True)
class VllmOptions:
    venv: Path = DEFAULT_VENV
    block_size: int = BLOCK_SIZE
    max_model_len: int = 32768
    kv_cache_gib: int = 1
    max_num_seqs: int = 8
    start_timeout_s: float = 300.0
    kv_blocks: int | None = None  # None: the cache fills kv_cache_gib; N: exactly N blocks (memory binds)

    @property
    def model_len(self) -> int:
        """vLLM refuses to start unless one request of ``--max-model-len`` fits the cache with a block to spare."""
        return min(self.max_model_len, (self.kv_blocks - 1) * self.block_size) if self.kv_blocks else self.max_model_len


def engine_command(vllm: Path, model_dir: Path, served_name: str, w: Worker, o: VllmOptions) -> list[str]:
    """The ``vllm serve`` command line of one engine."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{w.events_port}",
        "replay_endpoint": f"tcp://*:{w.replay_port}",
        "topic": f"kv@{w.address}@{served_name}",
    }
    return [
        str(vllm), "serve", str(model_dir), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(w.port),
        "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager",
        "--block-size", str(o.block_size), "--max-model-len", str(o.model_len),
        "--max-num-seqs", str(o.max_num_seqs),
        *(["--num-gpu-blocks-override", str(o.kv_blocks)] if o.kv_blocks else []),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events),
    ]


def engine_env(core: int, o: VllmOptions) -> dict[str, str]:
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(o.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "OMP_NUM_THREADS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between load-test policies
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",  # the engine's venv, not kvgate's source tree
    }


class VllmFleet(LocalFleet):
    """``with VllmFleet(FleetOptions(nodes=2, model="tiny"), workdir) as fleet:`` — as ``LocalFleet``."""

    def __init__(
        self, options: FleetOptions, workdir: Path, vllm: VllmOptions = VllmOptions(), *,
        serve_extra: dict[str, object] | None = None,
    ) -> None:
        """``serve_extra``: more ``kvgate serve`` settings (e.g. ``admin`` for ``/debug/explain``)."""
        super().__init__(options, workdir)
        self.vllm = vllm
        self.serve_extra = dict(serve_extra or {})
        self.model_dir = self.workdir / "model"
        self.engines: dict[str, ManagedProcess] = {}

    def start(self) -> VllmFleet:
        write_model_dir(self.model_dir)
        super().start()
        return self

    def _start_engines(self, indices: list[int]) -> list[int]:
        binary = vllm_binary(self.vllm.venv)
        cores = os.cpu_count() or 1
        ports = free_ports(3 * len(indices))
        started: list[tuple[int, Worker, ManagedProcess]] = []
        for j, i in enumerate(indices):
            w = Worker(f"n{i + 1}", *ports[3 * j : 3 * j + 3])
            cmd = engine_command(binary, self.model_dir, self.options.model, w, self.vllm)
            p = ManagedProcess(f"vllm-{w.node_id}", cmd, self.workdir, env=engine_env(i % cores, self.vllm), group=True)
            self._procs.append(p)
            started.append((i, w, p))
        failed = []
        for i, w, p in started:
            try:
                p.wait_port(w.port, timeout_s=self.vllm.start_timeout_s)
                wait_until(lambda w=w: http(w.url + "/health", timeout=5)[0] == 200,
                           timeout_s=self.vllm.start_timeout_s, what=f"vLLM {w.node_id} healthy", interval_s=0.5)
                self.workers.append(w)
                self.engines[w.node_id] = p
            except RuntimeError:  # exited before listening (e.g. a port was taken): retried with new ports
                p.stop()
                self._procs.remove(p)
                failed.append(i)
        return failed

    def reset_caches(self, timeout_s: float = 60.0) -> None:
        """``POST /reset_prefix_cache`` on every engine, retried while requests still hold blocks."""
        for w in self.workers:
            wait_until(
                lambda w=w: json.loads(http(w.url + "/reset_prefix_cache", method="POST")[1]).get("success") is True,
                timeout_s=timeout_s, what=f"prefix cache reset of {w.node_id}", interval_s=0.2,
            )

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each engine spent prefilling and decoding requests (vLLM's request_prefill/decode
        time sums: request-seconds, so concurrent requests each count), a counter."""
        return {n: c["prefill_s"] + c["decode_s"] for n, c in self.engine_counters().items()}

    def engine_counters(self) -> dict[str, dict[str, float]]:
        """Per engine, vLLM's own counters (requests finished, prefix-cache hit and query tokens,
        prefill and decode seconds): the per-node figures a client cannot see (vLLM names no node)."""
        out = {}
        for w in self.workers:
            status, text = http(w.url + "/metrics")
            if status == 200:
                sums = sample_sums(text.decode(), VLLM_COUNTERS.values())
                out[w.node_id] = {k: sums[name] for k, name in VLLM_COUNTERS.items()}
        return out

    def serve_settings(self) -> dict[str, object]:
        return {"block_size": self.vllm.block_size, "tokenizer": {"source": str(self.model_dir)}, **self.serve_extra}
