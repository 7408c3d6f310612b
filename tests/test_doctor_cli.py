"""`kvgate doctor` without engines: it first says which tokenizer and chat template kvgate loads
(what every node is compared against), then fails a node it cannot reach, naming the check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO, free_port


def _doctor(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({"models": ["m"], "fleet": [{"node_id": "n1", "address": f"127.0.0.1:{free_port()}"}]}))
    cmd = [sys.executable, "-m", "gateway.cli", "doctor", "--config", str(config), "--timeout", "2", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_doctor_names_what_kvgate_loaded_then_the_unreachable_node(tmp_path: Path) -> None:
    out = _doctor(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    first, *rest = out.stdout.splitlines()
    assert first.startswith("kvgate: tokenizer ") and "vocab 129280" in first, first
    assert "chat template default (deepseek_chat.jinja)" in first, first
    assert rest and rest[0].startswith("n1: FAIL reachable"), out.stdout


def test_doctor_json_lines_lead_with_the_loaded_tokenizer(tmp_path: Path) -> None:
    out = _doctor(tmp_path, "--json")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["kvgate"]["vocab"] == 129280 and lines[0]["kvgate"]["chat_template"].startswith("default")
    assert lines[1]["node_id"] == "n1" and lines[1]["ok"] is False and lines[1]["check"] == "reachable"
