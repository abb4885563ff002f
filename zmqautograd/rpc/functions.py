"""``zmqautograd.rpc.functions``: as ``torch.distributed.rpc.functions``."""

from __future__ import annotations

import functools
from typing import Callable


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
