"""``kvgate profile fit`` recovers the speeds of the engine that produced the metrics, and says
clearly what is missing when it cannot."""

from __future__ import annotations

import json

import pytest
import yaml

from gateway.cli import main
from gateway.profile import HardwareProfile, load_profile
from gateway.profile_fit import FitError, fit_profile, read_metrics, read_results

BASE = load_profile("llama-3.1-8b-h100")


def scrape(profile: HardwareProfile, *, requests: int = 400, prompt: int = 3000, cached: int = 1000,
           running: int = 8, tpot_name: str = "vllm:inter_token_latency_seconds", blocks: int | None = 41000) -> str:
    """What one vLLM engine running at ``profile``'s speeds would export after ``requests`` requests."""
    new = prompt - cached
    prefill = profile.prefill_seconds(new)  # as the fit reads it: new tokens, no cached context
    step = profile.decode_step_seconds(running, running * prompt)
    info = f'num_gpu_blocks="{blocks}",' if blocks else ""
    return f"""# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{model_name="m"}} {requests * prompt}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{model_name="m"}} {requests * cached}
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{{le="+Inf",model_name="m"}} {requests}
vllm:request_prefill_time_seconds_count{{model_name="m"}} {requests}
vllm:request_prefill_time_seconds_sum{{model_name="m"}} {requests * prefill}
# TYPE {tpot_name} histogram
{tpot_name}_bucket{{le="+Inf",model_name="m"}} {requests * 100}
{tpot_name}_count{{model_name="m"}} {requests * 100}
{tpot_name}_sum{{model_name="m"}} {requests * 100 * step}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",{info}gpu_memory_utilization="0.9"}} 1.0
"""


def test_the_fit_recovers_the_speeds_of_the_engine_that_was_measured() -> None:
    # an engine 1.6x slower at prefill and 1.3x slower at decode than the base profile says
    truth = BASE.model_copy(update={
        "prefill_tokens_per_s": BASE.prefill_tokens_per_s / 1.6,
        "decode_step_base_s": BASE.decode_step_base_s * 1.3,
        "decode_step_per_seq_s": BASE.decode_step_per_seq_s * 1.3,
        "decode_step_per_context_token_s": BASE.decode_step_per_context_token_s * 1.3,
    })  # fmt: skip
    fitted = fit_profile(read_metrics(scrape(truth)), BASE, name="mine", source="engine.prom")
    assert fitted.name == "mine" and fitted.kv_capacity_blocks == 41000
    assert fitted.prefill_tokens_per_s == pytest.approx(truth.prefill_tokens_per_s, rel=1e-6)
    assert fitted.decode_step_seconds(8, 24000) == pytest.approx(truth.decode_step_seconds(8, 24000), rel=1e-6)
    assert fitted.sources[0].startswith("fitted by `kvgate profile fit` from engine.prom")
    assert "400 prefills of 2000 new tokens" in fitted.sources[0]
    assert any(s.startswith("base llama-3.1-8b-h100: ") for s in fitted.sources)


def test_older_vllm_names_and_unknown_capacity_are_read_too() -> None:
    text = scrape(BASE, tpot_name="vllm:time_per_output_token_seconds", blocks=None)
    fitted = fit_profile(read_metrics(text), BASE, name="old", source="x")
    assert fitted.kv_capacity_blocks == BASE.kv_capacity_blocks
    assert fitted.prefill_tokens_per_s == pytest.approx(BASE.prefill_tokens_per_s, rel=1e-6)


def test_metrics_that_cannot_price_a_profile_are_refused_with_the_reason(tmp_path, capsys) -> None:
    with pytest.raises(FitError, match="request_prefill_time_seconds"):
        read_metrics("# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total 10\n")
    fast = scrape(BASE).replace(
        f"vllm:request_prefill_time_seconds_sum{{model_name=\"m\"}} {400 * BASE.prefill_seconds(2000)}",
        "vllm:request_prefill_time_seconds_sum{model_name=\"m\"} 0.4",
    )
    with pytest.raises(FitError, match="leaves no time"):
        fit_profile(read_metrics(fast), BASE, name="x", source="x")
    bad = tmp_path / "bad.prom"
    bad.write_text("up 1\n")
    assert main(["profile", "fit", str(bad)]) == 2
    assert "is this a vLLM /metrics scrape" in capsys.readouterr().out


def test_the_command_writes_a_profile_kvgate_loads(tmp_path) -> None:
    src = tmp_path / "engine.prom"
    src.write_text(scrape(BASE))
    out = tmp_path / "fitted.yaml"
    assert main(["profile", "fit", str(src), "--name", "fleet-a", "--out", str(out)]) == 0
    loaded = load_profile(str(out))
    assert loaded.name == "fleet-a" and yaml.safe_load(out.read_text())["sources"]


def test_a_load_tests_results_price_the_fleet_that_served_them(tmp_path) -> None:
    """Simulated engines run at half the base's prefill speed and twice its decode step; a light
    run's results JSON gives those speeds back through ``kvgate profile fit``."""
    truth = BASE.model_copy(update={
        "name": "truth", "prefill_tokens_per_s": BASE.prefill_tokens_per_s / 2,
        **{k: getattr(BASE, k) * 2 for k in ("decode_step_base_s", "decode_step_per_seq_s", "decode_step_per_context_token_s")},
    })
    (tmp_path / "truth.yaml").write_text(yaml.safe_dump(truth.model_dump()))
    results, out = tmp_path / "results.json", tmp_path / "fitted.yaml"
    assert main(["loadtest", "simulate", "--workload", "trace", "--trace-limit", "80", "--trace-time-scale", "20",
                 "--nodes", "4", "--profile", str(tmp_path / "truth.yaml"), "--policies", "least_request,oracle",
                 "--json", str(results)]) == 0
    assert main(["profile", "fit", str(results), "--name", "fleet-b", "--out", str(out)]) == 0
    fitted = load_profile(str(out))
    assert fitted.prefill_tokens_per_s == pytest.approx(truth.prefill_tokens_per_s, rel=0.1)
    assert fitted.decode_step_base_s == pytest.approx(truth.decode_step_base_s, rel=0.25)
    assert "80 requests of least_request" in fitted.sources[0]  # the oracle is no real fleet: left out


def test_results_without_request_rows_are_refused_with_the_reason(tmp_path, capsys) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"kind": "replay", "policies": {"kvgate": {"hit_rate": 0.5, "wall_s": 10}}}))
    assert main(["profile", "fit", str(old)]) == 2
    assert "policy 'kvgate' has no request_table" in capsys.readouterr().out
    assert main(["profile", "fit", str(old), "--policies", "sglang"]) == 2
    assert "no policy sglang in the results (has kvgate)" in capsys.readouterr().out
    with pytest.raises(FitError, match="not a kvgate loadtest results file"):
        read_results([1, 2])
