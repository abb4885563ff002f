"""The RPC worker pool (zmqautograd/rpc/pool.py): its wake-up policy and its liveness."""

from __future__ import annotations

import threading

import pytest

from zmqautograd.rpc.pool import ElasticPool

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pool():
    pool = ElasticPool(16, "test-pool")
    yield pool
    pool.shutdown(timeout=10)


def test_a_burst_of_quick_calls_does_not_wake_every_thread(pool):
    """Work that arrives while a thread makes progress is left to that thread: a burst of
    quick calls runs on a few threads, not on one woken thread per call."""
    names: list[str] = []
    done = threading.Event()
    count = 500

    def record() -> None:
        names.append(threading.current_thread().name)
        if len(names) == count:
            done.set()

    for _ in range(count):
        pool.submit(record)
    assert done.wait(30)
    assert len(set(names)) <= 4, sorted(set(names))


def test_work_queued_behind_a_blocked_call_still_starts(pool):
    """A call that blocks where the pool cannot see it (not through ``blocking()``) does not
    hold up the calls queued after it."""
    release = threading.Event()
    second_ran = threading.Event()
    first_started = threading.Event()

    def blocked() -> None:
        first_started.set()
        release.wait(30)

    pool.submit(blocked)
    assert first_started.wait(10)
    pool.submit(second_ran.set)
    try:
        assert second_ran.wait(10)
    finally:
        release.set()


def test_every_thread_blocked_grows_the_pool():
    """With every thread inside a call that waits on work queued behind it, the watchdog adds
    a thread (torch issue #23569, for waits the pool cannot see)."""
    pool = ElasticPool(2, "test-small-pool", stall_after=0.2)
    release = threading.Event()
    started = threading.Semaphore(0)
    blocked_on: list[str] = []

    def blocked() -> None:
        blocked_on.append(threading.current_thread().name)
        started.release()
        release.wait(30)

    def unblock() -> None:
        blocked_on.append(threading.current_thread().name)
        release.set()

    try:
        for _ in range(2):
            pool.submit(blocked)
        for _ in range(2):
            assert started.acquire(timeout=10)
        pool.submit(unblock)
        assert release.wait(10)  # both threads were still blocked: only a third could run it
        assert len(set(blocked_on)) == 3
    finally:
        release.set()
        pool.shutdown(timeout=10)


def test_blocking_starts_a_replacement_at_once():
    """A wait the pool knows about (``blocking()``, as ``rpc_sync`` in a pool thread uses) hands
    queued work to another thread without waiting for the watchdog."""
    pool = ElasticPool(1, "test-blocking-pool", stall_after=60)  # the watchdog would be too late
    inner_ran = threading.Event()
    outcome: list[bool] = []

    def outer() -> None:
        pool.submit(inner_ran.set)
        with pool.blocking():
            outcome.append(inner_ran.wait(10))

    try:
        pool.submit(outer)
        assert inner_ran.wait(10)
    finally:
        pool.shutdown(timeout=10)
    assert outcome == [True]


def test_a_failing_call_does_not_cost_a_thread(pool):
    def fail() -> None:
        raise ValueError("boom")

    for _ in range(5):
        pool.submit(fail)
    ran = threading.Event()
    pool.submit(ran.set)
    assert ran.wait(10)
    assert all(thread.is_alive() for thread in pool._threads)
