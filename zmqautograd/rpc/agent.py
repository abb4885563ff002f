"""The RPC agent: one per process between ``init_rpc`` and ``shutdown``.

It owns the transport endpoint, the pool that runs incoming calls, the table of pending
calls (futures by message id) and their timeouts. The endpoint's dispatcher thread completes
futures; the pool runs user functions; the endpoint's I/O thread never runs either.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zmqautograd.transport import (
    Envelope,
    Extension,
    FaultPolicy,
    MessageType,
    PeerDepartedError,
    PeerLostError,
    cuda_ipc,
)
from zmqautograd.transport import descriptors
from zmqautograd.transport.endpoint import Endpoint
from zmqautograd.transport.security import Membership
from zmqautograd.transport.tensors import adopt_torch_thread_settings

from . import current
from .answers import Answers
from .calls import Calling, _CallDeadlines, _Pending, _ReportSink
from .devices import DevicePlacement, Placement, decode_maps, encode_maps, validate_device_maps
from .errors import RendezvousError, RpcError
from .functions import answered_when_done
from .futures import Future
from .hooks import CallHooks, make_call_hooks
from .options import ZmqRpcBackendOptions
from .pool import ElasticPool
from .refusals import PeerLog
from .membership import DynamicGroup
from .message_types import REQUEST_TYPES
from .rendezvous import Member, Rendezvous, advertise_address
from .rref import RRef
from .rref_context import RRefContext
from .serialization import (
    CallablePolicy,
    RpcCodec,
    protocol_function,
)
from .serving import Serving

log = logging.getLogger(__name__)


EXT_RREF = 18


_WORKER_NAME = re.compile(r"[A-Za-z0-9\-_:]+")
# Calls a worker may refuse when too many from one peer wait (Agent._queue_call). A refused
# remote() or forward-autograd call fails on the caller as a failed send does.
_REFUSABLE = frozenset({MessageType.PYTHON_CALL, MessageType.PYTHON_REMOTE_CALL, MessageType.FORWARD_AUTOGRAD_REQ})


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


class Agent(Calling, Answers, Serving):
    def __init__(self, name: str, rendezvous: Rendezvous | DynamicGroup, options: ZmqRpcBackendOptions,
                 secret: bytes | None):
        self.options = options
        self.rank = rendezvous.rank
        self._me = str(self.rank)  # our name on the wire
        self.cuda_ipc = options.cuda_ipc
        self.info = WorkerInfo(name, self.rank)
        self.default_timeout = options.rpc_timeout
        host = advertise_address(rendezvous.master_addr, options.advertise_address)
        self._secret = secret  # the cluster secret (cluster_secret.py); None only with insecure_store
        # Every connection is a member's, proven in the handshake (transport/security.py).
        self.membership = Membership.generate(self._me, "curve" if options.encrypt else "plain", self._secret)
        self.codec = _make_codec(options.allow_pickle, CallablePolicy(options.allowed_functions))
        self.codec.max_message_bytes = options.max_message_bytes
        self.misdirected_answers = 0  # answers from a peer other than the one asked (dropped)
        self.peer_log = PeerLog(log)  # failures of what peers sent: once per peer, then at debug level
        self._max_queued_calls = options.max_queued_calls
        self.pool = ElasticPool(options.num_worker_threads, f"rpc-{name}", init_thread=adopt_torch_thread_settings)
        self.rrefs = RRefContext(self)
        # What the layers above add to calls (distributed autograd: rpc/hooks.py).
        self.hooks: CallHooks = make_call_hooks(self)
        # RRefs nested in pickled objects travel the same way, forked for the receiver.
        self.codec.add_extension(Extension(EXT_RREF, RRef, self.rrefs.encode, self.rrefs.decode), in_pickles=True)
        self.endpoint = Endpoint(
            str(self.rank),
            f"tcp://{host}:0",
            on_message=self._on_message,
            on_peer_lost=self._on_peer_lost,
            on_send_error=self._on_send_error,
            codec=self.codec,
            options=options.endpoint_options(rendezvous.timeout),
            # Requests go from the thread that received them straight to the pool that runs
            # them, and a response to rpc_sync straight to the thread that waits for it.
            executor=self._queue_call,
            on_envelope=self._route_to_waiter,
            faults=FaultPolicy.from_env(options.fault_options()),
            membership=self.membership,
        )
        # An idle pool thread receives itself: a request then wakes the thread that runs it.
        self.pool.receive_while_idle(self.endpoint)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        # Deadlines of pending calls that share one timeout, in order, under one timer
        # (calls.py, "_CallDeadlines").
        self._deadlines = _CallDeadlines()
        self._ids = itertools.count(1)
        self._sinks: dict[int, _ReportSink] = {}  # open report sinks by id (open_sink)
        self._all_done = threading.Condition(self._lock)
        self._done_waiters = 0  # threads in wait_outstanding
        self._stopping = False
        # Peers that finish init_rpc first may call us before our init_rpc has published this
        # agent; their calls wait until it has (_decoded_once_serving, start_serving).
        self._serving = threading.Event()
        self._arrivals: dict[int, torch.futures.Future] = {}  # the leader's shutdown barrier
        self._barrier_ids: set[int] = set()  # our own pending barrier call
        self._retrying = 0  # retryable control messages not settled yet (call_retrying)
        # A dynamic group (init_rpc without world_size: membership.py), else None.
        self.group = rendezvous if isinstance(rendezvous, DynamicGroup) else None
        # rank -> its member's join event number (the group's watcher keeps it; None: static)
        self._incarnations = rendezvous.joined if isinstance(rendezvous, DynamicGroup) else None
        self._members: dict[str, Member] = {}
        self._departed: dict[str, str] = {}  # name -> how a member of a dynamic group went
        self._former_names: dict[int, str] = {}  # rank -> name of the member that left it
        try:
            members = rendezvous.exchange(name, self.endpoint.address, self._device_record(),
                                          self.membership.own.published(), self.membership.mechanism, self._secret)
            self._set_members(members)
            if self.group is not None:
                # A worker of this rank may have been here before (restarted): ids made here
                # (RRefs, autograd contexts) must not be any it made, which may live on.
                self.rrefs.start_ids(self.group.event)
                self.hooks.joined(self.group.event)
        except BaseException:
            self._close_now("init_rpc failed")
            raise

    def _device_record(self) -> dict:
        """What peers need of our devices: our maps (checked by all), devices, CUDA count."""
        return {
            "maps": encode_maps(self.options.device_maps or {}),  # (dicts and lists once the options are made)
            "devices": [str(d) for d in self.options.devices or []],
            "count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        }

    def _set_members(self, members: list[Member]) -> None:
        self._admit(members)
        if self.group is None:
            self.membership.seal()  # nobody else: credentials of anybody else are refused
        self.endpoint.members_changed()
        for member in members:
            if member.rank != self.rank:
                self.endpoint.add_peer(str(member.rank), member.address)
        if self.group is not None:
            self.group.watch(self._member_joined, self._member_left)
        for member in members:
            if member.rank != self.rank:
                self._wait_for_member(member)

    def _admit(self, members: list[Member]) -> None:
        """Make ``members`` the group (all of it, or, joining a dynamic group, more of it):
        their names, device maps, credentials."""
        everyone = {**self._members, **{m.name: m for m in members}}
        validate_device_maps(
            list(everyone),
            {m.name: int(m.devices.get("count", 0)) for m in everyone.values()},
            {m.name: decode_maps(m.devices.get("maps", {})) for m in everyone.values()},
            {m.name: [torch.device(d) for d in m.devices.get("devices", [])] for m in everyone.values()},
        )
        for member in members:
            if member.rank != self.rank:
                try:
                    self.membership.admit(str(member.rank), member.credential)
                except ValueError as exc:
                    raise RendezvousError(f"rank {member.rank} published no usable credentials: {exc}") from None
        self._set_workers(everyone)

    def _set_workers(self, members: dict[str, Member]) -> None:
        # New dicts, never changed in place: calls read them without a lock.
        self._members = members
        self.placement = DevicePlacement(self.info.name, {m.name: decode_maps(m.devices.get("maps", {}))
                                                          for m in members.values()})
        self.workers = {m.name: WorkerInfo(m.name, m.rank) for m in members.values()}
        self.workers_by_id = {info.id: info for info in self.workers.values()}
        sending = self.placement.sending_devices() if self.cuda_ipc and torch.cuda.is_available() else []
        if sending:
            # Before any of our threads or the user's shares or allocates CUDA memory
            # (transport/cuda_ipc.py, "_limbo_anchor"). It initializes CUDA, as TensorPipe does
            # for the devices of its maps.
            cuda_ipc.prepare(sending[0])

    def _wait_for_member(self, member: Member) -> None:
        peer, timeout = str(member.rank), self.endpoint.options.connect_timeout
        if self.group is None:
            try:
                self.endpoint.wait_for_peer(peer, timeout)
            except PeerDepartedError as exc:
                # It joined, and shut down before we finished joining (torch's
                # test_local_shutdown): a member that left, whose calls fail saying so.
                log.info("%s: %s left the group while this worker joined: %s", self.info, member.name, exc)
            return
        # A dynamic group's member may leave while we join: its event ends the wait.
        deadline = time.monotonic() + timeout
        while self._members.get(member.name) is member:
            try:
                self.endpoint.wait_for_peer(peer, min(0.05, max(deadline - time.monotonic(), 0.0)))
                return
            except PeerLostError as exc:
                log.info("%s: %s left the group while this worker joined: %s", self.info, member.name, exc)
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise RendezvousError(descriptors.explained(
                        f"{self.info}: member {member.name} (rank {member.rank}) of the group "
                        f"did not connect within {timeout} s")) from None

    # ------------------------------------------------------------------ dynamic groups

    def _member_joined(self, member: Member) -> None:
        """A worker joined our dynamic group (membership.py; on its watcher thread): admitted
        before its handshake with us can finish."""
        known = self._members.get(member.name)
        if known is not None and known.rank == member.rank and known.credential == member.credential:
            return
        peer = str(member.rank)
        self._admit([member])
        self._departed.pop(member.name, None)
        self.endpoint.forget_peer(peer)  # a rank that left and comes back
        self.endpoint.members_changed()
        self.endpoint.add_peer(peer, member.address)

    def _member_left(self, rank: int, how: str) -> None:
        """A member of our dynamic group left (``how``: "leave") or was lost ("lost")."""
        info = self.workers_by_id.get(rank)
        if info is None:
            return
        self._departed[info.name] = how
        self._former_names[rank] = info.name
        self._set_workers({name: m for name, m in self._members.items() if m.rank != rank})

    def leave_group(self) -> None:
        """Shutting down in a dynamic group: tell the group (the log), once."""
        group, self.group = self.group, None
        if group is not None:
            group.stop()
            if group.event:  # (a join refused never published one: its rank may be another's)
                group.leave()

    # ---------------------------------------------------------------------------- lookup

    def incarnation_of(self, worker: int) -> int:
        """Which worker of rank ``worker`` is a member now: 0 in a static group; in a dynamic
        one the number of its join event (-1: none), which its RRef ids carry above bit 32."""
        joined = self._incarnations
        return 0 if joined is None else joined.get(worker, -1)

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
                raise RpcError(f"could not find destination {to}: no such worker in the group")
            return info
        if isinstance(to, str):
            info = self.workers.get(to)
            if info is None:
                how = self._departed.get(to)
                if how is not None:
                    raise RpcError(f"could not find destination worker {to!r}: it left the group ({how}); "
                                   f"workers are {sorted(self.workers)}")
                raise RpcError(f"could not find destination worker {to!r}; workers are {sorted(self.workers)}")
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self.workers_by_id.get(to)
            if info is None:
                raise RpcError(f"could not find destination worker id {to}; ids are {sorted(self.workers_by_id)}")
            return info
        # torch's type and message (rpc/api.py, _to_worker_info).
        raise ValueError(f"Cannot get WorkerInfo from name {to}: a worker is named by its name, id or WorkerInfo")

    def name_of(self, worker: int) -> str:
        """The name of rank ``worker``, also after it left the group (errors that report its
        loss may be made after its departure was read from the group's log)."""
        info = self.workers_by_id.get(worker)
        if info is not None:
            return info.name
        return self._former_names.get(worker, f"rank {worker}")

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """As torch's agents: this worker's info, or the named worker's."""
        return self.info if worker_name is None else self.worker_info(worker_name)

    def _get_device_map(self, to: Any) -> dict[torch.device, torch.device]:
        """torch's ``RpcAgent._get_device_map(WorkerInfo)``: this worker's device map for
        tensors sent to ``to`` (its devices -> ``to``'s); empty when none is set."""
        name = self.worker_info(to).name
        return dict((self.options.device_maps or {}).get(name, {}))

    def _queue_call(self, function: Callable, peer: str, envelope: Envelope) -> str | None:
        """The endpoint's executor: queue a message for the pool, fairly by peer; a call from
        a peer with ``max_queued_calls`` calls waiting here already is refused instead (the
        reason is returned; the endpoint answers it at once and the caller's call fails with
        ``PeerOverloadedError``): a flooding peer gets an error, not this worker's memory.
        Only calls are refused (never answers, backward passes or RRef bookkeeping)."""
        bound = self._max_queued_calls
        if bound and envelope.type in _REFUSABLE and self.pool.queued_from(peer) >= bound:
            info = self.workers_by_id.get(int(peer)) if peer.isdigit() else None
            caller = info.name if info is not None else repr(peer)
            return (f"{self.info.name} refused a call from {caller}: {bound} calls of {caller}'s already wait "
                    f"there to run (max_queued_calls)")
        if not self._serving.is_set() and envelope.type in REQUEST_TYPES:
            function = self._decoded_once_serving(function)
        self.pool.submit_from(function, peer, envelope)
        return None

    def _decoded_once_serving(self, deliver: Callable[[str, Envelope], None]) -> Callable[[str, Envelope], None]:
        """A request from a peer that finished init_rpc before us is decoded (on its pool
        thread) once our init_rpc has published this agent: its payload may hold RRefs, and
        unpickling one needs the current agent."""
        def deliver_once_serving(peer: str, envelope: Envelope) -> None:
            self._serving.wait(self.endpoint.options.connect_timeout)
            deliver(peer, envelope)
        return deliver_once_serving

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker of the group, by id (torch's ``RpcAgent.get_worker_infos``)."""
        return [self.workers_by_id[rank] for rank in sorted(self.workers_by_id)]

    def get_debug_info(self) -> dict[str, str]:
        """Counters of this agent, as strings (the keys of torch's agents where they apply)."""
        return {
            "num_pending_requests": str(self.outstanding()),
            "thread_pool_size": str(self.pool.thread_count),
            "agent.thread_pool_size": str(self.pool.size),  # torch's key: the threads asked for
            "num_worker_threads": str(self.pool.size),
            "world_size": str(len(self.workers)),
            "rpc_timeout_sec": str(self.default_timeout),
        }

    # ------------------------------------------------------------------------ lost peers

    def _on_peer_lost(self, peer: str, error: PeerLostError) -> None:
        with self._lock:
            lost = [(i, p) for i, p in self._pending.items() if str(p.to.id) == peer]
            for message_id, _ in lost:
                self._take(message_id)
        for _, pending in lost:  # (of the error's type: a peer that departed says so)
            pending.future.set_exception(type(error)(peer, f"call to {pending.to} failed: {error}"))
        if self._arrivals:  # the others wait at the shutdown barrier for someone who is gone
            self._release_arrivals(PeerLostError(peer, f"shutdown: {error}"))
        if not peer.isdigit():  # workers are named by rank; anything else is no member
            return
        group = self.group
        if group is not None and not isinstance(error, PeerDepartedError) and int(peer) in self.workers_by_id:
            # Lost without a goodbye: the group's log says so, for whoever joins next.
            group.lost(int(peer))
        self.hooks.peer_lost(int(peer), error)  # (distributed autograd: its passes and contexts)
        # Forks it held of our values, and our RRefs kept for it (rref.py).
        self.rrefs.peer_lost(int(peer), error)

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
        self.leave_group()  # (a dynamic group's; before the goodbyes, so joiners skip us)
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
@answered_when_done
def _arrive_at_shutdown(rank: int) -> torch.futures.Future:
    """On the leader: a worker arrived; which one, its connection says (``rank``, what its
    payload says, only for a call that came over none)."""
    caller = current.caller()
    return current.agent()._arrive(rank if caller is None else caller)
