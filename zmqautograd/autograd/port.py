"""What distributed autograd needs from the RPC layer under it: ``AgentPort``.

zmqautograd's RPC agent (``zmqautograd.rpc``) is one such port; an embedder's own RPC
framework is another (``embed.py``). The engine reaches the other workers of a context only
through these members: requests that carry gradients (``call``, ``notify``), reports of
forwarded passes (``open_sink``, ``report``), context releases (``call_retrying``), and what
it learns of the group (``is_lost``). Messages the engine sends name functions of its own
(``protocol_function`` in rpc/serialization.py); the port runs them on the receiving worker
and answers with what they return (a future: answer when it completes).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol

import torch

from zmqautograd.transport import MessageType

from ..rpc import current as current_rpc

# ``post(function, *args)``: have the thread that runs a pass run ``function(*args)``;
# ``on_answer(value, error)``: what it runs for an answer or a report.
Post = Callable[..., None]
OnAnswer = Callable[[Any, "BaseException | None"], None]
OnReport = Callable[[Any, "BaseException | None", int], None]  # (value, error, the worker that sent it)


class WorkerPool(Protocol):
    """The threads that serve calls, as far as distributed autograd cares."""

    def owns_current_thread(self) -> bool:
        """Whether this thread serves calls (a call that blocks on it holds others up)."""
        ...

    def blocking(self) -> ContextManager[Any]:
        """Around a wait on a serving thread: another thread serves calls meanwhile."""
        ...

    def has_work(self) -> bool: ...

    def submit(self, function: Callable, *args: Any) -> Any: ...


class AgentPort(Protocol):
    """The members of an RPC agent that distributed autograd uses. Workers are named by
    rank (an int) here; ``placement`` arguments are opaque to autograd (None: the port's
    default placement of tensors)."""

    @property
    def rank(self) -> int: ...

    @property
    def info(self) -> object:
        """This worker, as log lines name it."""
        ...

    @property
    def default_timeout(self) -> float:
        """Seconds; 0 or less: none. The originator of a pass that waits this long with
        nothing in flight fails it."""
        ...

    @property
    def hooks(self) -> Any:
        """Where distributed autograd keeps this worker's state (an ``AutogradHooks``)."""
        ...

    @property
    def pool(self) -> WorkerPool: ...

    @property
    def closed(self) -> bool: ...

    def is_lost(self, worker: int) -> bool:
        """Whether ``worker`` is gone for good (its passes and contexts are failed)."""
        ...

    def name_of(self, worker: int) -> str:
        """The name of ``worker`` (a rank), for errors that name it: also of a worker that
        left the group meanwhile (whose loss an error reports)."""
        ...

    def call(self, to: int, function: Callable, args: Any, kwargs: Any, timeout: float, sync: bool = False,
             message_type: MessageType = MessageType.PYTHON_CALL, barrier: bool = False,
             placement: Any = None, posted: tuple[Post, OnAnswer] | None = None) -> Any:
        """Run ``function(*args)`` on ``to``: a future of its answer. With ``posted`` =
        ``(post, on_answer)`` the answer is handed to ``post(on_answer, value, error)``
        instead (the pass's own thread decodes and handles it)."""
        ...

    def notify(self, to: int, function: Callable, args: Any, message_type: MessageType,
               placement: Any = None) -> None:
        """Run ``function(*args)`` on ``to``, one-way. Raises only when it cannot be sent."""
        ...

    def call_retrying(self, to: int, function: Callable, args: Any, message_type: MessageType) -> torch.futures.Future:
        """``call`` of an idempotent function, retried when it fails to arrive."""
        ...

    def open_sink(self, post: Post, on_report: OnReport) -> int:
        """A sink that ``report`` sends to: ``post(on_report, value, error, sender)`` per
        report, ``sender`` the worker it came from (by its connection, not its payload)."""
        ...

    def close_sink(self, sink_id: int) -> None: ...

    def report(self, to: int, sink_id: int, value: Any, placement: Any = None) -> None:
        """Send ``value`` to the sink ``sink_id`` that ``to`` opened; one-way."""
        ...

    def placement_back(self, worker: int, in_response: bool) -> Any:
        """Where gradients sent to ``worker`` land there: back the way its tensors came (in
        the answer to a call of ours when ``in_response``, else in a call of its own)."""
        ...

    def home_waiting(self) -> tuple[Callable[[Callable[[], bool]], object], Callable[[], object]] | None:
        """How the caller of ``backward()`` waits for its pass's work: ``(wait_until(ready),
        wake())``, where the wait may receive answers itself; None: it blocks on a queue."""
        ...


_embedded: AgentPort | None = None  # attached by embed.attach; else the RPC layer's agent


def current() -> AgentPort:
    """The port of this process: the one an embedder attached, else the running RPC agent
    (RpcNotInitializedError when there is none)."""
    port = _embedded
    if port is not None:
        return port
    return current_rpc.agent()  # (mypy checks here that the RPC layer's Agent is an AgentPort)


def attach_port(port: AgentPort | None) -> None:
    global _embedded
    _embedded = port

