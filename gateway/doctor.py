"""``kvgate doctor``: does each node's cache speak kvgate's keys? Checked end to end, per node.

A node whose blocks are keyed differently from kvgate's prompts is never hit, and nothing fails:
routing silently falls back to load. The doctor sends a canary prompt to each node and names the
**first** thing that differs, in the order a cause hides the next:

1. ``reachable``: the node answers ``GET /v1/models``;
2. ``model name``: it serves the model name kvgate keys its blocks with (``models`` / node ``model``);
3. ``tokenizer``: its ``POST /tokenize`` of plain text equals kvgate's;
4. ``chat template``: its ``POST /tokenize`` of a chat equals kvgate's;
5. ``events``: with the canary sent twice, its KV events report the canary's blocks, in blocks of
   kvgate's ``block_size`` (``block size`` otherwise), with the very token IDs kvgate keys, and
   the second answer's ``usage.prompt_tokens_details.cached_tokens`` shows the hit (``prefix
   caching`` otherwise: the engine needs ``--enable-prefix-caching`` and
   ``--enable-prompt-tokens-details``);
6. ``salt``: a salted canary's events carry its ``cache_salt`` where the bridge reads it, so the
   keys the bridge derives equal kvgate's for the salted prompt.

Keys equal when model name, block size, token IDs and salt do: both sides call
``tokenizer.block_keys`` seeded by ``namespace_seed`` (the doctor computes both and compares them).
Nodes are read from ``fleet`` in the config; each canary carries a fresh nonce, so it never
matches an earlier prompt. Exit status 0 when every node passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import zmq

from gateway.config import KvgateConfig, NodeConfig, load_config
from tokenizer import PromptTokenizer, block_keys, namespace_seed
from workers.bridge import read_extra_keys
from workers.kv_events import BlockStored, KVEventDecodeError, decode_batch

CHAT = "/v1/chat/completions"
CANARY = (
    "kvgate doctor canary. The harbour authority recorded a steady rise in traffic near Ashford, "
    "and the regional council confirmed fewer delays than last year. Meanwhile, the survey measured "
    "a sharp drop in water levels, which affected about 312 households in the northern district. "
    "Figures for Belmont show 87 cases in March, up from 54 a year earlier; the committee reviewed "
    "them twice before the annual report went out to every office along the river."
)


@dataclass(frozen=True)
class Finding:
    node_id: str
    ok: bool
    check: str  # the first check that failed, or "all" when every one passed
    detail: str

    def line(self) -> str:
        return f"{self.node_id}: {'OK' if self.ok else 'FAIL'} {self.check}: {self.detail}"


class _Failed(Exception):
    def __init__(self, check: str, detail: str) -> None:
        super().__init__(detail)
        self.check = check
        self.detail = detail


def _http(url: str, body: Any = None, timeout_s: float = 30.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _first_difference(a: list[int], b: list[int]) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"kvgate {len(a)} tokens, node {len(b)}; first difference at token {at}"


class NodeDoctor:
    """The checks for one node (see the module docstring)."""

    def __init__(self, cfg: KvgateConfig, node: NodeConfig, tokenizer: PromptTokenizer, *, timeout_s: float = 10.0) -> None:
        self.cfg = cfg
        self.node = node
        self.model = cfg.node_model(node)
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.base = f"http://{node.address}"

    def run(self) -> Finding:
        try:
            detail = self._checks()
        except _Failed as f:
            return Finding(self.node.node_id, False, f.check, f.detail)
        return Finding(self.node.node_id, True, "all", detail)

    def _checks(self) -> str:
        try:
            served = [m.get("id") for m in _http(self.base + "/v1/models", timeout_s=self.timeout_s).get("data", [])]
        except (OSError, ValueError) as e:
            raise _Failed("reachable", f"GET {self.base}/v1/models: {e}") from None
        if self.model not in served:
            raise _Failed("model name", f"node serves {served}, kvgate keys its blocks as {self.model!r}")
        nonce = uuid.uuid4().hex[:12]
        text = f"{nonce} {CANARY}"
        ours = self.tokenizer.encode_text(text, add_special_tokens=False).tolist()
        theirs = self._tokenize({"model": self.model, "prompt": text, "add_special_tokens": False})
        if ours != theirs:
            raise _Failed("tokenizer", _first_difference(ours, theirs))
        body = {"model": self.model, "messages": [{"role": "system", "content": f"canary {nonce}"},
                                                  {"role": "user", "content": CANARY}]}
        ours = self.tokenizer.tokenize_body(CHAT, body).token_ids.tolist()
        theirs = self._tokenize(body)
        if ours != theirs:
            raise _Failed("chat template", _first_difference(ours, theirs))
        if not self.node.events_endpoint:
            return "tokens equal; no events_endpoint configured, so blocks were not checked"
        blocks = self._check_events(body, ours, salt=None)
        self._check_events({**body, "messages": [{"role": "system", "content": f"salted {nonce}"}, *body["messages"][1:]]},
                           None, salt=f"doctor-{nonce}")
        return f"{blocks} blocks of {self.cfg.block_size} tokens keyed equally, salted and unsalted"

    def _tokenize(self, body: dict[str, Any]) -> list[int]:
        try:
            return list(_http(self.base + "/tokenize", body, timeout_s=self.timeout_s)["tokens"])
        except (OSError, ValueError, KeyError) as e:
            raise _Failed("reachable", f"POST {self.base}/tokenize: {e}") from None

    def _check_events(self, body: dict[str, Any], ours: list[int] | None, *, salt: str | None) -> int:
        """Send ``body`` twice; compare the blocks the node's events report with kvgate's keys."""
        if ours is None:
            ours = self.tokenizer.tokenize_body(CHAT, body).token_ids.tolist()
        bs = self.cfg.block_size
        full = len(ours) // bs
        if full == 0:
            raise _Failed("block size", f"the canary ({len(ours)} tokens) is shorter than one block of {bs}")
        request = {**body, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.node.events_endpoint)
        try:
            time.sleep(0.3)  # a SUB misses what is published before its subscription arrives
            try:
                _http(self.base + CHAT, request, timeout_s=self.timeout_s * 6)
                usage = _http(self.base + CHAT, request, timeout_s=self.timeout_s * 6).get("usage") or {}
            except (OSError, ValueError) as e:
                raise _Failed("reachable", f"POST {self.base}{CHAT}: {e}") from None
            stored = self._stored_chain(sub, ours[:bs])
        finally:
            sub.close()
        if not stored:
            raise _Failed("events", f"no BlockStored event for the canary on {self.node.events_endpoint} within "
                                    f"{self.timeout_s:g} s (KV events off, or another endpoint?)")
        sizes = {ev.block_size or len(ev.token_ids) // max(len(ev.block_hashes), 1) for ev in stored}
        if sizes != {bs}:
            raise _Failed("block size", f"node stores blocks of {sorted(sizes)} tokens, kvgate's block_size is {bs}")
        tokens = [t for ev in stored for t in ev.token_ids]
        if tokens != ours[: len(tokens)] or len(tokens) < full * bs:
            raise _Failed("events", "the tokens in the node's events are not the canary's: " + _first_difference(ours[: full * bs], tokens))
        event_salt = _salt_of(stored[0])
        if event_salt != salt:
            raise _Failed("salt", f"the node's events carry cache_salt {event_salt!r} for a prompt salted {salt!r}")
        ours_keys = block_keys(ours, block_size=bs, seed=namespace_seed(self.model, cache_salt=salt))
        theirs_keys = block_keys(tokens, block_size=bs, seed=namespace_seed(self.model, cache_salt=event_salt))
        if ours_keys[: len(theirs_keys)] != theirs_keys:
            raise _Failed("events", "block keys differ although tokens, model and salt agree")
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if cached < bs:
            raise _Failed("prefix caching", f"the canary sent twice reports cached_tokens {cached} (the engine needs "
                                            "--enable-prefix-caching and --enable-prompt-tokens-details)")
        return full

    def _stored_chain(self, sub: zmq.Socket, first_block: list[int]) -> list[BlockStored]:
        """The canary's BlockStored events: from the one starting with its first block, in order."""
        chain: list[BlockStored] = []
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if not sub.poll(timeout=100):
                if chain:
                    return chain
                continue
            frames = sub.recv_multipart()
            try:
                events = decode_batch(frames[-1]).events
            except KVEventDecodeError:
                continue
            for ev in events:
                if not isinstance(ev, BlockStored) or ev.medium not in (None, "GPU"):
                    continue
                if not chain and ev.parent_block_hash is None and ev.token_ids[: len(first_block)] == first_block:
                    chain.append(ev)
                elif chain and ev.parent_block_hash == chain[-1].block_hashes[-1]:
                    chain.append(ev)
        return chain


def _salt_of(ev: BlockStored) -> str | None:
    """The cache salt the bridge reads from a chain's first event (vLLM: block 0's ``extra_keys``)."""
    salt, _ = read_extra_keys(ev.extra_keys, len(ev.block_hashes), root=ev.parent_block_hash is None, lora_name=ev.lora_name)
    return salt


def diagnose(
    cfg: KvgateConfig, *, timeout_s: float = 10.0, only: str | None = None, tokenizer: PromptTokenizer | None = None
) -> list[Finding]:
    """Every configured node's finding (or only ``only``'s)."""
    tokenizer = tokenizer or load_tokenizer(cfg)
    nodes = [n for n in cfg.fleet if only is None or n.node_id == only]
    return [NodeDoctor(cfg, n, tokenizer, timeout_s=timeout_s).run() for n in nodes]


def load_tokenizer(cfg: KvgateConfig) -> PromptTokenizer:
    """The tokenizer and chat template ``kvgate serve`` loads with this config."""
    return PromptTokenizer(cfg.tokenizer.source, chat_template=cfg.tokenizer.chat_template)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="kvgate config file (the one `kvgate serve` runs with)")
    p.add_argument("--node", default=None, help="check this node only")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a node's events")
    p.add_argument("--json", action="store_true", help="print findings as JSON lines")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except (ValueError, OSError) as e:
        print(f"kvgate doctor: {e}", file=sys.stderr)
        return 2
    if not cfg.fleet:
        print("kvgate doctor: no nodes in `fleet` to check", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(cfg)
    loaded = tokenizer.loaded()  # what every check below compares the engines against
    if args.json:
        print(json.dumps({"kvgate": loaded}))
    else:
        print(f"kvgate: tokenizer {loaded['source']} (vocab {loaded['vocab']}), chat template {loaded['chat_template']}")
    findings = diagnose(cfg, timeout_s=args.timeout, only=args.node, tokenizer=tokenizer)
    for f in findings:
        print(json.dumps(asdict(f)) if args.json else f.line())
    return 0 if findings and all(f.ok for f in findings) else 1
