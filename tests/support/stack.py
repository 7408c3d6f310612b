"""A whole request path as real processes: three echo upstreams, `kvgate serve`, Envoy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis

from directory_client import open_directory
from directory_client.types import Tier
from gateway.envoy_config import EnvoySettings
from tests.conftest import free_port
from tests.support.http import eventually, get_json
from tests.redis_servers import purge_prefix
from tests.support.procs import Proc, start_echo, start_envoy, start_kvgate
from tokenizer import PromptTokenizer
from tokenizer.keys import block_keys, namespace_seed

MODEL = "deepseek-chat"
NODES = ("a", "b", "c")


def chat(doc: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": doc}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": MODEL, "messages": messages, "max_tokens": 8}


def document(topic: str, sentences: int = 400) -> str:
    return " ".join(f"Sentence {i} of the {topic} report notes figure {i * 7 % 101}." for i in range(sentences))


def keys_of(tok: PromptTokenizer, path: str, body: dict) -> list[int]:
    prompt = tok.tokenize_body(path, body)
    return block_keys(prompt.token_ids, block_size=16, seed=namespace_seed(prompt.model))


class Stack:
    def __init__(
        self, tmp: Path, envoy_bin: str, redis_url: str, key_prefix: str, integration: str = "ext_proc",
        *, failing: dict[str, int] | None = None, envoy_options: dict | None = None, kvgate_options: dict | None = None,
        roles: dict[str, str] | None = None,
        **envoy_settings: object,  # EnvoySettings fields to change (limits under test)
    ) -> None:
        """``failing``: node → the status it answers every request with; ``envoy_options``: more
        ``EnvoySettings`` fields; ``kvgate_options``: more kvgate config; ``roles``: node → its
        role in the static fleet (default both)."""
        self.tmp, self.redis_url, self.key_prefix = tmp, redis_url, key_prefix
        self.failing, self.envoy_options = failing or {}, {**(envoy_options or {}), **envoy_settings}
        self.kvgate_options = kvgate_options or {}
        self.roles = roles or {}
        self.procs: list[Proc] = []  # everything started, so a failed start still cleans up
        try:
            self._start(envoy_bin, integration)
        except BaseException:
            self.stop()
            raise

    def _start(self, envoy_bin: str, integration: str) -> None:
        tmp, redis_url, key_prefix = self.tmp, self.redis_url, self.key_prefix
        self.node_ports = {n: free_port() for n in NODES}
        self.echos = {}
        for n, p in self.node_ports.items():
            self.echos[n] = self._started(start_echo(n, p, tmp, fail_status=self.failing.get(n, 0)))
        self.ext_proc_port, self.admin_port, self.listen_port = free_port(), free_port(), free_port()
        self.ext_authz_port = free_port()
        self.config = {
            "listen_host": "127.0.0.1",
            "ext_proc_enabled": integration == "ext_proc",
            "ext_proc_port": self.ext_proc_port,
            "ext_authz_port": self.ext_authz_port if integration == "ext_authz" else None,
            "admin_port": self.admin_port,
            "directory": {
                "url": redis_url,
                "key_prefix": key_prefix,
                "heartbeat_ttl_s": 3.0,
                "lookup_timeout_ms": 1000,
            },
            "fleet": [{"node_id": n, "address": self.addr(n), "role": self.roles.get(n, "both")} for n in NODES],
            "limits": {"max_body_bytes": 256 << 10},
            **self.kvgate_options,
        }
        self.kvgate = self._started(start_kvgate(self.config, tmp))
        self.envoy = self._started(start_envoy(
            envoy_bin,
            EnvoySettings(
                fleet=[self.addr(n) for n in NODES],
                integration=integration,
                ext_proc_address=f"127.0.0.1:{self.ext_proc_port}",
                ext_authz_address=f"127.0.0.1:{self.ext_authz_port}",
                listen_address=f"127.0.0.1:{self.listen_port}",
                admin_address=f"127.0.0.1:{free_port()}",
                max_body_bytes=256 << 10,
                message_timeout_ms=2000,
                **self.envoy_options,
            ),
            tmp,
        ))
        eventually(lambda: get_json(f"http://127.0.0.1:{self.admin_port}/readyz")[1].get("live_nodes") == 3, timeout_s=30)

    def addr(self, node: str) -> str:
        return f"127.0.0.1:{self.node_ports[node]}"

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.listen_port}{path}"

    def node_requests(self) -> dict[str, int]:
        return {n: get_json(f"http://{self.addr(n)}/_stats")[1]["requests"] for n in NODES}

    def directory_call(self, fn):
        async def go():
            # a test's own set-up call: not bound by the request path's 0.5 s (a loaded machine may take longer to connect)
            d = open_directory(self.redis_url, key_prefix=self.key_prefix, heartbeat_ttl_s=3.0, op_timeout_s=10.0)
            try:
                return await fn(d)
            finally:
                await d.aclose()

        return asyncio.run(go())

    def seed(self, node: str, keys: list[int]) -> None:
        self.directory_call(lambda d: d.record_stored(node, keys, Tier.GPU))

    def _started(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """Stop every process (Envoy first), then remove this stack's keys from Redis."""
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        try:
            purge_prefix(self.redis_url, self.key_prefix)
        except redis.RedisError:
            pass  # a test's private Redis may be gone already: nothing left to purge


