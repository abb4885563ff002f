"""The RRef protocol's functions that run on the owner (or on a fork's parent), called by
reference (protocol functions, rpc/serialization.py), and the helpers they share with
``RRef``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from . import current
from .errors import NotEntitledError, RpcError, SerializationError, as_operator_error, user_error
from .functions import answered_when_done, check_async_result, is_async_function
from .futures import Future, settle_from
from .serialization import protocol_function

if TYPE_CHECKING:
    from .rref import RRef
    from .rref_context import RRefContext

def _context() -> RRefContext:
    return current.agent().rrefs


@protocol_function
def _rref_typeof_on_owner(rref: RRef) -> Any:
    """On the owner, for ``RRef._get_type``: the value's type, by reference; waits for the
    value as ``local_value`` does. torch's name: its profiler shows the call by it."""
    from .serialization import encode_function

    return encode_function(type(rref.local_value()))


@protocol_function
def _run_remote(rref_id_sent: list, fork_id: list | None, function: Callable, args: tuple, kwargs: dict) -> None:
    """On the owner, for remote(): register the caller's fork, run, keep the value."""
    from .serialization import resolve_function

    context, rref_id = _context(), tuple(rref_id_sent)
    caller = current.caller()
    if caller is not None and (rref_id[0] != caller or (fork_id is not None and fork_id[0] != caller)
                               or rref_id[1] >> 32 != context.agent.incarnation_of(caller)):
        # remote()'s caller makes the ids (RRefContext.new_id): others' (an earlier worker's of
        # its rank among them) are not its to name.
        raise RpcError(f"worker {caller} sent remote() with RRef ids of another worker ({rref_id}, {fork_id})")
    if fork_id is not None:  # made by the caller, who holds it
        context.add_fork(rref_id, tuple(fork_id), caller, made_by_holder=caller is not None)
    future = context.begin_making(rref_id)
    if future is None:
        return  # its creator was lost before this ran: the value has failed already
    try:
        function = resolve_function(function, context.agent.codec.policy)
        value = function(*args, **kwargs)
        if is_async_function(function):
            # The value is what the returned future completes with, whenever it does; no
            # thread waits for it meanwhile (fetches wait on the owner's value future).
            check_async_result(function, value)
            value.add_done_callback(lambda done: settle_from(future, done))
        elif not future.done():  # a remote() to ourselves that timed out already failed it
            future.set_result(value)
    except BaseException as exc:  # raised to whoever fetches the value, as torch does
        exc = as_operator_error(function, user_error(exc))
        if not future.done():
            future.set_exception(exc)
    context.set_created(rref_id)

def _failed(future: torch.futures.Future) -> bool:
    """Whether a completed future completed with an error."""
    try:
        future.value()
    except Exception:  # noqa: BLE001 - any error is a failure here
        return True
    return False


@protocol_function
@answered_when_done
def _fetch(rref_id: list, fork_id: list | None = None) -> torch.futures.Future:
    """The value, for its creator or the holder of its fork ``fork_id`` (RRefContext.check_user)."""
    context, caller = _context(), _worker_caller()
    rref_id_, fork_id_ = tuple(rref_id), None if fork_id is None else tuple(fork_id)
    context.check_user(rref_id_, fork_id_, caller)
    value = context.owner_value(rref_id_)
    if value.done() or caller == rref_id_[0]:
        return value
    checked: torch.futures.Future = Future()

    def check_again(done: torch.futures.Future) -> None:
        # A fork registered by another worker before its creator's remote() came (whose
        # registration is the fork's own: add_fork) was not that worker's to hold.
        try:
            context.check_user(rref_id_, fork_id_, caller)
        except NotEntitledError as exc:
            checked.set_exception(exc)
            return
        settle_from(checked, done)

    value.add_done_callback(check_again)
    return checked

# The worker a fork request or a delete is for is the one it came from (current.caller: the
# authenticated connection), never a rank its payload names.

@protocol_function
@answered_when_done
def _fork_request(rref_id: list, fork_id: list) -> torch.futures.Future:
    """A child registers the fork its parent (who made ``fork_id``) gave it: answered once the
    parent vouched for it (RRefContext.register_fork)."""
    return _context().register_fork(tuple(rref_id), tuple(fork_id), _worker_caller())


@protocol_function
def _vouch_for(fork_id: list, child: int) -> bool:
    """On a fork's parent, asked by the value's owner: whether we forked ``fork_id`` to ``child``."""
    return _context().vouches(tuple(fork_id), child, _worker_caller())


@protocol_function
def _child_accept(fork_id: list) -> None:
    _context().child_accepted(tuple(fork_id), _worker_caller())


@protocol_function
def _delete_fork(rref_id: list, fork_id: list) -> None:
    _context().delete_fork(tuple(rref_id), tuple(fork_id), _worker_caller())


def _worker_caller() -> int:
    """The worker whose call this is (None stands for this worker in the bookkeeping: a
    member that is no worker of the group, an embedder's extra peer, is refused)."""
    caller = current.caller()
    if caller is None:
        raise _context().refusals.refuse(caller, "an RRef protocol message")
    return caller


@protocol_function
def _backward_on_owner(rref_id: list, context_id: int, retain_graph: bool, fork_id: list | None = None) -> None:
    """On the owner, for a user's ``RRef.backward`` (its creator's, or the holder's of fork
    ``fork_id``): once the value is there (a remote() may still be running), the pass starts
    here, so this worker is its originator."""
    context, caller = _context(), _worker_caller()
    rref_id_, fork_id_ = tuple(rref_id), None if fork_id is None else tuple(fork_id)
    context.check_user(rref_id_, fork_id_, caller)
    made = context.owner_value(rref_id_).done()
    value = context.wait_for_value(rref_id_)  # (the call that makes it may need a pool thread)
    if not made:
        context.check_user(rref_id_, fork_id_, caller)  # (as _fetch's, once the value is made)
    _backward_value(value, context_id, retain_graph)

def _backward_value(value: Any, context_id: int, retain_graph: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
        return
    _context().agent.hooks.backward(context_id, [value], retain_graph)  # distributed autograd's


@protocol_function
@answered_when_done
def _call_method(name: str, rref: RRef, args: tuple, kwargs: dict) -> torch.futures.Future:
    """On the owner, for the proxies (``rref.rpc_sync().method(...)``): the method's result,
    as a future, so that a method marked ``async_execution`` is answered when the future it
    returns completes, as torch's proxies do. Where ``allowed_functions`` restricts what
    peers may run, only a method it lists (CallablePolicy.check_method)."""
    if not isinstance(name, str):
        raise SerializationError(f"method name {name!r:.60} is not a str")
    value = rref.local_value()
    _context().agent.codec.policy.check_method(type(value), name)
    method = getattr(value, name)
    result = method(*args, **kwargs)
    if is_async_function(method):
        check_async_result(method, result)
        return result
    done: torch.futures.Future = Future()
    done.set_result(result)
    return done


@protocol_function
def _owned_count() -> int:
    return _context().owned_count()
