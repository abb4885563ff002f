"""A ZeroMQ endpoint: one ROUTER socket per worker, guarded by one socket lock.

Threads:

* the **I/O thread** owns the endpoint's auxiliary sockets (the monitor socket, the ZAP
  socket) and does everything on the ROUTER except the sending of application messages: it
  receives, validates envelopes, answers transport control messages, sends heartbeats,
  connects and watches for dead peers. Other threads wake it through one eventfd.
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

Opt-in busy polling (``EndpointOptions.busy_poll``): after application traffic that it handled
the I/O thread keeps polling, yielding its CPU between polls, instead of sleeping, for that
long (traffic a waiting thread reads itself needs no I/O thread awake); where waking
a sleeping thread is slow (VMs), answers then find a thread already running (docs/transport.md).
With peers on shared-memory rings (transport/shm.py) it does so for ``EndpointOptions.spin``
at least, and waiting threads spin up to that long before they sleep (as long as their waits
have shown a spin to pay: transport/waiting.py, ``learn_spin``).

Peer loss is detected three ways, whichever is first: the connection closes (monitor events;
immediate when a process dies), nothing heard for ``peer_timeout`` (application heartbeats,
which also work through a network that silently drops), or the peer says GOODBYE on close.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import zmq

from . import descriptors, faults, lending, shm, staging
from .codec import Codec, Envelope, Message, MessageType
from .dispatcher import Dispatcher
from .errors import (
    EndpointClosedError,
    PeerLostError,
    TransportError,
    UnknownPeerError,
)
from .faults import FaultPolicy
from .handshake import Handshake
from .io_loop import _EVENTS, _POLLIN, IoThread, _frames_nbytes, _too_large
from .lend_protocol import LendingProtocol
from .liveness import Liveness
from .peers import EndpointOptions, PeerState, PeerStats, _Peer
from .ring_protocol import RingProtocol
from .security import Membership
from .waiter import AnyWaiter
from .waiting import WaitingThreads

log = logging.getLogger(__name__)


class Endpoint(IoThread, WaitingThreads, Handshake, LendingProtocol, RingProtocol, Liveness, Dispatcher):
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
            queue fairly by it) on the embedder's own thread pool and returns None; or it
            refuses the work and returns why (the endpoint answers the message at once, and
            the sender's call fails with ``PeerOverloadedError`` saying so). When given,
            incoming messages are decoded and passed to ``on_message`` on that pool, handed
            over by the receiving thread directly: one thread hop fewer than through the
            dispatcher thread, no ordering between messages. It must not block.
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
        executor: Callable[..., str | None] | None = None,
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
        self._shm_host: str | None = lending.host_key() if self.options.shm_ring and shm.SUPPORTED else None
        self._bell: shm.Bell | None = None
        self._flags: shm.Flags | None = None  # our spinning / pending flags, mapped by writers
        self._rings_in: tuple = ()
        self._ring_slots: list = []  # the peer whose ring has each slot of our Flags page's marks (None: free)
        self._unwritten: set[str] = set()
        self._spinning: bool = False
        self._spinning_for_work = False  # the spinning thread waits for work (waiting.py, _spin)
        self._spin_wanted = False  # a caller waiting for an answer asks that spinner to stop
        self._challenge = os.urandom(lending.CHALLENGE_BYTES)
        self._releases: deque = deque()
        self._transfer_ids = itertools.count(1)
        self._bulk = None  # made by the I/O thread once bound (io_loop.py, _open_bulk)

        self._lock: threading.Lock = threading.Lock()  # guards the peer table, outbox hand-over and closing
        # Held for every use of the ROUTER (see the module's docstring). Lock order: the socket
        # lock first, then ``_lock``; never the other way round.
        self._socket_lock: threading.Lock = threading.Lock()
        self._router_open: bool = False
        self._peers: dict[str, _Peer] = {}
        self._stats: dict[str, PeerStats] = {}
        self._outbox: deque = deque()
        self._io_asleep = False
        self._closed = False
        self._close_called = False
        self._thread_local = threading.local()  # .waiter: each thread's (waiting.py)
        self._open_file_room = 0  # the soft open-file limit when last raised for our peers
        self._dispatch_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue | None = None if on_message else queue.SimpleQueue()
        # With inline_handlers: callbacks the I/O thread runs after its receive batch (only
        # the I/O thread appends and pops).
        self._inline: deque | None = deque() if inline_handlers else None
        # Waiting threads read the ROUTER themselves (transport/waiter.py): the callers of
        # recv() and wait_until(), and the dispatcher when it delivers messages. Not with
        # inline_handlers, whose handlers run where the I/O thread received.
        self._waiters_read = not inline_handlers
        self._dispatcher_reads: bool = on_message is not None and executor is None and not inline_handlers
        self._reading_waiter: AnyWaiter | None = None  # the one watching the ROUTER (socket lock)
        # Waits for an answer going on (wait_until, recv()): when each began (no lock, see
        # WaitingThreads._take_reading_role).
        self._answer_waits: dict[object, float] = {}
        self._recv_waiters: set[AnyWaiter] = set()

        self._context: zmq.Context = zmq.Context()
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

    def forget_peer(self, peer: str) -> None:
        """Drop what is left of a lost peer, so that a peer of that name can be added again
        (a worker that left a dynamic group and joins it again)."""
        with self._lock:
            record = self._peers.get(peer)
            if record is not None and record.state is PeerState.LOST:
                del self._peers[peer]

    def connect(self, peer: str, address: str) -> None:
        """Connect to ``peer`` at ``address``; messages to it may be sent right away."""
        with self._lock:
            self._check_open()
            existing = self._peers.get(peer)
            if existing is not None and existing.state is not PeerState.EXPECTED:
                raise ValueError(f"peer {peer!r} is already {existing.state.value}")
            self._new_peer_locked(peer, PeerState.CONNECTING, address)
            self._post_locked(("connect", peer, address))

    def expect(self, peer: str) -> None:
        """Declare that ``peer`` will connect to us; messages to it wait for its HELLO."""
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                self._new_peer_locked(peer, PeerState.EXPECTED)

    def _new_peer_locked(self, peer: str, state: PeerState, address: str | None = None) -> _Peer:
        """A new peer's record (caller holds the lock), with room for its descriptors under
        the process's open-file limit (transport/descriptors.py)."""
        peers = len(self._peers) + 1
        if descriptors.room_for(peers) > self._open_file_room:
            self._open_file_room = descriptors.make_room(peers)
        record = self._peers[peer] = _Peer(peer, state, address=address)
        self._stats.setdefault(peer, PeerStats())
        return record

    def wait_for_peer(self, peer: str, timeout: float | None = None) -> None:
        """Block until HELLO has been exchanged with ``peer``."""
        with self._lock:
            record = self._peers.get(peer)
        if record is None:
            raise UnknownPeerError(peer, f"{self.identity}: unknown peer {peer!r}")
        # (a lock wait refuses more than threading.TIMEOUT_MAX: longer is no limit)
        if not record.ready.wait(None if timeout is None or timeout >= threading.TIMEOUT_MAX else timeout):
            raise TimeoutError(descriptors.explained(
                f"{self.identity}: peer {peer!r} did not connect within {timeout} s"))
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
                raise type(record.lost_error)(peer, str(record.lost_error))  # (a fresh one: no traceback kept)
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


    def _to_inbox(self, item: tuple | None) -> None:
        inbox = self._inbox
        assert inbox is not None, "only an endpoint without on_message has an inbox"
        inbox.put(item)
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
        a peer that was not asked, say): counted in its ``protocol_errors``, and logged: the
        peer's first as a warning, the rest at debug level (a peer that keeps at it must not
        flood the log)."""
        with self._lock:
            stats = self._stats.setdefault(peer, PeerStats())
            stats.protocol_errors += 1
            first = stats.protocol_errors == 1
        if first:
            log.warning("endpoint %s: protocol error from %s: %s (further ones of this peer are logged at debug level)",
                        self.identity, peer, reason)
        else:
            log.debug("endpoint %s: protocol error from %s: %s", self.identity, peer, reason)

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
        """Wake the I/O thread if it sleeps (caller holds the lock). Its poller's wake-up
        descriptor stays open while ``_io_asleep`` may be true (_close_sockets)."""
        if self._io_asleep:
            self._io_asleep = False
            self._io_poller.wake()
