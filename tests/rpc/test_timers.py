"""The process's timer thread (zmqautograd/timers.py)."""

from __future__ import annotations

import threading

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
