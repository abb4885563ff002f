"""zmqautograd's generic message transport: a pure codec (messages <-> msgpack + raw tensor
frames) and a ZeroMQ endpoint (one ROUTER socket per worker, owned by one I/O thread).

It knows frames and tensors, not RPC.
"""

from .codec import PROTOCOL_VERSION, Codec, Envelope, Extension, ExtensionNotDecoded, Message, MessageType
from .errors import (
    DeviceMapError,
    EndpointClosedError,
    InjectedFaultError,
    LocalProtocolError,
    MessageTooLargeError,
    PeerDepartedError,
    PeerError,
    PeerLostError,
    PeerOverloadedError,
    ProtocolError,
    RemoteProtocolError,
    TransportError,
    UnknownPeerError,
)
from .faults import FaultPolicy

__all__ = [
    "PROTOCOL_VERSION", "FaultPolicy", "Codec", "Envelope", "Extension", "ExtensionNotDecoded", "Message", "MessageType",
    "DeviceMapError", "EndpointClosedError", "InjectedFaultError", "LocalProtocolError", "MessageTooLargeError",
    "PeerDepartedError", "PeerError", "PeerLostError", "PeerOverloadedError", "ProtocolError", "RemoteProtocolError",
    "TransportError", "UnknownPeerError",
]
