"""One timer thread per process, for callbacks due later: RPC timeouts and retries, idle
checks of backward passes.

``threading.Timer`` starts a thread per timer, and ``start()`` waits until that thread runs:
on the 2-vCPU development VM that put 100-200 us and several context switches on the critical
path of every backward pass, which arms an idle check. Here, arming a timer is a heap push,
and the thread is woken only when the new timer is due before every other one.

Callbacks run on the timer thread, one after another: they must be quick and must not block.
(An RPC timeout completes its future here, so that future's callbacks run here too.)
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_SLACK = 0.005


class TimerHandle:
    __slots__ = ("deadline", "call")

    def __init__(self, deadline: float, callback: Callable, args: tuple):
        self.deadline = deadline
        self.call: tuple[Callable, tuple] | None = (callback, args)  # one attribute: read atomically

    def cancel(self) -> None:
        """The callback will not run (if it has not started yet). Cheap: the entry stays in
        the heap until it comes up, without what the callback refers to."""
        self.call = None

    @property
    def cancelled(self) -> bool:
        return self.call is None


class _TimerThread:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._serial = itertools.count()
        self._thread: threading.Thread | None = None

    def call_later(self, delay: float, callback: Callable, *args: Any) -> TimerHandle:
        handle = TimerHandle(time.monotonic() + max(0.0, delay), callback, args)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="zmqautograd-timers", daemon=True)
                self._thread.start()
            if not self._heap or handle.deadline < self._heap[0][0]:
                self._changed.notify()
            heapq.heappush(self._heap, (handle.deadline, next(self._serial), handle))
        return handle

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                if not due:
                    # Timers fire up to _SLACK late, so that ones due close together fire in
                    # one wake-up: the RPC layer arms one per rpc_async call and leaves it in
                    # the heap when the call is answered, and a wake-up per call costs a
                    # context switch.
                    self._changed.wait(self._heap[0][0] - now + _SLACK if self._heap else None)
                    continue
                self._lock.release()
                try:
                    for handle in due:
                        call = handle.call
                        if call is None:
                            continue  # cancelled
                        try:
                            call[0](*call[1])
                        except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                            log.exception("timer callback %r failed", call[0])
                finally:
                    self._lock.acquire()


_timers = _TimerThread()


def call_later(delay: float, callback: Callable, *args: Any) -> TimerHandle:
    """Run ``callback(*args)`` on the process's timer thread after ``delay`` seconds."""
    return _timers.call_later(delay, callback, *args)
