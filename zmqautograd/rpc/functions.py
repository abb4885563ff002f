"""``zmqautograd.rpc.functions``: as ``torch.distributed.rpc.functions``."""

from __future__ import annotations

import functools
from typing import Any, Callable

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

    wrapper._wrapped_async_rpc_function = fn  # torch's marker
    return wrapper


def is_async_function(function: Any) -> bool:
    """Whether ``function`` is marked ``async_execution`` (torch's marker; bound methods and
    static or class methods of marked functions are too)."""
    return getattr(function, "_wrapped_async_rpc_function", None) is not None


def check_async_result(function: Any, result: Any) -> None:
    """A function marked ``async_execution`` must return a future; raise AsyncResultError (a
    RuntimeError, as torch's, and a TypeError) with torch's message if not."""
    # (.then() returns the C++ base class; the library's own functions may return an Outcome.)
    if not isinstance(result, (torch._C.Future, Outcome)):
        raise AsyncResultError(
            f"Functions decorated with @rpc.async_function must return a torch.futures.Future object, "
            f"but got {type(result)} ({getattr(function, '__qualname__', function)} is marked async_execution)"
        )
