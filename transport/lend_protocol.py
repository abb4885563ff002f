"""Lending negotiated between two endpoints: offers, releases, borrowing a lent frame and
telling the lender it was read (the mechanism is lending.py)."""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import TYPE_CHECKING, Any

from . import lending
from .codec import Envelope, MessageType, _peek_message_id
from .errors import (
    ProtocolError,
    RemoteProtocolError,
)
from .lending import LentFrame
from .peers import _Peer

if TYPE_CHECKING:
    from .endpoint import Endpoint

log = logging.getLogger(__name__)


class LendingProtocol:
    """The endpoint's side of lending (part of ``Endpoint``)."""

    def _offer_to_lend(self: Endpoint, record: _Peer, hello: Any) -> None:
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

    def _lend_offered(self: Endpoint, record: _Peer, envelope: Envelope) -> None:
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

    def _lend_released(self: Endpoint, record: _Peer, envelope: Envelope) -> None:
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

    def _borrow(self: Endpoint, peer: str, frames: list) -> list:
        """Frames of a message with lent buffers, or buffers on the bulk connection
        (transport/bulk.py): each empty placeholder replaced with a frame that reads the
        buffer when the payload is decoded (LentFrame, BulkFrame)."""
        record = self._peers.get(peer)
        reader = record.reader if record is not None else None
        borrowed = 0
        envelope_frame = frames[2]
        try:
            entries = lending.decode_table(frames[1], frames[3:])
            frames = [frames[0], *frames[2:]]
            done = functools.partial(self._borrowed_done, peer)
            for index, transfer_id, address, nbytes in entries:
                if address is None:
                    if self._bulk is None or record is None:
                        raise RemoteProtocolError(f"{peer!r} sent a bulk transfer, but this endpoint offered it none")
                    frames[1 + index] = self._bulk.frame(peer, transfer_id, nbytes)
                    continue
                if reader is None:
                    raise RemoteProtocolError(f"{peer!r} lent buffers, but this endpoint has not verified it can read its memory")
                frames[1 + index] = LentFrame(reader, address, nbytes, transfer_id, done, peer)
                borrowed += 1
        except RemoteProtocolError as exc:
            exc.message_id = _peek_message_id(envelope_frame)  # so the refusal names the message
            raise
        self._stats[peer].buffers_borrowed += borrowed
        return frames

    def _borrowed_done(self: Endpoint, peer: str, transfer_id: int, read: bool) -> None:
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

    def _send_releases(self: Endpoint) -> None:
        """Send the queued releases, one LEND_RELEASE per lender (under the socket lock)."""
        releases = self._releases
        by_peer: dict[str, list[int]] = {}
        while releases:
            peer, transfer_id = releases.popleft()
            by_peer.setdefault(peer, []).append(transfer_id)
        for peer, ids in by_peer.items():
            self._send_control(peer, MessageType.LEND_RELEASE, ids)
