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
