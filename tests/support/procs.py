"""Real processes for end-to-end tests: start, wait until they answer, and always clean up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from gateway.envoy_config import EnvoySettings, render_yaml

REPO = Path(__file__).resolve().parents[2]


def wait_for_port(port: int, *, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


class Proc:
    """A child process with its output in a log file (shown when a test fails)."""

    def __init__(self, name: str, cmd: Sequence[str], log_dir: Path, env: dict | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(list(cmd), stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (what an attack makes it hold)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def python_module(name: str, module: str, args: Sequence[str], log_dir: Path, env: dict | None = None) -> Proc:
    return Proc(name, [sys.executable, "-m", module, *args], log_dir, env)


def start_echo(name: str, port: int, log_dir: Path, *, delay_s: float = 0.0, fail_status: int = 0) -> Proc:
    args = ["--port", str(port), "--name", name, "--delay", str(delay_s), "--fail-status", str(fail_status)]
    p = python_module(f"echo-{name}", "tests.support.echo_upstream", args, log_dir)
    wait_for_port(port, proc=p.popen)
    return p


def start_envoy(envoy_bin: str, settings: EnvoySettings, log_dir: Path, name: str = "envoy") -> Proc:
    cfg_path = log_dir / f"{name}.yaml"
    cfg_path.write_text(render_yaml(settings))
    p = Proc(
        name,
        [envoy_bin, "-c", str(cfg_path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"],
        log_dir,
    )
    wait_for_port(int(settings.listen_address.rsplit(":", 1)[1]), proc=p.popen)
    return p


def start_kvgate(config: dict, log_dir: Path, name: str = "kvgate") -> Proc:
    cfg_path = log_dir / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    p = python_module(name, "gateway.cli", ["serve", "--config", str(cfg_path)], log_dir)
    wait_for_port(config["admin_port"], proc=p.popen, timeout_s=30)
    return p
