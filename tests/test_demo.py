"""The README's demo, run as a user runs it: it must train (it asserts that itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_demo_trains_over_rpc():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--steps", "150"],
        capture_output=True, text=True, timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "held-out loss" in result.stdout and "steps/s" in result.stdout
