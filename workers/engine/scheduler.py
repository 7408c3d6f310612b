"""Continuous batching as vLLM's V1 scheduler does it, over the paged prefix cache, without a clock.

One step = ``schedule(now)`` (choose the batch and how long it takes) then ``complete(step,
end)`` (apply it: KV computed, blocks cached, tokens sampled). The real-time server sleeps the
step's duration between the two calls; a discrete-event simulator advances a virtual clock
instead. Both drive this very class.

Policy, as in vLLM V1 (FCFS, chunked prefill always on):

* A token budget of ``max_num_batched_tokens`` per step. Running requests go first, in arrival
  order: a decoding request takes 1 token, a request still in prefill takes ``min(rest, budget)``
  (chunked prefill). Then waiting requests are admitted in FCFS order while the budget lasts and
  fewer than ``max_num_seqs`` run.
* Admission needs KV blocks: the cached prefix is pinned and private blocks are reserved for the
  whole rest of the known sequence at once (vLLM reserves per chunk; reserving up front means a
  prompt never stalls half-prefilled). If they do not fit, admission stops (head-of-line, FCFS).
* At least one token is always computed, so a fully cached prompt recomputes its last token — and,
  when its length is a multiple of the block size, its whole last block (vLLM caps a hit at
  ``num_tokens - 1`` tokens). ``cached_tokens`` is what the first admission found.
* A decoding request that needs a new block and finds none preempts the most recently admitted
  running request (possibly itself) by *recompute*: its blocks are released (its computed full
  blocks stay cached and unreferenced, so a re-admission usually hits them) and it goes back to
  the front of the queue. No request is admitted in a step that preempted.
* Full blocks are cached as soon as a step computes them, prompt and reply alike; the last
  sampled token never gets KV (it is never fed back), as in vLLM.
* A request asking for ``n`` answers (``SimRequest.answers``) computes its prompt once and then
  decodes ``n`` sequences side by side, as vLLM's ``n`` does: its children share the prompt's full
  blocks, each decodes its own answer in blocks of its own (from the prompt's last full block on).
  Each decode step carries ``n`` tokens and reads ``n`` contexts, every answer is as long as the
  reply (the simulated reply depends on the prompt only), and the answers beyond the first hold
  their blocks privately until the request ends (not cached: nobody continues from them; a chat
  goes on from the first choice). Not modelled: the few tokens of the prompt's partial last block
  each child recomputes.

A discrete-event driver may ask for several decode steps at once (``schedule(now, max_steps=k)``):
a batch that only decodes, and would neither reserve nor cache a block, finish a request, nor
admit a waiting one before its last step, runs those steps unchanged one after the other, so
they are one ``ScheduledStep`` of ``steps`` tokens per request, applied at once. Nothing another
component can see (the cache, the queues) changes before its end; if a request joins the waiting
queue meanwhile, ``ScheduledStep.cut`` ends the run at the step in progress, where a one-step
driver would have admitted it. The real-time server runs one step at a time (it streams tokens).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from gateway.profile import HardwareProfile
from tokenizer.keys import block_keys
from workers.engine.kv_cache import CacheEvent, PrefixCache, engine_block_hashes
from workers.engine.sampling import Reply
from workers.engine.step_time import prefill_pairs, step_seconds


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the engine: its tokens (prompt + the reply it will produce) and progress."""

    request_id: str
    tokens: np.ndarray  # uint32: prompt then reply
    num_prompt: int
    num_reply: int
    finish_reason: str  # "stop" | "length" once all reply tokens are out
    hashes: list[int]  # engine hashes of every full block that can get KV
    keys: list[int]  # kvgate keys of the same blocks
    arrival: float
    state: State = State.WAITING
    generated: int = 0
    num_computed: int = 0
    held: list[int] = field(default_factory=list)  # cached blocks pinned, in chain order
    private: int = 0  # private blocks reserved
    cached_tokens: int = -1  # prefix hit at first admission (-1 = not admitted yet)
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    aborted: bool = False
    in_step: bool = False
    lora: str | None = None  # the key namespace, published with its blocks' events
    cache_salt: str | None = None
    answers: int = 1  # sequences decoded side by side (the request's ``n``)
    extra: int = 0  # private blocks reserved for the answers beyond the first

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_ids: np.ndarray,
        reply: Reply,
        *,
        block_size: int,
        root_hash: int,
        key_seed: int,
        arrival: float,
        lora: str | None = None,
        cache_salt: str | None = None,
        answers: int = 1,
    ) -> SimRequest:
        """Hash every block that can ever hold KV: the prompt and all reply tokens but the last."""
        tokens = np.concatenate([np.asarray(prompt_ids, dtype=np.uint32), reply.token_ids.astype(np.uint32)])
        with_kv = tokens[: max(len(tokens) - 1, 0)]
        hashes = engine_block_hashes(with_kv, block_size=block_size, parent=root_hash)
        keys = block_keys(with_kv, block_size=block_size, seed=key_seed)
        return cls(
            request_id, tokens, len(prompt_ids), len(reply.token_ids), reply.finish_reason, list(hashes), keys, arrival,
            lora=lora, cache_salt=cache_salt, answers=answers,
        )  # fmt: skip

    @property
    def known_tokens(self) -> int:
        """Tokens whose IDs exist so far: the prompt and the reply sampled up to now."""
        return self.num_prompt + self.generated

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    def extra_blocks(self, tokens: int, block_size: int) -> int:
        """Blocks the answers beyond the first hold once the sequence has KV for ``tokens``
        tokens: each its own from the prompt's last full block on (0 with one answer)."""
        if self.answers <= 1:
            return 0
        shared = self.num_prompt // block_size * block_size
        return (self.answers - 1) * -(-max(tokens - shared, 0) // block_size)


@dataclass(slots=True)
class ScheduledStep:
    """What one step computes: ``(request, tokens)`` pairs, and how long it takes on the hardware.

    ``steps`` > 1: a run of identical decode steps (module doc), each request decoding one token
    per step; the j-th step (1-based) lasts ``first_s + (j - 1) * growth_s`` (its context grows by
    one token per request), ``duration_s`` is the whole run.
    """

    items: list[tuple[SimRequest, int]]
    duration_s: float
    prefill_tokens: int
    decode_seqs: int
    started_at: float
    steps: int = 1
    first_s: float = 0.0
    growth_s: float = 0.0

    def run_s(self, steps: int) -> float:
        """Time from the start to the end of the first ``steps`` steps of the run."""
        return steps * self.first_s + self.growth_s * steps * (steps - 1) / 2

    def cut(self, now: float) -> bool:
        """End a decode run with the step in progress at ``now`` (a request is waiting to be
        admitted at the next step boundary); True if the run got shorter."""
        if self.steps <= 1:
            return False
        elapsed = now - self.started_at  # the steps that ended by now: the largest j with run_s(j) <= elapsed
        lo, hi = 0, self.steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.run_s(mid) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        keep = min(lo + 1, self.steps)
        if keep == self.steps:
            return False
        self.steps = keep
        self.duration_s = self.run_s(keep)
        return True


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """A request sampled its ``generated``-th token at the end of a step (1 = first token)."""

    request: SimRequest
    generated: int
    finished: bool


@dataclass(slots=True)
class StepResult:
    outputs: list[TokenOutput]
    finished: list[SimRequest]  # includes aborted ones (their ``aborted`` flag is set)
    events: list[CacheEvent]


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counters (vLLM's metric names in comments)."""

    prompt_tokens: int = 0  # vllm:prompt_tokens
    generation_tokens: int = 0  # vllm:generation_tokens
    prefix_queries: int = 0  # vllm:prefix_cache_queries (tokens looked up at first admission)
    prefix_hits: int = 0  # vllm:prefix_cache_hits (tokens found)
    preemptions: int = 0  # vllm:num_preemptions
    steps: int = 0
    busy_s: float = 0.0  # modelled time spent in steps
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})


class Scheduler:
    """Waiting queue, running list, token budget, KV admission and preemption (see module doc)."""

    def __init__(
        self,
        profile: HardwareProfile,
        cache: PrefixCache,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if cache.block_size != profile.block_size:
            raise ValueError("cache and profile disagree on the block size")
        self.profile = profile
        self.cache = cache
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.running_seqs = 0  # sequences the running requests decode: what ``max_num_seqs`` bounds
        self.requests: dict[str, SimRequest] = {}
        self.counters = SchedulerCounters()

    # -- requests in and out -------------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, now: float) -> bool:
        """Stop a request (client went away); its blocks are released now, or when its step ends."""
        r = self.requests.get(request_id)
        if r is None or r.finished:
            return False
        r.aborted = True
        if r.in_step:
            return True  # complete() releases it
        if r.state is State.WAITING:
            self.waiting.remove(r)
        self._finish(r, now, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, now: float, *, max_steps: int = 1) -> ScheduledStep | None:
        """Choose this step's batch; None when there is nothing to run.

        ``max_steps`` > 1 lets a pure decode batch run that many steps at most as one (module doc).
        """
        bs = self.cache.block_size
        cache = self.cache
        budget = self.max_num_batched_tokens
        items: list[tuple[SimRequest, int]] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.known_tokens - r.num_computed, budget)
            need = -(-(r.num_computed + n) // bs) - len(r.held) - r.private
            extra = r.extra_blocks(r.num_computed + n, bs) - r.extra if r.answers > 1 else 0
            if need + extra > 0:
                while not cache.reserve(need + extra):
                    victim = self.running[-1]
                    self._preempt(victim, now)
                    preempted = True
                    if victim is r:
                        break
                if r.state is not State.RUNNING:
                    break
                r.private += need
                r.extra += extra
            items.append((r, n))
            budget -= n * r.answers if r.generated and r.num_computed == r.known_tokens - 1 else n  # decoding: a token per answer
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and self.running_seqs < self.max_num_seqs:
                r = self.waiting[0]
                if self.running and self.running_seqs + r.answers > self.max_num_seqs:
                    break  # its answers do not all fit in the batch (alone, it runs whatever its n)
                known = r.known_tokens
                hashes = r.hashes[: min((known - 1) // bs, len(r.hashes))]
                hit = cache.match(hashes)
                matched = hashes[:hit]
                need = -(-known // bs) - hit
                extra = r.extra_blocks(known, bs)
                if not cache.can_reserve(need + extra, pinning=matched):
                    break
                cache.pin(matched, now)
                cache.reserve(need + extra)
                self.waiting.popleft()
                r.held = list(matched)
                r.private = need
                r.extra = extra
                r.num_computed = hit * bs
                if r.cached_tokens < 0:
                    r.cached_tokens = hit * bs
                    self.counters.prefix_queries += known
                    self.counters.prefix_hits += hit * bs
                    self.counters.prompt_tokens += r.num_prompt
                r.state = State.RUNNING
                self.running.append(r)
                self.running_seqs += r.answers
                n = min(known - r.num_computed, budget)
                items.append((r, n))
                budget -= n

        if not items:
            return None
        prefill_tokens = decode_seqs = decode_ctx = 0
        pairs = 0.0
        for r, n in items:
            r.in_step = True
            if r.generated and n == 1 and r.num_computed == r.known_tokens - 1:
                decode_seqs += r.answers  # each answer decodes a token and reads its own context
                decode_ctx += r.answers * (r.num_computed + 1)
            else:
                prefill_tokens += n
                pairs += prefill_pairs(n, r.num_computed)
        duration = step_seconds(
            self.profile,
            prefill_tokens=prefill_tokens,
            prefill_pairs=pairs,
            decode_seqs=decode_seqs,
            decode_context_tokens=decode_ctx,
        )
        step = ScheduledStep(items, duration, prefill_tokens, decode_seqs, now, 1, duration)
        # a run publishes its cache events at its end: not when this step's reservation evicted
        if max_steps > 1 and not preempted and not prefill_tokens and not cache.has_events:
            steps = min(max_steps, self._quiet_decode_steps(items))
            if steps > 1:
                step.steps = steps
                step.growth_s = self.profile.decode_step_per_context_token_s * decode_seqs
                step.duration_s = step.run_s(steps)
        return step

    def _quiet_decode_steps(self, items: list[tuple[SimRequest, int]]) -> int:
        """How many decode steps this batch can run before one of its requests finishes, needs a
        new block, or caches one (the last step may finish or cache: that happens at its end).
        Until then the cache is untouched, so nothing a router or an admission sees changes."""
        bs = self.cache.block_size
        steps = 1 << 30
        for r, _ in items:
            c = r.num_computed  # tokens with KV before this run; the run computes c .. c+steps-1
            held = len(r.held)
            quiet = min(r.num_reply - r.generated, (held + r.private) * bs - c)  # no reservation after step 1
            if r.answers > 1:  # nor for the other answers: each fills its blocks as the first does
                per = r.extra // (r.answers - 1)
                quiet = min(quiet, r.num_prompt // bs * bs + per * bs - c)
            if held < len(r.hashes):
                quiet = min(quiet, (held + 1) * bs - c)  # the step completing block held+1 caches it
            if quiet < steps:
                steps = quiet
        return max(steps, 1)

    def complete(self, step: ScheduledStep, now: float) -> StepResult:
        """Apply a step at its end time ``now``: KV computed, full blocks cached, tokens sampled."""
        outputs: list[TokenOutput] = []
        finished: list[SimRequest] = []
        run = step.steps  # decode steps applied at once (1 but for a decode run)
        for r, n in step.items:
            r.in_step = False
            if r.aborted:
                if not r.finished:
                    self._finish(r, now, "abort")
                    finished.append(r)
                continue
            r.num_computed += n * run
            self._cache_full_blocks(r, now)
            if run > 1:  # each step of the run sampled one token
                r.generated += run - 1
                self.counters.generation_tokens += (run - 1) * r.answers
            if r.num_computed == r.known_tokens:
                r.generated += 1
                self.counters.generation_tokens += r.answers
                if r.first_token_at is None:
                    r.first_token_at = now
                done = r.generated >= r.num_reply
                outputs.append(TokenOutput(r, r.generated, done))
                if done:
                    self._finish(r, now, r.finish_reason)
                    finished.append(r)
        self.counters.steps += step.steps
        self.counters.busy_s += step.duration_s
        return StepResult(outputs, finished, self.cache.drain_events())

    # -- internals -----------------------------------------------------------------------------

    def _cache_full_blocks(self, r: SimRequest, now: float) -> None:
        bs = self.cache.block_size
        full = min(r.num_computed // bs, len(r.hashes))
        h = len(r.held)
        if full <= h:
            return
        new = r.hashes[h:full]
        self.cache.commit(
            new, r.keys[h:full], r.held[-1] if h else None, r.tokens[h * bs : full * bs], h, now,
            lora=r.lora, cache_salt=r.cache_salt,
        )  # fmt: skip
        r.private -= len(new)
        r.held.extend(new)

    def _release(self, r: SimRequest, now: float) -> None:
        self.cache.unpin(r.held, now)
        self.cache.release_private(r.private + r.extra)
        r.held = []
        r.private = 0
        r.extra = 0

    def _finish(self, r: SimRequest, now: float, reason: str) -> None:
        if r.state is State.RUNNING:
            self.running.remove(r)
            self.running_seqs -= r.answers
            self._release(r, now)
        r.state = State.FINISHED
        r.finished_at = now
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        self.requests.pop(r.request_id, None)

    def _preempt(self, r: SimRequest, now: float) -> None:
        self.running.remove(r)
        self.running_seqs -= r.answers
        self._release(r, now)
        r.num_computed = 0
        r.state = State.WAITING
        r.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(r)
