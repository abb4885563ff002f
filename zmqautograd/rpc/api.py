"""The public RPC API, with the names and semantics of ``torch.distributed.rpc``."""

from __future__ import annotations

import contextlib
import os
import gc
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch

from zmqautograd.transport import MessageType, PeerError, TransportError

from . import cluster_secret, profiling
from .agent import Agent, WorkerInfo
from .errors import RpcError, RpcNotInitializedError
from .futures import Future
from .constants import DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT
from .profiling import profiler_enabled, set_profiler_node_id
from .options import BackendType, RpcBackendOptions, ZmqRpcBackendOptions
from .membership import DynamicGroup
from .rendezvous import Rendezvous
from .rref import RRef
from .rref_owner import _run_remote
from .serialization import encode_function

_agent: Agent | None = None
_state_lock = threading.Lock()


_closing: Agent | None = None  # between shutdown unpublishing the agent and its close


# torch's two messages: its Python API's, and its C++ layers' (RRefs, dist autograd).
NOT_INITIALIZED = "RPC has not been initialized. Call zmqautograd.rpc.init_rpc first."
AGENT_NOT_SET = "Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling `rpc.init_rpc`)?"


def _current(missing: str = NOT_INITIALIZED) -> Agent:
    agent = _agent
    if agent is None:
        closing = _closing
        if closing is not None:
            raise RpcNotInitializedError(f"RPC is shutting down on {closing.info}")
        raise RpcNotInitializedError(missing)
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
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions "
            f"(here zmqautograd.rpc.ZmqRpcBackendOptions), got {type(rpc_backend_options).__qualname__}"
        )
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, ZmqRpcBackendOptions):
        raise TypeError(  # another backend's options
            "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions` (zmqautograd.rpc.ZmqRpcBackendOptions, "
            f"the same class), got {type(rpc_backend_options).__qualname__}")
    if type(rank) is not int or (world_size is not None and type(world_size) is not int):
        raise TypeError(f"Argument rank must be of type int and world_size of type int or None, got {rank!r}, {world_size!r}")
    WorkerInfo(name, 0)  # torch's rules for names, checked before anyone waits for us
    options = rpc_backend_options or ZmqRpcBackendOptions()
    with _state_lock:
        if _agent is not None:
            raise RpcError("RPC is already initialized")
        _collect_startup_garbage()
        timeout = _wait_limit(options.rpc_timeout) or DEFAULT_RPC_TIMEOUT_SEC  # (start-up's)
        # Before the rendezvous: a group that would be open to whoever reaches its store is
        # refused before anyone waits for this worker.
        secret = cluster_secret.resolve(options.cluster_secret, options.init_method, options.encrypt,
                                        options.insecure_store)
        rendezvous: Rendezvous | DynamicGroup
        if world_size is None and not _world_size_from_environment(options.init_method):
            rendezvous = DynamicGroup(options.init_method, rank, timeout)  # membership.py
        else:
            rendezvous = Rendezvous(options.init_method, rank, world_size, timeout)
        _agent = Agent(name, rendezvous, options, secret)
        set_profiler_node_id(_agent.rank)  # profiler events made here name this worker (profiling.py)
    _agent.start_serving()


def _world_size_from_environment(init_method: str) -> bool:
    """env:// takes a missing world_size from WORLD_SIZE, as torch's."""
    return init_method.startswith("env://") and "WORLD_SIZE" in os.environ


def _collect_startup_garbage() -> None:
    """One full garbage collection now, while the rendezvous would wait for the others anyway.

    A fresh interpreter that imported torch tracks ~170,000 objects that no full collection
    has seen yet, so its first full collection comes soon after start-up and traverses them
    all: 90-120 ms on the development VM. Without this it landed in the first ~30-100 calls or
    passes of each worker; in a 4-stage pipeline each of the four stalled the whole step
    (steps of ~2 ms with three or four of ~90-190 ms among the first 120; docs/performance.md).
    After it, a full collection waits until the long-lived objects grow by a quarter
    (CPython's rule), which a steady training loop does not reach. Skipped where the user
    turned the collector off.

    A process that multiprocessing forked (start method fork or forkserver) freezes instead
    (``gc.freeze``): what it inherited is shared with its parent until written to, and a
    collection writes to every object it traverses. It cost each of four workers forked from
    a forkserver that imported torch 42 MB of private copies and 0.12 s of CPU; frozen, those
    objects stay shared and out of the collector's way for good (CPython's advice for forked
    processes). Garbage inherited from the parent stays: its pages are the parent's anyway."""
    if not gc.isenabled():
        return
    if _forked_by_multiprocessing():
        gc.freeze()
    else:
        gc.collect()


def _forked_by_multiprocessing() -> bool:
    """Whether multiprocessing started this process by fork, without a fresh interpreter."""
    import multiprocessing

    return multiprocessing.parent_process() is not None and \
        multiprocessing.get_start_method(allow_none=True) in ("fork", "forkserver")


def _wait_limit(timeout: float) -> float | None:
    """``timeout`` seconds as the limit of a wait; None, no limit, for 0 or less (torch's "no
    timeout") and beyond what a thread can wait (``threading.TIMEOUT_MAX``, 292 years; inf)."""
    return timeout if 0 < timeout < threading.TIMEOUT_MAX else None


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stop RPC on this worker.

    graceful: wait until every call this worker made has completed, then until every worker
    has reached shutdown (so nobody tears down while others still call it); then delete this
    worker's user RRefs (as torch's shutdown) and wait until every worker has; then close. With
    ``timeout`` 0 (torch's default) those waits have no time limit, but a lost peer ends them
    with a RuntimeError at once; a positive ``timeout`` (seconds) bounds them. Either way the
    worker is closed, and the error says what was still outstanding.
    graceful=False: fail this worker's pending calls and close at once.
    In a dynamic group (``init_rpc`` without ``world_size``) the worker leaves alone: the
    same waits for its own calls and deletes, no barrier; the group learns it left.
    """
    global _agent
    with _state_lock:
        agent = _current()
    # The agent stays current until it closes: while we wait for the others, this worker
    # still serves their calls, and those may make RPCs of their own.
    limit = _wait_limit(timeout)
    error: Exception | None = None
    barrier = agent.shutdown_barrier if agent.group is None else (lambda limit: None)
    if graceful:
        try:
            # Outstanding calls end by themselves: answered, timed out, or failed by peer loss.
            if not agent.wait_outstanding(limit):
                raise RpcError(f"shutdown: {agent.outstanding()} call(s) of {agent.info} still outstanding after {limit} s")
            barrier(limit)  # every worker's own work is done (torch's _wait_all_workers)
            # As torch, then: user RRefs are deleted (their owners told), and using one
            # afterwards says so; a second barrier keeps everyone open until every delete is
            # answered. (Looked up at call time: torch's tests patch it.)
            _delete_all_user_and_unforked_owner_rrefs()
            leaked = agent.rrefs.live_users()
            if leaked and not _ignore_rref_leak:
                error = RpcError(f"Leaking RRef: {leaked} user RRef(s) of {agent.info} were not deleted at shutdown")
            if not agent.wait_outstanding(limit):
                raise RpcError(f"shutdown: RRef deletions of {agent.info} still outstanding after {limit} s")
            barrier(limit)
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


# torch's switch: whether a graceful shutdown that finds user RRefs not deleted (only where
# something kept _delete_all_user_and_unforked_owner_rrefs from running) says "Leaking RRef".
_ignore_rref_leak = True


def _delete_all_user_and_unforked_owner_rrefs(timeout: timedelta = timedelta(minutes=5)) -> None:
    """torch's private helper, run by a graceful shutdown: delete every user RRef of this
    worker now (its owner is told) and wait until the deletes went out."""
    agent = _current()
    agent.rrefs.delete_all_users(timeout.total_seconds())
    if not agent.rrefs.flush_releases(timeout.total_seconds()):
        raise RpcError(f"deleting the user RRefs of {agent.info} took more than {timeout}")


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    agent = _current()
    return agent.info if worker_name is None else agent.worker_info(worker_name)


def rpc_async(to: Any, func: Callable, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Call ``func(*args, **kwargs)`` on worker ``to``; returns a ``torch.futures.Future``. A
    call that cannot be sent because of its peer (gone, or a fault injected) returns a future
    that fails with that error, as torch's do."""
    agent = _current()
    try:
        session = profiling.session() if profiler_enabled() else None
        if session is None:
            future = agent.call(to, func, args, kwargs, timeout)
        else:
            future = _profiled_async(agent, session, to, func, args, kwargs, timeout)
    except PeerError as exc:
        future = Future()
        future.set_exception(exc)
    collecting = getattr(_thread_local_var, "future_list", None)
    if collecting is not None:  # inside _wait_all()
        collecting.append(future)
    return future


# torch's: inside ``with _wait_all():`` this thread's rpc_async futures are collected in
# ``_thread_local_var.future_list`` and waited for at the end (torch.futures.wait_all).
_thread_local_var = threading.local()


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


@contextlib.contextmanager
def _use_rpc_pickler(rpc_pickler: Any) -> Iterator[None]:
    """torch's hook to replace its internal pickler; zmqautograd serialises with its own codec
    (rpc/serialization.py), which no pickler object replaces."""
    raise NotImplementedError("zmqautograd has no replaceable RPC pickler (torch's _use_rpc_pickler)")
    yield


def _profiled_async(agent: Agent, session: Any, to: Any, func: Callable, args: Any, kwargs: Any,
                    timeout: float) -> torch.futures.Future:
    """rpc_async under torch's legacy profiler (profiling.py)."""
    info = agent.worker_info(to)
    call = profiling.ProfiledCall(session, "async", func, agent.info, info)
    sent = agent.call(info, profiling._run_profiled, call.arguments(func, args, kwargs), None, timeout)
    future = Future()
    sent.add_done_callback(lambda done: call.settle(future, done))
    return future


def rpc_sync(to: Any, func: Callable, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and wait for the result."""
    agent = _current()
    session = profiling.session() if profiler_enabled() else None
    if session is None:
        return agent.call_sync(to, func, args, kwargs, timeout)
    info = agent.worker_info(to)
    call = profiling.ProfiledCall(session, "sync", func, agent.info, info)
    try:
        return call.answered(agent.call_sync(info, profiling._run_profiled, call.arguments(func, args, kwargs), None, timeout))
    finally:
        call.end()


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
    session = profiling.session() if profiler_enabled() else None
    profiled = None if session is None else profiling.ProfiledCall(session, "remote", func, agent.info, info)

    def send() -> torch.futures.Future:
        if profiled is None:
            return agent.call(info, _run_remote, call_args, None, timeout, message_type=MessageType.PYTHON_REMOTE_CALL)
        sent = agent.call(info, profiling._run_profiled, profiled.arguments(_run_remote, call_args, None), None,
                          timeout, message_type=MessageType.PYTHON_REMOTE_CALL)
        ended = Future()  # completes once the event ended, as torch's profiling future
        sent.add_done_callback(lambda done: profiled.settle(ended, done))
        return ended
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
            sent = send()
        except TransportError as exc:
            failed: torch.futures.Future = Future()
            failed.set_exception(exc)
            settled(failed)
            return rref
        sent.add_done_callback(settled)
        if profiled is not None:
            rref._set_profiling_future(sent)
        return rref
    rref = RRef._user(context, rref_id, info.id, fork_id, type_name)
    try:
        registered = send()
    except TransportError as exc:
        rref._creation_failed(exc)
        rref._unsent = True  # never reached the owner: nothing to delete there
        return rref
    registered.add_done_callback(rref._confirm_if_ok)
    if profiled is not None:
        rref._set_profiling_future(registered)
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


def get_rpc_timeout() -> float:
    """The default timeout of this worker's calls, in seconds (torch's ``rpc.get_rpc_timeout``)."""
    return _current().default_timeout


_get_rpc_timeout = get_rpc_timeout


def _is_initialized() -> bool:
    return _agent is not None


_is_current_rpc_agent_set = _is_initialized  # torch's name (its RemoteModule checks it)
