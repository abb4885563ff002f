"""The RPC agent: one per process between ``init_rpc`` and ``shutdown``.

It owns the transport endpoint, the pool that runs incoming calls, the table of pending
calls (futures by message id) and their timeouts. The endpoint's dispatcher thread completes
futures; the pool runs user functions; the endpoint's I/O thread never runs either.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import threading
from _thread import allocate_lock as _allocate_lock
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zmqautograd.transport import (
    DeviceMapError,
    EndpointClosedError,
    Envelope,
    Extension,
    FaultPolicy,
    InjectedFaultError,
    LocalProtocolError,
    Message,
    MessageType,
    PeerLostError,
    TransportError,
    UnknownPeerError,
    cuda_ipc,
)
from zmqautograd.transport import faults as transport_faults
from zmqautograd.transport.endpoint import Endpoint, EndpointOptions
from zmqautograd.transport.security import ENVIRONMENT_VARIABLE as SECRET_VARIABLE
from zmqautograd.transport.security import Membership, secret_bytes
from zmqautograd.transport.tensors import adopt_torch_thread_settings
from zmqautograd.transport.waiter import Waiter

from .. import timers
from . import current
from .devices import DevicePlacement, Placement, decode_maps, encode_maps, validate_device_maps
from .errors import RendezvousError, RpcError, RpcTimeoutError, SerializationError, as_operator_error, user_error
from .functions import check_async_result, is_async_function
from .futures import Future
from .hooks import CallHooks, OutgoingCall, make_call_hooks
from .options import DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT, ZmqRpcBackendOptions
from .pool import ElasticPool
from .rendezvous import Member, Rendezvous, advertise_address
from .rref import RRef, RRefContext
from .serialization import (
    CallablePolicy,
    RpcCodec,
    decode_exception,
    encode_exception,
    encode_function,
    protocol_function,
    resolve_function,
)

log = logging.getLogger(__name__)

_cuda_initialized = torch.cuda.is_initialized  # False: no CUDA tensor can exist in this process

EXT_RREF = 18


# Each request type and the type of its answer (the seeds' names). All requests carry a
# function reference and arguments and run the same way; the types tell them apart on the wire
# (fault injection and retries select by type).
REQUEST_TYPES = {
    MessageType.PYTHON_CALL: MessageType.PYTHON_RET,
    MessageType.PYTHON_REMOTE_CALL: MessageType.REMOTE_RET,
    MessageType.PYTHON_RREF_FETCH_CALL: MessageType.PYTHON_RREF_FETCH_RET,
    MessageType.RREF_FORK_REQUEST: MessageType.RREF_ACK,
    MessageType.RREF_CHILD_ACCEPT: MessageType.RREF_ACK,
    MessageType.RREF_USER_DELETE: MessageType.RREF_ACK,
    MessageType.FORWARD_AUTOGRAD_REQ: MessageType.FORWARD_AUTOGRAD_RESP,
    MessageType.BACKWARD_AUTOGRAD_REQ: MessageType.BACKWARD_AUTOGRAD_RESP,
    MessageType.CLEANUP_AUTOGRAD_CONTEXT_REQ: MessageType.CLEANUP_AUTOGRAD_CONTEXT_RESP,
    MessageType.RREF_BACKWARD_REQ: MessageType.RREF_BACKWARD_RESP,
}
RESPONSE_TYPES = frozenset({*REQUEST_TYPES.values(), MessageType.EXCEPTION})
# Control messages whose receivers are idempotent: retried with backoff when they fail.
RETRYABLE_TYPES = frozenset({
    MessageType.RREF_FORK_REQUEST, MessageType.RREF_CHILD_ACCEPT, MessageType.RREF_USER_DELETE,
    MessageType.CLEANUP_AUTOGRAD_CONTEXT_REQ,
})


_WORKER_NAME = re.compile(r"[A-Za-z0-9\-_:]+")


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's name and id (its rank), as ``torch.distributed.rpc.WorkerInfo``."""

    name: str
    id: int

    def __post_init__(self) -> None:
        # torch's rule and message (WorkerInfo's constructor, rpc/types.cpp).
        if not isinstance(self.name, str) or not _WORKER_NAME.fullmatch(self.name) or len(self.name) >= 128:
            raise RpcError(
                f"Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than 128 chars, "
                f"but got {self.name}"
            )

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    __str__ = __repr__


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

    def __init__(self, timeout: float, waiter: Waiter) -> None:
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
    ``_guard`` orders the two: a registration waits while the I/O thread completes."""

    def __init__(self) -> None:
        super().__init__()
        self._guard = _allocate_lock()
        self._observed = False

    def then(self, callback: Callable) -> torch.futures.Future:
        with self._guard:
            self._observed = True
        return super().then(callback)

    def add_done_callback(self, callback: Callable) -> None:
        with self._guard:
            self._observed = True
        super().add_done_callback(callback)


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

    def __init__(self, post: Callable, on_report: Callable[[Any, BaseException | None], None]) -> None:
        self.post = post
        self.on_report = on_report


# Answers the I/O thread may complete a _CallFuture with: not exceptions (rebuilding one may
# import and run the exception's class) and not autograd answers (they record a recv function).
_PLAIN_RESPONSE_TYPES = frozenset(REQUEST_TYPES.values()) - {MessageType.FORWARD_AUTOGRAD_RESP}
_INLINE_MAX_BYTES = 1 << 16  # bigger answers are decoded on the pool (CUDA copies among them)


@dataclass
class _Pending:
    future: torch.futures.Future | _SyncSlot | _PostedCall
    to: WorkerInfo
    timeout: float
    timer: timers.TimerHandle | None = None  # its timeout, cancelled once the call completes


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


class Agent:
    def __init__(self, name: str, rendezvous: Rendezvous, options: ZmqRpcBackendOptions):
        self.options = options
        self.rank = rendezvous.rank
        self._me = str(self.rank)  # our name on the wire
        self.cuda_ipc = options.cuda_ipc
        self.info = WorkerInfo(name, self.rank)
        self.default_timeout = options.rpc_timeout
        host = advertise_address(rendezvous.master_addr, options.advertise_address)
        secret = options.cluster_secret or os.environ.get(SECRET_VARIABLE) or None
        self._secret = secret_bytes(secret) if secret else None
        # Every connection is a member's, proven in the handshake (transport/security.py).
        self.membership = Membership.generate(self._me, "curve" if options.encrypt else "plain", self._secret)
        self.codec = _make_codec(options.allow_pickle, CallablePolicy(options.allowed_functions))
        self.codec.max_message_bytes = options.max_message_bytes
        self.misdirected_answers = 0  # answers from a peer other than the one asked (dropped)
        self.pool = ElasticPool(options.num_worker_threads, f"rpc-{name}", init_thread=adopt_torch_thread_settings)
        self.rrefs = RRefContext(self)
        # What the layers above add to calls (distributed autograd: rpc/hooks.py).
        self.hooks: CallHooks = make_call_hooks(self)
        self.codec.add_extension(Extension(EXT_RREF, RRef, self.rrefs.encode, self.rrefs.decode))
        self.endpoint = Endpoint(
            str(self.rank),
            f"tcp://{host}:0",
            on_message=self._on_message,
            on_peer_lost=self._on_peer_lost,
            on_send_error=self._on_send_error,
            codec=self.codec,
            options=EndpointOptions(
                heartbeat_interval=options.heartbeat_interval,
                peer_timeout=options.peer_timeout,
                connect_timeout=rendezvous.timeout,
                busy_poll=options.busy_poll,
                lend_min=options.lend_min,
                lend_cache=options.lend_cache,
                shm_ring=options.shm_ring,
                spin=options.spin,
                max_queued_bytes=options.max_queued_bytes,
            ),
            # Requests go from the thread that received them straight to the pool that runs
            # them, and a response to rpc_sync straight to the thread that waits for it.
            executor=self.pool.submit_from,
            on_envelope=self._route_to_waiter,
            faults=FaultPolicy.from_env(options.fault_options()),
            membership=self.membership,
        )
        # An idle pool thread receives itself: a request then wakes the thread that runs it.
        self.pool.receive_while_idle(self.endpoint)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._sinks: dict[int, _ReportSink] = {}  # open report sinks by id (open_sink)
        self._all_done = threading.Condition(self._lock)
        self._done_waiters = 0  # threads in wait_outstanding
        self._stopping = False
        # Peers that finish init_rpc first may call us before our init_rpc has published this
        # agent; their calls wait here until it has (see start_serving).
        self._serving = threading.Event()
        self._arrivals: dict[int, torch.futures.Future] = {}  # the leader's shutdown barrier
        self._barrier_ids: set[int] = set()  # our own pending barrier call
        self._retrying = 0  # retryable control messages not settled yet (call_retrying)
        try:
            members = rendezvous.exchange(name, self.endpoint.address, self._device_record(),
                                          self.membership.own.published(), self.membership.mechanism, self._secret)
            self._set_members(members)
        except BaseException:
            self._close_now("init_rpc failed")
            raise

    def _device_record(self) -> dict:
        """What peers need of our devices: our maps (checked by all), devices, CUDA count."""
        return {
            "maps": encode_maps(self.options.device_maps),
            "devices": [str(d) for d in self.options.devices],
            "count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        }

    def _set_members(self, members: list[Member]) -> None:
        self.workers = {m.name: WorkerInfo(m.name, m.rank) for m in members}
        self.workers_by_id = {info.id: info for info in self.workers.values()}
        names = [m.name for m in members]
        maps = {m.name: decode_maps(m.devices.get("maps", {})) for m in members}
        validate_device_maps(
            names,
            {m.name: int(m.devices.get("count", 0)) for m in members},
            maps,
            {m.name: [torch.device(d) for d in m.devices.get("devices", [])] for m in members},
        )
        self.placement = DevicePlacement(self.info.name, maps)
        sending = self.placement.sending_devices() if self.cuda_ipc and torch.cuda.is_available() else []
        if sending:
            # Before any of our threads or the user's shares or allocates CUDA memory
            # (transport/cuda_ipc.py, "_limbo_anchor"). It initializes CUDA, as TensorPipe does
            # for the devices of its maps.
            cuda_ipc.prepare(sending[0])
        for member in members:
            if member.rank != self.rank:
                try:
                    self.membership.admit(str(member.rank), member.credential)
                except ValueError as exc:
                    raise RendezvousError(f"rank {member.rank} published no usable credentials: {exc}") from None
        self.membership.seal()
        self.endpoint.members_changed()
        for member in members:
            if member.rank != self.rank:
                self.endpoint.add_peer(str(member.rank), member.address)
        for member in members:
            if member.rank != self.rank:
                self.endpoint.wait_for_peer(str(member.rank), self.endpoint.options.connect_timeout)

    # ---------------------------------------------------------------------------- lookup

    def is_lost(self, worker: int) -> bool:
        """Whether the connection to ``worker`` was lost (it will not come back)."""
        return self.endpoint.is_lost(str(worker))

    def placement_back(self, worker: int, in_response: bool) -> Placement:
        """Where tensors sent back to ``worker`` land there (gradients of tensors it sent):
        through the inverse of the device map they arrived through, that of a response
        when ``in_response``, else of a request."""
        name = self.worker_info(worker).name
        return self.placement.request(name) if in_response else self.placement.response(name)

    def home_waiting(self) -> tuple[Callable[[Callable[[], bool]], object], Callable[[], object]]:
        """How a thread that waits for answers should wait: ``(wait_until(ready), wake())``;
        the wait receives from the sockets meanwhile, so an answer usually reaches the very
        thread that waits for it."""
        return self.endpoint.wait_until, self.endpoint.waiter().wake

    def worker_info(self, to: Any) -> WorkerInfo:
        if isinstance(to, WorkerInfo):
            info = self.workers_by_id.get(to.id)
            if info is None or info.name != to.name:
                raise RpcError(f"unknown worker {to}")
            return info
        if isinstance(to, str):
            info = self.workers.get(to)
            if info is None:
                raise RpcError(f"unknown destination worker {to!r}; workers are {sorted(self.workers)}")
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self.workers_by_id.get(to)
            if info is None:
                raise RpcError(f"unknown destination worker id {to}; ids are 0..{len(self.workers) - 1}")
            return info
        raise TypeError(f"'to' must be a worker name, id or WorkerInfo, got {type(to).__qualname__}")

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """As torch's agents: this worker's info, or the named worker's."""
        return self.info if worker_name is None else self.worker_info(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker of the group, by id (torch's ``RpcAgent.get_worker_infos``)."""
        return [self.workers_by_id[rank] for rank in sorted(self.workers_by_id)]

    def get_debug_info(self) -> dict[str, str]:
        """Counters of this agent, as strings (the keys of torch's agents where they apply)."""
        return {
            "num_pending_requests": str(self.outstanding()),
            "thread_pool_size": str(self.pool.thread_count),
            "num_worker_threads": str(self.pool.size),
            "world_size": str(len(self.workers)),
            "rpc_timeout_sec": str(self.default_timeout),
        }

    # --------------------------------------------------------------------------- calling

    def call(
        self, to: Any, function: Callable, args: Any, kwargs: Any, timeout: float, sync: bool = False,
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
        if posted is not None:
            future = _PostedCall(*posted)
        else:
            future = _SyncSlot(timeout, self.endpoint.waiter()) if sync else _CallFuture()
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
        if sync:
            future.message_id = message_id  # its waiter times it out (call_sync)
        elif timeout > 0:
            # Cancelled when the call completes (_take); one that completes before the timer
            # is set here leaves a timer that fires, finds nothing, and is gone.
            pending.timer = timers.call_later(timeout, self._expire, message_id)
        recorded = outgoing is not None and outgoing.collect_tensors
        tensors = [] if recorded else None  # only hooks need them
        try:
            frames = self._encode_to(info, message, tensors, placement)
            if recorded and not sync:
                hooks.call_recorded(info.id, outgoing, tensors, False)
            self._transmit(info, message, frames)
        except BaseException as exc:
            self._claim(message_id)  # never sent: nothing will complete it
            self._not_sent(info, outgoing)
            if isinstance(exc, (TransportError, SerializationError)):
                raise _with_context(exc, f"cannot send a call to {info}") from None
            raise
        if recorded and sync:
            # Recorded while the call is on its way: nothing needs distributed autograd's send
            # function before this thread's wait for the answer ends (a backward pass over it
            # starts after that, on this thread), and the recording then costs no latency.
            # Other calls record first: their answer may start a pass on another thread at once.
            try:
                hooks.call_recorded(info.id, outgoing, tensors, True)
            except BaseException:
                self._claim(message_id)  # its answer, when it comes, is dropped
                raise
        return future

    def _not_sent(self, info: WorkerInfo, outgoing: OutgoingCall | None) -> None:
        if outgoing is not None:
            self.hooks.call_not_sent(info.id, outgoing)

    def _encode_to(self, info: WorkerInfo, message: Message, tensors: list | None,
                   placement: Placement | None) -> list:
        """The frames of a message we start (a call, a one-way call, a report) to ``info``:
        CUDA tensors land by ``placement``, by default our device map to that worker."""
        return self._encode(info.id, message, tensors, placement or self.placement.request(info.name),
                            self._cuda_ipc_to(info.id))

    def _encode(self, to: int | None, message: Message, tensors: list | None, placement: Placement | None,
                cuda_ipc: bool) -> list:
        """``codec.encode`` for a message to worker ``to`` (None: no member), noting where the
        RRef forks made while encoding it go, or taking them back if it cannot be encoded
        (rref.py: a lost worker's forks are let go)."""
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
        return frames

    def _cuda_ipc_to(self, peer: int | str) -> bool:
        """Whether CUDA tensors for ``peer`` (its rank, or its name on the wire) go by CUDA IPC
        (transport/cuda_ipc.py): it is another process of this host, and this process uses
        CUDA at all (cheap tests first, that spare CPU-only calls the lookup)."""
        return self.cuda_ipc and _cuda_initialized() and self.endpoint.reads_our_memory(str(peer))

    def _transmit(self, info: WorkerInfo, message: Message, frames: list) -> None:
        """Hand an encoded request to the transport, or to our own pool for a self call
        (fault injection applies to both, as in torch's faulty agent)."""
        if info.id != self.rank:
            self.endpoint.send_encoded(str(info.id), message.id, frames, message.type)
            return
        transport_faults.apply(self.endpoint.faults, str(self.rank), message.type,
                               lambda: self.pool.submit(self._serve, self._loopback(frames)), str(self.rank))

    def call_retrying(self, to: Any, function: Callable, args: Any, message_type: MessageType) -> torch.futures.Future:
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

    def _retried(self, _: Any) -> None:
        with self._lock:
            self._retrying -= 1
            self._all_done.notify_all()

    def notify(self, to: Any, function: Callable, args: Any, message_type: MessageType,
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

    def open_sink(self, post: Callable, on_report: Callable[[Any, BaseException | None], None]) -> int:
        """Open a report sink (_ReportSink): its id, which peers pass to ``report``. Each
        report is handled by ``post(function, *args)`` running ``on_report(value, error)``
        (error: a report that cannot be decoded)."""
        sink_id = next(self._ids)  # never the id of a call: both count on one counter
        self._sinks[sink_id] = _ReportSink(post, on_report)
        return sink_id

    def close_sink(self, sink_id: int) -> None:
        self._sinks.pop(sink_id, None)

    def report(self, to: Any, sink_id: int, value: Any, placement: Placement | None = None) -> None:
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

    def _report_sink(self, message_id: int, sender: str) -> tuple[_ReportSink, WorkerInfo] | None:
        """The open sink an answer with no pending call reports to, and the member that sent
        it; None if it is no report (a late answer, or from no member)."""
        sink = self._sinks.get(message_id) if self._sinks else None
        if sink is None or not sender.isdigit():
            return None
        info = self.workers_by_id.get(int(sender))
        return None if info is None else (sink, info)

    def call_sync(
        self, to: Any, function: Callable, args: Any, kwargs: Any, timeout: float,
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

    def _wait(self, slot: _SyncSlot) -> None:
        if not self.endpoint.wait_until(slot.done, slot.timeout if slot.timeout > 0 else None):
            self._expire(slot.message_id)  # fails it, unless it completed meanwhile
            self.endpoint.wait_until(slot.done)  # complete now, or at once: whoever took it completes it

    def _route_to_waiter(self, peer: str, envelope: Envelope) -> bool:
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
            found = self._report_sink(envelope.id, envelope.sender)
            if found is None:
                return False
            sink, sender = found
            sink.post(self._answer_posted, envelope, sender, sink.on_report)
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
        if type(future) is not _CallFuture or envelope.type not in _PLAIN_RESPONSE_TYPES \
                or envelope.nbytes > _INLINE_MAX_BYTES:
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
            value, error = self._response_value(Message(envelope.type, envelope.id, envelope.sender, payload, tensors), pending.to)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        return True

    def _answer_posted(self, envelope: Envelope, to: WorkerInfo, on_answer: Callable) -> None:
        """A _PostedCall's answer, on the thread it was posted to."""
        value, error = self._decode_response(envelope, to)
        on_answer(value, error)

    def _decode_response(self, envelope: Envelope, to: WorkerInfo) -> tuple[Any, BaseException | None]:
        tensors: list = []
        try:
            payload = self.codec.decode_payload(envelope, tensors)
        except Exception as exc:
            return None, SerializationError(f"cannot decode the response from {to}: {exc}")
        return self._response_value(Message(envelope.type, envelope.id, envelope.sender, payload, tensors), to)

    def _response_value(self, message: Message, to: WorkerInfo) -> tuple[Any, BaseException | None]:
        """A response's value or error; a hooked answer goes through the hooks first."""
        payload = message.payload
        if message.type is MessageType.EXCEPTION:
            return None, decode_exception(payload["exc"], repr(to))
        if message.type is MessageType.FORWARD_AUTOGRAD_RESP:
            try:
                self.hooks.answer_arrived(to.id, payload, message.tensors or [])
            except Exception as exc:
                return None, SerializationError(f"cannot record the autograd metadata of the response from {to}: {exc}")
        return payload["v"], None

    def _loopback(self, frames: list) -> Message:
        """A message to ourselves goes through the codec like any other, so that the receiver
        sees copies of its tensors, as it would from another worker."""
        return self.codec.decode([bytearray(memoryview(f)) for f in frames])

    # ------------------------------------------------------------------------- receiving

    def _on_message(self, message: Message) -> None:
        """On a pool thread (the endpoint's executor)."""
        kind = message.type
        if kind in REQUEST_TYPES:
            self._serve(message)
        elif kind in RESPONSE_TYPES:
            self._complete(message)
        else:
            log.warning("%s: unexpected %s from %s", self.info, kind.name, message.sender)

    def start_serving(self) -> None:
        self._serving.set()

    def _serve(self, message: Message) -> None:
        """Run a call on a pool thread and send its result or exception back."""
        if not self._serving.is_set():
            self._serving.wait(self.endpoint.options.connect_timeout)
        served = self._run_call(message)
        if served is not None:
            try:
                self.hooks.call_answered(served)
            except Exception:  # noqa: BLE001 - never the call's failure
                log.exception("%s: the hooks failed after call %d from %s", self.info, message.id, message.sender)

    def _run_call(self, message: Message) -> Any:
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
            exc = user_error(exc)
            if function is not None:
                exc = as_operator_error(function, exc)
            self._reply(message, None, exc, served)
            return served
        if is_async_function(function):  # and done already (a backward pass that ran to its end here)
            self._answer_with(message, result, served)
        else:
            self._reply(message, result, None, served)
        return served

    def _answer_with(self, request: Message, done: torch.futures.Future, served: Any) -> None:
        try:
            value = done.value()
        except Exception as exc:
            self._reply(request, None, exc, served)
            return
        self._reply(request, value, None, served)

    def _reply(self, request: Message, value: Any, error: BaseException | None, served: Any) -> None:
        """Send a call's result (or its error) back to the caller; the hooks may add to a
        result (distributed autograd records it: its tensors may require grad)."""
        to = request.sender
        me = self._me
        if request.payload.get("n"):  # one-way (notify): nobody waits for an answer
            if error is not None:
                log.warning("%s: one-way %s from %s failed: %s", self.info, request.type.name, to, error)
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
        try:
            tensors = [] if hooked is not None else None  # only the hooks need them
            caller = self.workers_by_id.get(int(to)) if to.isdigit() else None
            frames = self._encode(caller.id if caller else None, reply, tensors,
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

    def _send_answer(self, to: str, message_id: int, frames: list, message_type: MessageType) -> None:
        try:
            self.endpoint.send_encoded(to, message_id, frames, message_type)
        except TransportError as exc:
            log.warning("%s: could not answer call %d from %s: %s", self.info, message_id, to, exc)

    def _misdirected(self, pending: _Pending | None, peer: str, kind: MessageType, message_id: int) -> bool:
        """Whether ``peer``'s answer (or refusal) to call ``message_id`` (``pending``, if it
        still waits) is for a call that went to another worker: then it is a protocol error,
        counted and logged, never delivered (the call still waits for its callee)."""
        if pending is None or str(pending.to.id) == peer:
            return False
        self.misdirected_answers += 1
        self.endpoint.note_protocol_error(
            peer, f"{kind.name} to call {message_id}, which went to {pending.to}, not to this peer: dropped")
        return True

    def _complete(self, message: Message) -> None:
        if self._misdirected(self._pending.get(message.id), str(message.sender), message.type, message.id):
            return
        pending = self._claim(message.id)
        if pending is None:
            found = self._report_sink(message.id, message.sender)
            if found is not None:  # a report (not received by _route_to_waiter)
                sink, sender = found
                sink.post(sink.on_report, *self._response_value(message, sender))
                return
            log.debug("%s: late or unknown response %d (timed out?)", self.info, message.id)
            return
        value, error = self._response_value(message, pending.to)
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(value)

    def _on_send_error(self, peer: str, message_id: int, error: Exception) -> None:
        if self._misdirected(self._pending.get(message_id), peer, MessageType.PROTOCOL_ERROR, message_id):
            return
        pending = self._claim(message_id)
        if pending is not None:
            pending.future.set_exception(error)

    def _on_peer_lost(self, peer: str, error: PeerLostError) -> None:
        with self._lock:
            lost = [(i, p) for i, p in self._pending.items() if str(p.to.id) == peer]
            for message_id, _ in lost:
                self._take(message_id)
        for _, pending in lost:
            pending.future.set_exception(PeerLostError(peer, f"call to {pending.to} failed: {error}"))
        if self._arrivals:  # the others wait at the shutdown barrier for someone who is gone
            self._release_arrivals(PeerLostError(peer, f"shutdown: {error}"))
        if not peer.isdigit():  # workers are named by rank; anything else is no member
            return
        self.hooks.peer_lost(int(peer), error)  # (distributed autograd: its passes and contexts)
        # Forks it held of our values, and our RRefs kept for it (rref.py).
        self.rrefs.peer_lost(int(peer), error)

    # -------------------------------------------------------------------------- timeouts

    def _expire(self, message_id: int) -> None:
        """On the timer thread, at a call's deadline: fail it if it is still pending."""
        pending = self._claim(message_id)
        if pending is not None:
            pending.future.set_exception(RpcTimeoutError(
                f"RPC ran for more than set timeout ({pending.timeout * 1000:.0f} ms) "
                f"and will now be marked with an error (call to {pending.to})"
            ))

    # -------------------------------------------------------------------------- shutdown

    # ------------------------------------------------------------- the shutdown barrier

    def shutdown_barrier(self, timeout: float | None) -> None:
        """Every worker calls the leader (rank 0); the leader answers them all once everyone has
        arrived (torch's _wait_all_workers). A lost peer fails the wait, on every worker."""
        self.call_sync(0, _arrive_at_shutdown, (self.rank,), None, timeout or 0, barrier=True)

    def _arrive(self, rank: int) -> torch.futures.Future:
        """On the leader: one future per arrival, all completed once everyone has arrived."""
        arrival: torch.futures.Future = Future()
        with self._lock:
            self._arrivals[rank] = arrival
            everyone = len(self._arrivals) == len(self.workers)
        lost = [peer for peer, state in self.endpoint.peers().items() if state == "lost"]
        if lost:  # someone who can never arrive
            self._release_arrivals(RpcError(f"shutdown: lost worker(s) {', '.join(sorted(lost))}"))
        elif everyone:
            self._release_arrivals(None)
        return arrival

    def _release_arrivals(self, error: Exception | None) -> None:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, {}
        # The leader's own arrival last: its shutdown closes the endpoint, and by then the
        # answers to everyone else must be queued (close sends what is queued first).
        for rank in sorted(arrivals, key=lambda r: r == self.rank):
            arrival = arrivals[rank]
            if error is None:
                arrival.set_result(True)
            else:
                arrival.set_exception(error)

    @property
    def closed(self) -> bool:
        return self._stopping

    def outstanding(self) -> int:
        with self._lock:
            return len(self._pending)

    def _claim(self, message_id: int) -> _Pending | None:
        """Take a pending call out of the table to complete it: of all who may complete a call
        (its answer, its timeout, a send error, a lost peer, shutdown), only the one that gets
        it here does. None when someone else did."""
        with self._lock:
            return self._take(message_id)

    def _take(self, message_id: int) -> _Pending | None:
        """Remove a pending call (caller holds the lock) and wake wait_outstanding."""
        pending = self._pending.pop(message_id, None)
        if pending is not None:
            if pending.timer is not None:
                pending.timer.cancel()
            self._barrier_ids.discard(message_id)
            if self._done_waiters:  # (a notify costs ~1 us; nobody waits but at shutdown)
                self._all_done.notify_all()
        return pending

    def wait_outstanding(self, timeout: float | None) -> bool:
        """Wait until every call this worker made has completed (None: no limit; calls end by
        themselves: answered, timed out, or failed when their peer is lost), RRef deletions
        included; False on timeout."""
        if not self.rrefs.flush_releases(timeout):
            return False
        self.hooks.flush()  # what waits to ride on later calls
        with self._lock:
            self._done_waiters += 1
            try:
                return self._all_done.wait_for(
                    lambda: len(self._pending) <= len(self._barrier_ids) and self._retrying == 0, timeout
                )
            finally:
                self._done_waiters -= 1

    def _close_now(self, reason: str, drain: float = 10.0) -> None:
        self._serving.set()  # release calls that were waiting for an init that failed
        with self._lock:
            self._stopping = True
            pending, self._pending = self._pending, {}
            self._all_done.notify_all()
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(RpcError(f"call to {p.to} abandoned: {reason}"))
        # Calls already running finish first and queue their answers (the shutdown barrier's
        # among them); only then does the endpoint close, sending what is queued.
        self.pool.shutdown(timeout=drain)
        self.rrefs.stop_releasing()
        self.endpoint.close()


def _make_codec(allow_pickle: bool | None, policy: CallablePolicy) -> RpcCodec:
    """The pickle policy. Only members connect (every connection is authenticated), so by
    default pickles are accepted from them, as torch does, unless ``allowed_functions``
    restricts what they may run: a pickle can run anything it names."""
    if allow_pickle is not None:
        return RpcCodec(allow_pickle=allow_pickle, policy=policy)
    return RpcCodec(
        allow_pickle=True, accept_pickle=not policy.restricted, policy=policy,
        refusal="this worker restricts what peers may run (allowed_functions), and a pickle can run anything; "
                "send msgpack-able values, or set allow_pickle=True to accept pickles all the same",
    )


@protocol_function
def _arrive_at_shutdown(rank: int) -> torch.futures.Future:
    """On the leader: a worker arrived; which one, its connection says (``rank``, what its
    payload says, only for a call that came over none)."""
    caller = current.caller()
    return current.agent()._arrive(rank if caller is None else caller)


_arrive_at_shutdown._wrapped_async_rpc_function = _arrive_at_shutdown


def _with_context(exc: Exception, context: str) -> Exception:
    """The same error type with where it happened in front (types are kept for catching)."""
    try:
        if isinstance(exc, PeerLostError) or hasattr(exc, "peer"):
            return type(exc)(exc.peer, f"{context}: {exc}")
        return type(exc)(f"{context}: {exc}")
    except TypeError:
        return RpcError(f"{context}: {exc}")
