"""Errors of the RPC layer. All subclass ``RuntimeError``, which is what torch RPC users catch."""

from __future__ import annotations

from transport.errors import PeerLostError, TransportError  # noqa: F401  (re-exported)


class RpcError(RuntimeError):
    """Base class of the RPC layer's own errors."""


class RpcNotInitializedError(RpcError):
    """An RPC API was used before ``init_rpc`` (or after ``shutdown``)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """An RPC did not complete within its timeout."""


class RendezvousError(RpcError):
    """Workers could not agree on the group: duplicate names, wrong world size, a missing peer."""


class RemoteException(RpcError):
    """A remote function raised an exception whose type cannot be rebuilt here."""


class SerializationError(RpcError):
    """A call, its arguments or its result cannot be carried (or were refused by policy)."""
