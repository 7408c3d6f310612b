"""``kvgate profile fit``: a hardware profile priced from a real engine's ``/metrics``, not a guess.

The cost model prices prefill, decode and memory with a ``HardwareProfile``; the shipped ones are
derived from public datasheets and benchmarks. A fleet that runs differently (another GPU, a
quantized model, other vLLM flags) should be priced from what its engines measured. vLLM exports,
cumulatively since the engine started:

- ``vllm:prompt_tokens_total`` and ``vllm:prefix_cache_hits_total``: tokens asked, tokens found cached;
- ``vllm:request_prefill_time_seconds`` (histogram): each request's time in the prefill phase;
- ``vllm:inter_token_latency_seconds`` (``vllm:time_per_output_token_seconds`` before v0.11):
  the time between two output tokens, one decode step;
- ``vllm:num_requests_running``: the batch at scrape time;
- ``vllm:cache_config_info{num_gpu_blocks, block_size}``: the KV cache's size.

The fit keeps the base profile's shape (attention, overhead, how a step grows with the batch) and
rescales its two throughputs to the means: prefill tokens/s so that the mean request's new tokens
take the mean prefill time, decode steps so that the base model's step at the observed batch and
context takes the mean inter-token latency. KV capacity and block size come from the cache config
when exported. The profile's ``sources`` record the figures it was fitted from. Scrapes of several
engines may be concatenated: their samples are summed.

A load test's results (``kvgate loadtest replay --json``, or ``simulate``'s) price it too: their
``request_table`` has each request's prompt, cached and output tokens, TTFT and end. A TTFT is the
prefill plus whatever the request queued behind, so each request with enough new tokens gives a
lower bound of the prefill throughput (its new tokens over its TTFT minus the base's overhead and
attention), and the fit takes the requests that queued least: the 75th percentile of those
bounds. Decode is rescaled so that the base model's step, at the mean batch per node (the
requests' summed durations over the run's node-seconds) and mean context, takes the median time
per output token. A replay at a light load fits best (fewer requests queue).
"""

from __future__ import annotations

import argparse
import datetime
import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.profile import HardwareProfile, load_profile

TPOT_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
MIN_NEW_TOKENS = 256  # a shorter prefill is mostly fixed overhead: it says little about throughput
FAST_QUANTILE = 75  # percentile of per-request throughput bounds taken as the unqueued speed


class FitError(ValueError):
    """The metrics cannot price a profile (say which figure is missing or implausible)."""


@dataclass(frozen=True)
class Observed:
    """Engine-lifetime sums read from ``/metrics`` text."""

    prompt_tokens: float
    cached_tokens: float
    prefill_s: float  # sum of per-request prefill times
    prefills: float  # requests with a prefill time
    tpot_s: float  # sum of inter-token latencies
    tpots: float
    running: float  # requests running at scrape time (over all engines)
    engines: int
    gpu_blocks: int | None
    block_size: int | None


def read_metrics(text: str) -> Observed:
    """Sum the figures the fit needs over every engine in ``text``; ``FitError`` if any is missing."""
    sums: dict[str, float] = {}
    engines = 0
    gpu_blocks = block_size = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
            if s.name == "vllm:cache_config_info":
                engines += 1
                if "num_gpu_blocks" in s.labels and s.labels["num_gpu_blocks"] not in ("", "None"):
                    gpu_blocks = int(s.labels["num_gpu_blocks"])
                if "block_size" in s.labels:
                    block_size = int(s.labels["block_size"])
    tpot = next((n for n in TPOT_NAMES if f"{n}_count" in sums), None)
    needed = {
        "vllm:prompt_tokens_total": "prompt tokens",
        "vllm:request_prefill_time_seconds_count": "per-request prefill time histogram",
    }
    missing = [f"{k} ({v})" for k, v in needed.items() if k not in sums]
    if tpot is None:
        missing.append(f"{' or '.join(TPOT_NAMES)} (inter-token latency histogram)")
    if missing:
        raise FitError("the metrics lack " + "; ".join(missing) + " — is this a vLLM /metrics scrape?")
    assert tpot is not None
    return Observed(
        prompt_tokens=sums["vllm:prompt_tokens_total"],
        cached_tokens=sums.get("vllm:prefix_cache_hits_total", 0.0),
        prefill_s=sums["vllm:request_prefill_time_seconds_sum"],
        prefills=sums["vllm:request_prefill_time_seconds_count"],
        tpot_s=sums[f"{tpot}_sum"],
        tpots=sums[f"{tpot}_count"],
        running=sums.get("vllm:num_requests_running", 0.0),
        engines=max(engines, 1),
        gpu_blocks=gpu_blocks,
        block_size=block_size,
    )


def fit_profile(obs: Observed, base: HardwareProfile, *, name: str, source: str) -> HardwareProfile:
    """``base`` with prefill and decode speeds (and KV capacity, if known) fitted to ``obs``."""
    if obs.prefills < 1 or obs.tpots < 1:
        raise FitError("no request has finished a prefill and a decode step yet: send traffic first")
    new_tokens = (obs.prompt_tokens - obs.cached_tokens) / obs.prefills
    prefill_s = obs.prefill_s / obs.prefills
    attention = base.prefill_attention_s_per_token2 * new_tokens * new_tokens / 2
    linear_s = prefill_s - base.prefill_overhead_s - attention
    if new_tokens < 1 or linear_s <= 0:
        raise FitError(
            f"mean prefill of {new_tokens:.0f} new tokens in {prefill_s * 1000:.1f} ms leaves no time for the "
            f"linear term of base profile {base.name!r} (overhead + attention alone take longer)"
        )
    batch = max(obs.running / obs.engines, 1.0)
    context = obs.prompt_tokens / obs.prefills
    scale = (obs.tpot_s / obs.tpots) / base.decode_step_seconds(round(batch), round(batch * context))
    figures = (
        f"{obs.engines} engine(s), {obs.prefills:.0f} prefills of {new_tokens:.0f} new tokens on average "
        f"({obs.cached_tokens / max(obs.prompt_tokens, 1):.0%} of prompt tokens cached) in "
        f"{prefill_s * 1000:.1f} ms, {obs.tpots:.0f} inter-token gaps of {obs.tpot_s / obs.tpots * 1000:.2f} ms "
        f"at {batch:.1f} running"
    )
    return _fitted(base, name=name, source=source, figures=figures, prefill_tokens_per_s=new_tokens / linear_s,
                   decode_scale=scale, gpu_blocks=obs.gpu_blocks, block_size=obs.block_size)


def _fitted(
    base: HardwareProfile, *, name: str, source: str, figures: str, prefill_tokens_per_s: float, decode_scale: float,
    gpu_blocks: int | None = None, block_size: int | None = None,
) -> HardwareProfile:
    """``base`` with its prefill throughput replaced and its decode step scaled, saying from what."""
    update: dict[str, object] = {
        "name": name,
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "decode_step_base_s": base.decode_step_base_s * decode_scale,
        "decode_step_per_seq_s": base.decode_step_per_seq_s * decode_scale,
        "decode_step_per_context_token_s": base.decode_step_per_context_token_s * decode_scale,
        "sources": [
            f"fitted by `kvgate profile fit` from {source} on {datetime.date.today().isoformat()}: {figures}",
            *(f"base {base.name}: {s}" for s in base.sources),
        ],
    }
    if gpu_blocks:
        update["kv_capacity_blocks"] = gpu_blocks
    if block_size:
        update["block_size"] = block_size
    return HardwareProfile.model_validate({**base.model_dump(), **update})


@dataclass(frozen=True)
class ReplayRequests:
    """Per-request figures of a load test's results (``request_table`` rows of the chosen policies)."""

    prompt: np.ndarray  # tokens
    cached: np.ndarray
    output: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    node_seconds: float  # run length times nodes, summed over the policies read
    policies: tuple[str, ...]


def read_results(data: object, policies: list[str] | None = None) -> ReplayRequests:
    """The request table of ``kvgate loadtest replay|simulate --json`` results; ``FitError`` if absent."""
    if not isinstance(data, dict) or not isinstance(data.get("policies"), dict) or not data["policies"]:
        raise FitError("not a kvgate loadtest results file (no 'policies' in it)")
    chosen = policies or [p for p in data["policies"] if not p.startswith("oracle")]  # ceilings: no real fleet
    unknown = [p for p in chosen if p not in data["policies"]]
    if unknown:
        raise FitError(f"no policy {', '.join(unknown)} in the results (has {', '.join(data['policies'])})")
    rows: list[list[float]] = []
    node_seconds = 0.0
    for name in chosen:
        s = data["policies"][name]
        table = s.get("request_table")
        if not isinstance(table, dict) or "rows" not in table:
            raise FitError(f"policy {name!r} has no request_table: results written before kvgate recorded one")
        cols = table["columns"]
        idx = [cols.index(c) for c in ("prompt_tokens", "cached_tokens", "output_tokens", "ttft_ms", "e2e_ms")]
        rows.extend([row[i] for i in idx] for row in table["rows"])
        node_seconds += float(s.get("wall_s") or 0.0) * max(len(s.get("per_node_requests") or {}), 1)
    if not rows:
        raise FitError("the results hold no successful request: nothing to fit")
    a = np.asarray(rows, dtype=float)
    return ReplayRequests(a[:, 0], a[:, 1], a[:, 2], a[:, 3] / 1000, a[:, 4] / 1000, node_seconds, tuple(chosen))


def fit_results(req: ReplayRequests, base: HardwareProfile, *, name: str, source: str) -> HardwareProfile:
    """``base`` with prefill and decode speeds fitted to a load test's requests (module doc)."""
    new = np.maximum(req.prompt - req.cached, 1)
    usable = new >= MIN_NEW_TOKENS
    attention = base.prefill_attention_s_per_token2 * new * (req.cached + new / 2)
    linear = req.ttft_s - base.prefill_overhead_s - attention
    usable &= linear > 0
    if usable.sum() < 10:
        raise FitError(
            f"only {int(usable.sum())} requests prefilled {MIN_NEW_TOKENS}+ new tokens in more time than base profile "
            f"{base.name!r} spends on overhead and attention: need 10 (longer prompts, or a base closer to this hardware)"
        )
    rate = float(np.percentile(new[usable] / linear[usable], FAST_QUANTILE))
    multi = req.output >= 2
    if not multi.any():
        raise FitError("no request decoded two tokens or more: the time per output token is unknown")
    tpot = float(np.median((req.e2e_s[multi] - req.ttft_s[multi]) / (req.output[multi] - 1)))
    batch = float(req.e2e_s.sum() / req.node_seconds) if req.node_seconds > 0 else 1.0
    batch = max(batch, 1.0)
    context = float(np.mean(req.prompt + req.output / 2))
    scale = tpot / base.decode_step_seconds(round(batch), round(batch * context))
    figures = (
        f"{len(req.prompt)} requests of {', '.join(req.policies)}; prefill {rate:,.0f} tokens/s (p{FAST_QUANTILE} of "
        f"{int(usable.sum())} requests with {MIN_NEW_TOKENS}+ new tokens), {tpot * 1000:.2f} ms per output token "
        f"(median) at {batch:.1f} running per node"
    )
    return _fitted(base, name=name, source=source, figures=figures, prefill_tokens_per_s=rate, decode_scale=scale)


def _fit(source: str, base: HardwareProfile, *, name: str, policies: list[str] | None) -> HardwareProfile:
    """From a results JSON (``{...}``) or vLLM's /metrics text, whichever ``source`` holds."""
    text = _read(source)
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise FitError(f"{source} is not valid JSON: {e}") from None
        return fit_results(read_results(data, policies), base, name=name, source=source)
    return fit_profile(read_metrics(text), base, name=name, source=source)


def _read(source: str) -> str:
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=10) as r:  # noqa: S310 (the user's own engine)
            return r.read().decode()
    return Path(source).read_text()


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    f = sub.add_parser("fit", help="fit a hardware profile to a vLLM engine's /metrics or a load test's results",
                       description="fit a hardware profile to a vLLM engine's /metrics (file or URL) or to the "
                                   "results JSON of kvgate loadtest replay (or simulate)")
    f.add_argument("metrics", help="Prometheus text from vLLM's /metrics (a file, or an http(s) URL to scrape), "
                                   "or a kvgate loadtest results JSON")
    f.add_argument("--policies", default=None,
                   help="results JSON: comma-separated policies whose requests to fit (default: all but the oracles)")
    f.add_argument("--base", default="llama-3.1-8b-h100", help="profile whose shape is kept (shipped name or YAML)")
    f.add_argument("--name", default="fitted", help="name of the new profile")
    f.add_argument("--out", default="-", help="YAML file to write ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    try:
        base = load_profile(args.base)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
        profile = _fit(args.metrics, base, name=args.name, policies=policies)
    except (FitError, OSError) as e:
        print(f"kvgate profile fit: {e}")
        return 2
    text = yaml.safe_dump(profile.model_dump(), sort_keys=False)
    if args.out == "-":
        print(text, end="")
    else:
        Path(args.out).write_text(text)
        print(f"kvgate profile fit: wrote {args.out} (prefill {profile.prefill_tokens_per_s:,.0f} tokens/s, "
              f"decode step {profile.decode_step_base_s * 1000:.2f} ms)")
    return 0
