"""tools/stress.py, short: a random mix of calls, RRef forks and distributed passes from 4
threads on worker0 and one on every other worker while a worker is SIGKILLed; every result
checked, every error naming the dead worker, no context and no RRef left on the survivors
afterwards (a future that kept its failed waiter's frames left hundreds of user RRefs on
worker0; a dead worker's RRef forks and the contexts it passed on left things too)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_random_mix_with_a_worker_killed_leaves_nothing_on_the_survivors():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "stress.py"), "--seconds", "15",
                          "--kill-after", "5", "--seed", "11", "--everyone-drives", "1"],
                         capture_output=True, text=True, timeout=150, cwd=ROOT)
    summary = run.stdout
    print(summary)
    assert run.returncode == 0, summary + run.stderr[-3000:]
    assert "left on survivors: nothing" in summary and "failed, naming the dead worker" in summary, summary
