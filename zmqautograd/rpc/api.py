"""The public RPC API, with the names and semantics of ``torch.distributed.rpc``."""

from __future__ import annotations

import gc
import threading
from typing import Any, Callable

import torch

from zmqautograd.transport import MessageType, TransportError

from .agent import Agent, WorkerInfo
from .errors import RpcError, RpcNotInitializedError
from .futures import Future
from .options import DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT, BackendType, ZmqRpcBackendOptions
from .rendezvous import Rendezvous
from .rref import RRef
from .rref_owner import _run_remote
from .serialization import encode_function

_agent: Agent | None = None
_state_lock = threading.Lock()


_closing: Agent | None = None  # between shutdown unpublishing the agent and its close


def _current() -> Agent:
    agent = _agent
    if agent is None:
        closing = _closing
        if closing is not None:
            raise RpcNotInitializedError(f"RPC is shutting down on {closing.info}")
        raise RpcNotInitializedError("RPC has not been initialized. Call zmqautograd.rpc.init_rpc first.")
    return agent


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: ZmqRpcBackendOptions | None = None,
) -> None:
    """Join the group as ``name``: rendezvous, connect to every worker, start serving."""
    global _agent
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    # torch's checks and messages (rpc/__init__.py, _validate_rpc_args).
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, ZmqRpcBackendOptions):
        raise TypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions "
            f"(here zmqautograd.rpc.ZmqRpcBackendOptions), got {type(rpc_backend_options).__qualname__}"
        )
    if type(rank) is not int or (world_size is not None and type(world_size) is not int):
        raise TypeError(f"Argument rank must be of type int and world_size of type int or None, got {rank!r}, {world_size!r}")
    WorkerInfo(name, 0)  # torch's rules for names, checked before anyone waits for us
    options = rpc_backend_options or ZmqRpcBackendOptions()
    with _state_lock:
        if _agent is not None:
            raise RpcError("RPC is already initialized")
        _collect_startup_garbage()
        timeout = options.rpc_timeout if options.rpc_timeout > 0 else DEFAULT_RPC_TIMEOUT_SEC
        rendezvous = Rendezvous(options.init_method, rank, world_size, timeout)
        _agent = Agent(name, rendezvous, options)
    _agent.start_serving()


def _collect_startup_garbage() -> None:
    """One full garbage collection now, while the rendezvous would wait for the others anyway.

    A fresh interpreter that imported torch tracks ~170,000 objects that no full collection
    has seen yet, so its first full collection comes soon after start-up and traverses them
    all: 90-120 ms on the development VM. Without this it landed in the first ~30-100 calls or
    passes of each worker; in a 4-stage pipeline each of the four stalled the whole step
    (steps of ~2 ms with three or four of ~90-190 ms among the first 120; docs/performance.md).
    After it, a full collection waits until the long-lived objects grow by a quarter
    (CPython's rule), which a steady training loop does not reach. Skipped where the user
    turned the collector off."""
    if gc.isenabled():
        gc.collect()


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stop RPC on this worker.

    graceful: wait until every call this worker made has completed, then until every worker
    has reached shutdown (so nobody tears down while others still call it); then close. With
    ``timeout`` 0 (torch's default) those waits have no time limit, but a lost peer ends them
    with a RuntimeError at once; a positive ``timeout`` (seconds) bounds them. Either way the
    worker is closed, and the error says what was still outstanding.
    graceful=False: fail this worker's pending calls and close at once.
    """
    global _agent
    with _state_lock:
        agent = _current()
    # The agent stays current until it closes: while we wait for the others, this worker
    # still serves their calls, and those may make RPCs of their own.
    limit = timeout if timeout > 0 else None
    error: Exception | None = None
    if graceful:
        try:
            # Outstanding calls end by themselves: answered, timed out, or failed by peer loss.
            if not agent.wait_outstanding(limit):
                raise RpcError(f"shutdown: {agent.outstanding()} call(s) of {agent.info} still outstanding after {limit} s")
            agent.shutdown_barrier(limit)
        except RuntimeError as exc:  # timed out, or a peer was lost: say so, close anyway
            error = RpcError(f"shutdown of {agent.info} was not graceful: {exc}")
    global _closing
    with _state_lock:
        _agent, _closing = None, agent
    try:
        if graceful:
            agent._close_now("shutdown")
        else:
            agent._close_now("shutdown(graceful=False)", drain=0.5)
    finally:
        _closing = None
    if error is not None:
        raise error


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    agent = _current()
    return agent.info if worker_name is None else agent.worker_info(worker_name)


def rpc_async(to: Any, func: Callable, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Call ``func(*args, **kwargs)`` on worker ``to``; returns a ``torch.futures.Future``."""
    return _current().call(to, func, args, kwargs, timeout)


def rpc_sync(to: Any, func: Callable, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and wait for the result."""
    return _current().call_sync(to, func, args, kwargs, timeout)


def remote(to: Any, func: Callable, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and keep the result there; returns an RRef
    to it at once (``confirmed_by_owner()`` turns True when the owner has registered it)."""
    agent = _current()
    info = agent.worker_info(to)
    context = agent.rrefs
    rref_id = context.new_id()
    type_name = getattr(func, "__qualname__", type(func).__qualname__)
    fork_id = None if info.id == agent.rank else context.new_id()  # (None: owned here)
    call_args = (list(rref_id), fork_id and list(fork_id), encode_function(func), tuple(args or ()), dict(kwargs or {}))
    # As torch's, remote() returns an RRef even when the call fails to go out: the failure
    # is the RRef's creation error, raised when it is used (to_here, passing it on).
    if fork_id is None:  # owned here: the local handle exists before the call can run
        rref = RRef._owner_handle(context, rref_id, type_name)
        rref._creation = Future()

        def settled(done: torch.futures.Future) -> None:
            try:
                done.value()
            except Exception as exc:  # not sent, or timed out: the value is that error
                error = RuntimeError(f"RRef creation via rpc.remote() on {info} failed: {exc}")
                context.fail_creation(rref_id, error)
                if not rref._creation.done():
                    rref._creation.set_exception(error)
                return
            if not rref._creation.done():
                rref._creation.set_result(True)

        try:
            sent = agent.call(info, _run_remote, call_args, None, timeout, message_type=MessageType.PYTHON_REMOTE_CALL)
        except TransportError as exc:
            failed: torch.futures.Future = Future()
            failed.set_exception(exc)
            settled(failed)
            return rref
        sent.add_done_callback(settled)
        return rref
    rref = RRef._user(context, rref_id, info.id, fork_id, type_name)
    try:
        registered = agent.call(info, _run_remote, call_args, None, timeout, message_type=MessageType.PYTHON_REMOTE_CALL)
    except TransportError as exc:
        rref._creation_failed(exc)
        rref._unsent = True  # never reached the owner: nothing to delete there
        return rref
    registered.add_done_callback(rref._confirm_if_ok)
    return rref


def _get_current_rpc_agent() -> Any:
    """The agent of this process (``get_worker_infos()``, ``get_worker_info(name)``,
    ``get_debug_info()``, as torch's); a clear error before ``init_rpc``."""
    return _current()


def _rref_context_get_debug_info() -> dict[str, str]:
    """This worker's RRef counters, as torch's: ``num_owner_rrefs``, ``num_pending_futures``,
    ``num_pending_users``, ``num_forks`` (rref.py, ``RRefContext.debug_info``)."""
    return _current().rrefs.debug_info()


def _get_debug_info() -> dict[str, str]:
    """torch's ``rpc._get_debug_info()``: the RRef counters, the agent's and distributed
    autograd's, in one dict (their keys do not overlap)."""
    agent = _current()
    info = agent.rrefs.debug_info()
    info.update(agent.get_debug_info())
    info.update(agent.hooks.debug_info())  # distributed autograd's
    return info


def is_available() -> bool:
    """Whether RPC can be used in this build (always: it is pure Python)."""
    return True


def _set_rpc_timeout(rpc_timeout: float) -> None:
    _current().default_timeout = float(rpc_timeout)


def _get_rpc_timeout() -> float:
    return _current().default_timeout


def _is_initialized() -> bool:
    return _agent is not None
