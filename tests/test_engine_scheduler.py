"""The pure scheduler and timing model under a virtual clock (no sleeps, no wall-clock asserts)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.profile import load_profile
from workers.engine import fidelity
from workers.engine.kv_cache import PrefixCache, root_hash
from workers.engine.sampling import ReplySampler
from workers.engine.scheduler import Scheduler, SimRequest, State

PROFILE = load_profile("llama-3.1-8b-h100")
BS = PROFILE.block_size
SAMPLER = ReplySampler(range(1000, 1100))


def req(rid: str, prompt: np.ndarray, max_tokens: int = 4, *, ignore_eos: bool = True, now: float = 0.0) -> SimRequest:
    reply = SAMPLER.reply(prompt, max_tokens, ignore_eos=ignore_eos)
    return SimRequest.create(rid, prompt, reply, block_size=BS, root_hash=root_hash(), key_seed=7, arrival=now)


def prompt(n: int, salt: int = 0) -> np.ndarray:
    return np.random.default_rng(salt).integers(100, 50_000, size=n, dtype=np.uint32)


def run(s: Scheduler, now: float = 0.0, until=None, check=None) -> float:  # type: ignore[no-untyped-def]
    while s.has_work() and not (until and until()):
        step = s.schedule(now)
        assert step is not None
        if check:
            check(s, step)
        now += step.duration_s
        s.complete(step, now)
        s.cache.check_invariants()
    return now


def test_ttft_grows_with_prompt_length_and_falls_with_cached_prefix() -> None:
    cold = [fidelity.ttft(PROFILE, n, cached=False) for n in (256, 1024, 4096, 8192)]
    assert cold == sorted(cold) and cold[-1] > 4 * cold[1]
    for n in (1024, 8192):
        assert fidelity.ttft(PROFILE, n, cached=True) < fidelity.ttft(PROFILE, n, cached=False) / 3


def test_partial_prefix_hit_reports_shared_full_blocks_and_is_faster() -> None:
    s = Scheduler(PROFILE, PrefixCache(2000, BS))
    base = prompt(3000, 1)
    first = req("a", base)
    s.add(first)
    now = run(s)
    other = np.concatenate([base[:2000], prompt(1000, 2)])  # shares 2000 tokens = 125 full blocks
    second = req("b", other, now=now)
    s.add(second)
    run(s, now)
    assert second.cached_tokens == (2000 // BS) * BS
    assert second.first_token_at - second.arrival < first.first_token_at - first.arrival  # type: ignore[operator]
    assert s.counters.prefix_hits == second.cached_tokens
    assert s.counters.prefix_queries == 3000 + 3000


def test_identical_prompt_hits_all_full_blocks_but_recomputes_the_last_token() -> None:
    s = Scheduler(PROFILE, PrefixCache(500, BS))
    for n in (1000, 1024):  # unaligned: every full block; aligned: all but the last (vLLM caps at n-1)
        p = prompt(n, n)
        a, b = req(f"a{n}", p), req(f"b{n}", p)
        s.add(a)
        now = run(s)
        s.add(b)
        run(s, now)
        assert b.cached_tokens == ((n - 1) // BS) * BS


@given(
    budget=st.integers(16, 2048),
    max_seqs=st.integers(1, 8),
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
)
@settings(max_examples=40, deadline=None)
def test_steps_respect_token_budget_and_max_running(budget: int, max_seqs: int, lengths: list[int]) -> None:
    s = Scheduler(PROFILE, PrefixCache(3000, BS), max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    reqs = [req(f"r{i}", prompt(n, i), 3) for i, n in enumerate(lengths)]
    for r in reqs:
        s.add(r)

    def check(s: Scheduler, step) -> None:  # type: ignore[no-untyped-def]
        assert sum(n for _, n in step.items) <= budget
        assert len(s.running) <= max_seqs
        assert all(n >= 1 for _, n in step.items)

    run(s, check=check)
    assert all(r.state is State.FINISHED and r.generated == 3 for r in reqs)
    assert s.cache.stats().used_blocks == 0  # everything released


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    s = Scheduler(PROFILE, PrefixCache(2000, BS), max_num_batched_tokens=1000)
    r = req("long", prompt(4500))
    s.add(r)
    chunks = []
    now = 0.0
    while r.first_token_at is None:
        step = s.schedule(now)
        assert step is not None
        chunks.append(step.items[0][1])
        now += step.duration_s
        s.complete(step, now)
    assert chunks == [1000, 1000, 1000, 1000, 500]


def test_decode_batches_share_a_step_and_cost_more_than_one() -> None:
    one = fidelity.itl(PROFILE, 1, 2048)
    many = fidelity.itl(PROFILE, 32, 2048)
    assert PROFILE.decode_step_base_s <= one < many < 32 * one


def test_small_cache_preempts_and_still_finishes_everything() -> None:
    # 40 blocks = 640 tokens; four requests of 300 prompt + 100 reply tokens cannot all decode at once
    s = Scheduler(PROFILE, PrefixCache(40, BS))
    reqs = [req(f"r{i}", prompt(300, i), 100) for i in range(4)]
    for r in reqs:
        s.add(r)
    run(s)
    assert all(r.generated == 100 for r in reqs)
    assert s.counters.preemptions > 0
    assert s.cache.stats().hashed_blocks <= 40


def test_abort_releases_blocks() -> None:
    s = Scheduler(PROFILE, PrefixCache(100, BS))
    r = req("x", prompt(500), 50)
    s.add(r)
    now = run(s, until=lambda: r.generated >= 2)
    assert s.cache.stats().used_blocks > 0
    assert s.abort("x", now)
    assert r.finished and s.cache.stats().used_blocks == 0 and not s.has_work()
    assert s.counters.finished["abort"] == 1


def test_reply_is_deterministic_and_prefix_stable() -> None:
    p = prompt(100)
    a = SAMPLER.reply(p, 300, ignore_eos=True).token_ids
    b = SAMPLER.reply(p.copy(), 120, ignore_eos=True).token_ids
    assert np.array_equal(a[:120], b)
    assert not np.array_equal(SAMPLER.reply(prompt(100, 5), 300, ignore_eos=True).token_ids, a)
    natural = SAMPLER.reply(p, 10_000)
    assert natural.finish_reason == "stop" and len(natural.token_ids) < 10_000


def test_profile_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError):
        Scheduler(PROFILE, PrefixCache(10, BS * 2))


def test_fidelity_report_prints_profiles_and_public_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert fidelity.main() == 0
    out = capsys.readouterr().out
    print(out)
    for name in ("llama-3.1-8b-h100", "qwen2.5-32b-h100", "406.77 ms", "47.77 ms", "TTFT cached"):
        assert name in out
    for ref in fidelity.REFERENCES:  # the model stays within 15% (or inside the range) of each figure
        got = ref.modelled()
        lo, hi = ref.published_s
        assert lo * 0.85 <= got <= hi * 1.15, (ref.what, got)
