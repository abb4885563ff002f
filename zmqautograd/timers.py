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
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_SLACK = 0.005
# A lock wait refuses a timeout above threading.TIMEOUT_MAX, and a call's timeout may be inf:
# the thread waits at most this long at a time (seconds).
_LONGEST_WAIT = 3600.0
_COMPACT_MIN = 64  # cancelled handles in the heap before it may be compacted


class TimerHandle:
    __slots__ = ("deadline", "call", "_owner")

    def __init__(self, deadline: float, callback: Callable, args: tuple, owner: "_TimerThread"):
        self.deadline = deadline
        self.call: tuple[Callable, tuple] | None = (callback, args)  # one attribute: read atomically
        self._owner = owner

    def cancel(self) -> None:
        """The callback will not run (if it has not started yet). Cheap: the entry stays in
        the heap, without what the callback refers to, until it comes up or the heap is
        compacted (see ``_TimerThread._compact_locked``)."""
        if self.call is not None:
            self.call = None
            self._owner.cancelled += 1  # (a lost count under a race only delays a compaction)

    @property
    def cancelled(self) -> bool:
        """Cancelled, or run already."""
        return self.call is None


class _TimerThread:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._serial = itertools.count()
        # None when not running: set by the first timer, cleared by the thread as it ends, and
        # in a forked child (which has no such thread). Checked on every timer, so it is an
        # attribute, not ``is_alive()`` (a few times the cost).
        self._thread: threading.Thread | None = None
        self.cancelled = 0  # cancelled handles still in the heap (about)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_thread)

    def _forget_thread(self) -> None:
        """In a forked child: the thread did not come along, and the lock may have been
        held by another thread of the parent; the timers stay, to run on a new thread."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._thread = None

    def call_later(self, delay: float, callback: Callable, *args: Any) -> TimerHandle:
        handle = TimerHandle(time.monotonic() + max(0.0, delay), callback, args, self)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zmqautograd-timers", daemon=True)
                self._thread.start()
            if self.cancelled > _COMPACT_MIN and self.cancelled * 2 > len(self._heap):
                self._compact_locked()
            if not self._heap or handle.deadline < self._heap[0][0]:
                self._changed.notify()
            heapq.heappush(self._heap, (handle.deadline, next(self._serial), handle))
        return handle

    def _compact_locked(self) -> None:
        """Drop cancelled handles from the heap (caller holds the lock). A call's timeout is
        cancelled when it is answered, long before it comes up (60 s by default): without
        this, a process making 30,000 calls a second would keep 1.8 million of them, and
        their memory, and the garbage collector would move them all to its oldest
        generation and walk them in every full collection. Done when more than half the
        heap is cancelled: amortised, each handle is dropped once (asyncio does the same)."""
        self._heap = [entry for entry in self._heap if entry[2].call is not None]
        heapq.heapify(self._heap)
        self.cancelled = 0

    def _run(self) -> None:
        try:
            self._run_due()
        finally:  # (only a BaseException from a callback gets here): the next timer starts another
            with self._lock:
                self._thread = None

    def _run_due(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    handle = heapq.heappop(self._heap)[2]
                    if handle.call is None:
                        self.cancelled = max(0, self.cancelled - 1)
                    else:
                        due.append(handle)
                if not due:
                    # Timers fire up to _SLACK late, so that ones due close together fire in
                    # one wake-up: a wake-up per timer costs a context switch.
                    self._changed.wait(min(self._heap[0][0] - now + _SLACK, _LONGEST_WAIT) if self._heap else None)
                    continue
                self._lock.release()
                try:
                    for handle in due:
                        call, handle.call = handle.call, None  # out of the heap: cancel() counts nothing
                        if call is None:
                            continue  # cancelled meanwhile
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
