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
import time
from collections.abc import Callable
from typing import Any

import torch

from zmqautograd.transport import MessageType, PeerLostError

from .. import timers
from ..rpc import current
from ..rpc.errors import RpcError
from ..rpc.serialization import protocol_function
from . import port
from .port import AgentPort

log = logging.getLogger(__name__)

# Seconds; the timer thread may fire up to 5 ms later still. Longer than a step of a loop
# that reaches many workers (10 ms woke each process's timer thread about 3.5 times a step
# of a fan-out to 7 workers or a chain of 8, for batches that rode away meanwhile).
DEFAULT_DELAY = 0.05

Send = Callable[[int, list], None]  # send(worker, context_ids)


class _Batch:
    __slots__ = ("send", "ids", "due")

    def __init__(self, send: Send, ids: list[int], due: float) -> None:
        self.send = send
        self.ids = ids
        self.due = due  # (monotonic) when it leaves as a request of its own, unless it rode


class CleanupBatcher:
    """Context ids to release on other workers, by worker.

    One timer serves every batch (a timer per batch cost each step as many timers as the
    workers a context reached, and woke the timer thread for each): it is due when the
    oldest batch is, sends the batches that waited ``delay`` and waits again for the rest.
    A batch that rode away leaves nothing behind, and a batch never leaves as a request of
    its own before it waited its ``delay``."""

    def __init__(self, delay: float = DEFAULT_DELAY):
        self.delay = delay
        self._lock = threading.Lock()
        self._pending: dict[int, _Batch] = {}  # worker -> what waits for it
        self._timer: timers.TimerHandle | None = None  # armed while batches wait
        self._timer_due = 0.0  # what it was armed for: it fires then or up to timers' slack later
        self._timer_serial = 0  # which arming is current (a replaced timer may be firing)

    def add(self, worker: int, context_ids: list[int], send: Send) -> None:
        """Release ``context_ids`` on ``worker`` with the next ride or batch (``send`` sends a
        batch as a request of its own)."""
        with self._lock:
            batch = self._pending.get(worker)
            if batch is not None:
                batch.ids.extend(context_ids)
                return
            due = time.monotonic() + self.delay
            self._pending[worker] = _Batch(send, list(context_ids), due)
            if self._timer is None or self._timer_due > due:  # (due sooner: the delay was cut)
                self._arm_locked(due)

    def _arm_locked(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_serial += 1
        self._timer_due = due
        self._timer = timers.call_later(due - time.monotonic(), self._flush_due, self._timer_serial)

    def take(self, worker: int) -> tuple[Send, list[int]] | None:
        """What waits for ``worker``, for a request about to leave for it to carry (give it
        back with ``add`` if that request cannot be sent)."""
        if not self._pending:  # the common case, without the lock (a racing add rides next time)
            return None
        with self._lock:
            batch = self._pending.pop(worker, None)
        if batch is None:
            return None
        return batch.send, batch.ids

    def flush(self) -> None:
        """Send every pending batch now."""
        with self._lock:
            pending, self._pending = self._pending, {}
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        for worker, batch in pending.items():
            batch.send(worker, batch.ids)

    def _flush_due(self, serial: int) -> None:
        """On the timer thread: send the batches that waited their delay; arm again for the
        first of the others."""
        now = time.monotonic()
        with self._lock:
            due = [(worker, batch) for worker, batch in self._pending.items() if batch.due <= now]
            for worker, _ in due:
                del self._pending[worker]
            if serial == self._timer_serial:  # (else a timer armed since is in charge)
                self._timer = None
                if self._pending:
                    self._arm_locked(min([batch.due for batch in self._pending.values()]))
        for worker, batch in due:
            batch.send(worker, batch.ids)


def release_everywhere(agent: AgentPort, context: Any, skip: int = -1) -> None:
    """Release ``context`` (already removed here) on every worker it reached but ``skip``."""
    send = functools.partial(_send_batch, agent)
    for worker in sorted(context._known_worker_ids()):
        if worker not in (agent.rank, skip):  # not back to whoever told us
            agent.hooks.contexts.cleanups.add(worker, [context.context_id], send)


def release_here(agent: AgentPort, context_ids: list, from_worker: int) -> tuple[list, Exception | None]:
    """``from_worker`` released these contexts: release them here too, and pass them on.
    Idempotent; unknown ids are fine (never here, or released already). Only a worker that
    takes part in a context here (or made it) may release it: others' releases are refused,
    counted and logged, and the error for the sender is returned. Returns the contexts that
    were here: dropping a context's graph and gradients is most of a release's cost (~7 of
    ~11 us measured in a pipeline's workers), so a worker serving a call keeps them until
    its answer left."""
    if type(context_ids) is not list:
        raise RpcError(f"malformed context releases {context_ids!r:.80}")
    hooks = agent.hooks
    removed, refused = hooks.contexts.release_from(context_ids, from_worker)
    for context in removed:
        release_everywhere(agent, context, skip=from_worker)
    refusal = None
    if refused:
        shown = ", ".join(map(str, refused[:_IDS_LOGGED]))
        refusal = hooks.refusals.refuse(from_worker, f"the release of autograd context(s) {shown}")
    return removed, refusal


@protocol_function
def cleanup_contexts(context_ids: list) -> None:
    """The receiving end of a cleanup request (CLEANUP_AUTOGRAD_CONTEXT_REQ), from the worker
    it came over (current.caller), never one its payload names."""
    caller = current.caller()
    _, refusal = release_here(port.current(), context_ids, -1 if caller is None else caller)
    if refusal is not None:
        raise refusal


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
