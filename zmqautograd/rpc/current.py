"""The process's current RPC agent, for the modules that ``rpc.api`` itself imports (the RRef
and autograd layers): importing ``rpc.api`` at their top would be an import cycle, and an
import statement on every call costs more than the rest of a small call's bookkeeping."""

from __future__ import annotations

import threading
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .agent import Agent

_api: ModuleType | None = None  # zmqautograd.rpc.api, bound on first use
_calls = threading.local()  # .rank: the worker whose call this thread runs (agent._run_call)


def caller() -> int | None:
    """The rank of the worker whose call runs on this thread: taken from the authenticated
    connection the call came over, never from its payload (None outside a call)."""
    return getattr(_calls, "rank", None)


def agent() -> Agent:
    """The current agent; RpcNotInitializedError when there is none, in the words torch's
    C++ layers use (see ``rpc.api._current``)."""
    global _api
    if _api is None:
        from . import api

        _api = api
    current: Agent = _api._current(_api.AGENT_NOT_SET)
    return current
