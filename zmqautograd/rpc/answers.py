"""Answers to this worker's calls: routed to a waiting thread or completed where they
arrive, decoded, matched with the pending call, timed out, failed with a lost peer."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable

from zmqautograd.transport import (
    Envelope,
    Message,
    MessageType,
)

from .calls import AnswerTaker, _CallFuture, _Pending, _PostedCall, _ReportSink, _SyncSlot, takers
from .errors import RpcTimeoutError, SerializationError
from .futures import complete_future
from .message_types import REQUEST_TYPES, RESPONSE_TYPES
from .serialization import (
    decode_exception,
)

if TYPE_CHECKING:
    from .agent import Agent, WorkerInfo

log = logging.getLogger(__name__)

# Answers the I/O thread may complete a _CallFuture with: not exceptions (rebuilding one may
# import and run the exception's class) and not autograd answers (they record a recv function).
_PLAIN_RESPONSE_TYPES = frozenset(REQUEST_TYPES.values()) - {MessageType.FORWARD_AUTOGRAD_RESP}

_INLINE_MAX_BYTES = 1 << 16  # bigger answers are decoded on the pool (CUDA copies among them)
_NOT_BLOCKING = contextlib.nullcontext()


class Answers:
    """The agent's pending calls and their answers (part of ``Agent``)."""

    def _report_sink(self: Agent, message_id: int, sender: int | str,
                     kind: MessageType) -> tuple[_ReportSink, WorkerInfo] | None:
        """The open sink an answer with no pending call reports to, and the member that sent
        it; None if it is no report (a late answer, or from no member). Reports travel as
        BACKWARD_AUTOGRAD_RESP only (an answer of another type to a sink is no report: one
        that distributed autograd records would record into the sink's context)."""
        sink = self._sinks.get(message_id) if self._sinks else None
        if sink is None or kind is not MessageType.BACKWARD_AUTOGRAD_RESP or not str(sender).isdigit():
            return None
        info = self.workers_by_id.get(int(sender))
        return None if info is None else (sink, info)

    def _route_to_waiter(self: Agent, peer: str, envelope: Envelope) -> bool:
        """On the thread that received it (the I/O thread or a waiting thread, holding the
        socket lock: nothing here may send): a response to an rpc_sync goes to its waiting
        thread at once, undecoded; a small plain response to an rpc_async nobody registered a
        callback on completes its future here."""
        if envelope.type not in RESPONSE_TYPES:
            return False
        pending = self._pending.get(envelope.id)  # dict lookups are atomic
        if self._misdirected(pending, peer, envelope.type, envelope.id):
            return True
        if pending is None:
            found = self._report_sink(envelope.id, envelope.sender, envelope.type)
            if found is None:
                return False
            sink, sender = found
            sink.post(self._report_posted, envelope, sender, sink.on_report)
            return True
        future = pending.future
        if type(future) is _SyncSlot:
            if self._claim(envelope.id) is None:
                return True  # timed out meanwhile: already failed
            future.set_envelope(envelope, pending.to)
            return True
        if type(future) is _PostedCall:
            if self._claim(envelope.id) is not None:  # else timed out meanwhile: already failed
                future.settle(self._answer_posted, envelope, pending.to, future.on_answer)
            return True
        if type(future) is not _CallFuture:
            return False
        active = takers.active
        if active is not None or future._taker is not None:
            # A thread waits in wait(): this one (any such answer), or the future's own.
            with future._guard:
                taker = active or future._taker
                if taker is not None and not future._observed:
                    if self._claim(envelope.id) is not None:  # else timed out meanwhile: already failed
                        taker.items.append((future, envelope, pending.to))
                        if taker is not active:
                            taker.waiter.wake()
                    return True
        if envelope.type not in _PLAIN_RESPONSE_TYPES or envelope.nbytes > _INLINE_MAX_BYTES:
            return False
        with future._guard:
            if future._observed:
                return False
            tensors: list = []
            try:
                payload = self.codec.decode_payload(envelope, tensors, plain=True)
            except Exception:  # an extension, or malformed: the pool's path decodes or reports it
                return False
            if not isinstance(payload, dict) or "v" not in payload:
                return False
            if self._claim(envelope.id) is None:
                return True  # timed out meanwhile: already failed
            complete_future(future, *self._response_value(Message(envelope.type, envelope.id, envelope.sender, payload, tensors), pending.to))
        return True

    def _await_answers(self: Agent, futures: list[_CallFuture], done: Callable[[], bool]) -> None:
        """``wait()`` on rpc_async calls' futures (or ``wait_all``): receive on this thread
        until ``done()``, as ``rpc_sync`` does, completing here the answers taken meanwhile
        (_route_to_waiter): those of ``futures``, and while it waits, those of every call
        whose future has no callback (the other calls of a fan-out, which it would wait for
        next; no user code runs on the way). In a pool thread, the pool may start another
        meanwhile."""
        taker = takers.mine
        waiter = self.endpoint.waiter()
        if taker is None:
            taker = takers.mine = AnswerTaker(waiter)
        if not taker.depth:
            taker.waiter = waiter  # (this agent's endpoint's)
        items = taker.items
        taker.depth += 1
        takers.active = taker
        for future in futures:
            future._waiters.append(waiter)
            with future._guard:
                if future._taker is None:
                    future._taker = taker

        def ready() -> bool:
            return bool(items) or done()

        try:
            with self.pool.blocking() if self.pool.owns_current_thread() else _NOT_BLOCKING:
                while not done():
                    # Work the layers above deferred from the calls runs when nothing came.
                    self.endpoint.wait_until(ready, idle=self.hooks.while_waiting)
                    self._complete_taken(items)
        finally:
            for future in futures:
                future._waiters.remove(waiter)
                with future._guard:
                    if future._taker is taker:
                        future._taker = None
            taker.depth -= 1
            if not taker.depth:
                takers.active = None
                self._complete_taken(items)  # each was claimed: none may be left behind

    def _complete_taken(self: Agent, items: list) -> None:
        while items:
            future, envelope, to = items.pop(0)
            complete_future(future, *self._decode_response(envelope, to))
            del future

    def _answer_posted(self: Agent, envelope: Envelope, to: WorkerInfo, on_answer: Callable) -> None:
        """A _PostedCall's answer, on the thread it was posted to."""
        value, error = self._decode_response(envelope, to)
        on_answer(value, error)

    def _report_posted(self: Agent, envelope: Envelope, sender: WorkerInfo, on_report: Callable) -> None:
        """A report to a sink, on the thread it was posted to; ``on_report`` learns who sent it."""
        value, error = self._decode_response(envelope, sender)
        on_report(value, error, sender.id)

    def _decode_response(self: Agent, envelope: Envelope, to: WorkerInfo) -> tuple[Any, BaseException | None]:
        tensors: list = []
        try:
            payload = self.codec.decode_payload(envelope, tensors)
        except Exception as exc:
            return None, SerializationError(f"cannot decode the response from {to}: {exc}")
        finally:
            if self.rrefs.forks_registered:
                self.rrefs.take_registering()  # only a call waits for its RRefs' registration (serving.py)
        return self._response_value(Message(envelope.type, envelope.id, envelope.sender, payload, tensors), to)

    def _response_value(self: Agent, message: Message, to: WorkerInfo) -> tuple[Any, BaseException | None]:
        """A response's value or error; a hooked answer goes through the hooks first."""
        payload = message.payload
        if message.type is MessageType.EXCEPTION:
            return None, decode_exception(payload["exc"], repr(to), self.codec.policy)
        if message.type is MessageType.FORWARD_AUTOGRAD_RESP:
            try:
                self.hooks.answer_arrived(to.id, payload, message.tensors or [])
            except Exception as exc:
                return None, SerializationError(f"cannot record the autograd metadata of the response from {to}: {exc}")
        return payload["v"], None

    def _loopback(self: Agent, frames: list) -> Message:
        """A message to ourselves goes through the codec like any other, so that the receiver
        sees copies of its tensors, as it would from another worker."""
        return self.codec.decode([bytearray(memoryview(f)) for f in frames])

    def _misdirected(self: Agent, pending: _Pending | None, peer: str, kind: MessageType, message_id: int) -> bool:
        """Whether ``peer``'s answer (or refusal) to call ``message_id`` (``pending``, if it
        still waits) is for a call that went to another worker: then it is a protocol error,
        counted and logged, never delivered (the call still waits for its callee)."""
        if pending is None or str(pending.to.id) == peer:
            return False
        self.misdirected_answers += 1
        self.endpoint.note_protocol_error(
            peer, f"{kind.name} to call {message_id}, which went to {pending.to}, not to this peer: dropped")
        return True

    def _complete(self: Agent, message: Message) -> None:
        if self._misdirected(self._pending.get(message.id), str(message.sender), message.type, message.id):
            return
        pending = self._claim(message.id)
        if pending is None:
            found = self._report_sink(message.id, message.sender, message.type)
            if found is not None:  # a report (not received by _route_to_waiter)
                sink, sender = found
                sink.post(sink.on_report, *self._response_value(message, sender), sender.id)
                return
            log.debug("%s: late or unknown response %d (timed out?)", self.info, message.id)
            return
        complete_future(pending.future, *self._response_value(message, pending.to))

    def _on_send_error(self: Agent, peer: str, message_id: int, error: Exception) -> None:
        if self._misdirected(self._pending.get(message_id), peer, MessageType.PROTOCOL_ERROR, message_id):
            return
        pending = self._claim(message_id)
        if pending is not None:
            if pending.forks:  # not delivered (not sent, or refused undecoded): they never arrived
                self.rrefs.unsent(pending.forks)
            pending.future.set_exception(error)

    def _expire(self: Agent, message_id: int) -> None:
        """On the timer thread, at a call's deadline: fail it if it is still pending."""
        pending = self._claim(message_id)
        if pending is not None:
            pending.future.set_exception(RpcTimeoutError(
                f"RPC ran for more than set timeout ({pending.timeout * 1000:.0f} ms) "
                f"and will now be marked with an error (call to {pending.to})"
            ))

    def _claim(self: Agent, message_id: int) -> _Pending | None:
        """Take a pending call out of the table to complete it: of all who may complete a call
        (its answer, its timeout, a send error, a lost peer, shutdown), only the one that gets
        it here does. None when someone else did."""
        with self._lock:
            return self._take(message_id)

    def _take(self: Agent, message_id: int) -> _Pending | None:
        """Remove a pending call (caller holds the lock) and wake wait_outstanding."""
        pending = self._pending.pop(message_id, None)
        if pending is not None:
            if pending.timer is not None:
                pending.timer.cancel()
            self._barrier_ids.discard(message_id)
            if self._done_waiters:  # (a notify costs ~1 us; nobody waits but at shutdown)
                self._all_done.notify_all()
        return pending

    def outstanding(self: Agent) -> int:
        with self._lock:
            return len(self._pending)
