"""The thread pool that runs incoming calls.

It keeps ``size`` threads, and grows past that while calls are stuck behind threads that wait
on nested RPCs, so a user function that itself makes RPCs never deadlocks, even when every
thread is inside such a call (torch issue #23569):

* ``blocking()`` marks a wait the library knows about (``rpc_sync`` inside a pool thread): a
  replacement thread starts at once if work is queued.
* a watchdog covers waits it cannot see (a user function calling ``Future.wait()``): if work
  has been queued with every thread busy and none finishing for ``stall_after`` seconds, it
  adds a thread.

Threads beyond ``size`` leave again when they find no work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

_current_pool = threading.local()


class ElasticPool:
    def __init__(self, size: int, name: str, stall_after: float = 0.5, max_threads: int = 1024):
        self.size = size
        self.name = name
        self.stall_after = stall_after
        self.max_threads = max_threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._pending = 0  # submitted, not yet taken by a thread
        self._idle = 0  # threads waiting for work
        self._last_progress = time.monotonic()
        self._closed = threading.Event()
        self._serial = 0
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    def submit(self, function: Callable, *args: Any) -> None:
        with self._lock:
            if self._closed.is_set():
                # Shutting down: work that arrives now is not run (its caller's call fails by
                # timeout or when this worker's endpoint closes). Never an exception here: the
                # caller may be an I/O thread.
                log.info("pool %s is shut down: dropped %s", self.name, getattr(function, "__qualname__", function))
                return
            self._pending += 1
            self._queue.put((function, args))
            if self._pending > self._idle and len(self._threads) < self.size:
                self._start_thread()

    @contextmanager
    def blocking(self):
        """Wrap a wait inside a pool thread: queued work gets a thread meanwhile."""
        if getattr(_current_pool, "pool", None) is not self:
            yield
            return
        with self._lock:
            if self._pending > self._idle and len(self._threads) < self.max_threads:
                self._start_thread()
        yield

    @property
    def thread_count(self) -> int:
        return len(self._threads)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed.set()
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        current = threading.current_thread()
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))
        self._watchdog.join(timeout)

    def _start_thread(self) -> None:  # caller holds the lock
        self._serial += 1
        thread = threading.Thread(target=self._run, name=f"{self.name}-{self._serial}", daemon=True)
        self._threads.add(thread)
        thread.start()

    def _run(self) -> None:
        _current_pool.pool = self
        me = threading.current_thread()
        while True:
            with self._lock:
                if len(self._threads) > self.size and self._pending == 0:
                    self._threads.discard(me)  # surplus, and nothing to do: leave
                    return
                self._idle += 1
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                if item is None:
                    self._threads.discard(me)
                    return
                self._pending -= 1
            function, args = item
            function(*args)  # submitted functions handle their own errors
            del item, function, args  # release the call's data before waiting again
            self._last_progress = time.monotonic()

    def _watch(self) -> None:
        while not self._closed.wait(self.stall_after / 2):
            with self._lock:
                stalled = (
                    self._pending > self._idle
                    and time.monotonic() - self._last_progress > self.stall_after
                    and len(self._threads) < self.max_threads
                )
                if stalled:
                    self._start_thread()
                    self._last_progress = time.monotonic()
