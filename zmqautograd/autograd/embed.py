"""Distributed autograd inside another RPC framework, without ``zmqautograd.rpc``.

An embedder's framework carries calls between its processes. To run distributed autograd
over it (contexts, recording at call boundaries, ``backward`` across processes, context
release), it does three things; ``examples/embed_pipes.py`` is a complete one over
``multiprocessing`` pipes.

1. **A port.** Subclass ``EmbeddedPort`` and implement ``send_call(to, function, args)``:
   run ``function(*args)`` on worker ``to`` and return a ``torch.futures.Future`` of its
   answer (its error if it raised). ``send_one_way`` has a default over ``send_call``.
   ``attach(port)`` makes it the port of this process (one per process, as RPC's agent).
2. **Recording, around each of the framework's own calls that carry tensors**, as the RPC
   agent does with its call hooks:

   caller: ``metadata = port.call_leaving(to)``, sent with the call (None: no context is
   current, send none); before the call leaves, ``port.record_call(to, metadata,
   tensors)``; when its answer comes, ``port.record_answer(to, answer_metadata, tensors)``.

   callee: ``with port.serving(sender, metadata, tensors) as served:`` run the function;
   ``answer_metadata = served.answer(result_tensors)`` goes back with the answer.
3. **Serving the engine's own calls**: a ``send_call``/``send_one_way`` of one worker runs
   ``port.serve(sender, function, args)`` on the other. It refuses any function that is not
   one of zmqautograd's protocol functions, so a framework that hands it a function named
   by a message runs nothing else through it. Serve them off the thread that receives
   messages (a pass may wait for answers that thread delivers).

The framework tells the port of lost workers (``peer_lost``): passes that wait for them
fail, and contexts only they could release are released.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, ContextManager, Iterator

import torch

from zmqautograd.transport import MessageType

from ..rpc import current
from ..rpc.errors import RpcError
from ..rpc.functions import is_async_function
from ..rpc.futures import outcome_of, settle_from
from ..rpc.serialization import is_protocol_function, protocol_function
from . import port as port_module
from .context import DistAutogradContext
from .forward import message_metadata, record_recv, record_send
from .hooks import AutogradHooks
from .port import OnAnswer, OnReport, Post

log = logging.getLogger(__name__)


class _NoPool:
    """An embedder's framework serves calls on threads of its own: none of them is a pool's."""

    def owns_current_thread(self) -> bool:
        return False

    def blocking(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def has_work(self) -> bool:
        return False

    def submit(self, function: Callable, *args: Any) -> None:
        function(*args)


class ServedCall:
    """A call being served under ``EmbeddedPort.serving``."""

    def __init__(self, port: EmbeddedPort, sender: int, context: DistAutogradContext | None) -> None:
        self._port = port
        self._sender = sender
        self.context = context

    def answer(self, tensors: list[torch.Tensor]) -> list | None:
        """Record the answer that is about to go back with ``tensors``: the metadata to send
        with it (None when the call was not recorded). Before the answer is sent: the
        caller may start a backward pass over it as soon as it arrives."""
        if self.context is None:
            return None
        contexts = self._port.hooks.contexts
        metadata = message_metadata(contexts, self.context)
        record_send(contexts, metadata, tensors, self._sender)
        return metadata


class EmbeddedPort:
    """An ``AgentPort`` over an embedder's own transport (see the module's doc)."""

    def __init__(self, rank: int, timeout: float = 60.0) -> None:
        """``rank``: this worker's (0, 1, ...; what ``send_call`` names workers by);
        ``timeout``: seconds a ``backward()`` waits with nothing in flight before it fails."""
        self._rank = rank
        self._timeout = timeout
        self._lost: set[int] = set()
        self._closed = False
        self._sinks: dict[int, tuple[Post, OnReport]] = {}
        self._sink_ids = itertools.count(1)
        self._pool = _NoPool()
        self._hooks = AutogradHooks(self)

    # ------------------------------------------------------------------ for the embedder

    def send_call(self, to: int, function: Callable, args: tuple) -> torch.futures.Future:
        """Run ``function(*args)`` on worker ``to`` (its ``serve``): a future of the answer."""
        raise NotImplementedError

    def send_one_way(self, to: int, function: Callable, args: tuple) -> None:
        """Run ``function(*args)`` on ``to``, no answer needed (default: ``send_call``, its
        errors logged)."""
        future = self.send_call(to, function, args)
        future.add_done_callback(lambda done: _log_error(done, to, function))

    def serve(self, sender: int, function: Callable, args: tuple) -> torch.futures.Future:
        """Run one of the engine's calls from worker ``sender``: a future of its answer."""
        answer: torch.futures.Future = torch.futures.Future()
        try:
            if not is_protocol_function(function):
                raise RpcError(f"{getattr(function, '__qualname__', function)!r:.80} is not a function of "
                               "distributed autograd's protocol: refused")
            with self._as_caller(sender):
                result = function(*args)
        except Exception as exc:  # noqa: BLE001 - the answer carries it
            answer.set_exception(exc)
            return answer
        if is_async_function(function):  # answered when the future it returned completes
            result.add_done_callback(lambda done: settle_from(answer, done))
        else:
            answer.set_result(result)
        return answer

    def call_leaving(self, to: int) -> list | None:
        """A call to ``to`` leaves now: the metadata it must carry, or None (no context is
        current on this thread: the call is not recorded)."""
        contexts = self._hooks.contexts
        context = contexts.current()
        return None if context is None else message_metadata(contexts, context)

    def record_call(self, to: int, metadata: list | None, tensors: list[torch.Tensor]) -> None:
        """The call with ``metadata`` (``call_leaving``) carries ``tensors`` to ``to``; before
        it leaves (its answer may come back at once)."""
        if metadata is not None:
            record_send(self._hooks.contexts, metadata, tensors, to)

    def record_answer(self, sender: int, metadata: list | None, tensors: list[torch.Tensor]) -> None:
        """The answer to a recorded call came back from ``sender`` with ``tensors`` (before
        they are used)."""
        if metadata is not None:
            record_recv(self._hooks.contexts, metadata, tensors, sender, response=True)

    @contextlib.contextmanager
    def serving(self, sender: int, metadata: list | None, tensors: list[torch.Tensor]) -> Iterator[ServedCall]:
        """Around a call from ``sender`` that carried ``metadata`` and ``tensors``: its
        context (joined here) is current while the function runs."""
        contexts = self._hooks.contexts
        context = record_recv(contexts, metadata, tensors, sender) if metadata is not None else None
        local = contexts._local
        previous = local.context
        local.context = context
        try:
            with self._as_caller(sender):
                yield ServedCall(self, sender, context)
        finally:
            local.context = previous

    def peer_lost(self, worker: int, error: BaseException) -> None:
        """``worker`` is gone for good."""
        self._lost.add(worker)
        self._hooks.peer_lost(worker, error)

    def close(self) -> None:
        """Send the context releases that wait for their batch; no more after this."""
        self._hooks.flush()
        self._closed = True

    @contextlib.contextmanager
    def _as_caller(self, sender: int) -> Iterator[None]:
        """``sender`` is the worker whose call runs on this thread (rpc.current.caller), as
        the RPC agent sets it for the calls it serves."""
        calls = current._calls
        previous = getattr(calls, "rank", None)
        calls.rank = sender
        try:
            yield
        finally:
            calls.rank = previous

    # ------------------------------------------------------------------ AgentPort

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def info(self) -> str:
        return f"worker {self._rank}"

    @property
    def default_timeout(self) -> float:
        return self._timeout

    @property
    def hooks(self) -> AutogradHooks:
        return self._hooks

    @property
    def pool(self) -> _NoPool:
        return self._pool

    @property
    def closed(self) -> bool:
        return self._closed

    def is_lost(self, worker: int) -> bool:
        return worker in self._lost

    def name_of(self, worker: int) -> str:
        return f"worker {worker}"

    def call(self, to: int, function: Callable, args: Any, kwargs: Any, timeout: float, sync: bool = False,
             message_type: MessageType = MessageType.PYTHON_CALL, barrier: bool = False,
             placement: Any = None, posted: tuple[Post, OnAnswer] | None = None) -> torch.futures.Future:
        future = self.send_call(to, function, tuple(args or ()))
        if posted is not None:
            post, on_answer = posted
            future.add_done_callback(lambda done: post(on_answer, *outcome_of(done)))
        return future

    def notify(self, to: int, function: Callable, args: Any, message_type: MessageType, placement: Any = None) -> None:
        self.send_one_way(to, function, tuple(args or ()))

    def call_retrying(self, to: int, function: Callable, args: Any, message_type: MessageType) -> torch.futures.Future:
        return self.send_call(to, function, tuple(args or ()))

    def open_sink(self, post: Post, on_report: OnReport) -> int:
        sink_id = next(self._sink_ids)
        self._sinks[sink_id] = (post, on_report)
        return sink_id

    def close_sink(self, sink_id: int) -> None:
        self._sinks.pop(sink_id, None)

    def report(self, to: int, sink_id: int, value: Any, placement: Any = None) -> None:
        self.send_one_way(to, deliver_report, (sink_id, value))

    def placement_back(self, worker: int, in_response: bool) -> None:
        return None  # tensors travel as the framework sends them

    def home_waiting(self) -> None:
        return None

    def _deliver_report(self, sink_id: int, value: Any, sender: int | None) -> None:
        sink = self._sinks.get(sink_id) if type(sink_id) is int else None
        if sink is None or sender is None:
            log.debug("%s: a report for sink %r, which is closed (or from no worker)", self.info, sink_id)
            return
        post, on_report = sink
        post(on_report, value, None, sender)


@protocol_function
def deliver_report(sink_id: int, value: Any) -> None:
    """On the originator of a pass: a report to one of its sinks (``EmbeddedPort.report``)."""
    port = port_module.current()
    if not isinstance(port, EmbeddedPort):
        raise RpcError("a report for an embedded port came to a worker without one")
    port._deliver_report(sink_id, value, current.caller())


def attach(port: EmbeddedPort) -> None:
    """Make ``port`` this process's port: ``zmqautograd.autograd``'s API works over it."""
    if not isinstance(port, EmbeddedPort):
        raise TypeError(f"attach() needs an EmbeddedPort, got {type(port).__qualname__}")
    port_module.attach_port(port)


def detach() -> None:
    """Stop using the attached port (its releases are sent first: ``EmbeddedPort.close``)."""
    port = port_module._embedded
    if isinstance(port, EmbeddedPort):
        port.close()
    port_module.attach_port(None)


def _log_error(future: torch.futures.Future, to: int, function: Callable) -> None:
    _, error = outcome_of(future)
    if error is not None:
        log.warning("one-way %s to worker %d failed: %s", getattr(function, "__qualname__", function), to, error)


__all__ = ["EmbeddedPort", "ServedCall", "attach", "detach", "deliver_report"]
