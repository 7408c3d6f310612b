"""The simulated engine's HTTP face (aiohttp): vLLM's OpenAI API plus debug endpoints.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``POST /tokenize``, ``GET /health``, ``GET /metrics``, ``GET /debug/blocks``,
``POST /debug/reset`` (alias ``POST /reset_prefix_cache``, vLLM's name).

With ``--debug-headers``, every answer to a generation request carries ``x-kvgate-node`` (this engine's node id) and
``x-kvgate-cached-tokens`` (the prefix hit, also in ``usage.prompt_tokens_details``); a request
that came with pull instructions also gets ``x-kvgate-pull`` (``ok``, ``none`` or
``failed:<reason>``) and ``x-kvgate-pulled-blocks`` (``workers.engine.pull``). A request's
``kv_transfer_params`` (vLLM's disaggregated prefill/decode) are honoured the same way
(``workers.engine.disagg``). A streamed answer starts (headers and first chunk) only when the first token is out: the time to the first
chunk is the time to first token, as with a real engine.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.envoy_config import PULL_BLOCKS_HEADER, PULL_SOURCE_HEADER
from gateway.profile import HardwareProfile
from tokenizer import InvalidPrompt, PromptTokenizer, namespace_seed
from workers.engine.kv_cache import CacheEvent
from workers.transfer import SlotTable, TransferAgent, make_backend
from workers.transfer.auth import PeerAuth
from workers.engine.disagg import remote_decode_params, remote_prefill_source, wants_remote_decode
from workers.engine.events import EventPublisher
from workers.engine.kv_cache import NULL_BLOCKS, CacheBusy, PrefixCache, root_hash
from workers.engine.metrics import EngineMetrics
from workers.engine.openai_api import (
    DEFAULT_MAX_TOKENS,
    APIError,
    bad_request,
    chat_chunk,
    chat_response,
    check_model,
    completion_chunk,
    completion_response,
    generation_options,
    models_list,
    usage,
    usage_chunk,
)
from workers.engine.pull import CacheHolder, PullCollector, PullCoordinator, PullOutcome, follow_cache
from workers.engine.runtime import EngineFailed, EngineRuntime, RequestStream
from workers.engine.sampling import ReplySampler
from workers.engine.scheduler import Scheduler, SimRequest

NODE_HEADER = "x-kvgate-node"
CACHED_HEADER = "x-kvgate-cached-tokens"
PULL_HEADER = "x-kvgate-pull"
PULLED_BLOCKS_HEADER = "x-kvgate-pulled-blocks"
# streamed answers only (their headers leave with the first token): the engine's share of the TTFT
ENGINE_TTFT_HEADER = "x-kvgate-engine-ttft-ms"  # arrival here → first token, queue and prefill
INFLIGHT_HEADER = "x-kvgate-engine-inflight"  # requests this engine held when this one arrived


@dataclass(frozen=True)
class EngineConfig:
    """Everything that makes one simulated node."""

    model: str
    profile: HardwareProfile
    node_id: str = "node-0"
    time_scale: float = 1.0
    kv_blocks: int | None = None  # None: the profile's capacity
    max_model_len: int | None = None  # None: the profile's, capped by the KV capacity
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    transfer_port: int | None = None  # None: no transfer agent (cannot serve or pull blocks)
    transfer_host: str = "127.0.0.1"  # address the agent binds and advertises
    transfer_backend: str = "kvgate-tcp"
    transfer_device: str = ""  # RDMA device for rdma backends ("" = the first)
    transfer_link: str = "tcp"  # link whose speed models a pull's time (the gateway's policy.link)
    transfer_payload_bytes: int = 4096  # real bytes kept per block (the full-size KV is modelled)
    pull_timeout_s: float = 5.0  # real seconds a pull may take before the request recomputes
    debug_headers: bool = False  # answer with x-kvgate-* headers (node, cache hit, pull): benchmarks, tests
    transfer_secret_file: str = ""  # the fleet's transfer secret (required with transfer_port)
    transfer_peers: tuple[str, ...] | None = None  # transfer endpoints pulls may come from (None: any signed peer)

    @property
    def capacity_blocks(self) -> int:
        return self.kv_blocks or self.profile.kv_capacity_blocks

    @property
    def effective_max_model_len(self) -> int:
        """No request may need more KV than the cache holds (its null block aside), or it could never run."""
        cap = (self.capacity_blocks - NULL_BLOCKS) * self.profile.block_size
        return min(self.max_model_len or self.profile.max_model_len, cap)


class Engine:
    """One simulated node: tokenizer, reply sampler, cache, scheduler, runtime, metrics, events."""

    def __init__(self, config: EngineConfig, tokenizer: PromptTokenizer, events: EventPublisher | None = None) -> None:
        if config.default_max_tokens < 1:
            raise ValueError("default max_tokens must be >= 1")
        self.config = config
        self.tokenizer = tokenizer
        self.sampler = ReplySampler.from_encoder(lambda s: tokenizer.encode_text(s, add_special_tokens=False))
        self.cache = PrefixCache(config.capacity_blocks, config.profile.block_size, null_blocks=NULL_BLOCKS)
        self.scheduler = Scheduler(
            config.profile,
            self.cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.metrics = EngineMetrics(self.scheduler, config.model)
        self.events = events
        self.slots: SlotTable | None = None
        self.runtime = EngineRuntime(
            self.scheduler,
            time_scale=config.time_scale,
            metrics=self.metrics,
            publish=self._on_cache_events,
        )
        agent = None
        if config.transfer_port is not None:
            auth = PeerAuth.from_file(config.transfer_secret_file, config.node_id)
            self.slots = SlotTable(config.capacity_blocks, config.transfer_payload_bytes, checksum_key=auth.checksum_key)
            backend = make_backend(
                config.transfer_backend, host=config.transfer_host, auth=auth, device=config.transfer_device
            )
            agent = TransferAgent(
                backend, self.slots, CacheHolder(self.cache, self.runtime), auth=auth, peers=config.transfer_peers
            )
        self.transfer = agent
        self.pulls = PullCoordinator(
            agent, self.runtime, config.profile,
            link=config.transfer_link, time_scale=config.time_scale, timeout_s=config.pull_timeout_s,
        )
        self.metrics.registry.register(PullCollector(self.pulls, config.model))
        self.max_model_len = config.effective_max_model_len
        self.created = int(time.time())

    def _on_cache_events(self, records: Sequence[CacheEvent]) -> None:
        if self.slots is not None:
            follow_cache(self.slots, records)
        if self.events is not None:
            self.events.publish(records)

    async def start(self) -> None:
        await self.runtime.start()
        if self.transfer is not None:
            assert self.config.transfer_port is not None
            await self.transfer.start(self.config.transfer_host, self.config.transfer_port)

    async def close(self) -> None:
        if self.transfer is not None:
            await self.transfer.close()
        await self.runtime.close()
        if self.events is not None:
            self.events.close()


# -- handlers ---------------------------------------------------------------------------------

ENGINE_KEY = web.AppKey("engine", Engine)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps(data).encode(), status=status, content_type="application/json", headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return _json(e.body(), e.status)
    except EngineFailed as e:
        return _json(APIError(500, f"engine failed: {e}", "InternalServerError").body(), 500)


async def _read_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"Invalid JSON body: {e}") from None


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    cfg = engine.config
    arrival_wall = time.monotonic()
    body = await _read_body(request)
    check_model(body, cfg.model)
    try:
        tp = await engine.tokenizer.tokenize_body_async(request.path, body)
    except InvalidPrompt as e:
        raise bad_request(str(e)) from None
    n_prompt = len(tp.token_ids)
    opts = generation_options(
        body, chat=chat, prompt_tokens=n_prompt, max_model_len=engine.max_model_len,
        default_max_tokens=cfg.default_max_tokens,
    )
    reply = engine.sampler.reply(tp.token_ids, opts.max_tokens, ignore_eos=opts.ignore_eos, min_tokens=opts.min_tokens)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    sim = SimRequest.create(
        rid,
        tp.token_ids,
        reply,
        block_size=cfg.profile.block_size,
        root_hash=root_hash(lora=tp.lora, cache_salt=tp.cache_salt),
        key_seed=namespace_seed(cfg.model, lora=tp.lora, cache_salt=tp.cache_salt),
        arrival=time.monotonic(),
        lora=tp.lora,
        cache_salt=tp.cache_salt,
        answers=opts.answers,
    )
    source, blocks = remote_prefill_source(body) or (request.headers.get(PULL_SOURCE_HEADER), request.headers.get(PULL_BLOCKS_HEADER))
    pull = await engine.pulls.prepare(sim, source, blocks)
    inflight = engine.runtime.inflight
    stream = engine.pulls.submit(sim, pull, arrival_wall)
    try:
        if opts.stream:
            return await _stream(request, engine, stream, pull, chat=chat, include_usage=opts.include_usage,
                                 inflight=inflight)  # fmt: skip
        while not stream.finished:
            await stream.wait_change()
        text = engine.tokenizer.decode(_reply_ids(sim, sim.generated))
        use = usage(n_prompt, sim.generated * sim.answers, sim.cached_tokens)
        shape = chat_response if chat else completion_response
        answer = shape(rid, engine.created, cfg.model, text, sim.finish_reason, use, sim.answers)
        if wants_remote_decode(body):
            answer["kv_transfer_params"] = remote_decode_params(engine.transfer, cfg.node_id, n_prompt // cfg.profile.block_size)
        return _json(answer, headers=_headers(engine, sim, pull))
    finally:
        if not sim.finished:
            engine.runtime.abort(rid)


def _reply_ids(sim: SimRequest, n: int) -> Any:
    return sim.tokens[sim.num_prompt : sim.num_prompt + n]


def _headers(engine: Engine, sim: SimRequest, pull: PullOutcome) -> dict[str, str]:
    if not engine.config.debug_headers:  # internals are nobody's business but a benchmark's
        return {}
    headers = {NODE_HEADER: engine.config.node_id, CACHED_HEADER: str(max(sim.cached_tokens, 0))}
    if pull.status != "absent":
        headers[PULL_HEADER] = f"failed:{pull.reason}" if pull.status == "failed" else pull.status
        headers[PULLED_BLOCKS_HEADER] = str(pull.blocks)
    return headers


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def _stream(
    request: web.Request, engine: Engine, stream: RequestStream, pull: PullOutcome, *, chat: bool, include_usage: bool,
    inflight: int = 0,
) -> web.StreamResponse:
    sim = stream.request
    model = engine.config.model
    created = engine.created
    rid = sim.request_id
    while stream.generated == 0 and not stream.finished:
        await stream.wait_change()  # prefill: nothing is sent before the first token
    headers = _headers(engine, sim, pull)
    if headers:  # a benchmark splits the client's TTFT into this engine's part and the path in front
        headers[ENGINE_TTFT_HEADER] = f"{(time.monotonic() - stream.arrival_wall) * 1000.0:.3f}"
        headers[INFLIGHT_HEADER] = str(inflight)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    answers = range(sim.answers)  # each choice streams the same text (one reply per prompt)
    if chat:
        for k in answers:
            await resp.write(_sse(chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, include_usage, k)))
    sent_text = ""
    while True:
        done = stream.finished
        text = engine.tokenizer.decode(_reply_ids(sim, stream.generated))
        delta, sent_text = text[len(sent_text) :], text
        reason = sim.finish_reason if done else None
        if delta or done:
            for k in answers:
                if chat:
                    chunk = chat_chunk(rid, created, model, {"content": delta} if delta else {}, reason, include_usage, k)
                else:
                    chunk = completion_chunk(rid, created, model, delta, reason, include_usage, k)
                await resp.write(_sse(chunk))
        if done:
            break
        await stream.wait_change()
    if include_usage:
        use = usage(sim.num_prompt, sim.generated * sim.answers, sim.cached_tokens)
        await resp.write(_sse(usage_chunk(rid, created, model, chat=chat, usage_=use)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json(models_list(engine.config.model, engine.created, engine.max_model_len))


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.runtime.failure is not None:
        return _json(APIError(500, f"engine failed: {engine.runtime.failure!r}", "InternalServerError").body(), 500)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(body=engine.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def debug_blocks(request: web.Request) -> web.Response:
    """Every block the engine holds: its engine hash, kvgate key and medium (parents first)."""
    engine = request.app[ENGINE_KEY]
    cache = engine.cache
    blocks = [
        {
            "engine_hash": b.block_hash,
            "kvgate_key": b.kvgate_key,
            "parent_engine_hash": b.parent.block_hash if b.parent is not None else None,
            "depth": b.depth,
            "ref_count": b.ref_count,
            "medium": cache.medium,
        }
        for b in cache.blocks()
    ]
    stats = cache.stats()
    return _json(
        {
            "node_id": engine.config.node_id,
            "model": engine.config.model,
            "block_size": cache.block_size,
            "capacity_blocks": stats.capacity_blocks,
            "private_blocks": stats.private_blocks,
            "blocks": blocks,
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize``: a chat (``messages``) or a completion prompt, as this engine would see it."""
    engine = request.app[ENGINE_KEY]
    body = await _read_body(request)
    check_model(body, engine.config.model)
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    try:
        tp = await engine.tokenizer.tokenize_body_async(path, body)
    except InvalidPrompt as e:
        raise bad_request(str(e)) from None
    tokens = [int(t) for t in tp.token_ids]
    return _json({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens})


async def debug_reset(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        cleared = engine.runtime.reset_cache()
    except CacheBusy as e:
        return _json(APIError(409, str(e), "ConflictError").body(), 409)
    return _json({"cleared_blocks": cleared})


def create_app(engine: Engine) -> web.Application:
    """The aiohttp app; starting it starts the engine loop, cleaning it up stops loop and events."""
    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)
    app[ENGINE_KEY] = engine

    async def lifecycle(app: web.Application) -> Any:
        await engine.start()
        yield
        await engine.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/blocks", debug_blocks)
    app.router.add_post("/debug/reset", debug_reset)
    app.router.add_post("/reset_prefix_cache", debug_reset)
    return app
