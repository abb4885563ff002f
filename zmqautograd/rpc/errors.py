"""Errors of the RPC layer. All subclass ``RuntimeError``, which is what torch RPC users catch."""

from __future__ import annotations

from typing import Callable

import torch

from zmqautograd.transport.errors import PeerLostError, PeerOverloadedError, TransportError  # noqa: F401  (re-exported)


class RpcError(RuntimeError):
    """Base class of the RPC layer's own errors."""


class RpcNotInitializedError(RpcError):
    """An RPC API was used before ``init_rpc`` (or after ``shutdown``)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """An RPC did not complete within its timeout."""


class RendezvousError(RpcError):
    """Workers could not agree on the group: duplicate names, wrong world size, a missing peer."""


class NotEntitledError(RpcError):
    """A member asked for something it takes no part in (another worker's context, backward
    pass, RRef fork or call): refused, counted and logged (rpc/refusals.py)."""


class RemoteException(RpcError):
    """A remote function raised an exception whose type cannot be rebuilt here."""


class SerializationError(RpcError):
    """A call, its arguments or its result cannot be carried (or were refused by policy)."""


class OperatorArgumentsError(RpcError, TypeError):
    """A builtin operator (``torch.add``, ...) was called by RPC with arguments that none of its
    overloads takes. torch matches builtins against their schemas and raises RuntimeError
    ("failed to match any schema"); PyTorch's argument parser, which checks them here, raises
    TypeError. This is both, so either ``except`` catches it."""


class AsyncResultError(RpcError, TypeError):
    """A function marked ``async_execution`` returned something other than a future. torch
    raises RuntimeError for it (with the message this one starts with); a TypeError is what
    Python raises for a value of the wrong type. This is both."""


class ScriptFunctionError(RpcError):
    """A TorchScript function run by RPC failed: torch's caller gets a RuntimeError with the
    interpreter's message (``torch.jit.Error`` is no RuntimeError), and so does ours."""


def user_error(error: BaseException) -> Exception:
    """What a user's function raised, as an exception the RPC layer carries back to the caller
    (futures take only Exceptions). SystemExit, KeyboardInterrupt and the other exceptions
    that are not Exceptions become a RemoteException naming them, as torch's RuntimeError
    ("SystemExit: 3") does: raised on the callee's pool thread they would end that thread and
    leave the call unanswered, and re-raised as they are on the caller they would end its
    thread, or its program, for an error in a remote function."""
    if isinstance(error, Exception):
        return error
    kind = type(error)
    wrapped = RemoteException(f"{kind.__module__}.{kind.__qualname__}: {error}")
    wrapped.__cause__ = error  # its traceback (the user's frames) goes with it
    wrapped.__traceback__ = error.__traceback__
    return wrapped


def as_operator_error(function: Callable, exc: Exception) -> Exception:
    """What calling ``function`` raised, as the caller is to get it: a TypeError from a
    builtin operator given arguments it does not take becomes what torch raises for that
    (RuntimeError, "failed to match any schema"), still a TypeError too
    (OperatorArgumentsError); a TorchScript function's error a ScriptFunctionError, as
    torch's RuntimeError. Anything else, Python functions' TypeErrors included, as is."""
    if isinstance(exc, torch.jit.Error) and isinstance(function, torch.jit.ScriptFunction):
        error: Exception = ScriptFunctionError(str(exc))
        error.__traceback__ = exc.__traceback__
        return error
    if type(exc) is not TypeError:
        return exc
    name = _builtin_operator_name(function)
    if name is None:
        return exc
    error = OperatorArgumentsError(f"Overloaded torch operator invoked from Python failed to match any schema: {name}: {exc}")
    error.__traceback__ = exc.__traceback__
    return error


def _builtin_operator_name(function: Callable) -> str | None:
    """The qualified name of the builtin operator ``function`` is (``aten::add``), as torch's RPC
    finds it to send a builtin; None for anything else."""
    try:
        from torch.jit._builtins import _find_builtin
    except ImportError:  # a torch without it: no function is treated as an operator
        return None
    try:
        return _find_builtin(function)
    except Exception:  # noqa: BLE001 - unhashable callables and the like are no operators
        return None
