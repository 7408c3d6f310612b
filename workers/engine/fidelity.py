"""Fidelity, shown: each profile's modelled TTFT and ITL beside the public figures behind it.

``python -m workers.engine.fidelity`` drives the engine's own scheduler and cache (the same
classes ``kvgate worker`` runs) with a virtual clock, so the numbers are what a simulated node
would do, not the profile's formulas re-evaluated. For every shipped profile it prints TTFT of
1k / 4k / 8k-token prompts cold and fully cached, and the decode inter-token latency at batch 1
and 32; then every public figure a profile was calibrated from or checked against, with the
modelled value for the same setup.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.profile import HardwareProfile, load_profile, shipped_profiles
from workers.engine.kv_cache import PrefixCache, root_hash
from workers.engine.sampling import ReplySampler
from workers.engine.scheduler import Scheduler, SimRequest

_SAMPLER = ReplySampler(range(1000, 1200), min_natural=4096, max_natural=4096)


def _prompt(n: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng(salt)
    return rng.integers(100, 30000, size=n, dtype=np.uint32)


def _request(rid: str, prompt: np.ndarray, max_tokens: int, bs: int, arrival: float) -> SimRequest:
    reply = _SAMPLER.reply(prompt, max_tokens, ignore_eos=True)
    return SimRequest.create(rid, prompt, reply, block_size=bs, root_hash=root_hash(), key_seed=0, arrival=arrival)


def _run_until(s: Scheduler, now: float, done) -> float:  # type: ignore[no-untyped-def]
    while not done():
        step = s.schedule(now)
        if step is None:
            raise RuntimeError("the engine stalled")
        now += step.duration_s
        s.complete(step, now)
    return now


def _engine(profile: HardwareProfile) -> Scheduler:
    return Scheduler(profile, PrefixCache(profile.kv_capacity_blocks, profile.block_size))


def ttft(profile: HardwareProfile, prompt_tokens: int, *, cached: bool) -> float:
    """Seconds from arrival to first token of a lone request, on an idle engine."""
    s = _engine(profile)
    prompt = _prompt(prompt_tokens, prompt_tokens)
    now = 0.0
    if cached:
        warm = _request("warm", prompt, 1, profile.block_size, now)
        s.add(warm)
        now = _run_until(s, now, lambda: warm.finished)
    r = _request("probe", prompt, 2, profile.block_size, now)
    s.add(r)
    _run_until(s, now, lambda: r.first_token_at is not None)
    assert r.first_token_at is not None
    return r.first_token_at - r.arrival


def itl(profile: HardwareProfile, batch: int, context_tokens: int, *, steps: int = 8) -> float:
    """Mean seconds between tokens when ``batch`` requests of ``context_tokens`` prompts all decode."""
    s = _engine(profile)
    reqs = [_request(f"r{i}", _prompt(context_tokens, 10_000 + i), 64, profile.block_size, 0.0) for i in range(batch)]
    for r in reqs:
        s.add(r)
    now = _run_until(s, 0.0, lambda: all(r.generated >= 1 for r in reqs))
    start, first = now, reqs[0].generated
    now = _run_until(s, now, lambda: reqs[0].generated >= first + steps)
    return (now - start) / steps


@dataclass(frozen=True)
class Reference:
    """One public figure and how to compute the modelled value for the same setup."""

    profile: str
    what: str
    published: str
    published_s: tuple[float, float]  # a value (lo == hi) or a range
    source: str
    kind: str  # "ttft" | "itl"
    tokens: int
    batch: int = 1

    def modelled(self) -> float:
        p = load_profile(self.profile)
        if self.kind == "ttft":
            return ttft(p, self.tokens, cached=False)
        return itl(p, self.batch, self.tokens)


NIM = "NVIDIA NIM benchmarking, Performance (docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance)"
REFERENCES = (
    Reference("llama-3.3-70b-fp8-h100x2", "TTFT, 500-token prompt, concurrency 1", "47.77 ms", (0.04777, 0.04777), NIM, "ttft", 500),
    Reference("llama-3.3-70b-fp8-h100x2", "TTFT, 5000-token prompt, concurrency 1", "406.77 ms", (0.40677, 0.40677), NIM, "ttft", 5000),
    Reference("llama-3.3-70b-fp8-h100x2", "ITL, 5000-token context, concurrency 1", "18.58 ms", (0.01858, 0.01858), NIM, "itl", 5000),
    Reference(
        "llama-3.1-8b-h100",
        "TTFT added by a 500-token prompt (vLLM, 1x H100)",
        "~20-40 ms",
        (0.020, 0.040),
        "hungchun0201.github.io agentic-ai-survey, week 15 (LMCache / vLLM APC lab)",
        "ttft",
        500,
    ),
)


def report() -> str:
    lines: list[str] = []
    for name in shipped_profiles():
        p = load_profile(name)
        lines.append(f"{name}  ({p.model}, {p.hardware})")
        lines.append(f"  {'prompt':>8}  {'TTFT cold':>10}  {'TTFT cached':>11}")
        for n in (1024, 4096, 8192):
            lines.append(f"  {n:>8}  {ttft(p, n, cached=False) * 1e3:>8.1f}ms  {ttft(p, n, cached=True) * 1e3:>9.1f}ms")
        lines.append(
            f"  decode ITL (2k-token contexts): batch 1 {itl(p, 1, 2048) * 1e3:.2f} ms, "
            f"batch 32 {itl(p, 32, 2048) * 1e3:.2f} ms"
        )
        lines.append("")
    lines.append("Public figures vs the model (same setup):")
    for ref in REFERENCES:
        got = ref.modelled()
        lo, hi = ref.published_s
        if lo == hi:
            verdict = f"{(got - lo) / lo * 100:+.0f}%"
        else:
            verdict = "inside range" if lo <= got <= hi else "OUTSIDE range"
        lines.append(
            f"  {ref.profile}: {ref.what}: published {ref.published}, modelled {got * 1e3:.1f} ms ({verdict})"
            f"\n      source: {ref.source}"
        )
    lines.append(
        "Profiles without a row above are derived from the anchor's efficiencies (0.45 of peak FLOPs in "
        "prefill, 0.57 of peak bandwidth in decode); see the comments in gateway/profiles/*.yaml."
    )
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
