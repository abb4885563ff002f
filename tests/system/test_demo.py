"""The README's demo, run as a user runs it: it must train (it asserts that itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(180)
def test_demo_trains_over_rpc():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--steps", "250"],
        capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "held-out loss" in result.stdout and "steps/s" in result.stdout


@pytest.mark.timeout(180)
def test_demo_as_separate_processes_joined_by_env(tmp_path):
    """As docker-compose and torchrun run it: one process per rank, env:// rendezvous."""
    from tools.ports import free_port

    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--steps", "250"],
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(4)
    ]
    outputs = [p.communicate(timeout=170) for p in processes]
    assert all(p.returncode == 0 for p in processes), [err[-2000:] for _, err in outputs]
    assert "held-out loss" in outputs[0][0]
