"""The README's demo, run as a user runs it: it must train (it asserts that itself)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

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


def _elastic_worker(rank: int, port: int, log_dir, steps: int = 1200, rejoin_wait: int = 8) -> subprocess.Popen:
    with open(log_dir / f"rank{rank}.{time.monotonic_ns()}.log", "w") as out:
        return subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--elastic", "--steps", str(steps),
             "--rejoin-wait", str(rejoin_wait)],
            env={**os.environ, "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )


@pytest.mark.timeout(360)
@pytest.mark.parametrize("fault", ["kill", "restart"])
def test_elastic_demo_trains_on_when_a_worker_is_killed_or_restarted(tmp_path, fault):
    """--elastic (a dynamic group): worker2 killed mid-training. Killed for good, its stage
    moves to another worker; restarted under its name, it rejoins and gets its stage back.
    Either way the driver rewinds to its last checkpoint and trains to the end."""
    from tests.conftest import poll_until
    from tools.ports import free_port

    port = free_port()
    # Waiting for a restarted worker ends when it is back; a loaded machine may take long to
    # start one (torch's import).
    rejoin_wait = 90 if fault == "restart" else 8
    workers = {rank: _elastic_worker(rank, port, tmp_path, rejoin_wait=rejoin_wait) for rank in range(4)}
    driver_log = next(tmp_path.glob("rank0.*.log"))
    try:
        poll_until(lambda: "step   50" in driver_log.read_text(), 120, "training under way")
        workers[2].kill()
        workers[2].wait(10)
        if fault == "restart":
            workers[2] = _elastic_worker(2, port, tmp_path)
        assert workers[0].wait(200) == 0, driver_log.read_text()[-3000:]
        for rank in (1, 2, 3) if fault == "restart" else (1, 3):
            assert workers[rank].wait(30) == 0  # the driver told them training is over
    finally:
        for worker in workers.values():
            worker.kill()
    driver = driver_log.read_text()
    assert re.search(r"step \d+ failed at [\d.]+: .*worker2", driver)
    if fault == "restart":
        assert "worker2 rejoined after" in driver
        assert re.search(r"training goes on from the checkpoint of step \d+: stage 1 on worker2\n", driver)
    else:
        assert "worker2 did not come back within 8 s" in driver
        assert re.search(r"training goes on from the checkpoint of step \d+: stage 1 on worker[13]\n", driver)
    assert "held-out loss" in driver  # (the demo asserts that the model learned)


@pytest.mark.timeout(180)
def test_elastic_workers_end_on_their_own_when_the_driver_hangs(tmp_path):
    """The driver stopped (SIGSTOP: a hung process, or a partition as its workers see it):
    each worker loses it after the peer timeout and shuts down, although the group's store,
    which the driver hosts, cannot take its leave (that wait is bounded)."""
    from tests.conftest import poll_until
    from tools.ports import free_port

    port = free_port()
    workers = {rank: _elastic_worker(rank, port, tmp_path, steps=100_000) for rank in range(4)}
    driver_log = next(tmp_path.glob("rank0.*.log"))
    try:
        poll_until(lambda: "step   50" in driver_log.read_text(), 120, "training under way")
        workers[0].send_signal(signal.SIGSTOP)
        for rank in (1, 2, 3):
            # peer timeout (10 s) + the leave's bounded wait (5 s) + shutdown, with room
            assert workers[rank].wait(90) == 0
    finally:
        for worker in workers.values():
            worker.kill()
    logs = "".join(log.read_text() for log in tmp_path.glob("rank[123].*.log"))
    assert "lost peer '0'" in logs and "did not take our leave" in logs
