"""``zmqautograd.rpc.functions``: as ``torch.distributed.rpc.functions``."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

from .errors import AsyncResultError
from .futures import Outcome


def async_execution(fn: Callable) -> Callable:
    """Mark ``fn`` as returning a ``torch.futures.Future``: the callee sends the reply when that
    future completes, and holds no thread while it waits. Put it innermost, under
    ``@staticmethod`` / ``@classmethod``. Functions marked with torch's own decorator are
    recognised too (the same attribute)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    setattr(wrapper, _MARKER, fn)
    return wrapper


_F = TypeVar("_F", bound=Callable)
_MARKER = "_wrapped_async_rpc_function"  # torch's marker of an async_execution function


def answered_when_done(function: _F) -> _F:
    """Mark one of the library's own functions as ``async_execution`` without wrapping it:
    it returns a future (or an ``Outcome``), and its call is answered when that completes."""
    setattr(function, _MARKER, function)
    return function


def is_async_function(function: Any) -> bool:
    """Whether ``function`` is marked ``async_execution`` (torch's marker; bound methods and
    static or class methods of marked functions are too)."""
    return getattr(function, _MARKER, None) is not None


def check_async_result(function: Any, result: Any) -> None:
    """A function marked ``async_execution`` must return a future; raise AsyncResultError (a
    RuntimeError, as torch's, and a TypeError) with torch's message if not."""
    # (.then() returns the C++ base class; the library's own functions may return an Outcome.)
    if not isinstance(result, (torch._C.Future, Outcome)):
        raise AsyncResultError(
            f"Functions decorated with @rpc.async_function must return a torch.futures.Future object, "
            f"but got {type(result)} ({getattr(function, '__qualname__', function)} is marked async_execution)"
        )
