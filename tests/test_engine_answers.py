"""A request asking for ``n`` answers on the simulated engine, as vLLM serves it: the prompt is
computed once, ``n`` sequences decode side by side (each a token per step, each reading its own
context), and the answers beyond the first hold blocks of their own until the request ends."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.profile import load_profile
from workers.engine.kv_cache import PrefixCache, root_hash
from workers.engine.openai_api import APIError, generation_options
from workers.engine.scheduler import Scheduler, SimRequest
from workers.engine.step_time import step_seconds
from tests.test_engine_scheduler import SAMPLER, prompt

PROFILE = load_profile("llama-3.1-8b-h100")
BS = PROFILE.block_size


def asked(rid: str, ids: np.ndarray, tokens: int, answers: int) -> SimRequest:
    reply = SAMPLER.reply(ids, tokens, ignore_eos=True)
    return SimRequest.create(rid, ids, reply, block_size=BS, root_hash=root_hash(), key_seed=7, arrival=0.0, answers=answers)


def steps(s: Scheduler):  # type: ignore[no-untyped-def]
    """Every step until done: (step, blocks in use during it)."""
    out, now = [], 0.0
    while s.has_work():
        step = s.schedule(now, max_steps=1)
        assert step is not None
        out.append((step, s.cache.stats().used_blocks))
        now += step.duration_s
        s.complete(step, now)
        s.cache.check_invariants()
    return out


def test_n_answers_compute_the_prompt_once_and_decode_n_sequences_a_step() -> None:
    ids = prompt(1000, 3)  # 62 full blocks and 8 tokens
    one, four = Scheduler(PROFILE, PrefixCache(2000, BS)), Scheduler(PROFILE, PrefixCache(2000, BS))
    one.add(asked("a", ids, 40, 1))
    four.add(r := asked("b", ids, 40, 4))
    ran1, ran4 = steps(one), steps(four)
    assert sum(st.prefill_tokens for st, _ in ran4) == sum(st.prefill_tokens for st, _ in ran1) == 1000  # once
    assert four.counters.prompt_tokens == 1000 and four.counters.generation_tokens == 4 * 40
    assert r.generated == 40 and r.finished
    decodes = [st for st, _ in ran4 if st.decode_seqs]
    assert decodes and all(st.decode_seqs == 4 for st in decodes)
    # each step reads the four contexts: the step is what four sequences of that length cost
    last = decodes[-1]
    ctx = 1000 + 39
    assert last.duration_s == pytest.approx(step_seconds(PROFILE, prefill_tokens=0, prefill_pairs=0.0,
                                                         decode_seqs=4, decode_context_tokens=4 * ctx))
    assert sum(st.duration_s for st, _ in ran4) > sum(st.duration_s for st, _ in ran1)
    # the three other answers hold blocks of their own from the prompt's last full block on
    peak1, peak4 = max(u for _, u in ran1), max(u for _, u in ran4)
    assert peak4 - peak1 == 3 * -(-(1000 - 62 * BS + 40) // BS)
    assert four.cache.stats().used_blocks == 0  # all given back at the end


def test_n_answers_take_n_places_in_the_batch() -> None:
    s = Scheduler(PROFILE, PrefixCache(4000, BS), max_num_seqs=4)
    s.add(asked("wide", prompt(100, 1), 30, 3))
    s.add(asked("one", prompt(100, 2), 30, 1))
    s.add(asked("two", prompt(100, 3), 30, 2))  # 3 + 1 + 2 > 4: waits until a place is free
    first = s.schedule(0.0)
    assert first is not None and [r.request_id for r, _ in first.items] == ["wide", "one"]
    assert s.running_seqs == 4


def test_the_engine_accepts_n_from_1_and_refuses_less() -> None:
    opts = generation_options({"n": 3}, chat=False, prompt_tokens=10, max_model_len=1000, default_max_tokens=16)
    assert opts.answers == 3
    assert generation_options({}, chat=False, prompt_tokens=10, max_model_len=1000, default_max_tokens=16).answers == 1
    with pytest.raises(APIError, match="n must be"):
        generation_options({"n": 0}, chat=False, prompt_tokens=10, max_model_len=1000, default_max_tokens=16)
