"""Remote references (``RRef``) and the owner/user protocol, as torch's.

An RRef names a value that lives on its *owner*. Every other worker holding it holds a *fork*
(a user RRef with a fork id). The owner keeps the value while any fork, or a local handle of
its own, exists:

* ``remote()``: the caller makes the ids and sends PYTHON_REMOTE_CALL. The owner runs the
  function, stores the value (or its exception, raised later by ``to_here``) and registers
  the caller's fork. Its answer confirms the caller's RRef.
* An RRef passed in a call's arguments is forked. The sender makes a new fork id and, if it is
  a user, keeps its own RRef alive until the receiver says RREF_CHILD_ACCEPT. A receiving user
  first registers its fork with the owner (RREF_FORK_REQUEST). A receiving owner just gets
  its local handle back. Either way the parent is then told RREF_CHILD_ACCEPT.
* A user RRef that Python frees sends RREF_USER_DELETE to the owner.
* ``to_here()`` sends PYTHON_RREF_FETCH_CALL. The owner answers when the value is ready
  (async: no thread waits).

The pool serves these messages concurrently, so they may arrive in any order. Every owner
operation is get-or-create, and a delete that arrives before its fork's registration leaves
a tombstone. Duplicates are harmless, which issue 5's retries rely on.

A worker that dies can never delete its forks nor accept the forks sent to it, so the owner
notes which worker holds each fork (and sent each early delete), and the sender of a fork
which worker it went to: when a worker is lost (``peer_lost``) its forks and early deletes
go from the owners, and the RRefs kept for it as a child from their senders, as if it had
deleted them (torch keeps them forever). A value that others asked for before its remote()
arrived, whose creator is lost, fails with an error naming the creator, for whoever fetches
it. A fork request or early delete handled after its sender's loss keeps nothing. A message
whose forks could not be sent at all takes them back (``unsent``), and so does a call whose
send failed later or that its receiver refused undecoded (its forks never arrived).

Deleting all user RRefs at once (a graceful shutdown does) first waits, as torch's, until
the children they were forked to have accepted: a user's delete must not reach the owner
ahead of a child's fork request, or the owner lets go of a value the child still holds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

import torch

from zmqautograd.transport import MessageType

from . import current
from .errors import RpcError, SerializationError
from .futures import Future, settle_from
from .rref_owner import (
    _backward_on_owner,
    _backward_value,
    _call_method,
    _failed,
    _fetch,
    _rref_typeof_on_owner,
)

if TYPE_CHECKING:
    from .rref_context import RRefContext

log = logging.getLogger(__name__)

RRefId = tuple  # (worker id that created it, counter)


_T = TypeVar("_T")


class RRef(Generic[_T]):
    """A reference to a value on a (possibly) remote worker (``RRef[T]``: to a value of type
    ``T``, as torch's is generic).

    ``RRef(value)`` makes a local one, owned here. ``remote()`` returns them for values on other
    workers.
    """

    _unsent = False  # its remote() never reached the owner (rpc.api.remote): nothing to delete there
    _deleted = False  # a user RRef deleted by shutdown (RRefContext.delete_all_users)
    _profiling_future: torch.futures.Future | None = None  # remote() under the profiler (profiling.py)
    # A child's registration of its fork with the owner (RRefContext.decode; None: no child's).
    _registration: torch.futures.Future | None = None
    rref_id: RRefId
    owner_id: int
    fork_id: RRefId | None  # this user's own id; None on the owner

    def __init__(self, value: Any, type_hint: type | None = None):
        context = current.agent().rrefs
        rref_id = context.new_id()
        self._init_owner(context, rref_id, (type_hint or type(value)).__qualname__)  # (a handle first)
        context.owner_value(rref_id).set_result(value)
        context.set_created(rref_id)

    # How handles are made (not through __init__, which is the public RRef(value)).
    @classmethod
    def _owner_handle(cls, context: RRefContext, rref_id: RRefId, type_name: str) -> "RRef":
        """The owner's handle of an RRef that came in a message (its value may be one that no
        remote() makes: the owner then lets it go after the RPC timeout)."""
        rref = cls.__new__(cls)
        rref._init_owner(context, rref_id, type_name, decoded=True)
        return rref

    @classmethod
    def _user(cls, context: RRefContext, rref_id: RRefId, owner_id: int, fork_id: tuple, type_name: str) -> "RRef":
        rref = cls.__new__(cls)
        rref._context, rref.rref_id, rref.owner_id, rref.fork_id = context, rref_id, owner_id, fork_id
        rref._type_name = type_name
        rref._confirmed = threading.Event()
        rref._creation = Future()  # settles with the owner's answer
        context._users.add(rref)
        context._held[fork_id] = rref
        return rref

    def _init_owner(self, context: RRefContext, rref_id: RRefId, type_name: str, decoded: bool = False) -> None:
        self._context, self.rref_id, self.owner_id, self.fork_id = context, rref_id, context.agent.rank, None
        self._type_name = type_name
        self._confirmed = threading.Event()
        self._confirmed.set()
        self._creation = Future()
        self._creation.set_result(True)
        context.add_local_handle(rref_id, decoded)

    # ------------------------------------------------------------------------------ API

    def is_owner(self) -> bool:
        return self.fork_id is None

    def owner(self):
        return self._context.agent.workers_by_id[self.owner_id]

    def owner_name(self) -> str:
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        return self._confirmed.is_set()

    def _confirm_if_ok(self, done: torch.futures.Future) -> None:
        try:
            done.value()
        except Exception as exc:  # the owner never registered us: using the RRef says why
            self._creation_failed(exc)
            return
        self._confirmed.set()
        if not self._creation.done():
            self._creation.set_result(True)

    def _creation_failed(self, error: BaseException) -> None:
        if not self._creation.done():
            self._creation.set_exception(RuntimeError(
                f"RRef creation on its owner {self.owner()} failed (the remote() that made it, or the "
                f"fork that brought it here, was not confirmed), and the RRef may not exist there: {error}"
            ))

    def _check_created(self) -> None:
        """Raise the creation error of an RRef whose remote() failed (torch: 'RRef creation')."""
        if self._creation.done():
            self._creation.wait()

    def _get_future(self) -> torch.futures.Future:
        """Completes when the owner has confirmed this RRef (with an error if remote() failed)."""
        return self._creation

    def _get_profiling_future(self) -> torch.futures.Future:
        """Completes when the profiler event of the remote() that made this RRef has ended
        (where it was made under torch's legacy profiler; else as ``_get_future``)."""
        return self._profiling_future if self._profiling_future is not None else self._creation

    def _set_profiling_future(self, future: torch.futures.Future) -> None:
        self._profiling_future = future

    def local_value(self) -> Any:
        if self.fork_id is not None:  # a user
            raise RuntimeError(  # torch's message
                f"For UserRRef(rref_id={_unique_id(self.rref_id)}, fork_id={_unique_id(self.fork_id)}), "
                f"can't call localValue() on user {self._context.agent.info}. Call it on owner {self.owner()}"
            )
        return self._context.wait_for_value(self.rref_id)

    def to_here(self, timeout: float = -1.0) -> Any:
        """The value, copied here from its owner (waits until the owner has it)."""
        if self.is_owner():
            return self.local_value()
        self._check_created()
        agent = self._context.agent
        if self._deleted or agent.closed:  # shutdown() deleted this worker's user RRefs: torch's message
            raise RpcError(f"Cannot call to_here() on it after deletion. ({self}: RPC was shut down on {agent.info})")
        self._await_registration()
        value = agent.call_sync(self.owner_id, _fetch, (list(self.rref_id), list(self.fork_id or ())), None, timeout,
                                message_type=MessageType.PYTHON_RREF_FETCH_CALL)
        # The owner registers a fork before it stores the value, so having the value proves it
        # (the fetch can overtake remote()'s own acknowledgement).
        self._confirmed.set()
        return value

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """A backward pass with the value (a scalar tensor) as its root, run on the owner: a
        distributed one in autograd context ``dist_autograd_ctx_id`` (the gradients go to that
        context: ``get_gradients``), or without one a local ``torch.autograd.backward``, which
        only the owner may ask for. Returns when the pass is done; its errors raise here."""
        if type(dist_autograd_ctx_id) is not int or type(retain_graph) is not bool:
            raise TypeError(
                "backward(): incompatible function arguments: expected (dist_autograd_ctx_id: int = -1, "
                f"retain_graph: bool = False), got ({dist_autograd_ctx_id!r:.40}, {retain_graph!r:.40})"
            )
        if self.is_owner():
            _backward_value(self.local_value(), dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        self._check_created()
        self._await_registration()
        self._context.agent.call_sync(self.owner_id, _backward_on_owner,
                                      (list(self.rref_id), dist_autograd_ctx_id, retain_graph, list(self.fork_id or ())),
                                      None, -1.0, message_type=MessageType.RREF_BACKWARD_REQ)

    def _await_registration(self) -> None:
        """The owner serves the value only to the worker that holds a fork of it: one that is
        not this RRef's creator waits until the owner has registered its fork (its request
        may still be on its way, or waiting for the owner's pool)."""
        if self._confirmed.is_set() or self.rref_id[0] == self._context.agent.rank:
            return
        pool = self._context.agent.pool
        with pool.blocking() if pool.owns_current_thread() else contextlib.nullcontext():
            self._creation.wait()

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any:
        """The type of the value (torch's private API; its tests and proxies use it), or with
        ``blocking=False`` a future of it. The owner looks; a user asks the owner once,
        waiting there until the value exists (``timeout`` bounds that, as any call's), and
        keeps the answer: later calls return the same future. A failed ask is not kept."""
        future = getattr(self, "_type_future", None)
        if future is not None and future.done() and _failed(future):
            future = None  # a failed ask is not kept: ask again
        if future is None:
            if self.is_owner():
                future = Future()
                try:
                    future.set_result(type(self.local_value()))
                except Exception as exc:  # the value's creation failed: so does this
                    future.set_exception(exc)
            else:
                from . import api
                from .serialization import resolve_function

                self._check_created()
                asked = api.rpc_async(self.owner(), _rref_typeof_on_owner, args=(self,), timeout=timeout)
                future = Future()  # not asked.then(): it would wrap the owner's error
                # The owner names the type: this worker imports only what its policy allows
                # peers to name (allowed_functions), as for any value by reference.
                policy = self._context.agent.codec.policy
                asked.add_done_callback(
                    lambda done: settle_from(future, done, lambda ref: resolve_function(ref, policy)))
            self._type_future = future
        return future.wait() if blocking else future

    def rpc_sync(self, timeout: float = -1.0) -> "_Proxy":
        """``rref.rpc_sync().method(*args)`` runs ``method`` on the value, on its owner."""
        from . import api

        return _Proxy(self, api.rpc_sync, timeout)

    def rpc_async(self, timeout: float = -1.0) -> "_Proxy":
        from . import api

        return _Proxy(self, api.rpc_async, timeout)

    def remote(self, timeout: float = -1.0) -> "_Proxy":
        from . import api

        return _Proxy(self, api.remote, timeout)

    def _serialize(self) -> tuple:
        """torch's private API: this RRef forked, as data that ``RRef._deserialize`` turns into
        the fork on the worker that receives it (the owner counts the fork from now on, as
        torch's: data never deserialized keeps the value alive). Raises the creation error
        of an RRef whose remote() failed, and after its deletion, as forking it in a call does."""
        return tuple(self._context.encode(self, in_message=False))

    @classmethod
    def _deserialize(cls, data: tuple) -> "RRef":
        """The fork ``_serialize`` made, here (the worker that made it may be this one)."""
        return current.agent().rrefs.decode(list(data))

    def __str__(self) -> str:  # torch's format (py_rref.cpp)
        if self.fork_id is None:
            return f"OwnerRRef({_unique_id(self.rref_id)})"
        return f"UserRRef(RRefId = {_unique_id(self.rref_id)}, ForkId = {_unique_id(self.fork_id)})"

    __repr__ = __str__

    def __reduce__(self):
        # torch's message; an RRef goes as an RPC argument or result, where the RPC layer
        # encodes it (and tells its owner about the fork), never through a plain pickle.
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC")

    def __del__(self) -> None:
        try:
            context = self._context
        except AttributeError:
            return  # construction failed half-way
        # No lock and no I/O here: see RRefContext.__init__.
        try:
            if self.is_owner():
                context.release_later(("owner", self.rref_id))
            elif not self._unsent and not self._deleted:  # else its remote() never went out, or shutdown deleted it
                context.release_later(("user", self.owner_id, self.rref_id, self.fork_id, self._registration))
        except Exception:  # interpreter shutdown
            pass


def _unique_id(rref_or_fork_id: tuple) -> str:
    created_on, local_id = rref_or_fork_id
    return f"GloballyUniqueId(created_on={created_on}, local_id={local_id})"


class _Proxy:
    """``rref.rpc_sync()`` and friends: attribute access names a method of the remote value."""

    def __init__(self, rref: RRef, invoke: Callable, timeout: float):
        self._rref, self._invoke, self._timeout = rref, invoke, timeout

    def __getattr__(self, name: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            from . import api

            if self._invoke is api.remote:
                # As torch's: the value's type is looked at first, so that a method it does not
                # have raises here rather than in the RRef made (rpc_sync and rpc_async raise
                # the owner's AttributeError when they complete).
                try:
                    value_type = self._rref._get_type(timeout=self._timeout)
                except SerializationError:
                    pass  # a type this worker cannot import: the owner looks
                else:
                    _check_method(value_type, name)
            return self._invoke(self._rref.owner(), _call_method, args=(name, self._rref, args, kwargs), timeout=self._timeout)

        return call


def _check_method(value_type: type, name: str) -> None:
    if not issubclass(value_type, (torch.jit.ScriptModule, torch._C.ScriptModule)):  # torch does not look there
        getattr(value_type, name)  # AttributeError: type object 'X' has no attribute 'name'
