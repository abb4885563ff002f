"""zmqautograd's generic message transport: a pure codec (messages <-> msgpack + raw tensor
frames) and a ZeroMQ endpoint (one ROUTER socket per worker, owned by one I/O thread).

It knows frames and tensors, not RPC.
"""

from .codec import PROTOCOL_VERSION, Codec, Envelope, Extension, Message, MessageType
from .errors import (
    DeviceMapError,
    EndpointClosedError,
    LocalProtocolError,
    MessageTooLargeError,
    PeerError,
    PeerLostError,
    ProtocolError,
    RemoteProtocolError,
    TransportError,
    UnknownPeerError,
)

__all__ = [
    "PROTOCOL_VERSION", "Codec", "Envelope", "Extension", "Message", "MessageType",
    "DeviceMapError", "EndpointClosedError", "LocalProtocolError", "MessageTooLargeError",
    "PeerError", "PeerLostError", "ProtocolError", "RemoteProtocolError", "TransportError",
    "UnknownPeerError",
]
