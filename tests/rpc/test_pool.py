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


def test_work_that_arrives_while_threads_wait_in_blocking_gets_a_thread_at_once():
    """Work queued after a thread began a known wait (the next call of a nested chain comes
    back later) gets a thread at once too: threads in ``blocking()`` do not count toward the
    pool's size. Before, it waited for the watchdog (``stall_after``)."""
    pool = ElasticPool(1, "test-blocking-later", stall_after=60)  # the watchdog would be too late
    waiting = threading.Event()
    inner_ran = threading.Event()
    outcome: list[bool] = []

    def outer() -> None:
        with pool.blocking():
            waiting.set()
            outcome.append(inner_ran.wait(10))

    try:
        pool.submit(outer)
        assert waiting.wait(10)
        pool.submit(inner_ran.set)  # arrives while the only thread waits
        assert inner_ran.wait(10)
    finally:
        pool.shutdown(timeout=10)
    assert outcome == [True] and pool.stall_starts == 0


def test_a_pool_at_max_threads_all_waiting_on_nested_calls_says_so(caplog):
    """At ``max_threads`` with every thread in a nested wait, queued work cannot start: the
    pool says why (once per 10 s), and the work runs once a wait ends."""
    pool = ElasticPool(1, "test-full", stall_after=60, max_threads=2)
    release = threading.Event()
    inner_ran = threading.Event()
    blocked = threading.Barrier(3)

    def outer() -> None:
        with pool.blocking():
            blocked.wait(10)
            release.wait(10)

    try:
        pool.submit(outer)
        pool.submit(outer)
        blocked.wait(10)  # both threads wait on "nested calls"
        with caplog.at_level("WARNING", logger="zmqautograd.rpc.pool"):
            pool.submit(inner_ran.set)
        assert not inner_ran.is_set()
        said = [r.getMessage() for r in caplog.records if "max_threads" in r.getMessage()]
        assert said and "has all its 2 threads (max_threads), 2 of them waiting on nested calls" in said[0]
        release.set()
        assert inner_ran.wait(10)
    finally:
        release.set()
        pool.shutdown(timeout=10)


def test_a_failing_call_does_not_cost_a_thread(pool):
    def fail() -> None:
        raise ValueError("boom")

    for _ in range(5):
        pool.submit(fail)
    ran = threading.Event()
    pool.submit(ran.set)
    assert ran.wait(10)
    assert all(thread.is_alive() for thread in pool._threads)


class _Answers:
    """Calls that 'answer' the way the RPC agent does: held while the pool says so (pool.py,
    "Held work"), else at once. ``events`` logs the calls and the answers in the order they
    happened; ``sent[n]`` is set once answer ``n`` went."""

    def __init__(self, pool: ElasticPool, count: int) -> None:
        self.pool = pool
        self.events: list[str] = []
        self.held: list[bool] = []
        self.sent = [threading.Event() for _ in range(count)]

    def call(self, n: int) -> None:
        self.events.append(f"ran {n}")
        hold = self.pool.should_hold()
        self.held.append(hold)
        if hold:
            self.pool.hold(self._send, n)
        else:
            self._send(n)

    def _send(self, n: int) -> None:
        self.events.append(f"sent {n}")
        self.sent[n].set()


def _queue_behind_a_gate(pool: ElasticPool, *calls) -> threading.Event:
    """Submit a call that waits, then ``calls`` (queued behind it); returns the gate."""
    gate, started = threading.Event(), threading.Event()

    def wait_at_gate() -> None:
        started.set()
        gate.wait(30)

    pool.submit(wait_at_gate)
    assert started.wait(10)
    for function, *args in calls:
        pool.submit(function, *args)
    return gate


def test_answers_are_held_while_calls_wait_and_leave_in_order_when_the_thread_runs_out():
    pool = ElasticPool(1, "test-held")
    try:
        answers = _Answers(pool, 5)
        gate = _queue_behind_a_gate(pool, *[(answers.call, n) for n in range(5)])
        gate.set()
        assert answers.sent[4].wait(10)
        assert answers.events == [f"ran {n}" for n in range(5)] + [f"sent {n}" for n in range(5)]
        assert answers.held == [True] * 5
    finally:
        pool.shutdown(timeout=10)


def test_held_answers_go_once_max_held_are_held():
    pool = ElasticPool(1, "test-held", max_held=2)
    try:
        answers = _Answers(pool, 4)
        done = threading.Event()
        gate = _queue_behind_a_gate(pool, *[(answers.call, n) for n in range(4)], (done.set,))
        gate.set()
        assert done.wait(10)
        assert answers.events[:6] == ["ran 0", "ran 1", "sent 0", "sent 1", "ran 2", "ran 3"]
    finally:
        pool.shutdown(timeout=10)


def test_a_held_answer_does_not_wait_behind_a_long_call():
    """The next call blocks where the pool cannot see it, on the held answer itself: the
    watchdog sends it once that call has run longer than ``handoff``."""
    pool = ElasticPool(1, "test-held", handoff=0.01)
    try:
        answers = _Answers(pool, 1)
        seen = []

        def wait_for_answer() -> None:
            seen.append(answers.sent[0].wait(10))

        done = threading.Event()
        gate = _queue_behind_a_gate(pool, (answers.call, 0), (wait_for_answer,), (done.set,))
        gate.set()
        assert done.wait(20)
        assert answers.held == [True] and seen == [True]
    finally:
        pool.shutdown(timeout=10)


def test_a_thread_sends_what_it_held_before_it_waits_in_blocking():
    pool = ElasticPool(1, "test-held")
    try:
        answers = _Answers(pool, 1)
        seen = []

        def nested_wait() -> None:
            with pool.blocking():
                seen.append(list(answers.events))

        done = threading.Event()
        gate = _queue_behind_a_gate(pool, (answers.call, 0), (nested_wait,), (done.set,))
        gate.set()
        assert done.wait(10)
        assert answers.held == [True] and seen == [["ran 0", "sent 0"]]
    finally:
        pool.shutdown(timeout=10)
