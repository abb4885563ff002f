"""Releasing contexts on the other workers they reached.

Leaving a context releases it on every worker it reached (the seeds send a cleanup request
to each, and nobody waits for it), and each of those passes the release on to the workers
it reached in turn. In a training loop that is one more request and answer per worker and
step: as many messages as a small forward call, and processed in the middle of the next
step. Here a release for a worker waits in a batch, and leaves with whichever comes first:

* the next call this worker makes to that worker: the context ids ride on the request
  (``"rc"`` in its payload) and the receiver releases them before it serves the call. In a
  loop that calls the same workers every step, releases then cost no message at all;
* after ``delay``, one cleanup request listing the batch, retried on failure;
* a graceful shutdown, which sends every batch first (``CleanupBatcher.flush``).

Rides are skipped under fault injection: a call that an injected fault drops would drop its
releases with it; the cleanup requests are retried instead.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from zmqautograd.transport import MessageType, PeerLostError

from .. import timers
from ..rpc import current
from ..rpc.serialization import protocol_function
from . import port
from .port import AgentPort

log = logging.getLogger(__name__)

DEFAULT_DELAY = 0.01  # seconds; the timer thread may fire up to 5 ms later still

Send = Callable[[int, list], None]  # send(worker, context_ids)


class _Batch:
    __slots__ = ("send", "ids", "timer")

    def __init__(self, send: Send, ids: list[int]) -> None:
        self.send = send
        self.ids = ids
        self.timer: timers.TimerHandle | None = None


class CleanupBatcher:
    """Context ids to release on other workers, by worker."""

    def __init__(self, delay: float = DEFAULT_DELAY):
        self.delay = delay
        self._lock = threading.Lock()
        self._pending: dict[int, _Batch] = {}  # worker -> what waits for it

    def add(self, worker: int, context_ids: list[int], send: Send) -> None:
        """Release ``context_ids`` on ``worker`` with the next ride or batch (``send`` sends a
        batch as a request of its own)."""
        with self._lock:
            batch = self._pending.get(worker)
            if batch is not None:
                batch.ids.extend(context_ids)
                return
            batch = self._pending[worker] = _Batch(send, list(context_ids))
        # Each batch has its own timer, which flushes that batch only: a batch that rode
        # away must not leave a timer that later sends the next one (made after the ride,
        # and due to ride on the next call) as a request of its own.
        batch.timer = timers.call_later(self.delay, self._flush_worker, worker, batch)

    def take(self, worker: int) -> tuple[Send, list[int]] | None:
        """What waits for ``worker``, for a request about to leave for it to carry (give it
        back with ``add`` if that request cannot be sent)."""
        if not self._pending:  # the common case, without the lock (a racing add rides next time)
            return None
        with self._lock:
            batch = self._pending.pop(worker, None)
        if batch is None:
            return None
        if batch.timer is not None:  # (None: add has not armed it yet; it finds the batch gone)
            batch.timer.cancel()
        return batch.send, batch.ids

    def flush(self) -> None:
        """Send every pending batch now."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for worker, batch in pending.items():
            if batch.timer is not None:
                batch.timer.cancel()
            batch.send(worker, batch.ids)

    def _flush_worker(self, worker: int, batch: _Batch) -> None:
        with self._lock:
            if self._pending.get(worker) is not batch:
                return  # it rode on a call, or was flushed
            del self._pending[worker]
        batch.send(worker, batch.ids)


def release_everywhere(agent: AgentPort, context: Any, skip: int = -1) -> None:
    """Release ``context`` (already removed here) on every worker it reached but ``skip``."""
    send = functools.partial(_send_batch, agent)
    for worker in sorted(context._known_worker_ids()):
        if worker not in (agent.rank, skip):  # not back to whoever told us
            agent.hooks.contexts.cleanups.add(worker, [context.context_id], send)


def release_here(agent: AgentPort, context_ids: list, from_worker: int) -> list:
    """``from_worker`` released these contexts: release them here too, and pass them on.
    Idempotent; unknown ids are fine (never here, or released already). Returns the contexts
    that were here: dropping a context's graph and gradients is most of a release's cost (~7
    of ~11 us measured in a pipeline's workers), so a worker serving a call keeps them until
    its answer left."""
    remove = agent.hooks.contexts.remove
    removed = [context for context_id in context_ids if (context := remove(context_id)) is not None]
    for context in removed:
        release_everywhere(agent, context, skip=from_worker)
    return removed


@protocol_function
def cleanup_contexts(context_ids: list) -> None:
    """The receiving end of a cleanup request (CLEANUP_AUTOGRAD_CONTEXT_REQ), from the worker
    it came over (current.caller), never one its payload names."""
    caller = current.caller()
    release_here(port.current(), context_ids, -1 if caller is None else caller)


def _send_batch(agent: AgentPort, worker: int, context_ids: list) -> None:
    if agent.closed:  # shut down meanwhile without waiting (graceful shutdown flushes first)
        log.debug("not releasing autograd contexts %s on worker %d: RPC is shut down", context_ids, worker)
        return
    try:
        sent = agent.call_retrying(worker, cleanup_contexts, (context_ids,),
                                   MessageType.CLEANUP_AUTOGRAD_CONTEXT_REQ)
    except RuntimeError as exc:
        _release_failed(context_ids, worker, exc, agent)
        return
    sent.add_done_callback(lambda f: _log_failure(f, context_ids, worker, agent))


def _log_failure(future: torch.futures.Future, context_ids: list, worker: int, agent: AgentPort) -> None:
    try:
        future.value()
    except Exception as exc:  # noqa: BLE001
        _release_failed(context_ids, worker, exc, agent)


_IDS_LOGGED = 8


def _release_failed(context_ids: list, worker: int, exc: Exception, agent: AgentPort) -> None:
    """Log a release that did not reach ``worker``. Its contexts there died with a lost worker
    (whose loss the agent reported already: a warning per batch would repeat it for every
    step that had reached it; in a dynamic group it is no member any more), or go with the
    shutdown of this worker (after a graceful one's barrier the whole group is shutting
    down, and a release that a nested chain passes on can leave a worker after its last
    wait; graceful=False abandons on purpose), so that is a debug line; any other failure
    leaves contexts behind on a live worker, a warning."""
    gone = agent.is_lost(worker) or agent.closed
    shown = ", ".join(map(str, context_ids[:_IDS_LOGGED]))
    if len(context_ids) > _IDS_LOGGED:
        shown += f" and {len(context_ids) - _IDS_LOGGED} more"
    level = logging.DEBUG if gone or isinstance(exc, PeerLostError) else logging.WARNING
    log.log(level, "could not release autograd contexts [%s] on worker %d: %s", shown, worker, exc)
