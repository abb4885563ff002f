"""What an endpoint knows of itself and of each peer: its options, per-peer statistics, state
and the record the I/O thread keeps per connection."""

from __future__ import annotations

import enum
import math
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from . import shm
from .bulk import DEFAULT_BULK_MIN, MIN_BULK_BYTES
from .errors import (
    PeerLostError,
)
from .lending import DEFAULT_LEND_CACHE, DEFAULT_LEND_MIN, Offer, Reader


MAX_SHM_RING = 1 << 30  # bytes: shm_ring's largest


@dataclass
class EndpointOptions:
    """Timing and limits of an endpoint. Times are in seconds."""

    heartbeat_interval: float = 1.0  # each tick, a heartbeat to every peer sent nothing since the last
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
    # memory instead of the socket (transport/shm.py; x86-64 Linux). 0: never. At most
    # MAX_SHM_RING.
    shm_ring: int = shm.DEFAULT_RING_BYTES
    # With such peers, a thread that waits (for an answer, or idle for work) first spins on
    # the rings for up to this long, yielding its CPU between looks, before it sleeps: an
    # answer that comes within it needs no wake-up. A thread whose waits of a kind last longer
    # spins less, down to not at all (transport/waiting.py). The I/O thread spins after
    # traffic for shm.IO_SPIN, at most this (busy_poll if longer). 0: no waiting thread spins.
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
    # Over CURVE, buffers of at least this many bytes to a peer on another host go over a
    # TCP connection of their own, sealed with AES-256-GCM (transport/bulk.py): CurveZMQ
    # moves 120-240 MB/s. 0: never. ``bulk_window``: bytes of such buffers a peer's
    # connection may bring ahead of the messages that take them (at least one message's).
    # ``bulk_same_host``: to peers on this host too (where lending and rings do not apply).
    bulk_min: int = DEFAULT_BULK_MIN
    bulk_window: int = 256 << 20
    bulk_same_host: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.peer_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval!r} s) must be > 0 and below "
                             f"peer_timeout ({self.peer_timeout!r} s): a peer not heard from for "
                             f"peer_timeout is declared lost")
        if not math.isfinite(self.peer_timeout):
            # (a lost peer's lent buffers are held for it: docs/transport.md, "Lending")
            raise ValueError(f"peer_timeout must be a finite number of seconds, got {self.peer_timeout!r} (for "
                             f"peers that may be silent for days, give that many seconds)")
        if self.connect_timeout <= 0 or self.close_linger < 0:
            raise ValueError("connect_timeout must be > 0 and close_linger >= 0")
        if self.busy_poll < 0:
            raise ValueError("busy_poll must be >= 0")
        if self.lend_min < 0 or self.lend_cache < 0:
            raise ValueError("lend_min and lend_cache must be >= 0")
        if self.shm_ring < 0 or 0 < self.shm_ring < 4096 or self.shm_ring > MAX_SHM_RING:
            # A message of any size streams through a ring: a bigger one only takes memory,
            # from the start, per direction and same-host peer.
            raise ValueError(f"shm_ring must be 0 (off) or from 4096 to {MAX_SHM_RING} bytes, got {self.shm_ring!r}: "
                             f"messages of any size stream through a ring, which takes its memory per "
                             f"same-host peer and direction")
        if self.spin < 0:
            raise ValueError("spin must be >= 0")
        if self.bulk_min < 0 or 0 < self.bulk_min < MIN_BULK_BYTES or self.bulk_window < 0:
            # (Smaller buffers are copied into their message; a receiver refuses smaller
            # transfers, since the answers it decodes under its socket lock are that small.)
            raise ValueError(f"bulk_min must be 0 (off) or at least {MIN_BULK_BYTES} bytes, and bulk_window >= 0")
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
    refused: int = 0  # messages of its that our executor refused (too many queued: PeerOverloadedError)
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    buffers_lent: int = 0  # big buffers the peer read from our memory instead (transport/lending.py)
    buffers_borrowed: int = 0  # and buffers we read from its memory
    buffers_on_loan: int = 0  # lent to it and not released yet (now, not a running count)
    shared_memory: bool = False  # messages to it go through a shared-memory ring (now)
    buffers_bulk: int = 0  # big buffers sent to it over the bulk connection (transport/bulk.py)

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
    offer: Offer | None = None
    # Shared memory (transport/shm.py): the ring it writes to us (we made it; read once its
    # SHM_START said it writes there) and the decoder of its stream; the ring we write to
    # it (from our SHM_START on) and the bytes that had no room in it yet; its doorbell.
    ring_in: shm.Ring | None = None
    ring_slot: int = 0  # its ring's mark in our Flags page (shm.Flags.take_marks), while ring_in is set
    ring_in_active: bool = False
    decoder: shm.StreamDecoder | None = None
    ring_out: shm.Ring | None = None
    peer_flags: shm.Flags | None = None  # its Flags page (transport/shm.py), mapped with ring_out
    unwritten: deque = field(default_factory=deque)
    unwritten_bytes: int = 0
    # Zero-copy messages libzmq still holds for it: (tracker of the last frame, bytes), in
    # the order sent (libzmq writes them in that order), and their bytes.
    in_libzmq: deque = field(default_factory=deque)
    in_libzmq_bytes: int = 0
    lent_bytes: int = 0  # of the buffers in ``lent``
    bell: socket.socket | None = None
    ring_pid: int | None = None  # its pid, from its HELLO: the process whose ring we map
    # On our host, with rings on at both ends, and no ring made for it yet: we make one when
    # its first message of the layers above comes through the socket (ring_protocol.py).
    ring_due: bool = False

    def __post_init__(self) -> None:
        self.routing_id = self.name.encode()
