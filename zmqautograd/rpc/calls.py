"""Calls this worker makes: sending them (``call``, ``notify``, ``call_retrying``, reports)
and what stands for each until its answer comes (see answers.py)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from _thread import allocate_lock as _allocate_lock
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from zmqautograd.transport import (
    EndpointClosedError,
    Envelope,
    InjectedFaultError,
    Message,
    MessageType,
    PeerLostError,
    TransportError,
    UnknownPeerError,
)
from zmqautograd.transport import faults as transport_faults
from zmqautograd.transport.waiter import AnyWaiter

from .. import timers
from .devices import Placement
from .errors import RpcError, RpcTimeoutError, SerializationError
from .futures import Future
from .hooks import OutgoingCall
from .message_types import RETRYABLE_TYPES
from .constants import DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT
from .serialization import (
    encode_function,
)

if TYPE_CHECKING:
    from .agent import Agent, WorkerInfo

log = logging.getLogger(__name__)

_cuda_initialized = torch.cuda.is_initialized  # False: no CUDA tensor can exist in this process

class _SyncSlot:
    """What ``rpc_sync`` waits on instead of a torch Future: whichever thread receives the
    response can fill it, undecoded, without running any user code (a Future runs its
    callbacks).

    The calling thread waits in ``Endpoint.wait_until``, receiving from the socket itself
    meanwhile, so that its answer usually needs no hand-over at all; whoever else completes
    the call (exactly one: completers first take the call out of the pending table) wakes it
    through its ``waiter``. It times out by itself instead of through the timer thread: a
    timer costs a heap entry per call."""

    __slots__ = ("waiter", "finished", "envelope", "value", "error", "to", "message_id", "timeout")

    def __init__(self, timeout: float, waiter: AnyWaiter) -> None:
        self.waiter = waiter  # the calling thread's
        self.finished = False
        self.envelope: Envelope | None = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.to: WorkerInfo | None = None
        self.message_id = 0
        self.timeout = timeout  # seconds; <= 0: no limit

    def _finish(self) -> None:
        self.finished = True
        self.waiter.wake()

    def set_result(self, value: Any) -> None:
        self.value = value
        self._finish()

    def set_exception(self, error: BaseException) -> None:
        self.error = error
        self._finish()

    def set_envelope(self, envelope: Envelope, to: WorkerInfo) -> None:
        self.envelope = envelope
        self.to = to
        self._finish()

    def done(self) -> bool:
        return self.finished

class _CallFuture(Future):
    """The future of an ``rpc_async`` call. While nobody has registered a callback on it (most
    callers ``wait()`` or ``wait_all``), the I/O thread completes it with a small plain
    answer itself, one thread hand-over fewer than through the pool; a callback registered
    since sends its answer through the pool, so user callbacks never run on the I/O thread.
    ``_guard`` orders the two: a registration waits while the I/O thread completes.

    A thread in ``wait()`` receives meanwhile, as a caller of ``rpc_sync`` does, and takes
    the answers of such futures itself (answers.py, ``_await_answers``): the answer it waits
    for needs no hand-over to the pool and back, and neither do those of the calls it made
    before (a fan-out's), which it would wait for next."""

    def __init__(self, await_answers: Callable[[list[_CallFuture], Callable[[], bool]], None] | None = None) -> None:
        super().__init__()
        self._guard = _allocate_lock()
        self._observed = False
        self._await_answers = await_answers  # (the agent's)
        self._taker: AnswerTaker | None = None  # that of the first thread in wait()
        self._waiters: list[AnyWaiter] = []  # those of the threads in wait(): woken when it completes

    def then(self, callback: Callable) -> torch.futures.Future:
        with self._guard:
            self._observed = True
        return super().then(callback)

    def add_done_callback(self, callback: Callable) -> None:
        with self._guard:
            self._observed = True
        super().add_done_callback(callback)

    def wait(self) -> Any:
        if self._await_answers is not None and not self.done():
            self._await_answers([self], self.done)
        return super().wait()

    def set_result(self, result: Any) -> None:  # (set_exception comes here too)
        super().set_result(result)
        for waiter in tuple(self._waiters):
            waiter.wake()

class AnswerTaker:
    """A thread that waits in ``_CallFuture.wait()`` (``depth`` of them, nested): the
    answers it took and will complete (future, envelope, callee), and its waiter."""

    __slots__ = ("items", "waiter", "depth")

    def __init__(self, waiter: AnyWaiter) -> None:
        self.items: list[tuple[_CallFuture, Envelope, WorkerInfo]] = []
        self.waiter = waiter
        self.depth = 0

class _Takers(threading.local):
    mine: AnswerTaker | None = None  # this thread's, once it waited
    active: AnswerTaker | None = None  # the same, while it waits


takers = _Takers()

class _PostedCall:
    """The pending entry of a call whose answer is handled on one particular thread, one that
    works through a queue of its own (the caller of distributed ``backward()``, in its pass's
    ``run_at_home``). Whichever thread receives the answer only posts it there, undecoded:
    ``post(function, *args)`` queues it and wakes that thread, which decodes it and runs
    ``on_answer(value, error)``. No hand-over through the pool, and none at all when that
    thread received the answer itself while it waited for work (it waits in the endpoint's
    ``wait_until``). Completed exactly once, by whoever claimed the call."""

    __slots__ = ("post", "on_answer", "finished")

    def __init__(self, post: Callable, on_answer: Callable[[Any, BaseException | None], None]) -> None:
        self.post = post
        self.on_answer = on_answer
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def set_result(self, value: Any) -> None:
        self.settle(self.on_answer, value, None)

    def set_exception(self, error: BaseException) -> None:
        self.settle(self.on_answer, None, error)

    def settle(self, function: Callable, *args: Any) -> None:
        self.finished = True
        self.post(function, *args)

class _ReportSink:
    """Where reports to this worker go: one-way messages sent as answers to the sink's id
    (``Agent.report``), any number of them until it is closed. Whichever thread receives
    one posts it, undecoded, to the thread that handles them, as a _PostedCall's answer
    (distributed autograd's forwarded passes report to the originator this way: engine.py,
    "Forwarding")."""

    __slots__ = ("post", "on_report")

    def __init__(self, post: Callable, on_report: Callable[[Any, BaseException | None, int], None]) -> None:
        self.post = post
        self.on_report = on_report

@dataclass
class _Pending:
    future: torch.futures.Future | _SyncSlot | _PostedCall
    to: WorkerInfo
    timeout: float
    timer: timers.TimerHandle | None = None  # its timeout, cancelled once the call completes
    # The RRef forks its message carries (rref.py), taken back when it is not delivered.
    forks: list | None = None

class _CallDeadlines:
    """The timeouts of pending calls that share one (the agent's default, nearly always),
    without a timer each. Their deadlines come in the order the calls are made, so they
    wait in a queue behind one timer, due at the first: a timer per call cost a handle, a
    heap entry and a cancellation. An answered call's entry stays until the timer finds it
    at the front, or until the queue holds more than twice the pending calls (and 64): then
    the answered calls' entries are dropped at once (amortised: each entry once). A call of
    another timeout gets a timer of its own while calls of the queue's are pending. Used
    under the agent's lock."""

    __slots__ = ("timeout", "queue", "timer", "serial")

    def __init__(self) -> None:
        self.timeout = 0.0  # that of the calls queued
        self.queue: deque[tuple[float, int]] = deque()  # (deadline, message id), in order
        self.timer: timers.TimerHandle | None = None  # armed while the queue is not empty
        self.serial = 0  # which timer is in charge (one replaced may still be firing)

    def add(self, agent: Agent, message_id: int, timeout: float) -> bool:
        """Queue the deadline of a call just made pending (caller holds the agent's lock);
        False when the queue holds pending calls of another timeout."""
        queue = self.queue
        if queue and timeout != self.timeout:
            pending = agent._pending
            while queue and queue[0][1] not in pending:  # answered at the front
                queue.popleft()
            if queue:
                return False
        if not queue:
            self.timeout = timeout
            if self.timer is not None:  # (armed for an answered call: maybe later than this one)
                self.timer.cancel()
                self.timer = None
        queue.append((time.monotonic() + timeout, message_id))
        if len(queue) > 2 * len(agent._pending) + 64:  # answered calls' entries, mostly
            pending = agent._pending
            queue = self.queue = deque([entry for entry in queue if entry[1] in pending])
        if self.timer is None:
            self._arm(agent, queue[0][0] - time.monotonic())
        return True

    def _arm(self, agent: Agent, delay: float) -> None:
        self.serial += 1
        self.timer = timers.call_later(delay, self._expire_due, agent, self.serial)

    def _expire_due(self, agent: Agent, serial: int) -> None:
        """On the timer thread, at the first deadline: fail the calls whose deadline passed
        and that are still pending; wait for the next deadline."""
        now = time.monotonic()
        expired = []
        with agent._lock:
            queue, pending = self.queue, agent._pending
            while queue and (queue[0][0] <= now or queue[0][1] not in pending):
                message_id = queue.popleft()[1]
                if message_id in pending:
                    expired.append(message_id)
            if serial == self.serial:  # (else a timer armed since is in charge)
                self.timer = None
                if queue:
                    self._arm(agent, queue[0][0] - now)
        for message_id in expired:
            agent._expire(message_id)

class _RetriedCall:
    """The tries of one ``Agent.call_retrying``. A class, not closures that call each other:
    those would form reference cycles that only the cyclic collector frees."""

    def __init__(self, agent: "Agent", to: Any, function: Callable, args: Any, message_type: MessageType) -> None:
        self.agent, self.to, self.function, self.args, self.message_type = agent, to, function, args, message_type
        self.result: torch.futures.Future = Future()
        self.timeout = agent.default_timeout if agent.default_timeout > 0 else DEFAULT_RPC_TIMEOUT_SEC

    def attempt(self, number: int) -> None:
        try:
            sent = self.agent.call(self.to, self.function, self.args, None, self.timeout, message_type=self.message_type)
        except Exception as exc:  # noqa: BLE001
            self._retry_or_fail(number, exc)
            return
        sent.add_done_callback(functools.partial(self._finished, number))

    def _finished(self, number: int, done: torch.futures.Future) -> None:
        try:
            value = done.value()
        except Exception as exc:  # noqa: BLE001
            self._retry_or_fail(number, exc)
            return
        self.result.set_result(value)

    def _retry_or_fail(self, number: int, exc: Exception) -> None:
        agent, options = self.agent, self.agent.options
        retryable = isinstance(exc, (InjectedFaultError, RpcTimeoutError)) or (
            isinstance(exc, TransportError)
            and not isinstance(exc, (PeerLostError, UnknownPeerError, EndpointClosedError))
        )
        if not retryable or number >= options.max_retries or agent._stopping:
            self.result.set_exception(exc)
            return
        delay = options.retry_delay * options.retry_backoff ** number
        log.debug("%s: retrying %s to %s in %.2f s: %s", agent.info, self.message_type.name, self.to, delay, exc)
        timers.call_later(delay, self.attempt, number + 1)

def _with_context(exc: Exception, context: str) -> Exception:
    """The same error type with where it happened in front (types are kept for catching)."""
    try:
        if isinstance(exc, PeerLostError) or hasattr(exc, "peer"):
            return type(exc)(exc.peer, f"{context}: {exc}")
        return type(exc)(f"{context}: {exc}")
    except TypeError:
        return RpcError(f"{context}: {exc}")


class Calling:
    """The agent's outgoing calls (part of ``Agent``)."""

    def call(
        self: Agent, to: Any, function: Callable, args: Any, kwargs: Any, timeout: float, sync: bool = False,
        message_type: MessageType = MessageType.PYTHON_CALL, barrier: bool = False,
        placement: Placement | None = None, posted: tuple[Callable, Callable] | None = None,
    ) -> Any:
        """Send a call; the returned future (a _SyncSlot when ``sync``; with ``posted`` =
        ``(post, on_answer)`` a _PostedCall) completes with its result or exception.
        ``barrier`` marks the shutdown barrier's own call, which ``wait_outstanding`` does not
        count. ``placement``: where CUDA tensors land at the callee (default: this worker's
        device map to it)."""
        info = self.worker_info(to)
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple or list, got {type(args).__qualname__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict, got {type(kwargs).__qualname__}")
        # The arguments go as a list: the callee only unpacks them (a tuple would cost an
        # extension type each way; tuples inside them stay tuples).
        payload = {"f": encode_function(function), "a": list(args or ()), "k": dict(kwargs or {})}
        hooks = self.hooks
        # Deferred work rides on calls only without fault injection (which may drop it).
        outgoing = hooks.call_leaving(info.id, message_type, function, args, kwargs, payload, self.endpoint.faults is None)
        if outgoing is not None:
            message_type = outgoing.message_type
        timeout = self.default_timeout if timeout is None or timeout == UNSET_RPC_TIMEOUT else float(timeout)
        slot = _SyncSlot(timeout, self.endpoint.waiter()) if sync else None
        future: _SyncSlot | _CallFuture | _PostedCall
        if posted is not None:
            future = _PostedCall(*posted)
        else:
            future = slot if slot is not None else _CallFuture(self._await_answers)
        message_id = next(self._ids)
        message = Message(message_type, message_id, self._me, payload)
        pending = _Pending(future, info, timeout)
        with self._lock:
            if self._stopping:
                self._not_sent(info, outgoing)
                raise RpcError("RPC is shutting down on this worker")
            self._pending[message_id] = pending
            if barrier:
                self._barrier_ids.add(message_id)
            queued = slot is None and timeout > 0 and self._deadlines.add(self, message_id, timeout)
        if slot is not None:
            slot.message_id = message_id  # its waiter times it out (call_sync)
        elif timeout > 0 and not queued:
            # Cancelled when the call completes (_take); one that completes before the timer
            # is set here leaves a timer that fires, finds nothing, and is gone.
            pending.timer = timers.call_later(timeout, self._expire, message_id)
        recording = outgoing if outgoing is not None and outgoing.collect_tensors else None
        tensors: list | None = [] if recording is not None else None  # only hooks need them
        try:
            frames = self._encode_to(info, message, tensors, placement, pending)
            if recording is not None and tensors is not None and not sync:
                hooks.call_recorded(info.id, recording, tensors, False)
            self._transmit(info, message, frames)
        except BaseException as exc:
            self._claim(message_id)  # never sent: nothing will complete it
            self._not_sent(info, outgoing)
            if pending.forks:
                self.rrefs.unsent(pending.forks)
            if isinstance(exc, (TransportError, SerializationError)):
                raise _with_context(exc, f"cannot send a call to {info}") from None
            raise
        if recording is not None and tensors is not None and sync:
            # Recorded while the call is on its way: nothing needs distributed autograd's send
            # function before this thread's wait for the answer ends (a backward pass over it
            # starts after that, on this thread), and the recording then costs no latency.
            # Other calls record first: their answer may start a pass on another thread at once.
            try:
                hooks.call_recorded(info.id, recording, tensors, True)
            except BaseException:
                self._claim(message_id)  # its answer, when it comes, is dropped
                raise
        return future

    def _not_sent(self: Agent, info: WorkerInfo, outgoing: OutgoingCall | None) -> None:
        if outgoing is not None:
            self.hooks.call_not_sent(info.id, outgoing)

    def _encode_to(self: Agent, info: WorkerInfo, message: Message, tensors: list | None,
                   placement: Placement | None, pending: _Pending | None = None) -> list:
        """The frames of a message we start (a call, a one-way call, a report) to ``info``:
        CUDA tensors land by ``placement``, by default our device map to that worker."""
        return self._encode(info.id, message, tensors, placement or self.placement.request(info.name),
                            self._cuda_ipc_to(info.id), pending)

    def _encode(self: Agent, to: int | None, message: Message, tensors: list | None, placement: Placement | None,
                cuda_ipc: bool, pending: _Pending | None = None) -> list:
        """``codec.encode`` for a message to worker ``to`` (None: no member), noting where the
        RRef forks made while encoding it go, or taking them back if it cannot be encoded
        (rref.py: a lost worker's forks are let go). A call's forks are kept on its
        ``pending`` record, to be taken back if the call is not delivered."""
        rrefs = self.rrefs
        try:
            frames = self.codec.encode(message, tensors, placement, cuda_ipc)
        except BaseException:
            if rrefs.forks_made:
                rrefs.unsent(rrefs.take_made())
            raise
        if rrefs.forks_made:  # (0 until this worker sends its first RRef)
            made = rrefs.take_made()
            if made and to is not None:
                rrefs.sent_to(made, to)
                if pending is not None:
                    pending.forks = made
        return frames

    def _cuda_ipc_to(self: Agent, peer: int | str) -> bool:
        """Whether CUDA tensors for ``peer`` (its rank, or its name on the wire) go by CUDA IPC
        (transport/cuda_ipc.py): it is another process of this host, and this process uses
        CUDA at all (cheap tests first, that spare CPU-only calls the lookup)."""
        return self.cuda_ipc and _cuda_initialized() and self.endpoint.reads_our_memory(str(peer))

    def _transmit(self: Agent, info: WorkerInfo, message: Message, frames: list) -> None:
        """Hand an encoded request to the transport, or to our own pool for a self call
        (fault injection applies to both, as in torch's faulty agent)."""
        if info.id != self.rank:
            self.endpoint.send_encoded(str(info.id), message.id, frames, message.type)
            return
        transport_faults.apply(self.endpoint.faults, str(self.rank), message.type,
                               lambda: self.pool.submit(self._serve, self._loopback(frames)), str(self.rank))

    def call_retrying(self: Agent, to: Any, function: Callable, args: Any, message_type: MessageType) -> torch.futures.Future:
        """A call of a retryable control message: when it fails to be sent or its answer is
        lost (timeout), it is sent again after ``retry_delay``, then ``retry_backoff`` times
        longer each time, up to ``max_retries`` more times. Only for idempotent receivers.
        A lost peer or an error raised by the function itself is final."""
        if message_type not in RETRYABLE_TYPES:
            raise ValueError(f"{message_type.name} is not a retryable message type (its receiver may not be idempotent)")
        with self._lock:  # graceful shutdown waits for these too, between tries included
            self._retrying += 1
        retrying = _RetriedCall(self, to, function, args, message_type)
        retrying.result.add_done_callback(self._retried)
        retrying.attempt(0)
        return retrying.result

    def _retried(self: Agent, _: Any) -> None:
        with self._lock:
            self._retrying -= 1
            self._all_done.notify_all()

    def notify(self: Agent, to: Any, function: Callable, args: Any, message_type: MessageType,
               placement: Placement | None = None) -> None:
        """A one-way call: it runs on ``to`` and is never answered (its errors are logged
        there). Raises only when it cannot be sent. For protocols that learn the outcome
        another way (distributed autograd's gradients to the pass's originator)."""
        info = self.worker_info(to)
        payload = {"f": encode_function(function), "a": list(args or ()), "k": {}, "n": 1}
        message = Message(message_type, next(self._ids), self._me, payload)
        try:
            self._transmit(info, message, self._encode_to(info, message, None, placement))
        except (TransportError, SerializationError) as exc:
            raise _with_context(exc, f"cannot send a one-way call to {info}") from None

    def open_sink(self: Agent, post: Callable, on_report: Callable[[Any, BaseException | None, int], None]) -> int:
        """Open a report sink (_ReportSink): its id, which peers pass to ``report``. Each
        report is handled by ``post(function, *args)`` running ``on_report(value, error,
        sender)`` (error: a report that cannot be decoded; sender: the member that sent it,
        by its connection: what it may report is the sink owner's to judge)."""
        sink_id = next(self._ids)  # never the id of a call: both count on one counter
        self._sinks[sink_id] = _ReportSink(post, on_report)
        return sink_id

    def close_sink(self: Agent, sink_id: int) -> None:
        self._sinks.pop(sink_id, None)

    def report(self: Agent, to: Any, sink_id: int, value: Any, placement: Placement | None = None) -> None:
        """Send ``value`` to the report sink ``sink_id`` of ``to`` (open_sink): one-way, as an
        answer, so it needs no pool thread there. Raises only when it cannot be sent."""
        info = self.worker_info(to)
        message = Message(MessageType.BACKWARD_AUTOGRAD_RESP, sink_id, self._me, {"v": value})
        try:
            frames = self._encode_to(info, message, None, placement)
            if info.id == self.rank:
                self._complete(self._loopback(frames))
            else:
                self.endpoint.send_encoded(str(info.id), sink_id, frames, message.type)
        except (TransportError, SerializationError) as exc:
            raise _with_context(exc, f"cannot send a report to {info}") from None

    def call_sync(
        self: Agent, to: Any, function: Callable, args: Any, kwargs: Any, timeout: float,
        message_type: MessageType = MessageType.PYTHON_CALL, barrier: bool = False,
    ) -> Any:
        """Call and wait; a pool thread that waits lets the pool start another (nested RPCs)."""
        slot = self.call(to, function, args, kwargs, timeout, sync=True, message_type=message_type, barrier=barrier)
        if self.pool.owns_current_thread():
            with self.pool.blocking():
                self._wait(slot)
        else:
            self._wait(slot)
        if slot.envelope is not None:  # handed over undecoded by the I/O thread
            slot.value, slot.error = self._decode_response(slot.envelope, slot.to)
        error = slot.error
        if error is not None:
            # The error's traceback will hold this frame: a frame that still refers to the
            # error (or to the slot that does) would make a cycle, which keeps the call's
            # arguments (tensors, RRefs) alive until the cyclic garbage collector runs.
            del slot
            try:
                raise error
            finally:
                del error
        return slot.value

    def _wait(self: Agent, slot: _SyncSlot) -> None:
        if not self.endpoint.wait_until(slot.done, slot.timeout if slot.timeout > 0 else None):
            self._expire(slot.message_id)  # fails it, unless it completed meanwhile
            self.endpoint.wait_until(slot.done)  # complete now, or at once: whoever took it completes it
