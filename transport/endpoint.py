"""A ZeroMQ endpoint: one ROUTER socket per worker, guarded by one socket lock.

Threads:

* the **I/O thread** owns the endpoint's auxiliary sockets (the inproc wake-up socket, the
  monitor socket, the ZAP socket) and does everything on the ROUTER except the sending of
  application messages: it receives, validates envelopes, answers transport control messages,
  sends heartbeats, connects and watches for dead peers.
* the **dispatcher thread** decodes payloads and runs the user's callbacks, so a slow handler
  never stalls the socket. Messages of one peer reach ``on_message`` in the order they were
  sent; a peer's loss is reported after every message that arrived from it.
* **waiting threads** (the dispatcher when it delivers messages, callers of :meth:`recv` and
  :meth:`Endpoint.wait_until`) receive from the ROUTER themselves while they wait, exactly as
  the I/O thread would, so the message a thread waits for usually wakes that thread directly
  instead of the I/O thread, which would then have to wake it (transport/waiter.py).
* any other thread may call :meth:`Endpoint.send`: it encodes the message on its own thread and
  sends it on the ROUTER itself, holding the socket lock (or, when older messages still wait
  in the outbox, appends it there and wakes the I/O thread).

The ROUTER is used by one thread at a time, never concurrently: every use happens under
``_socket_lock``, which is also the full memory barrier libzmq asks for when a socket moves
between threads. The I/O thread does not block inside libzmq on the ROUTER: it polls the
socket's ``ZMQ_FD`` (a plain file descriptor), so it holds the lock only while it works. This
saves the thread hand-over per message that a socket-owning I/O thread costs (two context
switches and a GIL hand-over on every send, measured in docs/transport.md). ``ZMQ_FD`` is
edge-triggered: any use of the socket may consume its signal, so a thread that sent checks
``ZMQ_EVENTS`` afterwards and wakes the I/O thread when input is waiting; the I/O thread
checks it before it sleeps.

Connections: between two endpoints exactly one connects (the one whose identity sorts first,
when both use :meth:`Endpoint.add_peer`) and sends HELLO; the other answers HELLO. ZeroMQ's
``CONNECT_ROUTING_ID`` makes the connecting side able to send at once; the accepting side
holds messages for that peer until its HELLO arrives. ``ROUTER_MANDATORY`` makes a send to a
peer without a connection an error, never a silent drop.

Opt-in busy polling (``EndpointOptions.busy_poll``): after application traffic the I/O thread
keeps polling, yielding its CPU between polls, instead of sleeping, for that long; where waking
a sleeping thread is slow (VMs), answers then find a thread already running (docs/transport.md).
With peers on shared-memory rings (transport/shm.py) it does so for ``EndpointOptions.spin``
at least, and waiting threads spin that long before they sleep.

Peer loss is detected three ways, whichever is first: the connection closes (monitor events;
immediate when a process dies), nothing heard for ``peer_timeout`` (application heartbeats,
which also work through a network that silently drops), or the peer says GOODBYE on close.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import itertools
import logging
import os
import queue
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import faults
from .codec import CONTROL_TYPES as _CONTROL_TYPES
from .codec import Codec, Envelope, ExtensionNotDecoded, Message, MessageType, _peek_message_id
from .faults import FaultPolicy
from . import lending, shm, staging
from .lending import DEFAULT_LEND_CACHE, DEFAULT_LEND_MIN, LentFrame, Reader
from .security import ZAP_ENDPOINT, ClusterKeys, Membership, NotYetKnown, Refusal, zap_refusal
from .tensors import adopt_torch_thread_settings
from .waiter import IoPoller, LockWaiter, Waiter, new_waiter
from .errors import (
    DeviceMapError,
    EndpointClosedError,
    LocalProtocolError,
    PeerLostError,
    ProtocolError,
    RemoteProtocolError,
    TransportError,
    UnknownPeerError,
)

log = logging.getLogger(__name__)

_RECV_BATCH = 256  # messages received per loop turn before the outbox gets a look again
_RING_READS = 16  # reads of one ring per turn (a writer that never stops cannot hold us)
_RING_CHUNK = 1 << 20  # bytes taken from a ring per read
_ZERO_COPY_MIN = 1 << 16  # smaller messages are copied into their frames (cheaper to set up)
_endpoint_serial = itertools.count()
# Plain ints: pyzmq's constants are enum members, and mixing them costs enum arithmetic on
# every message (measured: ~9 enum constructions per received message).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)


@dataclass
class EndpointOptions:
    """Timing and limits of an endpoint. Times are in seconds."""

    heartbeat_interval: float = 1.0  # a heartbeat goes to a peer we sent nothing to for this long
    peer_timeout: float = 10.0  # a peer not heard from for this long is lost
    connect_timeout: float = 60.0  # a peer must complete HELLO within this
    close_linger: float = 1.0  # on close, how long queued messages may still take to leave
    detect_disconnect: bool = True  # treat a closed connection as a lost peer at once
    # Opt-in: after traffic, the I/O thread keeps polling for this long instead of sleeping
    # (see "Busy polling" in docs/transport.md). 0: it sleeps as soon as it is idle.
    busy_poll: float = 0.0
    # Buffers of at least this many bytes to a peer on the same host are lent, not sent: the
    # peer reads them from our memory (transport/lending.py). 0: never.
    lend_min: int = DEFAULT_LEND_MIN
    # Buffers we read lent tensors into go back to a pool when the tensors are gone, and the
    # next read of that size class reuses one (its pages in memory already: no page faults);
    # idle ones are kept up to this many bytes (transport/staging.py). 0: a new buffer each time.
    lend_cache: int = DEFAULT_LEND_CACHE
    # Messages to a peer on the same host go through a ring of this many bytes in shared
    # memory instead of the socket (transport/shm.py; x86-64 Linux). 0: never.
    shm_ring: int = shm.DEFAULT_RING_BYTES
    # With such peers, a thread that waits (for an answer, or idle for work) first spins on
    # the rings for this long, yielding its CPU between looks, before it sleeps: an answer
    # that comes within it needs no wake-up. 0: it sleeps at once.
    spin: float = shm.DEFAULT_SPIN
    # A peer that does not read what we send it is dropped (lost, with an error that says so)
    # once this many bytes of big messages wait in libzmq or its ring for it, or this many
    # messages wait in libzmq: what it makes us hold is bounded (0: no bound).
    max_queued_bytes: int = 1 << 32
    max_queued_messages: int = 1 << 16
    # With a cluster secret, all traffic is CURVE-encrypted and only peers that hold the same
    # secret get in (transport/security.py), under any name. ``Endpoint(membership=...)``
    # admits named members instead, each with credentials of its own.
    cluster_secret: str | bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.peer_timeout:
            raise ValueError("need 0 < heartbeat_interval < peer_timeout")
        if self.connect_timeout <= 0 or self.close_linger < 0:
            raise ValueError("connect_timeout must be > 0 and close_linger >= 0")
        if self.busy_poll < 0:
            raise ValueError("busy_poll must be >= 0")
        if self.lend_min < 0 or self.lend_cache < 0:
            raise ValueError("lend_min and lend_cache must be >= 0")
        if self.shm_ring < 0 or 0 < self.shm_ring < 4096:
            raise ValueError("shm_ring must be 0 (off) or >= 4096")
        if self.spin < 0:
            raise ValueError("spin must be >= 0")
        if self.max_queued_bytes < 0 or self.max_queued_messages < 0:
            raise ValueError("max_queued_bytes and max_queued_messages must be >= 0")


@dataclass
class PeerStats:
    """Traffic counters of one peer (a snapshot when read through :meth:`Endpoint.stats`)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    send_errors: int = 0
    protocol_errors: int = 0
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    buffers_lent: int = 0  # big buffers the peer read from our memory instead (transport/lending.py)
    buffers_borrowed: int = 0  # and buffers we read from its memory
    buffers_on_loan: int = 0  # lent to it and not released yet (now, not a running count)
    shared_memory: bool = False  # messages to it go through a shared-memory ring (now)


class PeerState(enum.Enum):
    EXPECTED = "expected"  # it will connect to us; messages wait for its HELLO
    CONNECTING = "connecting"  # we connected and sent HELLO; sends go out already
    READY = "ready"  # HELLO exchanged
    LOST = "lost"  # dead, disconnected, silent too long, or closed


@dataclass
class _Peer:
    name: str
    state: PeerState
    address: str | None = None  # the address we connected to, when we are the connecting side
    since: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    last_sent: float = 0.0
    fd: int | None = None  # the accepted connection's file descriptor, when they connected
    routing_id: bytes = b""
    waiting: deque = field(default_factory=deque)  # (message_id, frames) held until HELLO
    lost_error: PeerLostError | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    nonce: bytes | None = None  # what our HELLO asked it to prove itself with (security.py)
    max_bytes: int | None = None  # the largest message it accepts (its HELLO says)
    # Lending (transport/lending.py): whether it reads our big buffers; our right to read
    # its memory, won with our challenge; what we lent it, by transfer id, until it releases
    # them; our offer to it (its challenge in our memory, and the pid its HELLO named).
    lend: bool = False
    reader: Reader | None = None
    lent: dict = field(default_factory=dict)
    offer: Any = None
    # Shared memory (transport/shm.py): the ring it writes to us (we made it; read once its
    # SHM_START said it writes there) and the decoder of its stream; the ring we write to
    # it (from our SHM_START on) and the bytes that had no room in it yet; its doorbell.
    ring_in: Any = None
    ring_in_active: bool = False
    decoder: Any = None
    ring_out: Any = None
    peer_flags: Any = None  # its Flags page (transport/shm.py), mapped with ring_out
    unwritten: deque = field(default_factory=deque)
    unwritten_bytes: int = 0
    # Zero-copy messages libzmq still holds for it: (tracker of the last frame, bytes), in
    # the order sent (libzmq writes them in that order), and their bytes.
    in_libzmq: deque = field(default_factory=deque)
    in_libzmq_bytes: int = 0
    lent_bytes: int = 0  # of the buffers in ``lent``
    bell: Any = None
    ring_pid: int | None = None  # its pid, from its HELLO: the process whose ring we map

    def __post_init__(self) -> None:
        self.routing_id = self.name.encode()


class Endpoint:
    """One worker's ZeroMQ endpoint.

    Args:
        identity: this worker's name on the wire (the ROUTER routing id).
        bind: addresses to listen on (``tcp://host:port``, port 0 or ``*`` for any;
            ``ipc:///path``). :attr:`addresses` holds what was actually bound.
        on_message: called with each incoming :class:`Message`, on the dispatcher thread.
            Without it, messages queue for :meth:`recv`, whose caller usually receives them
            from the socket itself.
        on_peer_lost: called as ``on_peer_lost(peer, error)`` when a peer is lost.
        on_send_error: called as ``on_send_error(peer, message_id, error)`` when a message
            that ``send`` accepted could not be delivered (peer lost before it went out, or
            the peer answered that it could not decode it).
        codec: the :class:`Codec` for payloads (limits, extensions, device map).
        options: :class:`EndpointOptions`.
        executor: ``executor(function, peer, envelope)`` queues work (from ``peer``: a pool may
            queue fairly by it) on the embedder's own thread
            pool. When given, incoming messages are decoded and passed to ``on_message`` on
            that pool, handed over by the receiving thread directly: one thread hop fewer than
            through the dispatcher thread, no ordering between messages. It must not block.
            A pool that waits in :meth:`wait_until` while idle receives the requests it runs
            itself (``ElasticPool.receive_while_idle``).
        on_envelope: called on the receiving thread (the I/O thread or a waiting one, holding
            the socket lock, so it must not send) for each application message before
            anything else, as ``on_envelope(peer, envelope)``; returning True means it took the message
            (it then decodes the payload itself, with ``codec.decode_payload``). For routing a
            response straight to the thread that waits for it. It must be quick and must not
            block or run user code.
        faults: a :class:`~zmqautograd.transport.faults.FaultPolicy` applied to what is sent (and, for
            partitions, received): fault-injection runs and tests.
        membership: a :class:`~zmqautograd.transport.security.Membership`: only its members may connect,
            each proven in ZeroMQ's handshake under its own name (the RPC layer always
            passes one). Without it (and without ``options.cluster_secret``) any process
            that reaches the endpoint's address may connect and send it messages.
        inline_handlers: opt-in. ``on_message`` and ``on_peer_lost`` run on the I/O thread
            itself, right after each receive batch and outside the socket lock (they may
            send), in arrival order: one thread hand-over fewer per message. While a handler
            runs, all of the endpoint's I/O waits (receiving, HELLOs, heartbeats: a handler
            that runs longer than the peers' ``peer_timeout`` gets this endpoint declared
            lost), so this is for quick handlers only; the default keeps them on the
            dispatcher thread, where a slow one never stalls the socket.
    """

    def __init__(
        self,
        identity: str,
        bind: str | Sequence[str] = "tcp://127.0.0.1:0",
        *,
        on_message: Callable[[Message], None] | None = None,
        on_peer_lost: Callable[[str, PeerLostError], None] | None = None,
        on_send_error: Callable[[str, int, TransportError], None] | None = None,
        codec: Codec | None = None,
        options: EndpointOptions | None = None,
        executor: Callable[..., None] | None = None,
        on_envelope: Callable[[str, Envelope], bool] | None = None,
        faults: FaultPolicy | None = None,
        inline_handlers: bool = False,
        membership: Membership | None = None,
    ):
        if not identity or len(identity.encode()) > 255 or identity.startswith("\0"):
            raise ValueError(f"invalid endpoint identity {identity!r}")
        if inline_handlers and (on_message is None or executor is not None):
            raise ValueError("inline_handlers needs on_message and no executor")
        self.identity = identity
        self.codec = codec or Codec()
        self.options = options or EndpointOptions()
        self._on_message = on_message
        self._on_peer_lost = on_peer_lost
        self._on_send_error = on_send_error
        self._executor = executor
        self._on_envelope = on_envelope
        self.faults = faults
        if membership is not None and self.options.cluster_secret:
            raise ValueError("give an endpoint a membership or a cluster secret, not both")
        self.membership = membership
        # Connections refused in the handshake (no member's credentials) or at HELLO (a
        # member's connection that gave another name).
        self.refused_connections = 0
        self._identity_bytes = identity.encode()
        # Lending (transport/lending.py): our host key, which a peer compares with its own; the
        # challenge a peer must show back before we read its memory; (peer, transfer id) of
        # borrowed buffers whose release still has to go out; the next transfer id.
        self._host_key = lending.host_key() if self.options.lend_min else None
        # Where the buffers we read lent tensors into come from (None: fresh ones each time).
        self._lend_pool = staging.plain_pool(self.options.lend_cache, self.options.lend_min) \
            if self._host_key is not None and self.options.lend_cache else None
        # Shared memory (transport/shm.py): on where supported; the same host key decides.
        # The doorbell (made by the I/O thread), the peers whose rings we read, the peers
        # with bytes that had no room in their ring yet, whether a thread spins.
        self._shm_host = lending.host_key() if self.options.shm_ring and shm.SUPPORTED else None
        self._bell: shm.Bell | None = None
        self._flags: shm.Flags | None = None  # our spinning / pending flags, mapped by writers
        self._rings_in: tuple = ()
        self._unwritten: set[str] = set()
        self._spinning = False
        self._challenge = os.urandom(lending.CHALLENGE_BYTES)
        self._releases: deque = deque()
        self._transfer_ids = itertools.count(1)

        self._lock = threading.Lock()  # guards the peer table, outbox hand-over and closing
        # Held for every use of the ROUTER (see the module's docstring). Lock order: the socket
        # lock first, then ``_lock``; never the other way round.
        self._socket_lock = threading.Lock()
        self._router_open = False
        self._peers: dict[str, _Peer] = {}
        self._stats: dict[str, PeerStats] = {}
        self._outbox: deque = deque()
        self._io_asleep = False
        self._closed = False
        self._close_called = False
        self._wake_address = f"inproc://zmqautograd-wake-{next(_endpoint_serial)}"
        self._wake_sockets: list[tuple[threading.Thread, zmq.Socket]] = []
        self._thread_local = threading.local()
        self._dispatch_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue | None = None if on_message else queue.SimpleQueue()
        # With inline_handlers: callbacks the I/O thread runs after its receive batch (only
        # the I/O thread appends and pops).
        self._inline: deque | None = deque() if inline_handlers else None
        # Waiting threads read the ROUTER themselves (transport/waiter.py): the callers of
        # recv() and wait_until(), and the dispatcher when it delivers messages. Not with
        # inline_handlers, whose handlers run where the I/O thread received.
        self._waiters_read = not inline_handlers
        self._dispatcher_reads = on_message is not None and executor is None and not inline_handlers
        self._reading_waiter: Waiter | None = None  # the one watching the ROUTER (socket lock)
        self._recv_waiters: set[Waiter] = set()

        self._context = zmq.Context()
        self.addresses: list[str] = []
        started = threading.Event()
        self._start_error: BaseException | None = None
        bind_list = [bind] if isinstance(bind, str) else list(bind)
        self._io_thread = threading.Thread(
            target=self._io_main, args=(bind_list, started), name=f"zmq-io-{identity}", daemon=True
        )
        self._dispatch_thread = threading.Thread(
            target=self._dispatch_main, name=f"zmq-dispatch-{identity}", daemon=True
        )
        self._io_thread.start()
        started.wait()
        if self._start_error is not None:
            self._io_thread.join()
            self._context.term()
            raise self._start_error
        self._dispatch_thread.start()

    # ------------------------------------------------------------------------- public API

    @property
    def address(self) -> str:
        """The first bound address."""
        return self.addresses[0]

    def add_peer(self, peer: str, address: str) -> None:
        """Make ``peer`` (listening at ``address``) reachable. Of two endpoints that add each
        other, the one whose identity sorts first connects; the other waits for it."""
        if peer == self.identity:
            raise ValueError("an endpoint cannot add itself as a peer")
        if self.identity < peer:
            self.connect(peer, address)
        else:
            self.expect(peer)

    def connect(self, peer: str, address: str) -> None:
        """Connect to ``peer`` at ``address``; messages to it may be sent right away."""
        with self._lock:
            self._check_open()
            existing = self._peers.get(peer)
            if existing is not None and existing.state is not PeerState.EXPECTED:
                raise ValueError(f"peer {peer!r} is already {existing.state.value}")
            self._peers[peer] = _Peer(peer, PeerState.CONNECTING, address=address)
            self._stats.setdefault(peer, PeerStats())
            self._post_locked(("connect", peer, address))

    def expect(self, peer: str) -> None:
        """Declare that ``peer`` will connect to us; messages to it wait for its HELLO."""
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                self._peers[peer] = _Peer(peer, PeerState.EXPECTED)
                self._stats.setdefault(peer, PeerStats())

    def wait_for_peer(self, peer: str, timeout: float | None = None) -> None:
        """Block until HELLO has been exchanged with ``peer``."""
        with self._lock:
            record = self._peers.get(peer)
        if record is None:
            raise UnknownPeerError(peer, f"{self.identity}: unknown peer {peer!r}")
        if not record.ready.wait(timeout):
            raise TimeoutError(f"{self.identity}: peer {peer!r} did not connect within {timeout} s")
        if record.lost_error is not None:
            raise record.lost_error

    def send(self, peer: str, message: Message) -> None:
        """Queue ``message`` for ``peer``. Returns at once; the I/O thread sends it.

        Raises UnknownPeerError, PeerLostError or EndpointClosedError at once when the message
        cannot be sent, LocalProtocolError when it cannot be encoded. Tensors of 64 KiB and
        more are sent without a copy: do not modify them until the peer has answered.
        """
        self.send_encoded(peer, message.id, self.codec.encode(message), message.type)

    def send_encoded(self, peer: str, message_id: int, frames: list, message_type: MessageType | None = None) -> None:
        """``send`` for a message already encoded with this endpoint's codec (a layer that
        must see the message's tensors before it commits to sending it). ``message_type``
        selects the faults to inject, if any."""
        if self.faults is None or message_type is None:
            self._enqueue(peer, message_id, frames)
            return
        self._check_open()
        if peer not in self._peers:  # a clear error first, whatever the faults
            raise UnknownPeerError(peer, f"{self.identity}: unknown peer {peer!r}")
        faults.apply(self.faults, peer, message_type, lambda: self._enqueue(peer, message_id, frames), self.identity,
                     deliver_late=lambda: self._send_late(peer, message_id, frames))

    def _send_late(self, peer: str, message_id: int, frames: list) -> None:
        """Enqueue, reporting failure through ``on_send_error`` (fault injection may call
        this after ``send`` returned)."""
        try:
            self._enqueue(peer, message_id, frames)
        except TransportError as exc:
            if self._on_send_error is not None:
                self._on_send_error(peer, message_id, exc)

    def _enqueue(self, peer: str, message_id: int, frames: list) -> None:
        nbytes = _frames_nbytes(frames)
        with self._lock:
            self._check_open()
            record = self._peers.get(peer)
            if record is None:
                raise UnknownPeerError(peer, f"{self.identity}: unknown peer {peer!r}")
            if record.lost_error is not None:
                raise PeerLostError(peer, str(record.lost_error))
            if record.max_bytes is not None and nbytes > record.max_bytes:
                raise _too_large(peer, nbytes, record.max_bytes)
            if self._outbox:  # older messages wait there: this one goes behind them
                self._post_locked(("send", peer, message_id, frames, nbytes))
                return
        with self._socket_lock:
            if not self._router_open:
                raise EndpointClosedError(f"endpoint {self.identity!r} is closed")
            if self._outbox:  # someone queued meanwhile; keep the order
                with self._lock:
                    self._post_locked(("send", peer, message_id, frames, nbytes))
                return
            self._send_to_peer(peer, message_id, frames, nbytes)
            # A message that went to a ring did not touch the ROUTER: nothing to look after.
            needs_io = self._io_needed_after_send() if record.ring_out is None else bool(self._closing)
        if needs_io and self._io_asleep:
            with self._lock:
                self._wake_io_locked()

    def _io_needed_after_send(self) -> bool:
        """Whether the I/O thread must look after a send on another thread (socket lock
        held): the send may have consumed the ROUTER's edge-triggered wake-up for input that
        arrived meanwhile, or found the connection gone."""
        return bool(self._router.get(_EVENTS) & _POLLIN) or bool(self._closing)

    def recv(self, timeout: float | None = None) -> Message:
        """The next incoming message (only without ``on_message``). A message whose payload
        does not decode is answered with PROTOCOL_ERROR and skipped. Raises ``TimeoutError``
        after ``timeout`` seconds and EndpointClosedError once closed. The calling thread
        receives from the socket itself while it waits (see :meth:`wait_until`)."""
        inbox = self._inbox
        if inbox is None:
            raise TransportError("recv() is for endpoints made without on_message")
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = self.waiter()
        self._recv_waiters.add(waiter)
        try:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._wait(waiter, lambda: not inbox.empty(), remaining):
                    raise TimeoutError(f"{self.identity}: no message within {timeout} s")
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    continue  # another thread in recv() took it
                if item is None:
                    self._to_inbox(None)  # let every other waiting thread see the close too
                    raise EndpointClosedError(f"endpoint {self.identity!r} is closed")
                message = self._decode(*item)
                if message is not None:
                    return message
        finally:
            self._recv_waiters.discard(waiter)

    def waiter(self) -> Waiter | LockWaiter:
        """The calling thread's :class:`~transport.waiter.Waiter` for :meth:`wait_until`:
        whoever makes the condition of that thread's wait true calls its ``wake()``."""
        waiter = getattr(self._thread_local, "waiter", None)
        if waiter is None:
            waiter = self._thread_local.waiter = new_waiter(self._waiters_read)
        return waiter

    def wait_until(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block the calling thread until ``ready()`` is true (True) or ``timeout`` seconds
        have passed (False). Meanwhile the thread receives from the socket itself, exactly as
        the I/O thread would, so that the message it waits for wakes it directly, with no
        thread hand-over (transport/waiter.py). Whoever makes ``ready()`` true from another
        thread (or a callback this receiving runs) then calls ``waiter().wake()`` of the
        waiting thread. ``ready`` must be quick and must not block."""
        return self._wait(self.waiter(), ready, timeout)

    def _become_reading_waiter(self, waiter: Waiter) -> None:
        """Watch the ROUTER in ``waiter``'s place from now on, with the I/O thread behind it
        (transport/waiter.py)."""
        with self._socket_lock:  # the descriptor is valid only while the ROUTER is open
            if not self._router_open:
                return
            previous = self._reading_waiter
            for fd in self._shared_fds:
                if previous is not None:
                    previous.detach(fd)
                waiter.attach(fd)
            self._io_poller.go_last()
            self._reading_waiter = waiter

    def _wait(self, waiter: Waiter, ready: Callable[[], bool], timeout: float | None) -> bool:
        if ready():
            return True
        if waiter.reads and self._reading_waiter is not waiter:
            self._become_reading_waiter(waiter)
        deadline = None if timeout is None else time.monotonic() + timeout
        spin = self.options.spin if waiter.reads else 0.0
        if type(waiter) is Waiter:
            waiter.sleeper = threading.get_ident()
        try:
            while True:
                if waiter.reads:
                    self._read_for_waiter()
                waiter.waiting = True  # from here on, whoever makes ready() true wakes us
                if ready():
                    return True
                if spin and self._rings_in:  # spin first (bounded by the deadline), then sleep
                    until = time.monotonic() + spin
                    spun = self._spin(waiter, ready, until if deadline is None else min(until, deadline))
                    if spun:
                        return True
                    if spun is None:
                        continue
                remaining = None
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                waiter.sleep(remaining)
                waiter.waiting = False
        finally:
            waiter.waiting = False

    def _spin(self, waiter: Waiter, ready: Callable[[], bool], until: float) -> bool | None:
        """Receive without sleeping until ``ready()`` (True) or ``until`` (False), yielding
        the CPU (and the GIL) between looks; None: nothing was ready, but a ring got data as
        the spin ended (look again before sleeping). One thread spins at a time; while it
        does, peers that write to our rings need not ring our doorbell (transport/shm.py)."""
        with self._socket_lock:
            if self._spinning or not self._router_open:
                return False
            self._spinning = True
            self._flags.set_spinning(True)
        flags = self._flags
        clock = time.monotonic
        has_input = waiter.has_input
        result = False
        looks = 0
        try:
            while True:
                # Cheap looks first (one word of shared memory, our descriptors): the full
                # receive takes the socket lock, asks libzmq and looks at every ring.
                if flags.take_pending():
                    shm.fence()  # see Flags.take_pending
                    # Seen in shared memory: the rings alone, no doorbell to empty and no
                    # ROUTER to ask (system calls); input there shows in has_input below.
                    self._read_for_waiter(rings_only=True)
                    if ready():
                        result = True
                        break
                looks += 1
                # Our descriptors (a system call) one look in _DESCRIPTOR_LOOKS: the rings
                # carry what peers on this host send, and a look that is shorter by a system
                # call sees their data sooner.
                if looks % _DESCRIPTOR_LOOKS == 0 and has_input():
                    self._read_for_waiter()
                if ready():
                    result = True
                    break
                if clock() >= until:
                    break
                _yield_cpu()
        finally:
            with self._socket_lock:
                self._spinning = False
                missed = False
                if self._router_open:
                    flags.set_spinning(False)
                    # A writer that saw us spinning did not ring: look once more, after the
                    # fence that orders our "not spinning" before the look (transport/shm.py).
                    shm.fence()
                    missed = flags.pending()
                    if missed and result:
                        self._bell.ring()  # we leave: whoever sleeps takes it
        return None if missed and not result else result

    def _read_for_waiter(self, rings_only: bool = False) -> None:
        """Receive what waits in the ROUTER and the rings, on a waiting thread (as the I/O
        thread would); ``rings_only``: the rings alone, without emptying the doorbell (a
        spinner that saw their pending word)."""
        with self._socket_lock:
            if not self._router_open:
                return
            if rings_only:
                self._receive_rings(drain=False)
                more = False
            else:
                more = self._receive_batch()
            # The I/O thread finishes what we leave: a long burst, connections gone.
            needs_io = more or bool(self._closing)
        if needs_io and self._io_asleep:
            with self._lock:
                self._wake_io_locked()

    def _to_inbox(self, item: tuple | None) -> None:
        self._inbox.put(item)
        for waiter in tuple(self._recv_waiters):
            waiter.wake()

    def _to_dispatcher(self, function: Callable | None, args: tuple = ()) -> None:
        self._dispatch_queue.put(None if function is None else (function, args))
        self._dispatch_waiter.wake()

    def reads_our_memory(self, peer: str) -> bool:
        """Whether ``peer`` is a process of our host that reads our memory (it verified
        that it can: transport/lending.py), so it can also open our GPU memory."""
        record = self._peers.get(peer)
        return record is not None and record.lend

    def note_protocol_error(self, peer: str, reason: str) -> None:
        """A layer above found a message of ``peer`` that breaks its protocol (an answer from
        a peer that was not asked, say): logged and counted in its ``protocol_errors``."""
        log.warning("endpoint %s: protocol error from %s: %s", self.identity, peer, reason)
        with self._lock:
            self._stats.setdefault(peer, PeerStats()).protocol_errors += 1

    def through_shared_memory(self, peer: str) -> bool:
        """Whether messages to ``peer`` go through a shared-memory ring now (transport/shm.py)."""
        record = self._peers.get(peer)
        return record is not None and record.ring_out is not None

    def is_lost(self, peer: str) -> bool:
        """Whether ``peer`` is known and lost."""
        record = self._peers.get(peer)
        return record is not None and record.state is PeerState.LOST

    def peers(self) -> dict[str, str]:
        """Every known peer and its state ('expected', 'connecting', 'ready', 'lost')."""
        with self._lock:
            return {name: record.state.value for name, record in self._peers.items()}

    def stats(self) -> dict[str, PeerStats]:
        """A snapshot of the per-peer counters."""
        with self._lock:
            peers = self._peers
            return {
                name: replace(
                    stats,
                    buffers_on_loan=len(peers[name].lent) if name in peers else 0,
                    shared_memory=name in peers and peers[name].ring_out is not None,
                )
                for name, stats in self._stats.items()
            }

    def close(self) -> None:
        """Say GOODBYE to the peers, let queued messages leave for up to ``close_linger``
        seconds, and stop both threads. Idempotent; never hangs on a dead peer."""
        with self._lock:
            if self._close_called:
                return
            self._close_called = True
            self._closed = True
            if self._io_thread.is_alive():
                self._post_locked(("close",))
        self._io_thread.join()
        with self._lock:
            for _thread, socket in self._wake_sockets:
                socket.close(linger=0)
            self._wake_sockets.clear()
        self._to_dispatcher(None)
        if self._inbox is not None:
            self._to_inbox(None)
        if threading.current_thread() is not self._dispatch_thread:
            self._dispatch_thread.join()
        self._context.term()
        if self._lend_pool is not None:
            self._lend_pool.close()  # what tensors still use is freed with them

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ hand-over to I/O

    def _check_open(self) -> None:
        if self._closed:
            raise EndpointClosedError(f"endpoint {self.identity!r} is closed")

    def _post_locked(self, command: tuple) -> None:
        """Queue a command for the I/O thread (caller holds the lock)."""
        self._outbox.append(command)
        self._wake_io_locked()

    def _wake_io_locked(self) -> None:
        """Wake the I/O thread if it sleeps (caller holds the lock)."""
        if self._io_asleep:
            self._io_asleep = False
            self._wake_socket().send(b"", zmq.NOBLOCK)

    def _wake_socket(self) -> zmq.Socket:
        """This thread's inproc PUSH socket to the I/O thread (used under the lock only)."""
        socket = getattr(self._thread_local, "socket", None)
        if socket is None:
            # Threads come and go; close the sockets of finished ones (safe: a socket is only
            # used under the lock, which we hold).
            live = []
            for thread, old in self._wake_sockets:
                if thread.is_alive():
                    live.append((thread, old))
                else:
                    old.close(linger=0)
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self._wake_address)
            self._thread_local.socket = socket
            live.append((threading.current_thread(), socket))
            self._wake_sockets = live
        return socket

    # --------------------------------------------------------------------- the I/O thread

    def _io_main(self, bind_list: list[str], started: threading.Event) -> None:
        if self._inline is not None:
            adopt_torch_thread_settings()  # handlers run here and may run torch ops
        try:
            self._open_sockets(bind_list)
        except BaseException as exc:  # reported to the constructor's thread
            self._start_error = exc if isinstance(exc, TransportError) else TransportError(
                f"endpoint {self.identity!r} could not bind {bind_list}: {exc}"
            )
            self._close_sockets(linger=0)
            started.set()
            return
        started.set()
        try:
            self._io_loop()
        except BaseException:
            log.exception("endpoint %s: I/O thread failed", self.identity)
            with self._lock:
                self._closed = True
            with self._socket_lock:
                self._fail_all_peers("the endpoint's I/O thread failed")
            if self._inline:
                self._run_inline()
        finally:
            self._close_sockets(linger=self.options.close_linger)

    def _open_sockets(self, bind_list: list[str]) -> None:
        self._router = None
        self._wake_pull = self._context.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_address)
        router = self._context.socket(zmq.ROUTER)
        self._router = router
        router.setsockopt(zmq.ROUTING_ID, self._identity_bytes)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Never drop and never block (flow control is above us), but bounded: with
        # ROUTER_MANDATORY a send past the bound fails, and that peer is dropped (_send_to_peer).
        router.setsockopt(zmq.SNDHWM, self.options.max_queued_messages)
        router.setsockopt(zmq.RCVHWM, 0)
        router.setsockopt(zmq.LINGER, int(self.options.close_linger * 1000))
        # ZMTP heartbeats let libzmq itself close connections to hosts that went silent: a
        # backstop, well after our own check (_tick), whose error says what happened ("no
        # message or heartbeat for ...") where a closed connection would not.
        options = self.options
        zmtp_timeout = int((options.peer_timeout + max(2 * options.heartbeat_interval, 1.0)) * 1000)
        router.setsockopt(zmq.HEARTBEAT_IVL, int(options.heartbeat_interval * 1000))
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, zmtp_timeout)
        router.setsockopt(zmq.HEARTBEAT_TTL, zmtp_timeout)
        # libzmq refuses a frame larger than the limit as it arrives, before it buffers it
        # (the connection is closed). The codec checks the whole message after that; senders
        # check it first against the limit the peer's HELLO gave, so theirs fail cleanly.
        router.setsockopt(zmq.MAXMSGSIZE, min(self.codec.max_message_bytes, (1 << 63) - 1))
        self._monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._guard: Membership | ClusterKeys | None = self.membership
        if self._guard is None and self.options.cluster_secret:
            self._guard = ClusterKeys.from_secret(self.options.cluster_secret)
        self._zap = None
        self._zap_held: deque = deque()  # (request, deadline, why) of not yet known credentials
        if self._guard is not None:
            self._zap = self._context.socket(zmq.REP)  # this thread answers libzmq's auth requests
            self._zap.bind(ZAP_ENDPOINT)
            self._guard.configure_listener(router)
        for address in bind_list:
            if address.startswith("tcp://") and address.endswith(":0"):
                address = address[:-2] + ":*"
            router.bind(address)
            self.addresses.append(router.getsockopt(zmq.LAST_ENDPOINT).decode())
        # The ROUTER's own descriptor, not the socket: polling it touches no libzmq state, so
        # other threads may send while this one waits.
        self._router_fd = router.getsockopt(zmq.FD)
        self._shared_fds = [self._router_fd]  # what the reading waiter watches with us
        if self._shm_host is not None:
            try:
                self._bell = shm.Bell()
                self._flags = shm.Flags.create()
                self._shared_fds.append(self._bell.fd)
            except OSError as exc:
                log.info("endpoint %s: no doorbell (%s): messages to peers on this host go through the socket",
                         self.identity, exc)
                self._shm_host = None
        self._dispatch_waiter = new_waiter(self._dispatcher_reads)
        others = [self._wake_pull, self._monitor] + ([self._zap] if self._zap is not None else [])
        self._io_poller = IoPoller(self._shared_fds, [socket.getsockopt(zmq.FD) for socket in others])
        self._by_address: dict[str, str] = {}  # connected address -> peer
        self._by_fd: dict[int, str] = {}  # accepted connection fd -> peer
        self._closing: dict[str, str] = {}  # peers whose connection is gone -> why
        self._received = 0  # application messages received, by any thread (under the socket lock)
        self._heartbeat_frames = self.codec.encode(Message(MessageType.HEARTBEAT, 0, self.identity))
        self._router_open = True

    def _close_sockets(self, linger: float) -> None:
        with self._socket_lock:
            self._router_open = False  # senders now get EndpointClosedError
        with self._lock:
            records = list(self._peers.values())
            for record in records:  # peers may still be reading what we lent
                lent, record.lent = record.lent, {}
                lending.retire(lent.values(), self.options.peer_timeout)
        with self._socket_lock:
            for record in records:
                self._close_rings(record)
            if self._bell is not None:
                self._bell.close()
            if self._flags is not None:
                # Peers can no longer map it; the mapping itself stays until the endpoint is
                # collected, since a thread may still be spinning on it (it leaves once it
                # sees the endpoint closed).
                self._flags.close_descriptor()
        router = getattr(self, "_router", None)
        if router is not None:
            try:
                router.disable_monitor()
            except zmq.ZMQError:
                pass
            router.close(linger=int(linger * 1000))
        for name in ("_monitor", "_wake_pull", "_zap"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close(linger=0)
        poller = getattr(self, "_io_poller", None)
        if poller is not None:
            poller.close()

    def _io_loop(self) -> None:
        interval = self.options.heartbeat_interval
        next_tick = time.monotonic() + interval
        poller = self._io_poller
        poll = poller.poll
        wake, router = self._wake_pull, self._router
        socket_lock = self._socket_lock
        busy_poll = self.options.busy_poll
        spin = self.options.spin
        busy_until = 0.0  # with busy_poll: spin instead of sleeping until then (monotonic)
        while True:
            timeout = 0.0
            with self._lock:
                # From here on, a thread that queues a command or finds input waiting after
                # its own send must wake us.
                self._io_asleep = not self._outbox
            if self._io_asleep:
                # Checked after going to sleep: input that a sender's send made us miss on the
                # descriptor is either seen here or makes that sender wake us.
                with socket_lock:
                    idle = not router.get(_EVENTS) & _POLLIN and not self._closing
                if idle:
                    timeout = max(0.0, next_tick - time.monotonic())
            if timeout and busy_until > time.monotonic():
                if not _spin_poll(poll, min(busy_until, next_tick)):
                    timeout = max(0.0, next_tick - time.monotonic())  # the tick is due, or sleep until it is
                    poll(timeout)
            else:
                poll(timeout)
            # Unlocked: a sender that still sees True only sends one wake-up too many.
            self._io_asleep = False
            # Every socket's descriptor is edge-triggered: look at each, whatever woke us.
            while wake.get(_EVENTS) & _POLLIN:
                wake.recv()
            with socket_lock:
                received = self._received
                self._receive_batch()
                # Application traffic (not heartbeats) keeps a busy-polling thread spinning.
                active = self._received != received or bool(self._outbox)
                self._read_monitor()
                if self._zap is not None:
                    self._authenticate()
                closing = not self._drain_outbox()
                if not closing:
                    if self._closing:
                        self._declare_gone_peers_lost()
                    now = time.monotonic()
                    if now >= next_tick:
                        self._tick(now)
                        next_tick = now + interval
            if self._inline:
                self._run_inline()
            if closing:
                return
            # With peers on shared-memory rings, the I/O thread spins for ``spin`` after
            # traffic too: answers that reach no waiting thread (rpc_async callers, who wait
            # on torch futures) then need no wake-up either.
            window = max(busy_poll, spin) if self._rings_in else busy_poll
            if active and window:
                busy_until = time.monotonic() + window

    def _run_inline(self) -> None:
        """Run the handlers of what the last batch received (inline_handlers), in order."""
        inline = self._inline
        while inline:
            function, args = inline.popleft()
            try:
                function(*args)
            except Exception:
                log.exception("endpoint %s: callback %s failed", self.identity, getattr(function, "__name__", function))

    def _drain_outbox(self) -> bool:
        """Execute queued commands (under the socket lock); False once told to close. Only
        this thread pops the outbox, and deque operations are atomic, so popping needs no
        ``_lock``; a sender that finds the outbox empty under the socket lock knows that
        everything queued before went out."""
        outbox = self._outbox
        while outbox:
            command = outbox.popleft()
            kind = command[0]
            if kind == "send":
                _, peer, message_id, frames, nbytes = command
                self._send_to_peer(peer, message_id, frames, nbytes)
            elif kind == "connect":
                _, peer, address = command
                self._connect(peer, address)
            elif kind == "zap":
                if self._zap_held:
                    self._answer_held_zap()
            elif kind == "shm_start":
                _, peer, ring, flags = command
                self._start_ring(peer, ring, flags)
            elif kind == "close":
                self._finish_rings()
                self._say_goodbye()
                return False
            # "releases": a reading thread queued some (_borrowed_done); they go below.
        if self._releases:
            self._send_releases()
        return True

    def _authenticate(self) -> None:
        """Answer libzmq's ZAP requests: a connection without a member's credentials is
        refused here, inside the handshake, before any message of it exists."""
        while self._zap.get(zmq.EVENTS) & zmq.POLLIN:
            self._answer_zap(self._zap.recv_multipart(), time.monotonic() + self.options.connect_timeout)

    def _answer_zap(self, request: list[bytes], deadline: float) -> None:
        try:
            reply, admitted, why = self._guard.zap_reply(request, self._admissible)
        except NotYetKnown as exc:
            # Perhaps a member whose record we have not read yet: asked again as members are
            # admitted (members_changed), refused once all are or at the deadline. A bounded
            # number: strangers cannot make us hold more.
            held = self._zap_held
            if len(held) >= _ZAP_HELD_MAX:
                oldest = held.popleft()[0]
                self._answer_zap_refused(oldest, "too many connections waiting to be identified")
            held.append((request, deadline, str(exc)))
            return
        self._zap.send_multipart(reply)
        if admitted is None:
            self._refused(f"a connection from {_zap_address(request)}", why)

    def _answer_zap_refused(self, request: list[bytes], why: str) -> None:
        self._zap.send_multipart(zap_refusal(request[1] if len(request) > 1 else b""))
        self._refused(f"a connection from {_zap_address(request)}", why)

    def _answer_held_zap(self, now: float | None = None) -> None:
        """Held ZAP requests again (membership changed), or refused (``now`` past their
        deadline)."""
        held, self._zap_held = self._zap_held, deque()
        for request, deadline, why in held:
            if now is not None and now >= deadline:
                self._answer_zap_refused(request, why)
            else:
                self._answer_zap(request, deadline)

    def members_changed(self) -> None:
        """Tell the endpoint that its membership admitted members (or was sealed): held
        connections are looked at again."""
        with self._lock:
            self._check_open()
            self._post_locked(("zap",))

    def _admissible(self, member: str) -> bool:
        """Whether member ``member`` may connect now: once, before its HELLO (I/O thread)."""
        record = self._peers.get(member)
        return record is None or record.state is PeerState.EXPECTED

    def _refused(self, what: str, why: str) -> None:
        self.refused_connections += 1
        log.warning("endpoint %s: refused %s: %s", self.identity, what, why)

    def _connect(self, peer: str, address: str) -> None:
        try:
            if self._guard is not None:
                self._guard.configure_connect(self._router, peer)
            self._router.setsockopt(zmq.CONNECT_ROUTING_ID, peer.encode())
            self._router.connect(address)
        except (zmq.ZMQError, Refusal) as exc:
            self._peer_lost(peer, f"cannot connect to {address}: {exc}")
            return
        self._by_address[address] = peer
        record = self._peers[peer]
        record.nonce = self._guard.new_nonce() if self._guard is not None else None
        self._send_hello(peer, nonce=record.nonce)

    def _send_hello(self, peer: str, nonce: bytes | None = None, proof: str | None = None) -> None:
        payload: dict[str, Any] = {"identity": self.identity, "max_bytes": self.codec.max_message_bytes}
        if nonce is not None:
            payload["nonce"] = nonce
        if proof is not None:
            payload["proof"] = proof
        if self._host_key is not None:
            payload["lend"] = {"host": self._host_key, "pid": os.getpid(), "challenge": self._challenge}
        if self._shm_host is not None:
            payload["shm"] = {"host": self._shm_host, "pid": os.getpid()}
        self._send_control(peer, MessageType.HELLO, payload, hello=True)

    def _send_control(self, peer: str, kind: MessageType, payload: Any, hello: bool = False) -> None:
        frames = self.codec.encode(Message(kind, 0, self.identity, payload))
        self._send_to_peer(peer, 0, frames, _frames_nbytes(frames), hello)

    def _send_to_peer(self, peer: str, message_id: int, frames: list, nbytes: int, hello: bool = False) -> None:
        # Caller holds the socket lock. Peer states change on the I/O thread only, under the
        # socket lock (records are created under ``_lock`` by other threads, and a dict lookup
        # is atomic), so no other lock is needed here.
        record = self._peers.get(peer)
        # Until its HELLO: a peer that will connect to us, and one we connected to that has to
        # prove it is that member (security.py) before it gets anything but our HELLO.
        if record is not None and (record.state is PeerState.EXPECTED or (
                record.state is PeerState.CONNECTING and record.nonce is not None and not hello)):
            record.waiting.append((message_id, frames, nbytes))
            return
        if record is None or record.state is PeerState.LOST:
            error = record.lost_error if record else UnknownPeerError(peer, f"unknown peer {peer!r}")
            self._report_send_error(peer, message_id, error)
            return
        if record.max_bytes is not None and nbytes > record.max_bytes:
            self._report_send_error(peer, message_id, _too_large(peer, nbytes, record.max_bytes))
            return
        stats = self._stats[peer]
        copy = nbytes < _ZERO_COPY_MIN
        if record.lend and nbytes >= self.options.lend_min:
            lent_frames, lent = lending.lend(frames, self.options.lend_min, self._transfer_ids)
            if lent:
                frames = lent_frames
                record.lent.update(lent)
                stats.buffers_lent += len(lent)
                copy = True
                record.lent_bytes += sum(map(ctypes.sizeof, lent.values()))
                self._bound_queued(record, record.lent_bytes)  # it may never release what it read
        if record.ring_out is not None:  # a peer on this host (transport/shm.py)
            pieces = shm.encode(frames)
            if not record.unwritten and len(pieces) == 1:
                # The usual small message, nothing queued before it: straight into the ring.
                piece = pieces[0]
                written = record.ring_out.write(piece)
                if written == len(piece):
                    self._ring_written(record)
                else:
                    self._wait_for_room(record, [piece[written:]])
                    self._write_ring(record, wrote=written > 0)
            else:
                self._wait_for_room(record, pieces)
                self._write_ring(record)
        else:
            try:
                # Zero-copy frames cost more to set up than small copies: only big messages use
                # them. send_multipart, unrolled: it costs a few Python checks per frame. With
                # ROUTER_MANDATORY an unreachable peer fails on the routing id, before any frame.
                send = self._router.send
                send(record.routing_id, _MORE_NOBLOCK)
                last = len(frames) - 1
                if copy:
                    for index in range(last):
                        send(frames[index], _MORE_NOBLOCK)
                    send(frames[last], _NOBLOCK)
                else:
                    # libzmq holds the memory until it has written it: counted till then, by
                    # the tracker of the last frame it does not copy (it writes frames in order).
                    tracked = _last_uncopied(frames)
                    tracker = None
                    for index, frame in enumerate(frames):
                        flags = _NOBLOCK if index == last else _MORE_NOBLOCK
                        if index == tracked:
                            tracker = send(frame, flags, copy=False, track=True)
                        else:
                            send(frame, flags, copy=False)
                    if tracker is not None:
                        self._in_libzmq(record, tracker, nbytes)
            except zmq.ZMQError as exc:
                stats.send_errors += 1
                if exc.errno == zmq.EHOSTUNREACH:
                    reason = "send failed: no connection to it"
                elif exc.errno == zmq.EAGAIN:
                    reason = (f"it does not read: {self.options.max_queued_messages} messages wait for it "
                              "(max_queued_messages)")
                else:
                    reason = f"send failed: {exc}"
                self._connection_gone(peer, reason)
                self._report_send_error(peer, message_id, PeerLostError(peer, f"{self.identity}: lost peer {peer!r}: {reason}"))
                return
        record.last_sent = time.monotonic()
        stats.messages_sent += 1
        stats.bytes_sent += nbytes

    def _in_libzmq(self, record: _Peer, tracker: zmq.MessageTracker, nbytes: int) -> None:
        """A zero-copy message went to libzmq for ``record``: count what libzmq still holds
        for it, and drop it once that passes ``max_queued_bytes`` (socket lock held)."""
        queued = record.in_libzmq
        while queued and queued[0][0].done:
            record.in_libzmq_bytes -= queued.popleft()[1]
        queued.append((tracker, nbytes))
        record.in_libzmq_bytes += nbytes
        self._bound_queued(record, record.in_libzmq_bytes)

    def _wait_for_room(self, record: _Peer, pieces: list) -> None:
        """Queue what has no room in the peer's ring yet, bounded as ``_in_libzmq``."""
        record.unwritten.extend(pieces)
        record.unwritten_bytes += sum(len(piece) for piece in pieces)
        self._bound_queued(record, record.unwritten_bytes)

    def _bound_queued(self, record: _Peer, nbytes: int) -> None:
        """``nbytes`` of ours wait for ``record`` (in libzmq, for its ring, lent to it): past
        ``max_queued_bytes`` it is dropped, as a peer that does not read (socket lock held)."""
        limit = self.options.max_queued_bytes
        if limit and nbytes > limit and record.name not in self._closing:
            self._connection_gone(record.name, f"it does not read: {nbytes} bytes wait for it "
                                               f"(max_queued_bytes={self.options.max_queued_bytes})")

    def _report_send_error(self, peer: str, message_id: int, error: TransportError) -> None:
        if message_id and self._on_send_error is not None:
            self._to_dispatcher(self._on_send_error, (peer, message_id, error))

    def _receive_batch(self) -> bool:
        """Receive up to a batch of messages (caller holds the socket lock); whether input
        still waits."""
        if self._bell is not None:
            self._receive_rings()
        router = self._router
        recv = router.recv
        for _ in range(_RECV_BATCH):
            if not router.get(_EVENTS) & _POLLIN:  # cheaper than catching zmq.Again
                return False
            # recv_multipart, unrolled: it asks the socket for RCVMORE through an enum
            # conversion per frame; a received Frame knows (measured: 12 -> 3 us a message).
            frame = recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
            self._handle_incoming(frames)
        return bool(router.get(_EVENTS) & _POLLIN)

    def _handle_incoming(self, frames: list) -> None:
        """One received message: ``frames[0]`` is the sender's routing id (a zmq.Frame from the
        socket, bytes from a ring), the rest its frames."""
        routing_id = frames[0] if type(frames[0]) is bytes else frames[0].bytes
        try:
            peer = routing_id.decode()
        except UnicodeDecodeError:
            peer = "<raw:" + routing_id.hex() + ">"
        try:
            if len(frames) > 2 and lending.is_table(frames[1]):
                frames = self._borrow(peer, frames)
            envelope = self.codec.decode_envelope(frames[1:])
            if envelope.sender != peer:
                raise RemoteProtocolError(
                    f"sender field {envelope.sender!r:.60} does not match the connection's identity {peer!r}"
                )
        except ProtocolError as exc:
            self._protocol_error(routing_id, peer, None, exc)
            return
        if self.faults is not None and self.faults.is_partitioned(peer):
            # Injected partition: nothing gets through, heartbeats included; but releases of
            # buffers we lent before it are applied, as dropping them would only leak those.
            if envelope.type is MessageType.LEND_RELEASE and peer in self._peers:
                self._lend_released(self._peers[peer], envelope)
            return
        record = self._peers.get(peer)
        stats = self._stats.get(peer)
        if envelope.type is MessageType.HELLO:
            record = self._hello(peer, frames[1], envelope)
            if record is None:
                return  # refused (logged and counted)
            stats = self._stats[peer]
        if record is None:
            self._protocol_error(
                routing_id, peer, envelope, RemoteProtocolError(f"{envelope.type.name} from {peer!r} before HELLO")
            )
            return
        if record.state is PeerState.LOST:
            log.warning("endpoint %s: dropped %s from lost peer %s", self.identity, envelope.type.name, peer)
            return
        record.last_seen = time.monotonic()
        stats.messages_received += 1
        stats.bytes_received += envelope.nbytes
        kind = envelope.type
        if kind in _CONTROL_TYPES:
            if kind is MessageType.HEARTBEAT:
                stats.heartbeats_received += 1
            elif kind is MessageType.GOODBYE:
                self._peer_lost(peer, "the peer closed its endpoint", level=logging.INFO)
            elif kind is MessageType.PROTOCOL_ERROR:
                self._to_dispatcher(self._peer_rejected, (peer, envelope))
            elif kind is MessageType.LEND_RELEASE:
                self._lend_released(record, envelope)
            elif kind is MessageType.LEND_OFFER:
                self._lend_offered(record, envelope)
            elif kind is MessageType.LEND_READY:
                record.lend = record.offer is not None  # it read what we offered it
            elif kind is MessageType.SHM_OFFER:
                self._ring_offered(record, envelope)
            elif kind is MessageType.SHM_START:
                self._ring_started(record, envelope)
            return
        self._received += 1
        if self._on_envelope is not None and self._on_envelope(peer, envelope):
            return
        if self._inbox is not None:
            self._to_inbox((peer, envelope))
        elif self._inline is not None:
            self._inline.append((self._deliver, (peer, envelope)))
        elif self._executor is not None:
            self._executor(self._deliver, peer, envelope)
        else:
            self._to_dispatcher(self._deliver, (peer, envelope))

    def _hello(self, peer: str, envelope_frame: Any, envelope: Envelope) -> _Peer | None:
        """A HELLO: register or confirm the peer, flush what waited for it, answer it. None:
        refused (a connection that is not that member's)."""
        record = self._peers.get(peer)
        if record is not None and record.state in (PeerState.READY, PeerState.LOST):
            return record  # said already (or gone): a HELLO again changes nothing
        accepted = record is None or record.state is PeerState.EXPECTED
        membership = self.membership
        hello = self._control_payload(peer, envelope)
        if not isinstance(hello, dict):
            hello = {}
        if membership is not None:
            try:
                if accepted:
                    # The handshake named the member whose credentials it showed (User-Id):
                    # the connection must call itself that, and a HELLO never comes through
                    # a ring (those exist only after it).
                    user = envelope_frame.get("User-Id") if type(envelope_frame) is zmq.Frame else None
                    if user != peer or peer not in membership:
                        raise Refusal(f"a HELLO as {peer[:60]!r} over a connection of member {user!r}")
                else:
                    membership.verify(peer, record.nonce if record is not None else None, hello.get("proof"))
            except Refusal as exc:
                if accepted:
                    self._refused(f"a HELLO from {peer[:60]!r}", str(exc))
                    self._stats.setdefault(peer, PeerStats()).protocol_errors += 1
                else:
                    self._peer_lost(peer, f"refused: {exc}")
                return None
        with self._lock:
            record = self._peers.get(peer)
            if record is None:
                record = self._peers[peer] = _Peer(peer, PeerState.EXPECTED)
                self._stats.setdefault(peer, PeerStats())
            if record.state is PeerState.LOST:
                return record
            record.state = PeerState.READY
            limit = hello.get("max_bytes")
            record.max_bytes = limit if type(limit) is int and limit > 0 else None
            waiting, record.waiting = record.waiting, deque()
        if accepted:
            # Read pending monitor events first: a DISCONNECTED for an older connection that
            # used the same file descriptor must not be taken for this peer's.
            self._read_monitor()
            fd = envelope_frame.get(zmq.SRCFD)
            record.fd = fd
            self._by_fd[fd] = peer
            proof = self._guard.prove(hello.get("nonce"), peer) if self._guard is not None else None
            self._send_hello(peer, proof=proof)
        for message_id, frames, nbytes in waiting:
            self._send_to_peer(peer, message_id, frames, nbytes)
        if self._host_key is not None or self._shm_host is not None:
            self._offer_to_lend(record, hello)
            self._offer_ring(record, hello)
        record.ready.set()
        return record

    # ---------------------------------------------------- lending (transport/lending.py)

    def _control_payload(self, peer: str, envelope: Envelope) -> Any:
        try:
            return self.codec.decode_payload(envelope, plain=True)
        except (ProtocolError, ExtensionNotDecoded) as exc:
            log.warning("endpoint %s: malformed %s from %s: %s", self.identity, envelope.type.name, peer, str(exc))
            return None

    def _offer_to_lend(self, record: _Peer, hello: Any) -> None:
        """A peer on our host (``hello``: its HELLO's payload): show it its challenge in our
        memory (LEND_OFFER), and keep the pid its HELLO named, the one whose memory we will
        read if it does the same."""
        if self._host_key is None:
            return
        offer = lending.Offer.from_hello(hello, self._host_key)
        if offer is None:
            return
        record.offer = offer
        self._send_control(record.name, MessageType.LEND_OFFER, offer.message())

    def _lend_offered(self, record: _Peer, envelope: Envelope) -> None:
        """The peer shows our challenge in its memory: once we read it there, it may lend."""
        if record.offer is None or record.reader is not None:
            return  # not on our host (or lending is off here), or already done
        payload = self._control_payload(record.name, envelope)
        try:
            record.reader = lending.Reader.verify(record.offer.peer_pid, payload, self._challenge, self._lend_pool)
        except (OSError, ProtocolError) as exc:
            log.info("endpoint %s: cannot read the memory of %s, big buffers go through the socket: %s",
                     self.identity, record.name, exc)
            return
        self._send_control(record.name, MessageType.LEND_READY, None)

    def _lend_released(self, record: _Peer, envelope: Envelope) -> None:
        ids = self._control_payload(record.name, envelope)
        if not isinstance(ids, list):
            log.warning("endpoint %s: malformed LEND_RELEASE from %s", self.identity, record.name)
            return
        lent = record.lent
        for transfer_id in ids:
            if type(transfer_id) is int:
                buffer = lent.pop(transfer_id, None)
                if buffer is not None:
                    record.lent_bytes -= ctypes.sizeof(buffer)

    def _borrow(self, peer: str, frames: list) -> list:
        """Frames of a message with lent buffers: each empty placeholder replaced with a
        LentFrame that reads the buffer when the payload is decoded."""
        record = self._peers.get(peer)
        reader = record.reader if record is not None else None
        try:
            if reader is None:
                raise RemoteProtocolError(f"{peer!r} lent buffers, but this endpoint has not verified it can read its memory")
            entries = lending.decode_table(frames[1], frames[3:])
        except RemoteProtocolError as exc:
            exc.message_id = _peek_message_id(frames[2])  # so the refusal names the message
            raise
        frames = [frames[0], *frames[2:]]
        done = functools.partial(self._borrowed_done, peer)
        for index, transfer_id, address, nbytes in entries:
            frames[1 + index] = LentFrame(reader, address, nbytes, transfer_id, done, peer)
        self._stats[peer].buffers_borrowed += len(entries)
        return frames

    def _borrowed_done(self, peer: str, transfer_id: int, read: bool) -> None:
        """A borrowed buffer was read (or dropped unread): the lender may free it. Called
        from any thread, holding any lock or none (a frame dropped unread calls it from its
        finaliser), so the release is only queued here; a reading thread then sends it at
        once if it can take the socket lock, or has the I/O thread send it."""
        self._releases.append((peer, transfer_id))
        if not read:
            return  # the I/O thread sends it on its next turn (a heartbeat interval at most)
        if self._socket_lock.acquire(blocking=False):
            try:
                needs_io = False
                if self._router_open:
                    self._send_releases()
                    needs_io = self._io_needed_after_send()
            finally:
                self._socket_lock.release()
            if needs_io and self._io_asleep:
                with self._lock:
                    self._wake_io_locked()
        else:
            with self._lock:
                if not self._closed:
                    self._post_locked(("releases",))

    # ----------------------------------------------- shared-memory rings (transport/shm.py)

    def _offer_ring(self, record: _Peer, hello: Any) -> None:
        """A peer on our host (``hello``: its HELLO's payload): make the ring it will write to
        us, and tell it where (with our flags and doorbell). It answers SHM_START, behind
        everything it sent us through the socket."""
        if self._shm_host is None or record.ring_in is not None:
            return
        info = hello.get("shm") if isinstance(hello, dict) else None
        if not isinstance(info, dict) or info.get("host") != self._shm_host or type(info.get("pid")) is not int:
            return
        record.ring_pid = info["pid"]  # the only process whose ring we will map
        try:
            ring = shm.Ring.create(self.options.shm_ring)
        except OSError as exc:
            log.info("endpoint %s: no ring for %s (%s): it sends through the socket", self.identity, record.name, exc)
            return
        record.ring_in = ring
        # One frame more than the codec allows: a lent-buffer table may come first.
        record.decoder = shm.StreamDecoder(self.codec.max_frames + 1, self.codec.max_message_bytes + (1 << 20))
        self._send_control(record.name, MessageType.SHM_OFFER,
                           {"fd": ring.fd, "capacity": ring.capacity, "flags": self._flags.fd,
                            "bell": self._bell.address})

    def _ring_offered(self, record: _Peer, envelope: Envelope) -> None:
        """The peer made a ring for us: map it, then (through the outbox, so behind every
        message already queued for the socket) say SHM_START and write there from then on."""
        if record.ring_pid is None or record.ring_out is not None:
            return  # not on our host, or shared memory is off here
        payload = self._control_payload(record.name, envelope)
        try:
            if not isinstance(payload, dict):
                raise ValueError("malformed SHM_OFFER")
            fd, capacity, flags_fd = payload.get("fd"), payload.get("capacity"), payload.get("flags")
            if not all(type(v) is int and v >= 0 for v in (fd, capacity, flags_fd)) or not capacity:
                raise ValueError("malformed SHM_OFFER")
            self._open_bell(record, payload)
            flags = shm.Flags.open(record.ring_pid, flags_fd)
            try:
                ring = shm.Ring.open(record.ring_pid, fd, capacity)
            except BaseException:
                flags.close()
                raise
        except (OSError, ValueError) as exc:
            log.info("endpoint %s: cannot use the ring of %s (%s): messages to it go through the socket",
                     self.identity, record.name, exc)
            return
        with self._lock:
            self._post_locked(("shm_start", record.name, ring, flags))

    def _open_bell(self, record: _Peer, payload: dict) -> None:
        if record.bell is None:
            address = payload.get("bell")
            if not isinstance(address, str):
                raise ValueError("no doorbell address")
            record.bell = shm.open_bell(address)

    def _start_ring(self, peer: str, ring: shm.Ring, flags: shm.Flags) -> None:
        """On the I/O thread, in outbox order: SHM_START through the socket, then the ring."""
        record = self._peers.get(peer)
        if record is None or record.state is not PeerState.READY or record.ring_out is not None:
            ring.close()
            flags.close()
            return
        self._send_control(peer, MessageType.SHM_START, {"bell": self._bell.address})
        record.ring_out, record.peer_flags = ring, flags

    def _ring_started(self, record: _Peer, envelope: Envelope) -> None:
        """Everything the peer sent through the socket before it came first: read its ring."""
        if record.ring_in is None or record.ring_in_active:
            return
        payload = self._control_payload(record.name, envelope)
        try:
            self._open_bell(record, payload if isinstance(payload, dict) else {})
        except (OSError, ValueError) as exc:
            # It then learns of room in the ring on its heartbeat ticks only.
            log.warning("endpoint %s: cannot open the doorbell of %s: %s", self.identity, record.name, exc)
        record.ring_in.close_descriptor()  # the writer has it mapped
        record.ring_in_active = True
        self._rings_in = (*self._rings_in, record)
        self._read_ring(record)  # it may have written already

    def _receive_rings(self, drain: bool = True) -> None:
        """Read every ring (under the socket lock), after emptying the doorbell (``drain``);
        write what waited for room in the peers' rings."""
        if drain:
            self._bell.drain()
        for record in self._rings_in:
            # Most looks find most rings empty (one pending flag stands for all of them): a
            # look at two words is cheaper than the read that would find nothing.
            ring = record.ring_in
            if ring is not None and ring.has_data():
                self._read_ring(record)
        if self._unwritten:
            self._flush_unwritten()

    def _read_ring(self, record: _Peer) -> None:
        ring, decoder = record.ring_in, record.decoder
        if decoder is None:
            return
        routing_id = record.routing_id
        for _ in range(_RING_READS):
            if record.decoder is None:
                return  # the peer was lost while we handed over what we read
            chunk = ring.read(_RING_CHUNK)
            if chunk is None:
                return
            shm.fence()  # our new head before the look at its flag (transport/shm.py)
            if ring.take_writer_waiting() and record.bell is not None:
                shm.ring_bell(record.bell)
            try:
                messages = decoder.feed(chunk)
            except ProtocolError as exc:
                with self._lock:
                    self._stats[record.name].protocol_errors += 1
                record.decoder = None
                self._peer_lost(record.name, f"malformed shared-memory stream: {exc}")
                return
            for frames in messages:
                frames.insert(0, routing_id)
                self._handle_incoming(frames)
            if len(chunk) < _RING_CHUNK:
                # All there was. What the writer publishes after our look sets the pending
                # flag or rings our doorbell (transport/shm.py): no look again needed now.
                return
        self._bell.ring()  # more is waiting: for the next turn (ours or another thread's)

    def _write_ring(self, record: _Peer, wrote: bool = False) -> None:
        """Write what waits for the peer's ring, as far as there is room (socket lock held);
        what has no room waits for the peer's doorbell call (or our next tick). Ring the peer
        unless it spins (also when ``wrote``: the caller wrote part of a message already)."""
        ring, unwritten = record.ring_out, record.unwritten
        asked = False
        while unwritten:
            piece = unwritten[0]
            written = ring.write(piece)
            if written:
                wrote = True
                record.unwritten_bytes -= written
                if written == len(piece):
                    unwritten.popleft()
                else:
                    unwritten[0] = piece[written:]
                continue
            if asked:
                break
            # Full: ask the reader to ring us once it made room, then look once more (it may
            # have made room before it saw the flag).
            ring.set_writer_waiting(True)
            shm.fence()
            asked = True
        if unwritten:
            self._unwritten.add(record.name)
        else:
            self._unwritten.discard(record.name)
            if asked:
                ring.set_writer_waiting(False)
        if wrote:
            self._ring_written(record)

    @staticmethod
    def _ring_written(record: _Peer) -> None:
        """We published data in the peer's ring: mark it pending, and ring the peer's
        doorbell unless a thread of the peer spins."""
        flags = record.peer_flags
        flags.mark_pending()
        shm.fence()  # our new tail and mark before the look at the reader's flag
        if record.bell is not None and not flags.spinning():
            shm.ring_bell(record.bell)

    def _flush_unwritten(self) -> None:
        for name in tuple(self._unwritten):
            record = self._peers.get(name)
            if record is None or record.ring_out is None:
                self._unwritten.discard(name)
            else:
                self._write_ring(record)

    def _finish_rings(self) -> None:
        """On close, before GOODBYE: write what still waits for room in peers' rings, for up
        to ``close_linger`` (as libzmq lingers over what its queues hold)."""
        deadline = time.monotonic() + self.options.close_linger
        while self._unwritten:
            self._flush_unwritten()
            remaining = deadline - time.monotonic()
            if not self._unwritten or remaining <= 0:
                return
            select.select([self._bell.fd], [], [], min(remaining, 0.05))  # a reader made room
            self._bell.drain()

    def _close_rings(self, record: _Peer) -> None:
        """Unmap the peer's rings and close its doorbell (socket lock held)."""
        if record.ring_in is not None:
            self._rings_in = tuple(r for r in self._rings_in if r is not record)
            record.ring_in.close()
        if record.ring_out is not None:
            record.ring_out.close()
            record.peer_flags.close()
        if record.bell is not None:
            record.bell.close()
        record.ring_in = record.decoder = record.ring_out = record.peer_flags = record.bell = None
        record.ring_in_active = False
        record.unwritten.clear()
        record.unwritten_bytes = 0
        self._unwritten.discard(record.name)

    def _send_releases(self) -> None:
        """Send the queued releases, one LEND_RELEASE per lender (under the socket lock)."""
        releases = self._releases
        by_peer: dict[str, list[int]] = {}
        while releases:
            peer, transfer_id = releases.popleft()
            by_peer.setdefault(peer, []).append(transfer_id)
        for peer, ids in by_peer.items():
            self._send_control(peer, MessageType.LEND_RELEASE, ids)

    def _protocol_error(self, routing_id: bytes, peer: str, envelope: Envelope | None, exc: ProtocolError) -> None:
        """Count and log a malformed message, and tell the sender unless that could loop. The
        log gets the error's text, never the error: a handler that keeps records (pytest's,
        a memory handler) would keep, through its traceback, the refused message's frames."""
        log.warning("endpoint %s: malformed message from %s: %s", self.identity, peer, str(exc))
        with self._lock:
            self._stats.setdefault(peer, PeerStats()).protocol_errors += 1
        if envelope is not None and envelope.type in _CONTROL_TYPES:
            return  # never answer a control message with another: two broken peers could loop
        reply = self.codec.encode(self._protocol_error_message(envelope, exc))
        try:
            self._router.send_multipart([routing_id, *reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the sender is already gone; nothing more to tell

    def _protocol_error_message(self, envelope: Envelope | None, exc: Exception) -> Message:
        """The PROTOCOL_ERROR answer to a message we could not read (the envelope, if it was)."""
        return Message(
            MessageType.PROTOCOL_ERROR,
            envelope.id if envelope else getattr(exc, "message_id", 0),
            self.identity,
            {"error": f"{type(exc).__name__}: {exc}"[:4096], "type": envelope.type.name if envelope else None},
        )

    def _read_monitor(self) -> None:
        while self._monitor.get(_EVENTS) & _POLLIN:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] != zmq.EVENT_DISCONNECTED or not self.options.detect_disconnect:
                continue
            address = event["endpoint"].decode(errors="replace")
            peer = self._by_address.get(address) or self._by_fd.pop(event["value"], None)
            if peer is not None:
                self._connection_gone(peer, f"connection closed ({address})")

    def _connection_gone(self, peer: str, reason: str) -> None:
        """The peer's connection is gone; it is declared lost at the end of this loop turn.

        Not at once: what it sent just before (answers, GOODBYE) may still be unread in our
        socket, and a lost peer's messages are dropped."""
        self._closing.setdefault(peer, reason)

    def _declare_gone_peers_lost(self) -> None:
        self._receive_batch()  # take what they sent before going
        closing, self._closing = self._closing, {}
        for peer, reason in closing.items():
            self._peer_lost(peer, reason)

    def _tick(self, now: float) -> None:
        """Heartbeats out, silent peers declared lost, retired lent buffers forgotten."""
        options = self.options
        lending.retire((), 0.0)
        if self._zap_held:
            self._answer_held_zap(now)
        if self._unwritten:
            self._flush_unwritten()  # in case a doorbell call was lost
        with self._lock:
            records = list(self._peers.values())
        for record in records:
            if record.state is PeerState.READY:
                if now - record.last_seen > options.peer_timeout:
                    self._peer_lost(
                        record.name, f"no message or heartbeat for {now - record.last_seen:.1f} s "
                        f"(peer_timeout={options.peer_timeout} s)"
                    )
                elif now - record.last_sent >= options.heartbeat_interval:
                    self._stats[record.name].heartbeats_sent += 1
                    self._send_to_peer(record.name, 0, self._heartbeat_frames, 0)
            elif record.state in (PeerState.EXPECTED, PeerState.CONNECTING):
                if now - record.since > options.connect_timeout:
                    self._peer_lost(record.name, f"did not complete HELLO within {options.connect_timeout} s")

    def _peer_lost(self, peer: str, reason: str, level: int = logging.WARNING) -> None:
        record = self._peers.get(peer)
        if record is not None and record.ring_in_active and record.state is not PeerState.LOST:
            self._read_ring(record)  # what it wrote before it went comes first
        with self._lock:
            record = self._peers.get(peer)
            if record is None or record.state is PeerState.LOST:
                return
            record.state = PeerState.LOST
            error = PeerLostError(peer, f"{self.identity}: lost peer {peer!r}: {reason}")
            record.lost_error = error
            waiting, record.waiting = record.waiting, deque()
            lent, record.lent = record.lent, {}
            record.lend, record.reader, record.offer = False, None, None
            record.in_libzmq, record.in_libzmq_bytes, record.lent_bytes = deque(), 0, 0
        # The peer may not know yet that it lost us, and still read what we lent it.
        lending.retire(lent.values(), self.options.peer_timeout)
        self._close_rings(record)
        log.log(level, "%s", error)
        if record.address is not None:
            self._by_address.pop(record.address, None)
            try:
                self._router.disconnect(record.address)  # stop libzmq reconnecting to it
            except zmq.ZMQError:
                pass
        if record.fd is not None and self._by_fd.get(record.fd) == peer:
            del self._by_fd[record.fd]
        record.ready.set()
        for message_id, _frames, _nbytes in waiting:
            self._report_send_error(peer, message_id, error)
        if self._on_peer_lost is not None:
            # After every message that arrived from the peer, on the thread that runs handlers.
            if self._inline is not None:
                self._inline.append((self._on_peer_lost, (peer, error)))
            else:
                self._to_dispatcher(self._on_peer_lost, (peer, error))

    def _fail_all_peers(self, reason: str) -> None:
        with self._lock:
            names = [name for name, r in self._peers.items() if r.state is not PeerState.LOST]
        for name in names:
            self._peer_lost(name, reason)

    def _say_goodbye(self) -> None:
        with self._lock:
            names = [name for name, r in self._peers.items() if r.state in (PeerState.READY, PeerState.CONNECTING)]
        goodbye = self.codec.encode(Message(MessageType.GOODBYE, 0, self.identity))
        for name in names:
            try:
                self._router.send_multipart([name.encode(), *goodbye], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # -------------------------------------------------------------- the dispatcher thread

    def _dispatch_main(self) -> None:
        adopt_torch_thread_settings()  # handlers may run torch ops
        dispatch_queue, waiter = self._dispatch_queue, self._dispatch_waiter

        def has_work() -> bool:
            return not dispatch_queue.empty()

        while True:
            self._wait(waiter, has_work, None)  # returns at once when work is queued
            item = dispatch_queue.get_nowait()
            if item is None:
                return  # the waiter's descriptors close with it, once nobody can wake it
            function, args = item
            try:
                function(*args)
            except Exception:
                log.exception("endpoint %s: callback %s failed", self.identity, getattr(function, "__name__", function))
            # Drop the message now, not when the next one arrives: its frames' memory is then
            # free for the allocator to hand to the next receive.
            del item, function, args

    def _deliver(self, peer: str, envelope: Envelope) -> None:
        message = self._decode(peer, envelope)
        if message is None:
            return
        try:
            self._on_message(message)
        except Exception:  # on the embedder's pool nobody else would see it
            log.exception("endpoint %s: on_message failed for %s from %s", self.identity, message.type.name, peer)

    def _decode(self, peer: str, envelope: Envelope) -> Message | None:
        tensors: list = []
        try:
            payload = self.codec.decode_payload(envelope, tensors)
        except (ProtocolError, DeviceMapError) as exc:
            self._reject_payload(peer, envelope, exc)
            return None
        return Message(envelope.type, envelope.id, envelope.sender, payload, tensors)

    def _reject_payload(self, peer: str, envelope: Envelope, exc: TransportError) -> None:
        log.warning("endpoint %s: malformed %s payload from %s: %s", self.identity, envelope.type.name, peer, str(exc))
        with self._lock:
            self._stats[peer].protocol_errors += 1
        try:
            self.send(peer, self._protocol_error_message(envelope, exc))
        except TransportError:
            pass  # the sender is gone or we are closing: nobody left to tell

    def _peer_rejected(self, peer: str, envelope: Envelope) -> None:
        """A peer answered that it could not decode one of our messages."""
        try:
            payload = self.codec.decode_payload(envelope)
            detail = payload.get("error") if isinstance(payload, dict) else None
        except ProtocolError:
            detail = None
        error = LocalProtocolError(f"peer {peer!r} rejected message {envelope.id}: {detail or 'malformed'}")
        log.warning("endpoint %s: %s", self.identity, error)
        if envelope.id and self._on_send_error is not None:
            self._on_send_error(peer, envelope.id, error)


_ZAP_HELD_MAX = 64  # connections waiting to be identified (NotYetKnown), at most


def _zap_address(request: list[bytes]) -> str:
    return request[3].decode(errors="replace") if len(request) > 3 else "?"


_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))
_DESCRIPTOR_LOOKS = 4  # a spinning thread's looks at the rings per look at its descriptors


def _spin_poll(poll: Callable[[float], bool], until: float) -> bool:
    """Poll without sleeping until ``until`` (``time.monotonic``); whether anything became
    ready. Between polls the thread yields its CPU (and the GIL) to anything runnable."""
    clock = time.monotonic
    while True:
        if poll(0):
            return True
        if clock() >= until:
            return False
        _yield_cpu()


def _last_uncopied(frames: list) -> int:
    """The index of the last frame pyzmq hands to libzmq without a copy (-1: none)."""
    for index in range(len(frames) - 1, -1, -1):
        if memoryview(frames[index]).nbytes >= zmq.COPY_THRESHOLD:
            return index
    return -1


def _too_large(peer: str, nbytes: int, limit: int) -> LocalProtocolError:
    return LocalProtocolError(f"message is {nbytes} bytes, the limit is {limit} (max_message_bytes of peer {peer!r})")


def _frames_nbytes(frames: list) -> int:
    return sum(memoryview(frame).nbytes for frame in frames)
