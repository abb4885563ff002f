"""The dispatcher thread: it decodes payloads and runs the user's callbacks, in each peer's
order, so a slow handler never stalls the socket (see endpoint.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .codec import Envelope, Message
from .errors import (
    DeviceMapError,
    LocalProtocolError,
    PeerOverloadedError,
    ProtocolError,
    TransportError,
)
from .tensors import adopt_torch_thread_settings

if TYPE_CHECKING:
    from .endpoint import Endpoint

log = logging.getLogger(__name__)


class Dispatcher:
    """The endpoint's dispatcher thread (part of ``Endpoint``)."""

    def _dispatch_main(self: Endpoint) -> None:
        adopt_torch_thread_settings()  # handlers may run torch ops
        dispatch_queue, waiter = self._dispatch_queue, self._dispatch_waiter

        def has_work() -> bool:
            return not dispatch_queue.empty()

        while True:
            self._wait(waiter, has_work, None, for_work=True)  # returns at once when work is queued
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

    def _deliver(self: Endpoint, peer: str, envelope: Envelope) -> None:
        message = self._decode(peer, envelope)
        if message is None:
            return
        try:
            self._on_message(message)  # type: ignore[misc]  # (the dispatcher runs only with one)
        except Exception:  # on the embedder's pool nobody else would see it
            log.exception("endpoint %s: on_message failed for %s from %s", self.identity, message.type.name, peer)

    def _decode(self: Endpoint, peer: str, envelope: Envelope) -> Message | None:
        tensors: list = []
        try:
            payload = self.codec.decode_payload(envelope, tensors)
        except (ProtocolError, DeviceMapError) as exc:
            self._reject_payload(peer, envelope, exc)
            return None
        return Message(envelope.type, envelope.id, envelope.sender, payload, tensors)

    def _reject_payload(self: Endpoint, peer: str, envelope: Envelope, exc: TransportError) -> None:
        with self._lock:
            self._stats[peer].protocol_errors += 1
            first = self._stats[peer].protocol_errors == 1
        # A peer's first as a warning, the rest at debug level (a peer that keeps sending them
        # must not flood the log); every one is counted, and answered.
        log.log(logging.WARNING if first else logging.DEBUG, "endpoint %s: malformed %s payload from %s: %s%s",
                self.identity, envelope.type.name, peer, str(exc),
                " (further ones of this peer are logged at debug level)" if first else "")
        try:
            self.send(peer, self._protocol_error_message(envelope, exc))
        except TransportError:
            pass  # the sender is gone or we are closing: nobody left to tell

    def _peer_rejected(self: Endpoint, peer: str, envelope: Envelope) -> None:
        """A peer answered that it could not decode one of our messages."""
        overloaded = False
        try:
            payload = self.codec.decode_payload(envelope)
            if isinstance(payload, dict):
                detail, overloaded = payload.get("error"), payload.get("overloaded") is True
            else:
                detail = None
        except ProtocolError:
            detail = None
        error: TransportError
        if overloaded:
            error = PeerOverloadedError(peer, str(detail))
        else:
            error = LocalProtocolError(f"peer {peer!r} rejected message {envelope.id}: {detail or 'malformed'}")
        log.warning("endpoint %s: %s", self.identity, error)
        if envelope.id and self._on_send_error is not None:
            self._on_send_error(peer, envelope.id, error)
