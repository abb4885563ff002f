"""Context releases bound for other workers, sent in batches.

Leaving a context releases it on every worker it reached, by a cleanup message to each (the
seeds send one per context and worker, and the sender does not wait for it). In a training
loop that is one more request and answer per worker and step, as many messages as a small
forward call costs. Here releases for one worker wait up to ``delay`` and go together, as one
cleanup message listing the context ids: at a few steps per ``delay``, the cleanup traffic of
a step shrinks to a fraction of a message. Nothing waits for a release to arrive (as in the
seeds), and a graceful shutdown sends what is pending first (``flush``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .. import timers

DEFAULT_DELAY = 0.005  # seconds; the timer thread may fire up to 5 ms later still

Send = Callable[[int, list], None]  # send(worker, context_ids)


class CleanupBatcher:
    def __init__(self, delay: float = DEFAULT_DELAY):
        self.delay = delay
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Send, list[int]]] = {}  # worker -> (how to send, ids)

    def add(self, worker: int, context_id: int, send: Send) -> None:
        """Release ``context_id`` on ``worker`` with the next batch (``send`` sends a batch)."""
        with self._lock:
            entry = self._pending.get(worker)
            if entry is not None:
                entry[1].append(context_id)
                return
            self._pending[worker] = (send, [context_id])
        timers.call_later(self.delay, self._flush_worker, worker)

    def flush(self) -> None:
        """Send every pending batch now."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for worker, (send, ids) in pending.items():
            send(worker, ids)

    def pending(self) -> int:
        with self._lock:
            return sum(len(ids) for _, ids in self._pending.values())

    def _flush_worker(self, worker: int) -> None:
        with self._lock:
            entry = self._pending.pop(worker, None)
        if entry is not None:
            send, ids = entry
            send(worker, ids)
