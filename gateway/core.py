"""The request path's one entry point, shared by both Envoy integrations (ext_proc, ext_authz).

``RoutingCore.route`` turns an inference request body into one of three answers:
- ``routed``: set these headers (the chosen node, pull instructions) — the load is reserved
  on the node and must be given back with ``release`` when the response ends;
- ``rejected``: the body is not a valid inference request; answer the client with this HTTP
  status and JSON error body, and touch no node (same shapes as vLLM's OpenAI server);
- ``fail_open``: kvgate could not decide (directory down or slow, no live node, an internal
  error); set no header, so Envoy's fallback route balances by least-request. Counted in
  ``kvgate_fail_open{reason}``.

How a request's load is accounted: the chosen node is reserved with compare-and-reserve against
the load the decision saw (another replica taking it meanwhile means one more decision, never a
herd); the reservation itself says when its prompt stops counting as queued prefill (the
policy's estimate of the first token), so that needs no further call. The request leaves the
node's load when its response ends (``release``) or, for an integration that never sees the end
(ext_authz), at the estimate of its service time, when the directory drops it by itself.

A long prompt whose text was never tokenized here is first routed on its head: when no node
holds even its first blocks, the rest cannot change the decision (``_route_by_head``).

Observability is applied after the decision, from the ``RouteResult`` alone (``_account``): the
stages are timed with four ``perf_counter`` reads, and metrics, the decision log and the trace
are derived from those timings once the answer is known. With the decision log and tracing off
(the defaults) the per-request cost is two ``is None`` checks; ``explain`` runs the same stages
without reserving load or touching any of it.

What "fail open" promises: an internal problem never turns into a client-visible error. Only
the client's own mistakes (malformed JSON, a missing prompt, an unknown model, a body or prompt
over the limits) are rejected, because forwarding them would only fail later on the node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Literal, TypeVar

import msgspec
import numpy as np

from directory_client.types import (
    Directory,
    DirectoryUnavailable,
    DirectoryView,
    Reservation,
    ReservationConflict,
)
from gateway import metrics
from gateway.background_tokenize import BackgroundTokenizer
from gateway.body_memo import BodyMemo
from gateway.decision_log import DecisionLog
from gateway.decision_round import (
    MAX_ANSWER_TOKENS,
    MAX_HOLD_S,
    InvalidAnswerCount,
    Round,
    answer_budget,
    answer_count,
    decide_round,
    end_round,
    routing_request,
)
from gateway.elastic import DrainingNodes, HotRecorder
from gateway.envoy_config import DESTINATION_HEADER, PREFILLER_HEADER, PULL_BLOCKS_HEADER, PULL_SOURCE_HEADER
from gateway.profile import HardwareProfile
from gateway.sessions import Retention, retention, session_id, session_key
from gateway.token_memo import TokenMemo
from gateway.types import Decision, PrefillPlan, RoutingRequest
from tokenizer import InvalidPrompt, PreparedPrompt, PromptHead, PromptTokenizer, PromptTooLarge
from tokenizer.keys import PrefixKeyCache, request_seed
from tokenizer.openai_body import COMPLETIONS_PATH

if TYPE_CHECKING:  # the OpenTelemetry SDK is imported only when tracing is on
    from gateway.tracing import DecisionTracer

log = logging.getLogger("kvgate.core")
T = TypeVar("T")
Hold = Literal["until_release", "estimate"]
"""How long a routed request's load is held: until ``release`` (the response end is seen), or
for the decision's estimate of its service time (it never is)."""

FLEET_ONLY_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
"""Body fields that tell an engine to hold its KV for, or read KV from, another node (vLLM's
NIXL connector, SGLang's disaggregation): from a client they would pin a node's KV for minutes or
read other requests' blocks; only the P/D sidecar, after the decision, sets them."""
MAX_MODEL_NAME_CHARS = 1024  # longer names are refused even without a `models` allow-list: no engine serves one
_json_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class RoutingLimits:
    """What the request path accepts; from ``KvgateConfig``."""

    block_size: int = 16
    max_body_bytes: int = 8 << 20
    max_prompt_tokens: int = 131072
    models: frozenset[str] = frozenset()  # empty: accept any model name
    lora_adapters: Mapping[str, str] = field(default_factory=dict)  # adapter name -> base model (key seeds)
    lookup_timeout_s: float = 0.025
    max_prompt_bytes: int = 1 << 20  # rendered prompt text beyond this is passed through untokenized
    head_chars: int = 8192  # fresh text beyond this is first routed on its head (0: always tokenize all)
    max_answer_tokens: int = MAX_ANSWER_TOKENS  # ceiling of the answer budget a request's load is estimated with
    max_hold_s: float = MAX_HOLD_S  # a load held for an estimate (ext_authz) ends this long after at the latest
    session_ttl_s: float = 1800.0  # how long a session's node is remembered (0: sessions off)
    session_long_ttl_s: float = 86400.0  # ... when it asked for long retention


@dataclass(slots=True)
class RouteResult:
    kind: Literal["routed", "rejected", "fail_open"]
    headers: tuple[tuple[str, str], ...] = ()
    status: int = 200
    body: bytes = b""
    decision: Decision | None = None
    reservation: Reservation | None = None
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    request: RoutingRequest | None = None  # what the policy was asked (None: rejected before tokenizing)
    ttft_s: float = 0.0  # the policy's estimate of the time to first token on the chosen node
    service_s: float = 0.0  # ... and until the last token (for integrations that never see the end)
    sees_end: bool = True  # the caller releases it at the response end (else: held for service_s)
    released: bool = False
    round: Round | None = None  # the decision round of a routed request (its ledger entries end with it)


def error_body(status: int, message: str) -> bytes:
    """vLLM's OpenAI-compatible error shape, so clients see the same error either way."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError"}.get(status, "BadRequestError")
    return _json_encode({"object": "error", "message": message, "type": kind, "param": None, "code": status})


def _reject(status: int, message: str) -> RouteResult:
    return RouteResult("rejected", status=status, body=error_body(status, message), reason=message)


def _fail_open(reason: str) -> RouteResult:
    return RouteResult("fail_open", reason=reason)


def _account(result: RouteResult, policy: str) -> None:
    """Metrics of one answered request (``route`` only: ``explain`` counts nothing)."""
    if result.kind == "routed":
        decision = result.decision
        assert decision is not None and result.request is not None
        for stage, seconds in result.timings.items():
            metrics.STAGE_SECONDS[stage].observe(seconds)
        metrics.decisions(decision.policy, decision.outcome).inc()
        metrics.PROMPT_TOKENS.inc(result.request.prompt_tokens)
        metrics.CACHED_TOKENS.inc(decision.expected_cached_tokens)
        if decision.node is not None:
            metrics.CACHE_LOOP.count(decision.node.node_id, result.request.prompt_tokens, decision.expected_cached_tokens)
        if result.sees_end:
            metrics.INFLIGHT.inc()
    elif result.kind == "fail_open":
        metrics.FAIL_OPEN.labels(result.reason).inc()
        metrics.decisions(policy, "fail_open").inc()
    else:
        metrics.REJECTED.labels(str(result.status)).inc()


class RoutingCore:
    """Parse → tokenize → block keys → directory lookup → policy → reservation."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        directory: Directory,
        policy,  # gateway.policy.Policy
        profile: HardwareProfile,
        limits: RoutingLimits,
        *,
        decision_log: DecisionLog | None = None,
        tracer: DecisionTracer | None = None,
        clock: Callable[[], float] = time.monotonic,
        background: BackgroundTokenizer | None = None,
        body_memo_bytes: int = 64 << 20,
        token_memo_bytes: int = 64 << 20,
    ) -> None:
        self.tokenizer = tokenizer
        self.directory = directory
        self.in_process = directory.in_process  # read once: a wrapper (TrustedDirectory) forwards it by __getattr__
        self.policy = policy
        self.profile = profile
        self.limits = limits
        self.keys = PrefixKeyCache()
        self.bodies = BodyMemo(max_bytes=body_memo_bytes)  # a chat's history is not JSON-decoded again
        self.token_bodies = TokenMemo(max_bytes=token_memo_bytes)  # nor a token-ID prompt's, nor into a list
        self.background = background or BackgroundTokenizer(tokenizer)  # whole prompts after a head decision
        self._tasks: set[asyncio.Task] = set()  # sessions being recorded (the loop keeps only weak references)
        self.decision_log = decision_log  # None: /debug endpoints are off, keep nothing
        self.tracer = tracer  # None: tracing is off, no span is ever built
        self.clock = clock  # the time a decision is made at (the simulator's is virtual)
        self.hot = HotRecorder(directory)  # what each node served lately: a drain copies it first
        self.draining = DrainingNodes(directory)  # nodes being drained get no new request

    async def route(
        self,
        path: str,
        body: bytes,
        request_id: str = "",
        traceparent: str = "",
        *,
        sees_response_end: bool = True,
        session_header: str = "",
        retention_header: str = "",
    ) -> RouteResult:
        """Decide and reserve the node's load; ``traceparent`` (W3C) parents the decision's span.

        ``sees_response_end``: the caller calls ``release`` when the response ends (ext_proc).
        False (ext_authz): the load is held for the decision's estimate of the service time and
        the directory ends it by itself (``release`` still gives it back earlier); such requests
        are not in ``kvgate_inflight_requests``, whose end this replica never learns.
        ``session_header``, ``retention_header``: the request's ``x-session-id`` and
        ``x-kvgate-retention`` (``gateway.sessions``).
        """
        start_ns = time.time_ns() if self.tracer is not None else 0
        try:
            hold: Hold = "until_release" if sees_response_end else "estimate"
            with self.background.busy():  # its worker process is held stopped meanwhile
                result = await self._route(
                    path, body, request_id, hold=hold, session_header=session_header, retention_header=retention_header
                )
        except asyncio.CancelledError:
            raise
        except Exception:  # fail open on anything we did not foresee, and say so
            log.exception("routing failed; failing open (request_id=%s)", request_id)
            result = _fail_open("internal_error")
        _account(result, self.policy.name)
        if result.kind == "routed" and result.request is not None and result.request.session:
            self._remember_session(result)
        if result.kind != "rejected":
            if self.decision_log is not None:
                self.decision_log.record(path, request_id, result)
            if log.isEnabledFor(logging.DEBUG):
                _log_decision(result)
        if self.tracer is not None:  # built after the caller has answered Envoy: off the request's latency
            asyncio.get_running_loop().call_soon(self.tracer.record, result, path, request_id, start_ns, traceparent)
        return result

    async def explain(self, path: str, body: bytes) -> RouteResult:
        """What ``route`` would answer for this body now, without reserving load or counting it.

        The directory is really asked (the answer must be today's), so its latency and errors
        still count in ``kvgate_directory_*``; the decision itself is not counted, logged or traced.
        """
        return await self._route(path, body, "", hold=None)

    async def _route(
        self,
        path: str,
        body: bytes,
        request_id: str,
        *,
        hold: Hold | None,
        session_header: str = "",
        retention_header: str = "",
    ) -> RouteResult:
        lim = self.limits
        t0 = time.perf_counter()
        if len(body) > lim.max_body_bytes:
            return _reject(413, f"request body of {len(body)} bytes exceeds the limit of {lim.max_body_bytes} bytes")
        try:
            req = self.token_bodies.decode(body) if path.startswith(COMPLETIONS_PATH) else None
            if req is None:
                req = self.bodies.decode(body)
        except msgspec.DecodeError as e:
            return _reject(400, f"request body is not valid JSON: {e}")
        except RecursionError:  # msgspec recurses per nesting level: a client's doing, not ours
            return _reject(400, "request body is nested too deeply")
        if not isinstance(req, dict):
            return _reject(400, "request body must be a JSON object")
        if forged := next((name for name in FLEET_ONLY_FIELDS if name in req), None):
            return _reject(400, f"`{forged}` is set inside the fleet for disaggregated prefill, never by a client")
        model = req.get("model")
        if isinstance(model, str) and len(model) > MAX_MODEL_NAME_CHARS:  # kept in hot notes and the decision log
            return _reject(404, f"The model `{model[:64]}…` does not exist (no name longer than {MAX_MODEL_NAME_CHARS} characters does).")
        if isinstance(model, str) and lim.models and model not in lim.models:
            return _reject(404, f"The model `{model}` does not exist.")
        try:
            answer_count(req)  # an `n` the engine refuses is refused here, before any work
        except InvalidAnswerCount as e:
            return _reject(400, str(e))
        t1 = time.perf_counter()
        try:
            prepared = self.tokenizer.prepare(path, req, max_text_bytes=lim.max_prompt_bytes)
            session = self._session(session_header, retention_header, req, prepared)
            head = await self.tokenizer.head_async(prepared, fresh_chars=lim.head_chars) if lim.head_chars > 0 else None
            if head is not None:
                early = await self._route_by_head(prepared, req, head, request_id, hold, t0, t1, session)
                if early is not None:
                    return early
            prompt = await self.tokenizer.complete_async(prepared)
        except InvalidPrompt as e:
            return _reject(getattr(e, "status", 400), str(e))
        except PromptTooLarge:  # not worth seconds of CPU to judge: the fallback route takes it
            return _fail_open("prompt_too_large")
        except RecursionError:  # e.g. a template's tojson over a deeply nested `tools`
            return _reject(400, "request body is nested too deeply")
        n_tokens = len(prompt.token_ids)
        if n_tokens > lim.max_prompt_tokens:
            return _reject(
                400,
                f"This model's maximum context length is {lim.max_prompt_tokens} tokens. "
                f"However, you requested {n_tokens} tokens in the messages.",
            )
        seed = request_seed(prompt.model, cache_salt=prompt.cache_salt, adapters=lim.lora_adapters)
        keys = self.keys.block_keys(prompt.token_ids, block_size=lim.block_size, seed=seed)
        request = routing_request(
            prompt.model, prompt.token_ids, keys, block_size=lim.block_size, seed=seed, request_id=request_id,
            salted=prompt.cache_salt is not None, session=session[0], retention=session[1],
        )
        t2 = time.perf_counter()
        decided = await self._decide(request, keys, self._answer_tokens(req, request))
        result = await self._answer(req, request, keys, decided, hold, (t0, t1, t2))
        if hold is not None and result.kind == "routed" and result.decision is not None and result.decision.node:
            self.hot.record(result.decision.node.node_id, prompt.model, request, prompt.token_ids)
        return result

    async def _route_by_head(
        self,
        prepared: PreparedPrompt,
        req: dict,
        head: PromptHead,
        request_id: str,
        hold: Hold | None,
        t0: float,
        t1: float,
        session: tuple[str, Retention] = ("", ""),
    ) -> RouteResult | None:
        """Decide on a long fresh prompt's first blocks alone, when that cannot change the answer.

        If no node holds every block of the head that the lookup could report, each node's cached
        prefix of the whole prompt is exactly its prefix of the head (prefixes stop at the first
        missing block), so the policy would see the same view. The rest of the prompt is
        tokenized in the background (``BackgroundTokenizer``), to have it cached for the
        conversation's next turn. Returns None when some node may hold more: the caller
        tokenizes everything and asks again.
        """
        lim = self.limits
        seed = request_seed(head.model, cache_salt=head.cache_salt, adapters=lim.lora_adapters)
        keys = self.keys.block_keys(head.token_ids, block_size=lim.block_size, seed=seed)
        if not len(keys) or head.estimated_tokens > lim.max_prompt_tokens:
            return None
        request = RoutingRequest(
            model=head.model,
            prompt_tokens=head.estimated_tokens,
            total_blocks=head.estimated_tokens // lim.block_size,
            block_size=lim.block_size,
            request_id=request_id,
            salted=head.cache_salt is not None,
            session=session[0],
            retention=session[1],
            affinity=int(keys[-1]),
        )
        t2 = time.perf_counter()
        decided = await self._decide(request, keys, self._answer_tokens(req, request))
        view = decided.view
        if view is not None and (
            view.answerable_blocks < 0 or any(nv.cached_blocks >= view.answerable_blocks for nv in view.nodes)
        ):
            if decided.round is not None:  # asked again on the whole prompt: this round is not made
                end_round(self.policy, decided.round)
            return None
        if view is not None:
            metrics.HEAD_DECISIONS.inc()
        self.background.submit(prepared)  # bounded; dropped (and counted) when full
        return await self._answer(req, request, keys, decided, hold, (t0, t1, t2))

    def _session(self, header: str, retention_header: str, req: dict, prepared: PreparedPrompt) -> tuple[str, Retention]:
        """The request's session key ("" when it names none) and its retention class.

        The node the session was last routed to comes back with the directory lookup itself
        (``Directory.lookup(keys, session)``): one round trip, not a second one before it.
        """
        sid = session_id(header, req) if self.limits.session_ttl_s > 0 else ""
        if not sid:
            return "", ""
        return session_key(sid, prepared.model, prepared.cache_salt), retention(retention_header, req)

    def _remember_session(self, result: RouteResult) -> None:
        """Record the session's node off the request's path (the answer does not wait for it)."""
        assert result.request is not None and result.decision is not None and result.decision.node is not None
        session, node_id = result.request.session, result.decision.node.node_id
        lim = self.limits
        # Long retention is granted to a session that came back (its node was recorded): a client
        # minting a fresh ID per request would otherwise leave a directory key a day for each.
        kept_long = result.request.retention == "long" and bool(result.request.session_node)
        ttl_s = lim.session_long_ttl_s if kept_long else lim.session_ttl_s

        async def record() -> None:
            try:
                await self._bounded(self.directory.record_session(session, node_id, ttl_s))
            except (DirectoryUnavailable, TimeoutError):
                metrics.DIRECTORY_ERRORS.labels("record_session").inc()

        task = asyncio.get_running_loop().create_task(record())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(
        self,
        req: dict,
        request: RoutingRequest,
        keys: np.ndarray,
        decided: _Decided,
        hold: Hold | None,
        marks: tuple[float, float, float],
    ) -> RouteResult:
        """Reserve the chosen node's load (``hold`` None: do not) and build the answer."""
        t0, t1, t2 = marks
        t3, t4 = decided.looked_up, time.perf_counter()
        request = decided.request
        timings = {"parse": t1 - t0, "tokenize": t2 - t1, "lookup": t3 - t2, "score": t4 - t3, "total": t4 - t0}
        if decided.view is None:  # the lookup failed: nothing was scored
            del timings["score"]
            timings["total"] = t3 - t0
        if decided.failed is not None:
            decided.failed.request = request
            decided.failed.timings = timings
            return decided.failed
        assert decided.round is not None
        rnd = decided.round
        reservation = None
        if hold is None:  # explained, not routed: its split arrives nowhere, it answers nowhere
            end_round(self.policy, rnd)
        else:
            try:
                reservation = await self._reserve(rnd, hold)
            except ReservationConflict:
                # Another replica took the node this decision saw idle: decide again on a fresh
                # view (its load now counted) and take that node whatever happens next.
                metrics.RESERVATION_CONFLICTS.inc()
                again = await self._decide(request, keys, self._answer_tokens(req, request))
                if again.failed is None:
                    assert again.round is not None
                    end_round(self.policy, rnd)  # that split or answer is not made: the new round stands
                    rnd = again.round
                    try:
                        reservation = await self._reserve(rnd, hold, conditional=False)
                    except (DirectoryUnavailable, TimeoutError):  # as below: the decision stands
                        metrics.DIRECTORY_ERRORS.labels("reserve").inc()
            except (DirectoryUnavailable, TimeoutError):
                # The decision stands; only the shared load accounting misses this request.
                metrics.DIRECTORY_ERRORS.labels("reserve").inc()
            if rnd.shared is not None and (reservation is None or not reservation.arrival_recorded):
                metrics.PD_ARRIVALS_UNSHARED.inc()  # this replica's ledger has it; the others do not
            self._answer_held(rnd, reservation, hold)
            if rnd.decision.prefill is not None:
                try:
                    await self._reserve_prefill(rnd.decision.prefill)
                except BaseException:  # cancelled: no caller holds the reservation to release it
                    if reservation is not None:
                        await asyncio.shield(self._give_back(reservation))
                    raise
            timings["reserve"] = time.perf_counter() - t4

        decision = rnd.decision
        headers = [(DESTINATION_HEADER, decision.destination_header)]
        if decision.pull is not None:
            headers.append((PULL_SOURCE_HEADER, decision.pull.source_endpoint))
            headers.append((PULL_BLOCKS_HEADER, str(decision.pull.blocks)))
        if decision.prefill is not None:
            headers.append((PREFILLER_HEADER, decision.prefill.address))
        return RouteResult(
            "routed", headers=tuple(headers), decision=decision, reservation=reservation, timings=timings,
            request=request, ttft_s=rnd.ttft_s, service_s=rnd.service_s, sees_end=hold != "estimate",
            round=rnd if hold is not None else None,
        )

    async def _decide(self, request: RoutingRequest, keys: np.ndarray, answer: tuple[int, int]) -> _Decided:
        """Directory lookup under the configured timeout, then the decision round (pure, no I/O)
        for an answer budget of ``answer``: (tokens per answer, answers)."""
        t = time.perf_counter()
        session = request.session
        try:
            view = await self._bounded(self.directory.lookup(keys, session) if session else self.directory.lookup(keys))
        except (DirectoryUnavailable, TimeoutError) as e:
            done = time.perf_counter()
            metrics.DIRECTORY_LOOKUP_SECONDS.observe(done - t)
            metrics.DIRECTORY_ERRORS.labels("lookup").inc()
            log.warning("directory lookup failed (%s); failing open", type(e).__name__)
            return _Decided(None, None, done, _fail_open("directory_unavailable"), request)
        done = time.perf_counter()
        metrics.DIRECTORY_LOOKUP_SECONDS.observe(done - t)
        if view.session_node:
            request = replace(request, session_node=view.session_node)
        rnd = decide_round(
            self.policy, request, view, self.profile, now=self.clock(), answer_tokens=answer[0], answers=answer[1],
            max_hold_s=self.limits.max_hold_s, draining=self.draining.current(),
        )
        if rnd.decision.node is None:
            failed = RouteResult("fail_open", decision=rnd.decision, reason="no_live_node")
            return _Decided(view, rnd, done, failed, request)
        return _Decided(view, rnd, done, None, request)

    async def _reserve(self, rnd: Round, hold: Hold, *, conditional: bool = True) -> Reservation:
        """Take the chosen node's load; ``conditional``: only if nobody added load since the lookup.

        Its prompt stops counting as queued prefill at the policy's estimate of the first token:
        the node is still busy decoding it, but a prompt already prefilled must not make the owner
        look queued to the next turn of the same conversation (that is what sent follow-up turns
        away from their cache). No integration sees the first token, so the estimate stands in.
        """
        node = rnd.decision.node
        assert node is not None
        return await self._bounded(
            self.directory.reserve(
                node.node_id,
                rnd.prefill_tokens,
                if_inflight_at_most=rnd.seen_load.inflight if conditional else None,
                first_token_s=rnd.ttft_s,
                hold_s=rnd.service_s if hold == "estimate" else None,
                **({"arrival": rnd.shared} if rnd.shared is not None else {}),
                **({"requests": rnd.answers} if rnd.answers > 1 else {}),  # its answers decode side by side
                **({"context_tokens": rnd.context_tokens} if rnd.context_tokens else {}),  # what its decodes read
            )
        )

    def _answer_held(self, rnd: Round, reservation: Reservation | None, hold: Hold) -> None:
        """Tell the policy's ledger of answers whether, and until when, the directory counts this
        request's answer for the other replicas (``gateway.policy.answering``)."""
        answer = rnd.answer
        if answer is None:
            return
        if reservation is None:  # not counted: this replica prices it alone
            self.policy.answering.unshared(answer)
            metrics.PD_ANSWERING_UNSHARED.inc()
        elif hold == "until_release":  # counted until released, or the directory's ceiling
            ceiling = getattr(self.directory, "max_request_s", self.limits.max_hold_s)
            self.policy.answering.held(answer, self.clock() + ceiling)

    async def _reserve_prefill(self, plan: PrefillPlan) -> None:
        """A split request's prompt counts on its prefill node until the estimated end of that
        prefill, when the reservation ends by itself (the prefill's own answer is never seen)."""
        try:
            await self._bounded(
                self.directory.reserve(plan.node_id, plan.prefill_tokens, first_token_s=plan.ready_s, hold_s=plan.ready_s)
            )
        except (DirectoryUnavailable, TimeoutError):
            metrics.DIRECTORY_ERRORS.labels("reserve").inc()

    def _answer_tokens(self, req: dict, request: RoutingRequest) -> tuple[int, int]:
        """The answer budget the request's load is estimated with, clamped by the limits: (tokens
        per answer, answers; ``n`` was checked on arrival)."""
        lim = self.limits
        return answer_budget(
            req, request.prompt_tokens, context_tokens=lim.max_prompt_tokens, ceiling=lim.max_answer_tokens
        )

    async def _bounded(self, operation: Awaitable[T]) -> T:
        """A directory call under the lookup timeout; an in-process directory needs none."""
        if self.in_process:
            return await operation
        async with asyncio.timeout(self.limits.lookup_timeout_s):  # no task, unlike wait_for
            return await operation

    async def release(self, result: RouteResult) -> None:
        """Give back the load a routed request took; called when its response has ended (or,
        held for an estimate, when nobody will use the route: the client went away)."""
        if result.kind != "routed" or result.released:
            return
        result.released = True
        if result.sees_end:
            metrics.INFLIGHT.dec()
        if result.reservation is not None:
            await self._give_back(result.reservation)
        if result.round is not None:  # answered: no later decision prices it any more
            end_round(self.policy, result.round)

    async def _give_back(self, reservation: Reservation) -> None:
        try:
            await self.directory.release(reservation)
        except DirectoryUnavailable:
            # Reservations expire in the backend, so a lost release heals by itself.
            metrics.DIRECTORY_ERRORS.labels("release").inc()


@dataclass(slots=True)
class _Decided:
    """One lookup + decision round: the view it saw, the round, or why it failed open."""

    view: DirectoryView | None
    round: Round | None
    looked_up: float  # perf_counter when the lookup answered
    failed: RouteResult | None
    request: RoutingRequest  # what was asked, with the session's node the lookup found


def _log_decision(result: RouteResult) -> None:
    """One DEBUG line per decision (the request ID comes from the logging context)."""
    d = result.decision
    if result.kind == "routed" and d is not None and d.node is not None:
        log.debug("routed to %s (%s, %s): %s", d.node.node_id, d.policy, d.outcome, d.reason,
                  extra={"outcome": d.outcome, "node": d.node.node_id})
    else:
        log.debug("failing open: %s", result.reason, extra={"outcome": "fail_open", "reason": result.reason})
