"""Calls other workers make to this one: run on the pool, answered (an async function's
when its future completes), with the call hooks around them (hooks.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from zmqautograd.transport import (
    DeviceMapError,
    LocalProtocolError,
    Message,
    MessageType,
    TransportError,
)

from . import current
from .errors import NotEntitledError, SerializationError, user_error
from .functions import check_async_result, is_async_function
from .message_types import REQUEST_TYPES, RESPONSE_TYPES
from .futures import when_all_done
from .profiling import run_server_profiled, server_profiles
from .serialization import (
    encode_exception,
    resolve_function,
    served_error,
)

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)


class Serving:
    """The agent's serving of calls (part of ``Agent``)."""

    def _on_message(self: Agent, message: Message) -> None:
        """On a pool thread (the endpoint's executor), which decoded the message."""
        kind = message.type
        registering = self.rrefs.take_registering() if self.rrefs.forks_registered else None
        if kind in REQUEST_TYPES:
            if registering and not all(future.done() for future in registering):
                self._serve_once_registered(message, registering)
                return
            self._serve(message)
        elif kind in RESPONSE_TYPES:
            self._complete(message)
        else:
            log.warning("%s: unexpected %s from %s", self.info, kind.name, message.sender)

    def _serve_once_registered(self: Agent, message: Message, registering: list[torch.futures.Future]) -> None:
        """A call whose arguments hold user RRefs still being registered with their owners
        runs once they are, on a pool thread (torch's callee waits for its pending user RRefs
        too: inside, ``confirmed_by_owner()`` is True). A registration that fails does not
        stop the call; using that RRef raises why."""
        when_all_done(registering, lambda: self.pool.submit(self._serve, message))

    def start_serving(self: Agent) -> None:
        self._serving.set()

    def _serve(self: Agent, message: Message) -> None:
        """Run a call on a pool thread and send its result or exception back."""
        served = self._run_call(message)
        if served is not None:
            try:
                self.hooks.call_answered(served)
            except Exception:  # noqa: BLE001 - never the call's failure
                log.exception("%s: the hooks failed after call %d from %s", self.info, message.id, message.sender)

    def _run_call(self: Agent, message: Message) -> Any:
        """Run the call and answer it; returns the hooks' state for it (rpc/hooks.py), for
        ``call_answered``. An async function is answered when its future completes."""
        hooks = self.hooks
        served = function = None
        try:
            served = hooks.call_arrived(message)
            payload = message.payload
            function = resolve_function(payload["f"], self.codec.policy)
            token = hooks.call_starts(served, function)
            calls = current._calls
            caller = getattr(calls, "rank", None)
            # Who asked: its connection's name (current.caller); None for a peer that is no
            # worker of the group (an embedder's extra member).
            sender = str(message.sender)
            calls.rank = int(sender) if sender.isdigit() else None
            try:
                if server_profiles:  # a _server_process_global_profile is open (profiling.py)
                    result = run_server_profiled(function, payload["a"], payload["k"])
                else:
                    result = function(*payload["a"], **payload["k"])
            finally:
                hooks.call_ends(token)
                calls.rank = caller
            if is_async_function(function):
                check_async_result(function, result)
                if not result.done():
                    # Answer when it completes; no thread waits for it meanwhile.
                    result.add_done_callback(lambda done: self._answer_with(message, done, served))
                    return served
        except BaseException as exc:  # a user's sys.exit() too: answered, never this thread's end
            # As torch: a function's error is logged where it happened as well as returned.
            exc = user_error(exc) if function is None else served_error(function, exc, self.info)
            self._reply(message, None, exc, served)
            return served
        if is_async_function(function):  # and done already (a backward pass that ran to its end here)
            self._answer_with(message, result, served)
        else:
            self._reply(message, result, None, served)
        return served

    def _answer_with(self: Agent, request: Message, done: torch.futures.Future, served: Any) -> None:
        try:
            value = done.value()
        except Exception as exc:
            self._reply(request, None, exc, served)
            return
        self._reply(request, value, None, served)

    def _reply(self: Agent, request: Message, value: Any, error: BaseException | None, served: Any) -> None:
        """Send a call's result (or its error) back to the caller; the hooks may add to a
        result (distributed autograd records it: its tensors may require grad)."""
        to = request.sender
        assert type(to) is str, "the endpoint admits no sender but its peers' names"
        me = self._me
        if request.payload.get("n"):  # one-way (notify): nobody waits for an answer
            if error is not None and not isinstance(error, NotEntitledError):  # (refusals log themselves)
                self.peer_log.log(to, logging.WARNING, "%s: one-way %s from %s failed: %s", self.info,
                                  request.type.name, to, error)
            return
        hooked = None
        if error is not None:
            reply = Message(MessageType.EXCEPTION, request.id, me, {"exc": encode_exception(error)})
        else:
            hooked = self.hooks.answer_payload(served, value) if served is not None else None
            if hooked is not None:
                reply = Message(hooked[0], request.id, me, hooked[1])
            else:
                reply = Message(REQUEST_TYPES[request.type], request.id, me, {"v": value})
        tensors: list = []  # what the reply carries, collected only for the hooks
        try:
            caller = self.workers_by_id.get(int(to)) if to.isdigit() else None
            frames = self._encode(caller.id if caller else None, reply, tensors if hooked is not None else None,
                                  self.placement.response(caller.name if caller else to), self._cuda_ipc_to(to))
        except (LocalProtocolError, SerializationError, DeviceMapError) as exc:
            # The result itself cannot travel (or has no device map back): the caller gets
            # that as its error.
            self._reply(request, None, SerializationError(f"the result of the call could not be sent back: {exc}"), None)
            return
        if hooked is not None:
            self.hooks.answer_leaving(served, reply.payload, int(to), to == me, tensors)
        if to == me:
            self._complete(self._loopback(frames))
            return
        try:
            if self.pool.should_hold() and not self.endpoint.through_shared_memory(to):
                # More calls wait for this thread: the answer leaves with theirs (pool.py,
                # "Held work"). Not to a caller on a shared-memory ring: a send there costs no
                # wake-up of libzmq's thread, so holding would only delay the answer.
                self.pool.hold(self._send_answer, to, reply.id, frames, reply.type)
            else:
                self._send_answer(to, reply.id, frames, reply.type)
        finally:
            if hooked is not None:
                self.hooks.answer_left(served, reply.payload, int(to), tensors)

    def _send_answer(self: Agent, to: str, message_id: int, frames: list, message_type: MessageType) -> None:
        try:
            self.endpoint.send_encoded(to, message_id, frames, message_type)
        except TransportError as exc:
            log.warning("%s: could not answer call %d from %s: %s", self.info, message_id, to, exc)
