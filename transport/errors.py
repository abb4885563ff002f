"""Typed errors of the transport.

Modelled on h11: a *local* protocol error means this side tried to put something on the wire
that the protocol cannot carry (or a peer told us it could not read what we sent); a *remote*
protocol error means bytes that arrived from a peer do not form a valid message. Everything
subclasses ``RuntimeError`` because that is what ``torch.distributed.rpc`` users catch.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """Base class of every error raised by the transport."""


class ProtocolError(TransportError):
    """A message that does not follow the wire format. ``message_id``: the id of the message
    it is about, where the receiver could read it (its refusal names the message)."""

    message_id: int = 0


class LocalProtocolError(ProtocolError):
    """We were asked to encode something the wire format cannot carry, or a peer rejected a
    message of ours as malformed."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes that do not decode to a valid message."""


class MessageTooLargeError(RemoteProtocolError):
    """An incoming message is larger than the configured maximum."""


class PeerError(TransportError):
    """An error about one peer; ``peer`` names it."""

    def __init__(self, peer: str, message: str):
        super().__init__(message)
        self.peer = peer


class UnknownPeerError(PeerError):
    """A message was addressed to a peer this endpoint has never heard of."""


class PeerLostError(PeerError):
    """The peer is gone: its process died, its connection broke, or it missed heartbeats."""


class PeerDepartedError(PeerLostError):
    """The peer said goodbye: it closed its endpoint (it shut down) rather than failing."""


class PeerOverloadedError(PeerError):
    """The peer refused a call of ours without running it: too many of our calls already wait
    there (its bound on queued calls per caller). Retrying later may succeed."""


class InjectedFaultError(PeerError):
    """A send failed on purpose: fault injection (``transport.faults``) asked for it."""


class EndpointClosedError(TransportError):
    """The endpoint was used after ``close()``."""


class DeviceMapError(TransportError):
    """A received tensor names a device that this process cannot place it on."""
