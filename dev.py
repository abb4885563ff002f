#!/usr/bin/env python3
"""The project's commands, runnable on a fresh machine that has only Python 3.10+.

    python3 dev.py demo             # a model split over 3 workers, trained from a driver (dist autograd)
    python3 dev.py test             # ruff, mypy, then the whole test suite (arguments: pytest's only)
    python3 dev.py lint / types     # ruff / mypy alone
    python3 dev.py bench            # zmqautograd.rpc next to torch.distributed.rpc (TensorPipe)
    python3 dev.py bench-transport  # the transport next to raw pyzmq
    python3 dev.py bench-scale      # as the work grows: 2-16 workers, chains, threads, idle cost
    python3 dev.py bench-instr      # instructions per step under callgrind, two commits (A/B)
    python3 dev.py bench-hosts      # between hosts (network + pid namespaces, root): next to TensorPipe
    python3 dev.py pingpong         # tensors out and back over the transport
    python3 dev.py stress           # a random mix under faults and a kill (tools/stress.py --help)
    python3 dev.py compose          # the demo on a real Docker engine, one container per worker;
                                    # --faults: then partition, pause, kill, restart a worker

Each creates ``.venv`` on first use and installs what it needs: torch (pinned to 2.13.0, the
CPU build, where the environment does not have torch yet), pyzmq, msgpack, and the test
extras; the project itself is installed in editable mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".installed"
TORCH_PIN = "torch==2.13.0"


def run(*args: str | os.PathLike) -> None:
    subprocess.run([str(a) for a in args], cwd=ROOT, check=True)


def ensure_venv() -> None:
    """Create and fill .venv unless it is already up to date with pyproject.toml."""
    pyproject = ROOT / "pyproject.toml"
    if STAMP.exists() and STAMP.stat().st_mtime >= pyproject.stat().st_mtime:
        return
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        run(sys.executable, "-m", "venv", VENV)
    has_torch = subprocess.run([str(PYTHON), "-c", "import torch"], capture_output=True).returncode == 0
    if not has_torch:
        print(f"installing {TORCH_PIN}", flush=True)
        run(PYTHON, "-m", "pip", "install", "-q", TORCH_PIN)
    print("installing zmqautograd and its test dependencies", flush=True)
    run(PYTHON, "-m", "pip", "install", "-q", "-e", ".[test]")
    STAMP.touch()


def ensure_bench_extras() -> None:
    """The benchmark's TensorPipe side needs numpy (pyproject.toml, extra "bench")."""
    if subprocess.run([str(PYTHON), "-c", "import numpy"], capture_output=True).returncode != 0:
        print("installing the benchmark's extras (numpy, for TensorPipe)", flush=True)
        run(PYTHON, "-m", "pip", "install", "-q", "-e", ".[test,bench]")


def main() -> int:
    commands = {
        "demo": [PYTHON, "tools/demo.py"],
        "test": [PYTHON, "-m", "pytest", "-q", *sys.argv[2:]],
        "lint": [PYTHON, "-m", "ruff", "check", "."],
        "types": [PYTHON, "-m", "mypy"],
        "bench": [PYTHON, "tools/bench.py", *sys.argv[2:]],
        "bench-transport": [PYTHON, "tools/bench_transport.py", *sys.argv[2:]],
        "bench-scale": [PYTHON, "tools/bench_scale.py", *sys.argv[2:]],
        "bench-instr": [PYTHON, "tools/bench_instr.py", *sys.argv[2:]],
        "bench-hosts": [PYTHON, "tools/bench_hosts.py", *sys.argv[2:]],
        "pingpong": [PYTHON, "tools/pingpong.py"],
        "stress": [PYTHON, "tools/stress.py", *sys.argv[2:]],
        "compose": [PYTHON, "tools/compose.py", *sys.argv[2:]],
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__.strip())
        return 2
    ensure_venv()
    if sys.argv[1] in ("bench", "bench-scale", "bench-hosts"):
        ensure_bench_extras()
    if sys.argv[1] == "test" and len(sys.argv) == 2:  # the whole suite: lint and types first
        for step in ("lint", "types"):
            print(f"{step}: {' '.join(str(a) for a in commands[step][1:])}", flush=True)
            if subprocess.run([str(a) for a in commands[step]], cwd=ROOT).returncode != 0:
                print(f"{step} failed", flush=True)
                return 1
    return subprocess.run([str(a) for a in commands[sys.argv[1]]], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
