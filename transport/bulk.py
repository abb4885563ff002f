"""Big buffers between hosts on a connection of their own, sealed with AES-256-GCM.

CurveZMQ seals every byte with libsodium's XSalsa20-Poly1305 on libzmq's I/O thread, at
120-240 MB/s on the development VM; OpenSSL's AES-256-GCM (through ``cryptography``) seals
and opens ~10 GB/s on the same CPU, with the GIL released. So a buffer of at least
``EndpointOptions.bulk_min`` bytes to a peer on another host goes over a plain TCP
connection of its own (the *bulk connection*, one per direction and pair), sealed by us, and
the message on the CURVE socket carries only where to find it:

```
[routing id] [0xc1 + msgpack [[buffer_index, transfer_id, nbytes], ...]] [envelope] [buffer 1] ...
```

(the table of lending, transport/lending.py, whose entries have four fields; a bulk entry has
three), with an empty frame in each such buffer's place.

**Keys.** Each HELLO over CURVE (confidential and authenticated as the member: only the
holder of the member's secret key reads it) carries, for the peer it goes to, our bulk
listener's address, a fresh 256-bit key and a 16-byte connection id: what that peer must
use to send to us. So a key is bound to the CURVE identities at both ends, is used for one
connection only, and nobody else can seal a record under it.

**Wire.** The connecting side sends ``MAGIC`` and the connection id, then records:

```
[transfer_id u64] [total u64] [length u32]   (the header: 20 bytes, in clear, authenticated)
[ciphertext of length bytes] [GCM tag, 16 bytes]
```

sealed under the connection's key with a nonce that counts the connection's records (never
sent), the header as associated data. A flipped, dropped, replayed, reordered or injected
byte makes a record fail to open (or its header fail a check); the receiver then drops the
connection, fails every transfer of that peer with an error that names it, and the endpoint
loses the peer. Each transfer's records follow each other, ``total`` bytes in all; transfer
ids rise.

**Bounds.** ``total`` is checked against ``max_message_bytes`` before anything is allocated,
and the bytes of transfers that arrived (or are arriving) and that no message has taken yet
are bounded per peer (``window``): past it, the reader stops reading that connection (TCP
pushes back) until messages take theirs. A transfer is taken by the message that names it,
when that message arrives on the socket: transfers before it that no message named were
orphaned (their message was lost) and are dropped then.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import RemoteProtocolError
from .lending import encode_table, host_identity  # (the buffer table's format is lending's)
from .staging import BufferPool
from .tensors import as_buffer

try:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    AVAILABLE = True
except ImportError:  # pragma: no cover - a dependency; without it, big buffers stay on CURVE
    AVAILABLE = False

log = logging.getLogger(__name__)

MAGIC = b"ZQBULK01"
ACK = b"\x01"  # the listener's answer to a connection id it knows
KEY_BYTES = 32
ID_BYTES = 16
TAG_BYTES = 16
_HEADER = struct.Struct(">QQI")
HEADER_BYTES = _HEADER.size
# Records of 256 KiB: sealing, the wire and opening overlap record by record (the sender
# seals the next while the receiver opens the last); each costs a few Python calls a side.
RECORD_BYTES = 256 << 10
DEFAULT_BULK_MIN = 256 << 10
# Smaller buffers are copied into their message (never zero-copy); a receiver refuses smaller
# transfers: answers that small are decoded under the socket lock, where nothing may wait.
MIN_BULK_BYTES = 64 << 10
PREAMBLE_TIMEOUT = 10.0  # a connection must name itself within this, in all
MAX_UNNAMED_CONNECTIONS = 64  # accepted connections that have not named themselves yet, at most
MAX_UNNAMED_TRANSFERS = 256  # per peer: transfers that arrived and no message named yet, at most
# A named transfer must come at least this fast (after a first peer_timeout): a member that
# trickles bytes cannot hold the thread that waits for them for longer.
FLOOR_RATE = 1 << 20  # bytes a second


def new_secrets() -> tuple[bytes, bytes]:
    """A fresh key and connection id, for one peer to send to us with."""
    return os.urandom(KEY_BYTES), os.urandom(ID_BYTES)


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


class BulkError(RemoteProtocolError):
    """A bulk connection failed: tampered with, cut, or silent."""


# ------------------------------------------------------------------------------ sending


class BulkSender:
    """Our bulk connection to one peer: one thread owns its socket. It connects at once;
    ``connected`` is set once it did (until then, and for good if it cannot, big buffers
    go through the socket: ``unusable`` says why). Then it seals the queued buffers record
    by record and writes them, in the order queued (the order of the messages that name
    them). ``on_broken(self, reason)`` once if the connection breaks; what is queued then
    is dropped."""

    def __init__(self, peer: str, address: tuple[str, int], key: bytes, connection_id: bytes,
                 on_broken: Callable[[BulkSender, str], None], connect_timeout: float):
        self.peer = peer
        self._address = address
        self._aead = AESGCM(key)
        self.key = key
        self.connection_id = self._id = connection_id
        self._on_broken = on_broken
        self._connect_timeout = connect_timeout
        self._queue: deque = deque()
        self._ready = threading.Condition(threading.Lock())
        self._closing = False
        self._linger_until: float | None = None
        self.queued_bytes = 0
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self.connected = threading.Event()
        self.unusable: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"zmq-bulk-to-{peer}", daemon=True)
        self._thread.start()

    def send(self, buffer: Any) -> tuple[int, int]:
        """Queue ``buffer`` (it must not change until written); its (transfer id, size)."""
        view = memoryview(buffer).cast("B")
        transfer_id = next(self._ids)
        with self._ready:
            self._queue.append((transfer_id, view))
            self.queued_bytes += view.nbytes
            self._ready.notify()
        return transfer_id, view.nbytes

    def close(self, deadline: float) -> None:
        """Stop once what is queued has gone, at the latest at ``deadline`` (monotonic):
        then the connection is cut, whatever is left."""
        with self._ready:
            self._closing = True
            self._linger_until = deadline
            self._ready.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        sock = self._sock
        if self._thread.is_alive() and sock is not None:
            _shut(sock)  # a write blocked on a peer that does not read

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        where = f"{self._address[0]}:{self._address[1]}"
        try:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # (NATs drop idle links)
            sock.sendall(MAGIC + self._id)
            if _read_by(sock, len(ACK), time.monotonic() + self._connect_timeout) != ACK:
                raise OSError("the peer did not take it")
            sock.settimeout(None)
        except (OSError, EOFError) as exc:
            # A firewall that lets only the socket's port through, an address we cannot
            # reach, a listener crowded by strangers: big buffers to this peer go through
            # the socket, as before.
            self.unusable = f"cannot open the bulk connection to {where}: {exc}"
            log.warning("bulk: %s: %s; its big buffers go through the socket", self.peer, self.unusable)
            return
        self._sock = sock
        self.connected.set()
        try:
            self._write_queued(sock)
        except Exception as exc:  # OSError mostly; anything else must not end the thread unsaid
            if not self._closing:
                self._broken(f"the bulk connection to {where} broke: {exc}")
        finally:
            sock.close()

    def _write_queued(self, sock: socket.socket) -> None:
        scratch = bytearray(HEADER_BYTES + RECORD_BYTES + TAG_BYTES)
        out = memoryview(scratch)
        seal = self._aead.encrypt_into
        counter = 0
        while True:
            with self._ready:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if not self._queue or (self._closing and time.monotonic() > (self._linger_until or 0)):
                    return
                transfer_id, view = self._queue[0]
            total = view.nbytes
            offset = 0
            while offset < total:
                length = min(RECORD_BYTES, total - offset)
                header = _HEADER.pack(transfer_id, total, length)
                out[:HEADER_BYTES] = header
                seal(_nonce(counter), view[offset:offset + length], header,
                     out[HEADER_BYTES:HEADER_BYTES + length + TAG_BYTES])
                counter += 1
                sock.sendall(out[:HEADER_BYTES + length + TAG_BYTES])
                offset += length
            with self._ready:
                self._queue.popleft()
                self.queued_bytes -= total

    def _broken(self, reason: str) -> None:
        with self._ready:
            self._closing = True
            self._queue.clear()
            self.queued_bytes = 0
        log.warning("bulk: %s: %s", self.peer, reason)
        self._on_broken(self, reason)


# ------------------------------------------------------------------------------ receiving


class _Transfer:
    __slots__ = ("transfer_id", "nbytes", "block", "view", "received", "error", "taken")

    def __init__(self, transfer_id: int, nbytes: int):
        self.transfer_id = transfer_id
        self.nbytes = nbytes
        self.block: Any = None
        self.view: memoryview | None = None
        self.received = 0
        self.error: str | None = None
        self.taken = False  # named by a message that arrived


class BulkInbox:
    """What one peer sends us over its bulk connection: transfers by id, arriving, arrived,
    named by a message or not yet. Shared by the connection's reader thread (which fills
    transfers) and the threads that decode the messages naming them (which take them);
    one lock, ``_changed``, guards it all, except drops from collected frames, which only
    queue (``drop``: a collection may run inside any lock).

    Bounds: transfers that no message named yet (a member can send those at will) count
    against the window and MAX_UNNAMED_TRANSFERS; past either, the reader waits (and TCP
    pushes the peer back). A named transfer's bytes are its message's, held as a queued
    message's frames were on the socket, and never wait for room: so a decoder that waits
    for one never waits on others' decoders."""

    def __init__(self, peer: str, key: bytes, connection_id: bytes, max_bytes: int, window: int,
                 pool: BufferPool | None, silence: float):
        self.peer = peer
        self.key = key
        self.connection_id = connection_id
        self.max_bytes = max_bytes
        # One message of any allowed size fits; more than two never need to wait here.
        self.window = max(min(window, 2 * max_bytes), max_bytes)
        self._pool = pool
        self._silence = silence
        self._changed = threading.Condition(threading.RLock())
        self._transfers: dict[int, _Transfer] = {}
        self._held = 0  # bytes of transfers allocated and not yet handed to a decoder
        self._unnamed: deque[int] = deque()  # ids of allocated transfers no message named, in order
        self._unnamed_bytes = 0
        self._unnamed_count = 0
        self._dropped: deque[int] = deque()  # ids of transfers whose frames went unread (drop)
        # Called once when the link must be given up without a reader to say so (silence
        # before any connection): set by the receiver.
        self.on_silent: Callable[[str], None] | None = None
        self._last_arrived = 0  # the highest transfer id the connection started
        self._named_upto = 0  # the highest transfer id a message named
        self._progress = time.monotonic()
        self.error: str | None = None
        self.connected = False
        self.sock: socket.socket | None = None
        self.draining = False  # the peer said GOODBYE: read what it sent, take nothing new

    # --- the I/O thread, as a message naming transfers arrives

    def name(self, transfer_id: int, nbytes: int) -> None:
        """A message names ``transfer_id`` of ``nbytes``: it will take it when decoded.
        Transfers before it that no message named are dropped (their message was lost)."""
        with self._changed:
            self._drop_queued_locked()
            if transfer_id <= self._named_upto:
                raise RemoteProtocolError(f"bulk transfer {transfer_id} from {self.peer!r} named twice or out of order")
            unnamed = self._unnamed
            while unnamed and unnamed[0] < transfer_id:  # in id order: each is looked at once
                old = self._transfers.get(unnamed[0])
                if old is not None and not old.taken:
                    self._drop_locked(old)
                else:
                    unnamed.popleft()
            self._named_upto = transfer_id
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                transfer = self._transfers[transfer_id] = _Transfer(transfer_id, nbytes)
            elif transfer.nbytes != nbytes:
                self._drop_locked(transfer)
                raise RemoteProtocolError(f"bulk transfer {transfer_id} from {self.peer!r} is {transfer.nbytes} bytes, "
                                          f"its message says {nbytes}")
            else:
                self._forget_unnamed_locked(transfer)
            transfer.taken = True

    # --- the decoding thread

    def take(self, transfer_id: int) -> memoryview:
        """The bytes of a named transfer, once all arrived (waiting for them). Raises
        BulkError if the connection breaks, brings nothing for ``silence`` seconds, or
        brings this transfer slower than FLOOR_RATE (a member trickling bytes cannot hold
        the thread that waits)."""
        began = time.monotonic()
        with self._changed:
            self._drop_queued_locked()
            transfer = self._transfers.get(transfer_id)
            deadline = began + self._silence + (transfer.nbytes if transfer is not None else 0) / FLOOR_RATE
            while True:
                if transfer is None:
                    raise BulkError(self.error or f"bulk transfer {transfer_id} from {self.peer!r} was dropped")
                if transfer.error is not None:
                    self._drop_locked(transfer)
                    raise BulkError(transfer.error)
                view = transfer.view
                if view is not None and transfer.received == transfer.nbytes:
                    del self._transfers[transfer_id]
                    self._held -= transfer.nbytes
                    return view
                if self.error is not None:
                    self._drop_locked(transfer)
                    raise BulkError(self.error)
                now = time.monotonic()
                waited = now - max(self._progress, began)  # (an idle link made none)
                if waited > self._silence:
                    reason = (f"no bulk data from {self.peer!r} for {waited:.0f} s: transfer {transfer_id} has "
                              f"{transfer.received} of {transfer.nbytes} bytes")
                    break
                if now > deadline:
                    reason = (f"bulk transfer {transfer_id} from {self.peer!r} too slow: {transfer.received} of "
                              f"{transfer.nbytes} bytes in {now - began:.0f} s")
                    break
                self._changed.wait(min(1.0, self._silence))
        # The connection is stuck mid-transfer: nothing after it can come either. Cut it;
        # its reader then reports the peer lost, with this reason.
        if not self.cut(reason) and self.on_silent is not None:
            self.on_silent(reason)  # never connected: no reader will say it
        raise BulkError(reason)

    def arrived(self, transfer_id: int) -> bool:
        """Whether all of ``transfer_id`` is here (``take`` would not wait)."""
        with self._changed:
            transfer = self._transfers.get(transfer_id)
            return transfer is not None and transfer.view is not None and transfer.received == transfer.nbytes

    def drop(self, transfer_id: int) -> None:
        """A message that named ``transfer_id`` went unread: its bytes are not needed. Only
        queued here (this runs from a finalizer, which may fire inside any lock, the pool's
        included); the inbox's next user lets them go."""
        self._dropped.append(transfer_id)

    def _drop_queued_locked(self) -> None:
        dropped = self._dropped
        while dropped:
            transfer = self._transfers.get(dropped.popleft())
            if transfer is not None:
                self._drop_locked(transfer)

    def _forget_unnamed_locked(self, transfer: _Transfer) -> None:
        if transfer.view is not None and not transfer.taken:
            self._unnamed_bytes -= transfer.nbytes
            self._unnamed_count -= 1
            self._changed.notify_all()  # a reader may wait for room

    def _drop_locked(self, transfer: _Transfer) -> None:
        if self._transfers.pop(transfer.transfer_id, None) is not None and transfer.view is not None:
            self._held -= transfer.nbytes
            self._forget_unnamed_locked(transfer)
            self._changed.notify_all()
        transfer.view = None
        transfer.block = None

    # --- the reader thread

    def start(self, transfer_id: int, total: int, hung_up: Callable[[], bool]) -> _Transfer | None:
        """A transfer's first record arrived: the transfer to fill (None: drop its bytes).
        One no message named yet waits for room first: the peer waits with it (unless it
        hangs up: ``hung_up``, then EOFError)."""
        if not MIN_BULK_BYTES <= total <= self.max_bytes:
            raise BulkError(f"bulk transfer {transfer_id} from {self.peer!r} of {total} bytes: the limits are "
                            f"{MIN_BULK_BYTES} and {self.max_bytes} (max_message_bytes)")
        if transfer_id <= self._last_arrived:
            raise BulkError(f"bulk transfer {transfer_id} from {self.peer!r} after transfer {self._last_arrived}")
        with self._changed:
            self._drop_queued_locked()
            self._last_arrived = transfer_id
            transfer = self._transfers.get(transfer_id)
            while self.error is None and transfer is None and not self.draining and (
                    self._unnamed_bytes + total > self.window or self._unnamed_count >= MAX_UNNAMED_TRANSFERS):
                self._progress = time.monotonic()  # pushed back, not silent
                if not self._changed.wait(0.5) and hung_up():
                    raise EOFError(f"the peer closed it in the middle of transfer {transfer_id}")
                self._drop_queued_locked()
                transfer = self._transfers.get(transfer_id)
            if self.error is not None or (transfer is None and (transfer_id <= self._named_upto or self.draining)):
                return None  # its message came and went (dropped unread), or no message will come
            if transfer is None:
                transfer = self._transfers[transfer_id] = _Transfer(transfer_id, total)
                self._unnamed.append(transfer_id)
                self._unnamed_bytes += total
                self._unnamed_count += 1
            elif transfer.nbytes != total:  # (checked here, after any wait: its message may be new)
                raise BulkError(f"bulk transfer {transfer_id} from {self.peer!r} is {total} bytes, its message says "
                                f"{transfer.nbytes}")
            transfer.block, transfer.view = self._allocate(total)
            self._held += total
            return transfer

    def _allocate(self, nbytes: int) -> tuple[Any, memoryview]:
        pool = self._pool
        if pool is None:
            data = bytearray(nbytes)
            return data, memoryview(data)
        block = pool.acquire(nbytes)
        exporter = as_buffer(block.tensor)
        weakref.finalize(exporter, pool.release, block)  # back to the pool when nothing sees it
        return exporter, memoryview(exporter).cast("B")[:nbytes]

    def filled(self, transfer: _Transfer, nbytes: int) -> None:
        with self._changed:
            transfer.received += nbytes
            self._progress = time.monotonic()
            if transfer.received == transfer.nbytes:
                self._changed.notify_all()

    def progress(self) -> None:
        self._progress = time.monotonic()

    def fail(self, reason: str) -> None:
        """The connection failed or the peer is gone: every transfer not both named and
        whole fails, and what they hold is freed (a decoder waiting for one gets
        ``reason``); whole named ones stay for their decoders."""
        with self._changed:
            if self.error is None:
                self.error = reason
            self._drop_queued_locked()
            for transfer in list(self._transfers.values()):
                if transfer.received < transfer.nbytes or not transfer.taken:
                    transfer.error = reason
                    self._drop_locked(transfer)
            self._changed.notify_all()

    def cut(self, reason: str) -> bool:
        """Fail everything (``fail``) and cut the connection, whose reader then ends; whether
        there was one."""
        self.fail(reason)
        sock = self.sock
        if sock is not None:
            _shut(sock)
        return sock is not None

    def drain(self, reason: str, within: float) -> None:
        """The peer said GOODBYE after sending what it had (its links close before that):
        read the rest, for the messages that came before the GOODBYE, then end; what is not
        whole within ``within`` seconds fails with ``reason``."""
        with self._changed:
            self.draining = True
            for transfer in [t for t in self._transfers.values() if not t.taken]:
                self._drop_locked(transfer)  # no message can name them now
            self._changed.notify_all()
        if self.sock is None:
            self.fail(reason)
            return
        timer = threading.Timer(within, self.cut, args=(reason,))
        timer.daemon = True
        timer.start()

    def held_bytes(self) -> int:
        """Bytes of transfers that arrived (or are arriving) and no decoder has taken yet."""
        with self._changed:
            self._drop_queued_locked()
            return self._held


class BulkReceiver:
    """Our bulk listener: one thread accepts connections, and each connection, once it names
    the inbox it was given (its connection id, once), gets a reader thread of its own.
    ``on_broken(inbox, reason)`` when a peer's connection fails. Connections that have not
    named themselves are bounded (MAX_UNNAMED_CONNECTIONS, PREAMBLE_TIMEOUT in all): a
    stranger holds no more than that."""

    def __init__(self, host: str, on_broken: Callable[[BulkInbox, str], None]):
        self._on_broken = on_broken
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=64)
        self.address = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._by_id: dict[bytes, BulkInbox] = {}
        self._inboxes: dict[str, BulkInbox] = {}
        self._closed = False
        self._readers: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()  # accepted, until their reader ends
        self._unnamed = 0  # accepted connections still to name themselves
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name="zmq-bulk-listen", daemon=True)
        self._thread.start()

    def inbox_for(self, peer: str, max_bytes: int, window: int, pool: BufferPool | None, silence: float) -> BulkInbox:
        """A new inbox for ``peer`` (its key and id go in our HELLO to it); any older one of
        that peer is closed."""
        key, connection_id = new_secrets()
        inbox = BulkInbox(peer, key, connection_id, max_bytes, window, pool, silence)
        inbox.on_silent = lambda reason: self._report(inbox, reason)
        with self._lock:
            old = self._inboxes.get(peer)
            self._inboxes[peer] = inbox
            self._by_id[connection_id] = inbox
            if old is not None:
                self._by_id.pop(old.connection_id, None)
        if old is not None:
            self._close_inbox(old, f"{peer!r} connected again")
        return inbox

    def inbox(self, peer: str) -> BulkInbox | None:
        return self._inboxes.get(peer)

    def forget(self, peer: str, reason: str, drain_within: float | None = None) -> None:
        """``peer`` is gone: its inbox is cut, or with ``drain_within`` (it said GOODBYE)
        read to its end first, for that long at most."""
        with self._lock:
            inbox = self._inboxes.pop(peer, None)
            if inbox is not None:
                self._by_id.pop(inbox.connection_id, None)
        if inbox is None:
            return
        if drain_within is None:
            self._close_inbox(inbox, reason)
        else:
            inbox.drain(reason, drain_within)

    def _close_inbox(self, inbox: BulkInbox, reason: str) -> None:
        inbox.cut(reason)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inboxes = list(self._inboxes.values())
            self._inboxes.clear()
            self._by_id.clear()
        _shut(self._listener)
        self._listener.close()
        self._thread.join(5.0)
        for inbox in inboxes:
            self._close_inbox(inbox, "the endpoint closed")
        with self._lock:
            connections, readers = list(self._connections), list(self._readers)
        for sock in connections:  # (those of no inbox: not named yet, or of a replaced one)
            _shut(sock)
        # Joined, not left running: a daemon thread still in OpenSSL when the interpreter
        # exits is one more thing that can crash it.
        for reader in readers:
            reader.join(5.0)

    def _accept(self) -> None:
        failures = 0
        while not self._closed:
            try:
                sock, address = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # Out of descriptors (EMFILE), an aborted connection: try again, not too fast.
                failures += 1
                if failures & (failures - 1) == 0:
                    log.warning("bulk: accepting a connection failed (%d so far): %s", failures, exc)
                time.sleep(0.05)
                continue
            with self._lock:
                crowded = self._unnamed >= MAX_UNNAMED_CONNECTIONS or self._closed
                if not crowded:
                    self._unnamed += 1
                    self._connections.add(sock)
            if crowded:
                self._refuse(sock, f"{address[0]}:{address[1]}", "too many connections naming themselves")
                continue
            reader = threading.Thread(target=self._serve, args=(sock, address), name="zmq-bulk-in", daemon=True)
            try:
                reader.start()
            except RuntimeError as exc:  # no thread to be had (a pids limit)
                with self._lock:
                    self._unnamed -= 1
                    self._connections.discard(sock)
                self._refuse(sock, f"{address[0]}:{address[1]}", f"no thread for it: {exc}")
                continue
            with self._lock:
                self._readers = [r for r in self._readers if r.is_alive()]
                self._readers.append(reader)

    def _refuse(self, sock: socket.socket, where: str, why: str) -> None:
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th...: a flood logs a few lines
            log.warning("bulk: refused a connection from %s (%d so far): %s", where, self.refused, why)
        sock.close()

    def _serve(self, sock: socket.socket, address: Any) -> None:
        where = f"{address[0]}:{address[1]}"
        try:
            preamble = _read_by(sock, len(MAGIC) + ID_BYTES, time.monotonic() + PREAMBLE_TIMEOUT)
        except (OSError, EOFError):
            preamble = b""
        with self._lock:
            self._unnamed -= 1
            inbox = self._by_id.pop(preamble[len(MAGIC):], None) if preamble[:len(MAGIC)] == MAGIC else None
            if inbox is None:
                self._connections.discard(sock)
        if inbox is None:
            self._refuse(sock, where, "no connection id of ours")
            return
        inbox.sock = sock
        inbox.connected = True
        reason: str | None
        try:
            sock.sendall(ACK)  # the sender uses the link only once we said we know it
            sock.settimeout(None)
            _read_records(sock, inbox)
            reason = None
        except BulkError as exc:
            reason = str(exc)
        except Exception as exc:  # OSError, EOFError; anything else must not end the thread unsaid
            reason = inbox.error or f"the bulk connection from {inbox.peer!r} ({where}) broke: {exc}"
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()
        if reason is None:
            # Closed between transfers: the peer's endpoint closes (its GOODBYE says so).
            # Whatever waits for more of it fails now rather than after peer_timeout.
            inbox.fail(f"{inbox.peer!r} closed its bulk connection")
            return
        self._report(inbox, reason)

    def _report(self, inbox: BulkInbox, reason: str) -> None:
        inbox.fail(reason)
        if not self._closed and self._inboxes.get(inbox.peer) is inbox:  # (not a forgotten one's)
            log.warning("bulk: %s", reason)
            self._on_broken(inbox, reason)


def _shut(sock: socket.socket) -> None:
    """End what blocks on ``sock`` in another thread (its owner closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed its end (even with bytes of it still unread)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return bool(poller.poll(0))


def _read_by(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """``nbytes`` from ``sock``, all of them before ``deadline`` (monotonic)."""
    data = bytearray(nbytes)
    view = memoryview(data)
    got = 0
    while got < nbytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("it did not name itself in time")
        sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed it")
        got += n
    return bytes(data)


def _fill(sock: socket.socket, view: memoryview, what: str) -> None:
    got, nbytes = 0, len(view)
    recv_into = sock.recv_into
    while got < nbytes:
        n = recv_into(view[got:])
        if n == 0:
            raise EOFError(f"the peer closed it in the middle of {what}")
        got += n


def _read_records(sock: socket.socket, inbox: BulkInbox) -> None:
    """Read, check and open records until the peer closes the connection between transfers
    (returns None); raises BulkError (or OSError, EOFError) on anything else. A transfer's
    first record is opened before anything is allocated for it: its header is then known
    to be the peer's."""
    open_into = AESGCM(inbox.key).decrypt_into
    scratch = bytearray(RECORD_BYTES + TAG_BYTES)
    sealed = memoryview(scratch)
    header_buffer = bytearray(HEADER_BYTES)
    header_view = memoryview(header_buffer)
    plain = memoryview(bytearray(RECORD_BYTES))  # a transfer's first record, and bytes nobody takes
    counter = 0
    transfer: _Transfer | None = None
    current = (0, 0)  # (transfer id, total) of the transfer being read
    offset = 0
    peer = inbox.peer
    while True:
        first = sock.recv_into(header_view)
        if first == 0:
            if offset:
                raise EOFError(f"the peer closed it in the middle of transfer {current[0]}")
            return None
        if first < HEADER_BYTES:
            _fill(sock, header_view[first:], "a record's header")
        inbox.progress()
        transfer_id, total, length = _HEADER.unpack(header_buffer)
        if not 0 < length <= RECORD_BYTES:
            raise BulkError(f"bulk record {counter} from {peer!r} is {length} bytes (at most {RECORD_BYTES})")
        if offset and (transfer_id, total) != current:
            raise BulkError(f"bulk record {counter} from {peer!r} belongs to transfer {transfer_id}, "
                            f"transfer {current[0]} is not complete")
        if offset + length > total:
            raise BulkError(f"bulk record {counter} from {peer!r} runs past its transfer's {total} bytes")
        _fill(sock, sealed[:length + TAG_BYTES], f"record {counter}")
        if offset == 0 or transfer is None or transfer.view is None:
            target = plain[:length]
        else:
            target = transfer.view[offset:offset + length]
        try:
            open_into(_nonce(counter), sealed[:length + TAG_BYTES], bytes(header_buffer), target)
        except Exception:  # cryptography's InvalidTag: the record is not the one we expect
            raise BulkError(f"bulk record {counter} from {peer!r} failed authentication: the connection was "
                            f"tampered with (a byte changed, dropped, replayed, reordered or injected)") from None
        counter += 1
        if offset == 0:
            transfer = inbox.start(transfer_id, total, lambda: _hung_up(sock))
            current = (transfer_id, total)
            if transfer is not None and transfer.view is not None:
                transfer.view[:length] = target
        offset += length
        if transfer is not None:
            inbox.filled(transfer, length)
        if offset == total:
            offset, transfer = 0, None


class BulkFrame:
    """A received frame whose bytes come over the bulk connection. Its ``buffer`` waits for
    them (on the thread that decodes the message, never under the socket lock); a frame
    never read gives its transfer up when dropped. ``len()`` is the transfer's size, so
    message size limits count it."""

    __slots__ = ("_inbox", "_transfer_id", "_nbytes", "_view", "_before_wait")

    def __init__(self, inbox: BulkInbox, transfer_id: int, nbytes: int, before_wait: Callable[[], None]):
        self._inbox: BulkInbox | None = inbox
        self._transfer_id = transfer_id
        self._nbytes = nbytes
        self._view: memoryview | None = None
        self._before_wait = before_wait

    def __len__(self) -> int:
        return self._nbytes

    @property
    def buffer(self) -> memoryview:
        if self._view is None:
            inbox, self._inbox = self._inbox, None
            if inbox is None:
                raise BulkError(f"bulk transfer {self._transfer_id} could not be read")
            if not inbox.arrived(self._transfer_id):
                self._before_wait()  # (not under the inbox's lock: it takes the socket lock)
            self._view = inbox.take(self._transfer_id)
        return self._view

    def __del__(self) -> None:
        inbox = self._inbox
        if inbox is not None:
            self._inbox = None
            inbox.drop(self._transfer_id)


# ------------------------------------------------------------------------------ the endpoint's part


def listen_host(address: str) -> str | None:
    """The host of a ``tcp://host:port`` address (None for other transports)."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].rsplit(":", 1)[0]
    if host in ("*", ""):
        return "0.0.0.0"
    return host.strip("[]")


class BulkLinks:
    """An endpoint's bulk connections: our listener and the inboxes of what peers send us,
    and our senders to the peers that offered us theirs.

    Used under the endpoint's socket lock (HELLOs, sends, losses all happen there), except
    the callback: ``on_broken(peer, reason)`` comes from a bulk thread, and only for the
    peer's current connection (never a forgotten one's, which may name a peer that has since
    come back)."""

    def __init__(self, host: str, min_bytes: int, window: int, max_bytes: int, silence: float,
                 pool: BufferPool | None, same_host: bool, connect_timeout: float,
                 on_broken: Callable[[str, str, object], None], before_wait: Callable[[], None]):
        self.min_bytes = min_bytes
        self._window = window
        self._max_bytes = max_bytes
        self._silence = silence
        self._pool = pool
        self._same_host = same_host
        self._connect_timeout = connect_timeout
        self._on_broken = on_broken
        # Called by a thread about to wait for bytes still on their way: one that watches
        # the endpoint's socket hands that over first (a wait may last peer_timeout).
        self._before_wait = before_wait
        self._host = host_identity()
        self._closed = False
        self.receiver = BulkReceiver(host, self._inbox_broken)
        self._senders: dict[str, BulkSender] = {}

    def hello(self, peer: str) -> dict:
        """What our HELLO to ``peer`` carries: how it is to send to us (a fresh key and id)."""
        inbox = self.receiver.inbox_for(peer, self._max_bytes, self._window, self._pool, self._silence)
        return {"port": self.receiver.address[1], "key": inbox.key, "id": inbox.connection_id, "host": self._host}

    def offered(self, peer: str, info: Any, peer_host: str | None) -> None:
        """``peer``'s HELLO said how to send to it (``info``): if it is on another host (or
        always, with ``same_host``), connect to it now; its big buffers go that way once
        connected."""
        if not isinstance(info, dict) or peer_host is None or self._closed:
            return
        port, key, connection_id = info.get("port"), info.get("key"), info.get("id")
        if type(port) is not int or not 0 < port < 65536 or not isinstance(key, bytes) or len(key) != KEY_BYTES \
                or not isinstance(connection_id, bytes) or len(connection_id) != ID_BYTES:
            log.warning("bulk: %s offered a malformed bulk connection; its big buffers stay on the socket", peer)
            return
        if info.get("host") == self._host and self._host is not None and not self._same_host:
            return  # our host: lending and rings carry its big buffers
        old = self._senders.pop(peer, None)
        if old is not None:
            old.close(time.monotonic())
        try:
            self._senders[peer] = BulkSender(peer, (peer_host, port), key, connection_id, self._sender_broken,
                                             self._connect_timeout)
        except RuntimeError as exc:  # no thread to be had (a pids limit): its big buffers stay on the socket
            log.warning("bulk: no thread for the bulk connection to %s (%s); its big buffers go through the socket",
                        peer, exc)

    def uses(self, peer: str) -> bool:
        """Whether big buffers to ``peer`` go over its bulk connection now."""
        sender = self._senders.get(peer)
        return sender is not None and sender.connected.is_set()

    def divert(self, peer: str, frames: list) -> tuple[list, int]:
        """The frames of a message to ``peer`` with each buffer of at least ``min_bytes``
        queued on the bulk connection instead, behind the table naming them; and how many
        went (0: the frames unchanged)."""
        entries = []
        out = list(frames)
        sender = self._senders[peer]
        for index in range(1, len(frames)):  # frame 0 is the envelope
            frame = frames[index]
            if type(frame) is bytes or len(memoryview(frame).cast("B")) < self.min_bytes:
                continue
            transfer_id, nbytes = sender.send(frame)
            entries.append([index, transfer_id, nbytes])
            out[index] = b""
        if not entries:
            return frames, 0
        return [encode_table(entries), *out], len(entries)

    def queued_bytes(self, peer: str) -> int:
        sender = self._senders.get(peer)
        return sender.queued_bytes if sender is not None else 0

    def frame(self, peer: str, transfer_id: int, nbytes: int) -> BulkFrame:
        """The frame of a message from ``peer`` whose buffer comes over its bulk connection
        (called as the message arrives, in the order messages arrive)."""
        inbox = self.receiver.inbox(peer)
        if inbox is None:
            raise RemoteProtocolError(f"{peer!r} named a bulk transfer, but we offered it no bulk connection")
        if nbytes < MIN_BULK_BYTES:
            raise RemoteProtocolError(f"{peer!r} named a bulk transfer of {nbytes} bytes (at least {MIN_BULK_BYTES})")
        inbox.name(transfer_id, nbytes)
        return BulkFrame(inbox, transfer_id, nbytes, self._before_wait)

    def _sender_broken(self, sender: BulkSender, reason: str) -> None:
        if not self._closed and self._senders.get(sender.peer) is sender:
            self._on_broken(sender.peer, reason, sender)

    def _inbox_broken(self, inbox: BulkInbox, reason: str) -> None:
        if not self._closed:
            self._on_broken(inbox.peer, reason, inbox)

    def forget(self, peer: str, reason: str, departed: bool = False) -> None:
        """``peer`` is lost: its connections go, what was queued for it is dropped. One that
        ``departed`` (GOODBYE) sent its big buffers before: those are read first."""
        sender = self._senders.pop(peer, None)
        if sender is not None:
            sender.close(time.monotonic())
        self.receiver.forget(peer, reason, self._silence if departed else None)

    def is_current(self, peer: str, link: object) -> bool:
        """Whether ``link`` (a sender or an inbox) is ``peer``'s now: a report of an older
        one, handled late, must not end a peer that came back."""
        return self._senders.get(peer) is link or self.receiver.inbox(peer) is link

    def close(self, linger: float) -> None:
        """What is queued goes within ``linger`` seconds; then every connection is cut and
        its thread joined. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + linger
        senders = list(self._senders.values())
        self._senders.clear()
        for sender in senders:
            sender.close(deadline)
        for sender in senders:
            sender.join(5.0)
        self.receiver.close()
