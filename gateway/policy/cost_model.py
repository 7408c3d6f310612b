"""Estimated time to first token (TTFT) of one request on one node: the kvgate cost model.

Every policy reports its candidates through this one estimator, so a load test compares what
each policy *chose* on the same scale, whatever it chose by.

For node *n* holding ``c`` leading blocks of a prompt of ``P`` tokens (block size ``b``)::

    ttft_local(n)   = queue(n) + stage(n) + prefill(max(P - c·b, 1) new tokens after c·b cached)
    ttft_pull(n, o) = queue(n) + stage(n) + transfer((c_o - c)·b tokens over the link) + stage_src(o)
                      + prefill(max(P - c_o·b, 1) new tokens after c_o·b cached)

    queue(n) = min(Q / prefill_tokens_per_s, due(n))                (1) prefill queued ahead of us
             + 1.5 · decode_step_seconds(R, Q)        if R > 0      (2) decode interference
             + saturation_penalty_s · (R - max_num_seqs + 1)  if R >= max_num_seqs   (3)

with ``R`` = in-flight requests, ``Q`` = the tokens they had to prefill (``NodeView.load``: the
gateway reserves prompt minus expected cached tokens per request) and ``due(n)`` = the time until
the last of those prompts' estimated first token (``NodeLoad.prefill_due_s``).

Why this shape:

(1) Queued prefill is charged at the *linear* rate only. The profile's attention term is
    quadratic in one sequence's length; ``Q`` is the sum over many independent requests, so
    charging ``prefill_seconds(Q)`` would price 10 queued 1k prompts like one 10k prompt.
    A prompt stops counting in ``Q`` at its estimated first token, but counts whole until then,
    although most of it is computed by then: a node that took a fresh 7k-token prompt 0.25 s ago,
    its first token due at 0.3 s, has 0.05 s of it left, not 0.4 s. Capped by ``due``, the
    owner of a conversation is not priced as if that prefill had just begun (uncapped, replay's
    follow-up turns left their cache to recompute 5k tokens on an idle node to save a wait that
    was mostly over). The cap is an upper bound, and a tighter one would not pay: in ``loadtest
    simulate`` (``--view engines``, seeds 0/1), pricing every node with the engines' true remaining
    prefill instead left kvgate's figures where they were (chat, 8 nodes: hit 80.5/80.5%, TTFT p99
    332/335 ms both ways; memchat, 16 × 200 blocks: 61.4/59.6% → 61.4/59.7%, p99 692/678 →
    696/682 ms).
(2) With continuous batching, the step that prefills us also decodes every running sequence,
    and we arrive, on average, half-way through a step already running: 1 + 1/2 decode steps
    of a batch of ``R`` whose context is taken as ``Q`` (the part of it the gateway knows). Small
    next to (1) but it is what separates two nodes with nothing queued and different batches.
(3) A node whose batch is full (``R >= max_num_seqs``) makes a new request wait for a running
    one to *finish*, a time the gateway cannot see (it depends on output lengths). The default
    1 s per request beyond the limit is larger than an 8k-token prefill on the shipped profiles,
    so a saturated owner loses to a pull or a recompute elsewhere: a hot prefix gets a second
    copy instead of a queue.

``stage`` is the host→GPU load time of a non-GPU hit (``profile.cpu_tier_load_seconds``; the
profile has one figure for CPU and STORAGE tiers). A pull from a source whose prefix sits in a
non-GPU tier also pays that load for the pulled part (the source has to stage it): a
conservative choice, since some transports read host memory directly.

With memory priced (``memory``, the ``kvgate`` policy's default), each candidate also carries the
cost of the blocks it would evict (``memory_s``, not part of the TTFT) and the chance its own hit
survives the queue ahead of it, by which its prefill estimate blends hit and miss
(``gateway.policy.memory``).

The engine always computes at least one token (it needs that token's logits), so prefill is
never free, and more cached blocks on a node never raise its own estimate (for any profile
where staging a token costs less than prefilling it, which holds for every shipped profile).
"""

from __future__ import annotations

from collections.abc import Sequence

from directory_client.types import NodeLoad, NodeView, Tier
from gateway.policy.memory import MemoryPricing
from gateway.profile import HardwareProfile
from gateway.types import CandidateCost, RoutingRequest

DEFAULT_SATURATION_PENALTY_S = 1.0


class TtftEstimator:
    """Cost model bound to one request, one profile and one link: built once per decision.

    ``link=None`` prices local serving only (the load-balancing policies report these costs too,
    so a load test can compare every policy's choices on one scale).
    """

    __slots__ = (
        "profile", "request", "link", "saturation_penalty_s", "memory",
        "_prompt", "_block_size", "_inv_prefill_rate", "_prefill_memo",
        "_busy_s", "_busy_s_per_running", "_busy_s_per_context", "_max_seqs",
    )

    def __init__(
        self,
        profile: HardwareProfile,
        request: RoutingRequest,
        *,
        link: str | None = None,
        saturation_penalty_s: float = DEFAULT_SATURATION_PENALTY_S,
        memory: MemoryPricing | None = None,
    ) -> None:
        if link is not None and link not in profile.links_gbps:
            raise ValueError(f"link {link!r} not in profile {profile.name!r} (has {sorted(profile.links_gbps)})")
        self.profile = profile
        self.request = request
        self.link = link
        self.saturation_penalty_s = saturation_penalty_s
        self.memory = memory
        self._prompt = request.prompt_tokens
        self._block_size = request.block_size
        self._inv_prefill_rate = 1.0 / profile.prefill_tokens_per_s
        self._prefill_memo: dict[int, float] = {}
        # queue_s for a busy node, expanded once: Q/rate + 1.5·decode_step_seconds(R, Q) is linear
        # in R and Q, so three constants price every node (decide() runs over hundreds per request).
        self._busy_s = 1.5 * (profile.decode_step_base_s - profile.decode_step_per_seq_s)
        self._busy_s_per_running = 1.5 * profile.decode_step_per_seq_s
        self._busy_s_per_context = 1.5 * profile.decode_step_per_context_token_s
        self._max_seqs = profile.max_num_seqs

    def cached_tokens(self, blocks: int) -> int:
        """Prompt tokens covered by ``blocks`` leading full blocks."""
        tokens = blocks * self._block_size
        return tokens if tokens < self._prompt else self._prompt

    def queue_s(self, load: NodeLoad) -> float:
        """Wait before our prefill starts on a node with this load (module docstring, (1)–(3))."""
        running = load.inflight
        queued = load.prefill_tokens * self._inv_prefill_rate
        if queued > load.prefill_due_s:
            queued = load.prefill_due_s
        if running <= 0:
            return queued
        wait = queued + self._busy_s + self._busy_s_per_running * running + self._busy_s_per_context * load.prefill_tokens
        if running >= self._max_seqs:
            wait += self.saturation_penalty_s * (running - self._max_seqs + 1)
        return wait

    def prefill_s(self, cached_tokens: int) -> float:
        """Prefill of what is not cached; at least one token is always computed.

        Memoised per decision: most nodes hold nothing (or the same prefix), so a 256-node
        decision computes only a handful of distinct prefills.
        """
        memo = self._prefill_memo
        seconds = memo.get(cached_tokens)
        if seconds is None:
            seconds = self.profile.prefill_seconds(max(self._prompt - cached_tokens, 1), cached_tokens)
            memo[cached_tokens] = seconds
        return seconds

    def stage_s(self, tokens: int, tier: Tier) -> float:
        """Host→GPU load of a hit kept outside GPU memory; free for GPU-tier hits."""
        if tier == Tier.GPU or tokens <= 0:
            return 0.0
        return self.profile.cpu_tier_load_seconds(tokens)

    def transfer_s(self, tokens: int) -> float:
        """Moving the full-size KV of ``tokens`` from another node over the configured link."""
        if self.link is None:
            raise ValueError("this estimator was built without a link: it prices local serving only")
        return self.profile.transfer_seconds(tokens, self.link)

    def pull_transfer_s(self, own_tokens: int, own_tier: Tier, source_tokens: int, source_tier: Tier) -> float:
        """Everything moved before prefill when a node holding ``own_tokens`` pulls up to ``source_tokens``."""
        moved = source_tokens - own_tokens
        return self.stage_s(own_tokens, own_tier) + self.transfer_s(moved) + self.stage_s(moved, source_tier)

    def node_costs(
        self,
        nodes: Sequence[NodeView],
        *,
        source: NodeView | None = None,
        min_pull_blocks: int = 1,
        pull_margin_s: float = 0.0,
        turnover: Sequence[float] | None = None,
    ) -> list[CandidateCost]:
        """Each node's cheaper option: serve from its own cache, or pull ``source``'s prefix first.

        A node pulls only if it runs a transfer agent itself (a node without one cannot receive
        blocks), ``source`` holds at least ``min_pull_blocks`` more blocks, and the pull beats its
        own recompute by more than ``pull_margin_s``. ``turnover`` (one factor per node, with memory
        priced) scales each node's eviction cost (``gateway.policy.churn``). With ``source=None`` every
        node is priced serving locally. This loop is the hot path of a decision (one call per
        request over every live node), hence the local names.
        """
        cached_tokens, stage_s, prefill_s = self.cached_tokens, self.stage_s, self.prefill_s
        if source is not None:
            src_blocks = source.cached_blocks
            src_tokens = cached_tokens(src_blocks)
            src_tier = source.tier
            pull_prefill = prefill_s(src_tokens)
        else:
            src_blocks, src_tokens, src_tier, pull_prefill = 0, 0, Tier.GPU, 0.0
        pull_memo: dict[tuple[int, Tier], float] = {}  # most nodes hold nothing: one transfer price
        memory, total_blocks = self.memory, self.request.total_blocks + self.request.answer_blocks  # what the node adds
        out: list[CandidateCost] = []
        append = out.append
        # queue_s inlined (same arithmetic), and a node holding nothing of the prompt (most of a
        # large fleet) priced without calls: no staging, the whole prompt's prefill
        busy_s, per_running, per_context = self._busy_s, self._busy_s_per_running, self._busy_s_per_context
        inv_rate, max_seqs, penalty_s = self._inv_prefill_rate, self._max_seqs, self.saturation_penalty_s
        cold_prefill = prefill_s(0)
        for i, nv in enumerate(nodes):
            load = nv.load
            running = load.inflight
            queue = load.prefill_tokens * inv_rate
            if queue > load.prefill_due_s:
                queue = load.prefill_due_s
            if running > 0:
                queue += busy_s + per_running * running + per_context * load.prefill_tokens
                if running >= max_seqs:
                    queue += penalty_s * (running - max_seqs + 1)
            blocks = nv.cached_blocks
            tier = nv.tier
            if blocks <= 0:
                own, transfer, prefill = 0, 0.0, cold_prefill
            else:
                own = cached_tokens(blocks)
                transfer = stage_s(own, tier)
                prefill = prefill_s(own)
            memory_s, survival = 0.0, 1.0
            if memory is not None:
                survival, memory_s = memory.price(nv, total_blocks, turnover[i] if turnover is not None else 1.0)
                queue += memory.crowding_s(nv, total_blocks, penalty_s)
                if survival < 1.0:  # expected prefill: the hit is gone with probability 1 - survival
                    prefill = survival * prefill + (1.0 - survival) * cold_prefill
            via_pull = False
            if src_blocks - blocks >= min_pull_blocks and nv.node.transfer_endpoint:
                pull_transfer = pull_memo.get((own, tier))
                if pull_transfer is None:
                    pull_transfer = pull_memo[(own, tier)] = self.pull_transfer_s(own, tier, src_tokens, src_tier)
                if pull_transfer + pull_prefill < transfer + prefill - pull_margin_s:
                    transfer, prefill, via_pull = pull_transfer, pull_prefill, True
            node = nv.node
            append(
                CandidateCost(
                    node.node_id, node.address, blocks, tier, load.inflight,
                    queue, transfer, prefill, queue + transfer + prefill, via_pull, memory_s, survival,
                )
            )
        return out
