"""Peer loss: connections that close, peers not heard from for ``peer_timeout`` (heartbeats),
GOODBYE; what is failed when a peer is lost (see endpoint.py)."""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

import zmq

from . import lending
from .codec import Message, MessageType
from .errors import (
    PeerDepartedError,
    PeerLostError,
)
from .peers import PeerState

if TYPE_CHECKING:
    from .endpoint import Endpoint

log = logging.getLogger(__name__)


class Liveness:
    """The endpoint's watch over its peers (part of ``Endpoint``)."""

    def _connection_gone(self: Endpoint, peer: str, reason: str) -> None:
        """The peer's connection is gone; it is declared lost at the end of this loop turn.

        Not at once: what it sent just before (answers, GOODBYE) may still be unread in our
        socket, and a lost peer's messages are dropped."""
        self._closing.setdefault(peer, reason)

    def _declare_gone_peers_lost(self: Endpoint) -> None:
        self._receive_batch()  # take what they sent before going
        fresh: dict[str, str] = {}
        closing, self._closing = self._closing, fresh
        for peer, reason in closing.items():
            self._peer_lost(peer, reason)

    def _tick(self: Endpoint, now: float, last_tick: float) -> None:
        """Heartbeats out (to peers sent nothing since ``last_tick``, when the last tick
        ended), silent peers declared lost, retired lent buffers forgotten."""
        options = self.options
        lending.retire((), 0.0)
        if self._zap_held:
            self._answer_held_zap(now)
        if self._unwritten:
            self._flush_unwritten()  # in case a doorbell call was lost
        self._read_every_ring()  # in case a mark was
        with self._lock:
            records = list(self._peers.values())
        for record in records:
            if record.state is PeerState.READY:
                if now - record.last_seen > options.peer_timeout:
                    self._peer_lost(
                        record.name, f"no message or heartbeat for {now - record.last_seen:.1f} s "
                        f"(peer_timeout={options.peer_timeout} s)"
                    )
                elif record.last_sent < last_tick:
                    self._stats[record.name].heartbeats_sent += 1
                    self._send_to_peer(record.name, 0, self._heartbeat_frames, 0)
            elif record.state in (PeerState.EXPECTED, PeerState.CONNECTING):
                if now - record.since > options.connect_timeout:
                    self._peer_lost(record.name, f"did not complete HELLO within {options.connect_timeout} s")

    def _peer_lost(self: Endpoint, peer: str, reason: str, level: int = logging.WARNING,
                   kind: type[PeerLostError] = PeerLostError) -> None:
        record = self._peers.get(peer)
        if record is not None and record.ring_in_active and record.state is not PeerState.LOST:
            self._read_ring(record)  # what it wrote before it went comes first
        with self._lock:
            record = self._peers.get(peer)
            if record is None or record.state is PeerState.LOST:
                return
            record.state = PeerState.LOST
            error = kind(peer, f"{self.identity}: lost peer {peer!r}: {reason}")
            record.lost_error = error
            waiting, record.waiting = record.waiting, deque()
            lent, record.lent = record.lent, {}
            record.lend, record.reader, record.offer = False, None, None
            record.in_libzmq, record.in_libzmq_bytes, record.lent_bytes = deque(), 0, 0
        # The peer may not know yet that it lost us, and still read what we lent it.
        lending.retire(lent.values(), self.options.peer_timeout)
        if self._bulk is not None:
            self._bulk.forget(peer, str(error), departed=kind is PeerDepartedError)
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

    def _fail_all_peers(self: Endpoint, reason: str) -> None:
        with self._lock:
            names = [name for name, r in self._peers.items() if r.state is not PeerState.LOST]
        for name in names:
            self._peer_lost(name, reason)

    def _say_goodbye(self: Endpoint) -> None:
        with self._lock:
            names = [name for name, r in self._peers.items() if r.state in (PeerState.READY, PeerState.CONNECTING)]
        goodbye = self.codec.encode(Message(MessageType.GOODBYE, 0, self.identity))
        for name in names:
            try:
                self._router.send_multipart([name.encode(), *goodbye], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
