"""``kvgate loadtest replay`` end to end: real engines, real Envoy, real ``kvgate serve``, a handful
of streamed requests per policy; the JSON has the documented schema and the report its files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KEYS = {"hit_rate", "ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s", "redundant_prefill_frac", "imbalance",
        "errors", "requests", "hit_rate_local", "hit_rate_pulled", "ttft_p90_ms", "ttft_by_turn",
        "requests_per_s", "decision_p50_ms", "decision_p99_ms", "ttft_mean_ms", "engine_ttft_mean_ms",
        "path_ttft_mean_ms", "path_ttft_p50_ms", "engine_ttft_p50_ms"}


def test_replay_smoke_two_policies(tmp_path: Path) -> None:
    out, report = tmp_path / "r.json", tmp_path / "report"
    cmd = [
        sys.executable, "-m", "gateway.cli", "loadtest", "replay",
        "--workload", "chat", "--conversations", "3", "--turns", "2", "--rate", "4",
        "--doc-tokens", "600", "900", "--think", "0.1", "0.2", "--max-tokens", "8",
        "--nodes", "2", "--time-scale", "0.2", "--policies", "round_robin,kvgate",
        "--max-requests", "6", "--duration", "30", "--timeout", "30",
        "--json", str(out), "--report", str(report), "--workdir", str(tmp_path / "wd"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["kind"] == "replay" and data["schema_version"] == 1
    assert list(data["policies"]) == ["round_robin", "kvgate"]
    for name, s in data["policies"].items():
        assert KEYS <= set(s), KEYS - set(s)
        assert s["requests"] == 6 and s["errors"] == 0, (name, s["error_examples"])
        assert 0.0 <= s["hit_rate"] <= 1.0 and s["ttft_p50_ms"] > 0
        assert 0.0 < s["engine_ttft_p50_ms"] <= s["ttft_p99_ms"] and s["path_ttft_p50_ms"] is not None
        assert sum(s["per_node_requests"].values()) == 6
        assert set(s["ttft_by_turn"]) == {"1", "2"}
        # the engines' own TTFT (their histograms) is part of the client's; the rest is the path
        assert 0 < s["engine_ttft_mean_ms"] < s["ttft_mean_ms"], s
        assert s["path_ttft_mean_ms"] == pytest.approx(s["ttft_mean_ms"] - s["engine_ttft_mean_ms"])
    # the second turn of each chat follows its history under kvgate
    assert data["policies"]["kvgate"]["hit_rate"] > 0.3
    assert data["policies"]["kvgate"]["decision_p50_ms"] is not None  # read from kvgate's /metrics
    assert data["policies"]["round_robin"]["decision_p50_ms"] is None
    html = (report / "index.html").read_text()
    for png in ("ttft_cdf.png", "hit_rate.png", "ttft_by_turn.png"):
        assert (report / png).stat().st_size > 1000
        assert f'src="{png}"' in html
    assert "round_robin" in proc.stdout and "kvgate" in proc.stdout


def test_replay_kvgate_over_ext_authz(tmp_path: Path) -> None:
    """``--integration ext_authz``: Envoy asks kvgate over HTTP (its ext_proc server is off), and the
    decisions still route: follow-up turns hit their history and kvgate's decision metric moved."""
    out = tmp_path / "r.json"
    cmd = [
        sys.executable, "-m", "gateway.cli", "loadtest", "replay",
        "--workload", "chat", "--conversations", "3", "--turns", "2", "--rate", "4",
        "--doc-tokens", "600", "900", "--think", "0.1", "0.2", "--max-tokens", "8",
        "--nodes", "2", "--time-scale", "0.2", "--policies", "kvgate", "--integration", "ext_authz",
        "--max-requests", "6", "--duration", "30", "--timeout", "30",
        "--json", str(out), "--workdir", str(tmp_path / "wd"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["fleet"]["integration"] == "ext_authz"
    s = data["policies"]["kvgate"]
    assert s["requests"] == 6 and s["errors"] == 0, s["error_examples"]
    assert s["hit_rate"] > 0.3
    assert s["decision_p50_ms"] is not None  # kvgate decided every request (read from its /metrics)
    config = (tmp_path / "wd" / "kvgate-kvgate.yaml").read_text()
    assert "ext_authz_port" in config and "ext_proc_enabled: false" in config
    assert "envoy.filters.http.ext_authz" in (tmp_path / "wd" / "envoy-kvgate.yaml").read_text()


@pytest.mark.timeout(600)  # three gateways in turn in front of three engines and two sidecars
def test_replay_a_disaggregated_fleet(tmp_path: Path) -> None:
    """``--roles 1:2``: n1 prefills only (never answers a request), n2/n3 answer behind their
    pd-sidecars; kvgate told never to split leaves n1 idle, every answer is whole."""
    out = tmp_path / "r.json"
    cmd = [
        sys.executable, "-m", "gateway.cli", "loadtest", "replay",
        "--workload", "mixed", "--sessions", "6", "--rate", "4", "--seed", "3",
        "--nodes", "3", "--roles", "1:2", "--link", "rdma", "--time-scale", "0.1",
        "--policies", "round_robin,kvgate_aggregated,kvgate", "--max-requests", "5", "--duration", "30", "--timeout", "60",
        "--json", str(out), "--workdir", str(tmp_path / "wd"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["fleet"]["roles"] == "1:2" and data["fleet"]["link"] == "rdma"
    for name, s in data["policies"].items():
        assert s["requests"] == 5 and s["errors"] == 0, (name, s["error_examples"])
        assert s["per_node_requests"].get("n1", 0) == 0, name  # the prefill node never answers
        assert {"tpot_p50_ms", "tpot_p99_ms", "split_frac"} <= set(s)
    assert data["policies"]["round_robin"]["split_frac"] == data["policies"]["kvgate_aggregated"]["split_frac"] == 0.0
    assert (tmp_path / "wd" / "pd-sidecar-n2.log").exists() and not (tmp_path / "wd" / "pd-sidecar-n1.log").exists()


def test_replay_roles_must_fit_the_fleet(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "gateway.cli", "loadtest", "replay", "--workload", "mixed", "--nodes", "3",
           "--roles", "2:2", "--policies", "kvgate", "--workdir", str(tmp_path / "wd")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "roles 2:2 must be at least one of each and add up to 3 nodes" in proc.stdout
