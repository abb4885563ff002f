"""A worker that may start no more threads (a real limit: the pids cgroup of Linux, as a
container's ``pids.max`` or a user's process limit would impose): calls that would grow its
pool queue for the threads it has (back-pressure) and all complete, the worker lives on, and
the pool grows again once the limit is lifted."""

from __future__ import annotations

import os
import time

import pytest
import torch

from zmqautograd import rpc

from ..rpc_harness import group_fixture

PIDS = "/sys/fs/cgroup/pids"
CGROUP = os.path.join(PIDS, f"zmqautograd-test-{os.getpid()}")

pytestmark = pytest.mark.skipif(
    not (os.path.isdir(PIDS) and os.access(PIDS, os.W_OK)), reason="needs a writable pids cgroup (v1) to limit threads"
)

group = group_fixture(world_size=2)


def confine(cgroup: str) -> int:
    """On worker1: move this process into ``cgroup`` and let it have no more tasks than now."""
    os.makedirs(cgroup, exist_ok=True)
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    tasks = len(os.listdir("/proc/self/task"))
    with open(os.path.join(cgroup, "pids.max"), "w") as f:
        f.write(str(tasks))
    return tasks


def release(cgroup: str) -> None:
    with open(os.path.join(PIDS, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    os.rmdir(cgroup)


def pool_state() -> tuple[int, int]:
    pool = rpc.api._get_current_rpc_agent().pool
    return pool.thread_count, pool.start_failures


def nested(x: torch.Tensor) -> torch.Tensor:
    """Holds its pool thread in a nested call (which grows the pool where it can)."""
    time.sleep(0.05)
    return rpc.rpc_sync("worker0", torch.add, args=(x, 1)) * 2


@pytest.mark.timeout(120)
def test_a_worker_that_cannot_start_threads_queues_calls_and_lives_on(group):
    tasks = rpc.rpc_sync("worker1", confine, args=(CGROUP,))
    try:
        threads_before, failures_before = rpc.rpc_sync("worker1", pool_state)
        futures = [rpc.rpc_async("worker1", nested, args=(torch.full((2,), float(i)),)) for i in range(24)]
        for i, future in enumerate(futures):
            assert torch.equal(future.wait(), torch.full((2,), (i + 1) * 2.0))
        threads, failures = rpc.rpc_sync("worker1", pool_state)
        # It tried to grow, could not, and ran everything on the threads it had.
        assert failures > failures_before
        assert threads <= threads_before and len(os.listdir(f"/proc/{_pid_of_worker1()}/task")) <= tasks
    finally:
        rpc.rpc_sync("worker1", release, args=(CGROUP,))
    # The limit lifted: the pool grows again for calls that wait.
    futures = [rpc.rpc_async("worker1", nested, args=(torch.ones(2),)) for _ in range(24)]
    assert all(torch.equal(f.wait(), torch.full((2,), 4.0)) for f in futures)
    assert rpc.rpc_sync("worker1", pool_state)[0] > threads


def _pid_of_worker1() -> int:
    return rpc.rpc_sync("worker1", os.getpid)
