"""The process's timer thread (zmqautograd/timers.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from zmqautograd import timers

pytestmark = pytest.mark.timeout(30)


def test_timers_fire_in_deadline_order_and_cancelled_ones_do_not():
    fired: list[str] = []
    all_done = threading.Event()

    def record(name: str) -> None:
        fired.append(name)
        if name == "last":
            all_done.set()

    timers.call_later(0.30, record, "last")
    timers.call_later(0.10, record, "second")
    cancelled = timers.call_later(0.05, record, "cancelled")
    timers.call_later(0.0, record, "first")
    cancelled.cancel()
    assert cancelled.cancelled
    assert all_done.wait(10)
    assert fired == ["first", "second", "last"]


def test_a_failing_callback_does_not_stop_the_timer_thread():
    ran = threading.Event()

    def fail() -> None:
        raise ValueError("boom")

    timers.call_later(0.0, fail)
    timers.call_later(0.01, ran.set)
    assert ran.wait(10)


def test_cancelled_timers_leave_the_heap_long_before_they_would_come_up():
    # A call's timeout is cancelled when it is answered, a minute before it comes up: the
    # heap must not keep one entry per call made in that minute.
    thread = timers._timers
    handles = [timers.call_later(3600.0, print, i) for i in range(1000)]
    for handle in handles:
        handle.cancel()
    assert all(handle.cancelled for handle in handles)
    kept = timers.call_later(3600.0, print, "kept")
    try:
        with thread._lock:
            assert len(thread._heap) < 100, "cancelled timers are still in the heap"
            assert any(entry[2] is kept for entry in thread._heap)
    finally:
        kept.cancel()


def test_cancelling_a_timer_that_ran_changes_nothing():
    ran = threading.Event()
    handle = timers.call_later(0.0, ran.set)
    assert ran.wait(10)
    before = timers._timers.cancelled
    handle.cancel()
    assert handle.cancelled and timers._timers.cancelled == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end, on purpose
def test_timers_run_again_after_a_callback_ended_the_thread():
    """A BaseException from a callback (SystemExit, say) ends the timer thread; the next timer
    starts another, and timers armed before it ran come up there."""
    ended = threading.Event()

    def exit_thread() -> None:
        ended.set()
        raise SystemExit("a callback that ends its thread")

    first = threading.Event()
    timers.call_later(0.0, exit_thread)
    assert ended.wait(10)
    timers.call_later(0.2, first.set)  # armed while the thread may still be on its way out
    deadline = time.monotonic() + 10
    # (The thread that ended, or the one the next timer starts.)
    while (thread := timers._timers._thread) is not None and not first.is_set() and time.monotonic() < deadline:
        thread.join(0.05)
    second = threading.Event()
    timers.call_later(0.0, second.set)
    assert second.wait(10) and first.wait(10)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_timers_on_a_thread_of_its_own():
    """The parent's timer thread does not come along into a child; its lock may have been
    held by another thread at the fork. The child's timers still fire."""
    started = threading.Event()
    timers.call_later(0.0, started.set)  # the parent's thread is running
    assert started.wait(10)
    with timers._timers._lock:  # held by this thread across the fork: a new lock in the child
        pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its timer fired
        fired = threading.Event()
        timers.call_later(0.0, fired.set)
        os._exit(0 if fired.wait(10) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_timer_due_after_any_wait_of_the_os_leaves_the_thread_serving_others():
    """A call's timeout of 1e12 s or inf is a timer that far away; waiting for it alone made
    the thread's lock wait raise OverflowError, and the thread ended."""
    clock = timers._TimerThread()  # (the process's may have nearer timers of other tests)
    far = [clock.call_later(delay, lambda: None) for delay in (1e12, float("inf"))]
    thread = clock._thread
    assert thread is not None
    time.sleep(0.05)  # the thread now waits for the far timers alone (nothing signals that)
    ran = threading.Event()
    clock.call_later(0.0, ran.set)
    try:
        assert ran.wait(10)
        assert clock._thread is thread and thread.is_alive()  # not ended and replaced
    finally:
        for handle in far:
            handle.cancel()
