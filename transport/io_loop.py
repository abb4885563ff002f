"""The I/O thread: it opens and closes the sockets, polls them, drains the outbox, sends
and receives on the ROUTER and validates envelopes (see endpoint.py)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from . import bulk, lending, shm, staging
from .codec import CONTROL_TYPES as _CONTROL_TYPES
from .codec import Envelope, Message, MessageType
from .errors import (
    LocalProtocolError,
    PeerDepartedError,
    PeerLostError,
    ProtocolError,
    RemoteProtocolError,
    TransportError,
    UnknownPeerError,
)
from .peers import PeerState, PeerStats, _Peer
from .security import ZAP_ENDPOINT, ClusterKeys, Membership
from .tensors import adopt_torch_thread_settings
from .waiter import IoPoller, new_waiter
from .waiting import _spin_poll

if TYPE_CHECKING:
    from .endpoint import Endpoint

log = logging.getLogger(__name__)

# Plain ints: pyzmq's constants are enum members, and mixing them costs enum arithmetic on
# every message (measured: ~9 enum constructions per received message).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)

_RECV_BATCH = 256  # messages received per loop turn before the outbox gets a look again

_MAX_ZMQ_MS = (1 << 31) - 1  # libzmq's time options are C ints of milliseconds (24.8 days)
_ZERO_COPY_MIN = 1 << 16  # smaller messages are copied into their frames (cheaper to set up)


class OpenSocket(Protocol):
    """What the endpoint does with its zmq sockets once they are set up, typed as it does it:
    pyzmq's stubs type ``get`` as ``int | bytes``, and the options read through it here
    (EVENTS) are ints, looked at on every turn of the loop (no cast there)."""

    def get(self, option: int) -> int: ...
    def recv(self, flags: int = 0, copy: bool = True) -> Any: ...  # bytes, or a zmq.Frame with copy=False
    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False) -> Any: ...
    def recv_multipart(self, flags: int = 0) -> list[bytes]: ...
    def send_multipart(self, msg_parts: list, flags: int = 0) -> Any: ...
    def setsockopt(self, option: int, optval: int | bytes) -> None: ...
    def connect(self, addr: str) -> Any: ...
    def disconnect(self, addr: str) -> None: ...
    def close(self, linger: int | None = None) -> None: ...


def _opened(socket: zmq.Socket) -> OpenSocket:
    return cast(OpenSocket, socket)

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


def tick_after(now: float, interval: float) -> float:
    """When the I/O thread ticks next: the first multiple of ``interval`` after ``now`` on
    the monotonic clock, which every process on a host shares. Heartbeats between a host's
    idle peers then arrive together, and each process wakes for them about once an interval,
    not once per peer (16 idle workers on 2 cores: 0.33 CPU-s in 10 s, against 1.22 with
    ticks at random phases)."""
    tick = (now // interval + 1) * interval
    return tick if tick > now else tick + interval  # (1.0 // 0.1 is 9.0)


class IoThread:
    """The endpoint's I/O thread and the sending path (part of ``Endpoint``)."""

    # Made by _open_sockets before the constructor returns (it waits for them), so that every
    # thread may use them without a check.
    _router: OpenSocket
    _monitor: OpenSocket
    _zap: OpenSocket | None  # only with a membership or a cluster secret
    # The constructor's, which _open_sockets may change (no doorbell: no shared memory).
    _shm_host: str | None
    _bell: shm.Bell | None
    _flags: shm.Flags | None
    _start_error: BaseException | None
    _bulk: bulk.BulkLinks | None  # big buffers to peers on other hosts (transport/bulk.py)

    def _io_main(self: Endpoint, bind_list: list[str], started: threading.Event) -> None:
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

    def _open_sockets(self: Endpoint, bind_list: list[str]) -> None:
        router = self._context.socket(zmq.ROUTER)
        self._router = _opened(router)
        router.setsockopt(zmq.ROUTING_ID, self._identity_bytes)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Never drop and never block (flow control is above us), but bounded: with
        # ROUTER_MANDATORY a send past the bound fails, and that peer is dropped (_send_to_peer).
        router.setsockopt(zmq.SNDHWM, self.options.max_queued_messages)
        router.setsockopt(zmq.RCVHWM, 0)
        router.setsockopt(zmq.LINGER, int(self.options.close_linger * 1000))
        # ZMTP heartbeats let libzmq itself close connections to hosts that went silent: a
        # backstop, well after our own check (_tick), whose error says what happened ("no
        # message or heartbeat for ...") where a closed connection would not. libzmq pings
        # every connection each interval, busy or not, waking its I/O thread at both ends
        # (at one ping a second, 1.2% of the CPU of a fan-out to 15 workers on 2 cores): a
        # backstop needs only a few pings per timeout.
        options = self.options
        zmtp_timeout = min(int((options.peer_timeout + max(2 * options.heartbeat_interval, 1.0)) * 1000), _MAX_ZMQ_MS)
        zmtp_interval = min(int(max(options.heartbeat_interval, options.peer_timeout / 2) * 1000), _MAX_ZMQ_MS)
        router.setsockopt(zmq.HEARTBEAT_IVL, zmtp_interval)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, zmtp_timeout)
        # No HEARTBEAT_TTL: both ends ping and time out on their own, and libzmq's receiver
        # keeps the TTL in 16-bit milliseconds (libzmq issue 4226): one above 65.5 s wraps,
        # to 64 ms for 65.6 s, and then every ping closed a connection that is otherwise
        # quiet, as those of workers that talk through shared memory are.
        # libzmq refuses a frame larger than the limit as it arrives, before it buffers it
        # (the connection is closed). The codec checks the whole message after that; senders
        # check it first against the limit the peer's HELLO gave, so theirs fail cleanly.
        router.setsockopt(zmq.MAXMSGSIZE, min(self.codec.max_message_bytes, (1 << 63) - 1))
        self._monitor = _opened(router.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        self._guard: Membership | ClusterKeys | None = self.membership
        if self._guard is None and self.options.cluster_secret:
            self._guard = ClusterKeys.from_secret(self.options.cluster_secret)
        self._zap = None
        self._zap_held: deque = deque()  # (route, request, deadline, why) of not yet known credentials
        if self._guard is not None:
            zap = self._context.socket(zmq.ROUTER)  # this thread answers libzmq's auth requests
            self._zap = _opened(zap)
            zap.bind(ZAP_ENDPOINT)
            self._guard.configure_listener(router)
        for address in bind_list:
            if address.startswith("tcp://") and address.endswith(":0"):
                address = address[:-2] + ":*"
            router.bind(address)
            self.addresses.append(router.getsockopt(zmq.LAST_ENDPOINT).decode())
        # The ROUTER's own descriptor, not the socket: polling it touches no libzmq state, so
        # other threads may send while this one waits.
        self._bulk = self._open_bulk()
        self._router_fd = router.getsockopt(zmq.FD)
        self._shared_fds: list[int] = [self._router_fd]  # what the reading waiter watches with us
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
        others = [self._monitor] + ([self._zap] if self._zap is not None else [])
        self._io_poller: IoPoller = IoPoller(self._shared_fds, [socket.get(zmq.FD) for socket in others])
        self._by_address: dict[str, str] = {}  # connected address -> peer
        self._by_fd: dict[int, str] = {}  # accepted connection fd -> peer
        self._closing: dict[str, str] = {}  # peers whose connection is gone -> why
        self._received = 0  # application messages received, by any thread (under the socket lock)
        self._heartbeat_frames = self.codec.encode(Message(MessageType.HEARTBEAT, 0, self.identity))
        self._router_open = True

    def _open_bulk(self: Endpoint) -> bulk.BulkLinks | None:
        """Our bulk listener (transport/bulk.py), where it applies: over CURVE (HELLOs carry
        its keys, so they must be confidential), on TCP, with ``bulk_min`` set."""
        options = self.options
        guard = self._guard
        confidential = isinstance(guard, ClusterKeys) or (isinstance(guard, Membership) and guard.mechanism == "curve")
        host = bulk.listen_host(self.addresses[0]) if self.addresses else None
        if not (options.bulk_min and confidential and host and bulk.AVAILABLE):
            return None
        pool = staging.plain_pool(options.lend_cache, 1 << 16) if options.lend_cache else None
        try:
            return bulk.BulkLinks(host, options.bulk_min, options.bulk_window, self.codec.max_message_bytes,
                                  options.peer_timeout, pool, options.bulk_same_host, options.connect_timeout,
                                  self._bulk_broken, self._stop_reading_here)
        except OSError as exc:
            log.warning("endpoint %s: no bulk listener on %s (%s): big buffers go through the socket",
                        self.identity, host, exc)
            return None

    def _bulk_broken(self: Endpoint, peer: str, reason: str, link: object) -> None:
        """A bulk connection (``link``) of ``peer`` failed (called from a bulk thread): the
        I/O thread loses the peer, so that the calls waiting on it fail at once with the
        reason, if that is still the peer's link then."""
        with self._lock:
            if not self._closed:
                self._post_locked(("bulk_broken", peer, reason, link))

    def _close_sockets(self: Endpoint, linger: float) -> None:
        bulk_links = getattr(self, "_bulk", None)
        if bulk_links is not None:
            bulk_links.close(linger)
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
        for name in ("_monitor", "_zap"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close(linger=0)
        poller = getattr(self, "_io_poller", None)
        if poller is not None:
            with self._lock:  # nobody wakes it once closed (_wake_io_locked; the loop has ended)
                self._io_asleep = False
            poller.close()

    def _io_loop(self: Endpoint) -> None:
        interval = self.options.heartbeat_interval
        last_tick = time.monotonic()
        next_tick = tick_after(last_tick, interval)
        poller = self._io_poller
        poll = poller.poll
        router = self._router
        socket_lock = self._socket_lock
        busy_poll = self.options.busy_poll
        io_spin = min(self.options.spin, shm.IO_SPIN)
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
            # Unlocked: a sender that still sees True only sends one wake-up too many. (The
            # poll consumed the wake-up; every socket's descriptor is edge-triggered: look at
            # each, whatever woke us.)
            self._io_asleep = False
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
                        self._tick(now, last_tick)
                        next_tick = tick_after(now, interval)
                        last_tick = time.monotonic()  # after the heartbeats it sent
            if self._inline:
                self._run_inline()
            if closing:
                return
            # With peers on shared-memory rings, the I/O thread spins after traffic too (for
            # shm.IO_SPIN, at most ``spin``): answers that reach no waiting thread (rpc_async
            # callers, who wait on torch futures) then need no wake-up either.
            window = max(busy_poll, io_spin) if self._rings_in else busy_poll
            if active and window:
                busy_until = time.monotonic() + window

    def _run_inline(self: Endpoint) -> None:
        """Run the handlers of what the last batch received (inline_handlers), in order."""
        inline = self._inline
        while inline:
            function, args = inline.popleft()
            try:
                function(*args)
            except Exception:
                log.exception("endpoint %s: callback %s failed", self.identity, getattr(function, "__name__", function))

    def _drain_outbox(self: Endpoint) -> bool:
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
            elif kind == "bulk_broken":
                _, peer, reason, link = command
                if self._bulk is not None and self._bulk.is_current(peer, link):
                    self._peer_lost(peer, reason)
            elif kind == "zap":
                if self._zap_held:
                    self._answer_held_zap()
            elif kind == "shm_start":
                _, peer, ring, flags = command
                self._start_ring(peer, ring, flags)
            elif kind == "close":
                self._finish_rings()
                if self._bulk is not None:
                    self._bulk.close(self.options.close_linger)  # big buffers before the GOODBYE
                self._say_goodbye()
                return False
            # "releases": a reading thread queued some (_borrowed_done); they go below.
        if self._releases:
            self._send_releases()
        return True

    def _send_to_peer(self: Endpoint, peer: str, message_id: int, frames: list, nbytes: int, hello: bool = False) -> None:
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
            self._report_send_error(peer, message_id, error or PeerLostError(peer, f"lost peer {peer!r}"))
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
        elif (bulk_links := self._bulk) is not None and nbytes >= bulk_links.min_bytes and record.ring_out is None \
                and bulk_links.uses(peer):
            frames, diverted = bulk_links.divert(peer, frames)
            if diverted:
                stats.buffers_bulk += diverted
                copy = True
                self._bound_queued(record, bulk_links.queued_bytes(peer))  # it may stop reading its link
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

    def _in_libzmq(self: Endpoint, record: _Peer, tracker: zmq.MessageTracker, nbytes: int) -> None:
        """A zero-copy message went to libzmq for ``record``: count what libzmq still holds
        for it, and drop it once that passes ``max_queued_bytes`` (socket lock held)."""
        queued = record.in_libzmq
        while queued and queued[0][0].done:
            record.in_libzmq_bytes -= queued.popleft()[1]
        queued.append((tracker, nbytes))
        record.in_libzmq_bytes += nbytes
        self._bound_queued(record, record.in_libzmq_bytes)

    def _wait_for_room(self: Endpoint, record: _Peer, pieces: list) -> None:
        """Queue what has no room in the peer's ring yet, bounded as ``_in_libzmq``."""
        record.unwritten.extend(pieces)
        record.unwritten_bytes += sum(len(piece) for piece in pieces)
        self._bound_queued(record, record.unwritten_bytes)

    def _bound_queued(self: Endpoint, record: _Peer, nbytes: int) -> None:
        """``nbytes`` of ours wait for ``record`` (in libzmq, for its ring, lent to it): past
        ``max_queued_bytes`` it is dropped, as a peer that does not read (socket lock held)."""
        limit = self.options.max_queued_bytes
        if limit and nbytes > limit and record.name not in self._closing:
            self._connection_gone(record.name, f"it does not read: {nbytes} bytes wait for it "
                                               f"(max_queued_bytes={self.options.max_queued_bytes})")

    def _report_send_error(self: Endpoint, peer: str, message_id: int, error: TransportError) -> None:
        if message_id and self._on_send_error is not None:
            self._to_dispatcher(self._on_send_error, (peer, message_id, error))

    def _receive_batch(self: Endpoint) -> bool:
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

    def _apply_shared_state(self: Endpoint, record: _Peer, envelope: Envelope) -> None:
        """The control messages that keep the two ends' shared state in step (a lent
        buffer's release, a ring's offer and switch-over): applied in a partition too."""
        kind = envelope.type
        if kind is MessageType.LEND_RELEASE:
            self._lend_released(record, envelope)
        elif kind is MessageType.SHM_OFFER:
            self._ring_offered(record, envelope)
        elif kind is MessageType.SHM_START:
            self._ring_started(record, envelope)

    def _handle_incoming(self: Endpoint, frames: list) -> None:
        """One received message: ``frames[0]`` is the sender's routing id (a zmq.Frame from the
        socket, bytes from a ring), the rest its frames."""
        routing_id = frames[0] if type(frames[0]) is bytes else frames[0].bytes
        try:
            peer = routing_id.decode()
        except UnicodeDecodeError:
            peer = "<raw:" + routing_id.hex() + ">"
        try:
            borrowed = len(frames) > 2 and lending.is_table(frames[1])
            if borrowed:
                frames = self._borrow(peer, frames)
            envelope = self.codec.decode_envelope(frames[1:])
            if borrowed and envelope.type in _CONTROL_TYPES:
                # Decoded under the socket lock, where nothing may wait for bytes: no
                # control message carries a buffer.
                raise RemoteProtocolError(f"{envelope.type.name} from {peer!r} carries lent or bulk buffers")
            if envelope.sender != peer:
                raise RemoteProtocolError(
                    f"sender field {envelope.sender!r:.60} does not match the connection's identity {peer!r}"
                )
        except ProtocolError as exc:
            self._protocol_error(routing_id, peer, None, exc)
            return
        if self.faults is not None and self.faults.is_partitioned(peer):
            # Injected partition: nothing gets through, heartbeats included; but what keeps
            # the two ends' transport state in step is applied. Dropping the release of a
            # buffer we lent would leak it; dropping the switch to a ring (a ring is made on
            # a peer's first message, so a partition can come in the middle of it) would
            # leave the peer writing to a ring we never read, after the partition healed too.
            # (The messages that come through the ring are partitioned like the socket's.)
            record = self._peers.get(peer)
            if record is not None:
                self._apply_shared_state(record, envelope)
            return
        record = self._peers.get(peer)
        if envelope.type is MessageType.HELLO:
            record = self._hello(peer, frames[1], envelope)
            if record is None:
                return  # refused (logged and counted)
        if record is None:
            self._protocol_error(
                routing_id, peer, envelope, RemoteProtocolError(f"{envelope.type.name} from {peer!r} before HELLO")
            )
            return
        if record.state is PeerState.LOST:
            log.warning("endpoint %s: dropped %s from lost peer %s", self.identity, envelope.type.name, peer)
            return
        record.last_seen = time.monotonic()
        stats = self._stats[peer]  # made with the record
        stats.messages_received += 1
        stats.bytes_received += envelope.nbytes
        kind = envelope.type
        if kind in _CONTROL_TYPES:
            if kind is MessageType.HEARTBEAT:
                stats.heartbeats_received += 1
            elif kind is MessageType.GOODBYE:
                self._peer_lost(peer, "the peer closed its endpoint", level=logging.INFO, kind=PeerDepartedError)
            elif kind is MessageType.PROTOCOL_ERROR:
                self._to_dispatcher(self._peer_rejected, (peer, envelope))
            elif kind is MessageType.LEND_OFFER:
                self._lend_offered(record, envelope)
            elif kind is MessageType.LEND_READY:
                record.lend = record.offer is not None  # it read what we offered it
            else:
                self._apply_shared_state(record, envelope)
            return
        self._received += 1
        if record.ring_due:
            self._offer_ring(record)
        if self._on_envelope is not None and self._on_envelope(peer, envelope):
            return
        if self._inbox is not None:
            self._to_inbox((peer, envelope))
        elif self._inline is not None:
            self._inline.append((self._deliver, (peer, envelope)))
        elif self._executor is not None:
            refusal = self._executor(self._deliver, peer, envelope)
            if refusal is not None:
                self._refuse(record.routing_id, peer, envelope, refusal)
        else:
            self._to_dispatcher(self._deliver, (peer, envelope))

    def _protocol_error(self: Endpoint, routing_id: bytes, peer: str, envelope: Envelope | None, exc: ProtocolError) -> None:
        """Count and log a malformed message, and tell the sender unless that could loop. The
        log gets the error's text, never the error: a handler that keeps records (pytest's,
        a memory handler) would keep, through its traceback, the refused message's frames."""
        log.warning("endpoint %s: malformed message from %s: %s", self.identity, peer, str(exc))
        with self._lock:
            self._stats.setdefault(peer, PeerStats()).protocol_errors += 1
        if envelope is not None and envelope.type in _CONTROL_TYPES:
            return  # never answer a control message with another: two broken peers could loop
        self._answer_at_once(routing_id, self._protocol_error_message(envelope, exc))

    def _answer_at_once(self: Endpoint, routing_id: bytes, message: Message) -> None:
        """Send ``message`` straight on the ROUTER from the receiving thread (socket lock
        held): answers to what we will not take, which must wait behind nothing."""
        try:
            self._router.send_multipart([routing_id, *self.codec.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the sender is gone, or its queue is full: its call times out instead

    def _refuse(self: Endpoint, routing_id: bytes, peer: str, envelope: Envelope, reason: str) -> None:
        """The executor refused a message (``reason``: its words): answer it at once, on the
        receiving thread, so that the refusal waits behind nothing and holds no memory. The
        sender fails that call with :class:`PeerOverloadedError`."""
        with self._lock:
            stats = self._stats.setdefault(peer, PeerStats())
            stats.refused += 1
            refused = stats.refused
        if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, 8th... : a flood logs a few lines
            log.warning("endpoint %s: refused %s from %s (%d so far): %s", self.identity, envelope.type.name, peer,
                        refused, reason)
        self._answer_at_once(routing_id, Message(MessageType.PROTOCOL_ERROR, envelope.id, self.identity,
                                                 {"error": reason[:4096], "type": envelope.type.name, "overloaded": True}))

    def _protocol_error_message(self: Endpoint, envelope: Envelope | None, exc: Exception) -> Message:
        """The PROTOCOL_ERROR answer to a message we could not read (the envelope, if it was)."""
        return Message(
            MessageType.PROTOCOL_ERROR,
            envelope.id if envelope else getattr(exc, "message_id", 0),
            self.identity,
            {"error": f"{type(exc).__name__}: {exc}"[:4096], "type": envelope.type.name if envelope else None},
        )

    def _read_monitor(self: Endpoint) -> None:
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
