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
whose forks could not be sent at all takes them back (``unsent``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zmqautograd.transport import MessageType
from zmqautograd.transport.errors import PeerLostError

from . import current
from .errors import RpcError, SerializationError, as_operator_error, user_error
from .functions import check_async_result, is_async_function
from .futures import Future
from .serialization import protocol_function

log = logging.getLogger(__name__)

RRefId = tuple  # (worker id that created it, counter)


@dataclass
class _OwnerEntry:
    value: torch.futures.Future = field(default_factory=Future)
    # fork id -> the worker that holds it (None until the message that carries it is sent)
    forks: dict = field(default_factory=dict)
    deleted_early: dict = field(default_factory=dict)  # deletes that came before their fork: id -> sender
    local_handles: int = 0
    created: bool = False  # the remote() call (or RRef(value)) has set it up
    making: bool = False  # the remote() call runs (``begin_making``)
    orphaned: bool = False  # failed: its creator was lost before its remote() call ran


class RRefContext:
    """One per agent: this worker's owned values and the user RRefs it keeps alive for children."""

    def __init__(self, agent: Any):
        self.agent = agent
        self._lock = threading.Lock()
        self._owned: dict[RRefId, _OwnerEntry] = {}
        # fork id -> (our RRef, the child it went to: None until sent), until the child accepts
        self._pending_children: dict[tuple, tuple] = {}
        # Forks made while encoding a message on this thread, for the agent to tell where the
        # message went (``sent_to``) or that it did not go (``unsent``). ``forks_made`` is 0
        # until the first fork on any thread (increments may race; it never returns to 0): a
        # program that never sends an RRef never looks.
        self._made = threading.local()
        self.forks_made = 0
        self._counter = itertools.count(1)
        self._users: weakref.WeakSet = weakref.WeakSet()  # user RRefs here (debug_info counts the unconfirmed)
        self._control_in_flight = 0  # fork requests, child accepts and deletes not answered yet
        # RRefs dropped by ``__del__``, released on a thread of their own. ``__del__`` runs
        # wherever the garbage collector happens to run, possibly on a thread that holds the
        # endpoint's socket lock or this context's lock (seen: the I/O thread, mid-receive,
        # deadlocked on its own socket lock): it must take no lock, and SimpleQueue.put is
        # reentrant for exactly this use.
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        self._release_thread = threading.Thread(
            target=self._release_loop, name=f"rref-release-{agent.rank}", daemon=True
        )
        self._release_thread.start()

    def new_id(self) -> tuple:
        return (self.agent.rank, next(self._counter))

    # -------------------------------------------------------------------------- owner side

    def _entry(self, rref_id: RRefId) -> _OwnerEntry:  # caller holds the lock
        entry = self._owned.get(rref_id)
        if entry is None:
            entry = self._owned[rref_id] = _OwnerEntry()
        return entry

    def owner_value(self, rref_id: RRefId) -> torch.futures.Future:
        with self._lock:
            return self._entry(rref_id).value

    def add_fork(self, rref_id: RRefId, fork_id: tuple, holder: int | None = None) -> None:
        with self._lock:
            entry = self._entry(rref_id)
            if fork_id in entry.deleted_early:
                del entry.deleted_early[fork_id]  # its delete came first: nothing to keep
                self._maybe_release(rref_id, entry)
            elif self._is_lost(holder):
                # A request that waited in our pool while its sender's loss was handled:
                # ``peer_lost`` could not drop a fork not yet there, and nobody else will.
                self._maybe_release(rref_id, entry)
            else:
                entry.forks[fork_id] = holder

    def delete_fork(self, rref_id: RRefId, fork_id: tuple, sender: int | None = None) -> None:
        with self._lock:
            entry = self._entry(rref_id)
            if fork_id in entry.forks:
                holder = entry.forks[fork_id]
                if sender is not None and holder is not None and holder != sender:
                    # Only the worker that holds a fork releases it (sender: its connection).
                    raise RpcError(f"RRef fork {fork_id} of {rref_id} is held by worker {holder}, "
                                   f"not by worker {sender}, which asked to delete it")
                del entry.forks[fork_id]
            elif not self._is_lost(sender):  # (a lost sender's fork is never kept: add_fork)
                entry.deleted_early[fork_id] = sender
            self._maybe_release(rref_id, entry)

    def _is_lost(self, worker: int | None) -> bool:
        """Whether ``worker`` (a fork's holder, None for one we registered ourselves) is lost.
        ``add_fork`` and ``delete_fork`` check it under the lock: ``peer_lost`` runs after the
        endpoint marks a worker lost, so a fork noted before that mark is dropped by it, and
        one after it is never noted."""
        return worker is not None and worker != self.agent.rank and self.agent.endpoint.is_lost(str(worker))

    def begin_making(self, rref_id: RRefId) -> torch.futures.Future | None:
        """For the remote() call that makes the value: its future, or None when the value is
        settled already (its creator was lost before the call ran, and ``peer_lost`` failed
        it: nothing waits for what the call would make)."""
        with self._lock:
            entry = self._entry(rref_id)
            if entry.orphaned:
                return None
            entry.making = True
            return entry.value

    def set_created(self, rref_id: RRefId) -> None:
        """The value is set up. Every fork may be gone by then: a user may delete its RRef
        while the remote() that makes the value still runs (the pool serves both at once)."""
        with self._lock:
            entry = self._entry(rref_id)
            entry.created = True
            self._maybe_release(rref_id, entry)

    def fail_creation(self, rref_id: RRefId, error: BaseException) -> None:
        """remote() to ourselves could not be sent: the value is that error."""
        with self._lock:
            entry = self._entry(rref_id)
        if not entry.value.done():
            entry.value.set_exception(error)
        self.set_created(rref_id)

    def add_local_handle(self, rref_id: RRefId) -> None:
        with self._lock:
            self._entry(rref_id).local_handles += 1

    # --------------------------------------------------------------- releases from __del__

    def release_later(self, item: tuple) -> None:
        """From ``RRef.__del__``: ``("owner", rref_id)`` or ``("user", owner_id, rref_id,
        fork_id)``. Takes no lock (see ``__init__``)."""
        self._released.put(item)

    def flush_releases(self, timeout: float | None) -> bool:
        """Wait until every release queued so far has been acted on (a user delete is then
        counted by the agent's outstanding work). False on timeout."""
        done = threading.Event()
        self._released.put(done)
        return done.wait(timeout)

    def stop_releasing(self) -> None:
        self._released.put(None)

    def _release_loop(self) -> None:
        while True:
            item = self._released.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if item[0] == "owner":
                    self.drop_local_handle(item[1])
                else:
                    _, owner_id, rref_id, fork_id = item
                    agent = self.agent
                    if not agent.closed and agent.rrefs is self:
                        self._control(owner_id, _delete_fork, (list(rref_id), list(fork_id)),
                                      MessageType.RREF_USER_DELETE)
            except Exception as exc:  # noqa: BLE001 - the owner's peer-loss handling covers the rest
                log.debug("releasing %s failed: %s", item, exc)
            del item

    def drop_local_handle(self, rref_id: RRefId) -> None:
        with self._lock:
            entry = self._owned.get(rref_id)
            if entry is not None:
                entry.local_handles -= 1
                self._maybe_release(rref_id, entry)

    def _maybe_release(self, rref_id: RRefId, entry: _OwnerEntry) -> None:  # caller holds the lock
        if entry.created and not entry.forks and not entry.deleted_early and entry.local_handles <= 0:
            del self._owned[rref_id]

    def owned_count(self) -> int:
        with self._lock:
            return len(self._owned)

    # --------------------------------------------------------------------------- user side

    def keep_for_child(self, fork_id: tuple, rref: "RRef") -> None:
        with self._lock:
            self._pending_children[fork_id] = (rref, None)

    def child_accepted(self, fork_id: tuple, sender: int | None = None) -> None:
        with self._lock:
            kept = self._pending_children.get(fork_id)
            if kept is not None and sender is not None and kept[1] is not None and kept[1] != sender:
                # Only the worker we forked it to may say it has its own now.
                raise RpcError(f"RRef fork {fork_id} went to worker {kept[1]}, not to worker {sender}")
            kept = self._pending_children.pop(fork_id, None)
        del kept  # (our RRef's __del__, if this was its last reference, outside the lock)

    # ------------------------------------------------------------- forks and lost workers

    def take_made(self) -> list | None:
        """The forks this thread made while encoding its last message (and forgets them)."""
        made = getattr(self._made, "forks", None)
        if made:
            self._made.forks = None
        return made

    def sent_to(self, made: list, to: int) -> None:
        """The message holding the forks ``made`` went to worker ``to``: it holds them now."""
        with self._lock:
            for rref_id, fork_id in made:
                if rref_id is None:  # a fork of a user RRef: kept for the child until it accepts
                    kept = self._pending_children.get(fork_id)
                    if kept is not None:
                        self._pending_children[fork_id] = (kept[0], to)
                else:
                    entry = self._owned.get(rref_id)
                    if entry is not None and fork_id in entry.forks:
                        entry.forks[fork_id] = to
        if self._is_lost(to):
            self.peer_lost(to)  # lost before we noted it: what peer_lost found had no holder yet

    def unsent(self, made: list | None) -> None:
        """The message holding the forks ``made`` could not be sent: take them back."""
        for rref_id, fork_id in made or ():
            if rref_id is None:
                self.child_accepted(fork_id)
            else:
                self.delete_fork(rref_id, fork_id)

    def peer_lost(self, worker: int, error: BaseException | None = None) -> None:
        """``worker`` is gone: drop the forks it held of our values and the deletes it sent
        early, fail the values its remote() calls were to create but never did (``error``
        says why), and let go of the RRefs we kept for it as a child."""
        unborn = []
        with self._lock:
            for rref_id, entry in list(self._owned.items()):
                held = [f for f, holder in entry.forks.items() if holder == worker]
                early = [f for f, sender in entry.deleted_early.items() if sender == worker]
                for fork_id in held:
                    del entry.forks[fork_id]
                for fork_id in early:
                    del entry.deleted_early[fork_id]
                never_created = not entry.created and not entry.making and rref_id[0] == worker
                if never_created:
                    # Others referred to it (a fork request, a fetch) before its remote()
                    # ran; now it never will, and whoever fetches it would wait forever.
                    entry.created = entry.orphaned = True
                    unborn.append(entry.value)
                if held or early or never_created:
                    self._maybe_release(rref_id, entry)
            children = [f for f, (_, child) in self._pending_children.items() if child == worker]
            kept = [self._pending_children.pop(f) for f in children]
        for value in unborn:  # (outside the lock: failing it answers the fetches waiting on it)
            if not value.done():
                value.set_exception(PeerLostError(str(worker), (
                    f"the value of this RRef was never created: its creator, worker {worker}, was lost "
                    f"before its remote() call arrived ({error})")))
        if kept or unborn:
            log.debug("let go of %d RRef(s) kept for lost worker %d, failed %d it never created",
                      len(kept), worker, len(unborn))
        del kept  # (outside the lock: see child_accepted)

    def _accept_child(self, parent: int, fork_id: tuple) -> None:
        """Tell the worker that forked this RRef to us that it may let go of its own."""
        if parent == self.agent.rank:
            self.child_accepted(fork_id)
        else:
            self._control(parent, _child_accept, (list(fork_id),), MessageType.RREF_CHILD_ACCEPT)

    def _control(self, to: int, function: Callable, args: tuple, message_type: MessageType) -> torch.futures.Future:
        """An RRef protocol message (retried; see Agent.call_retrying), counted while unanswered."""
        with self._lock:
            self._control_in_flight += 1
        try:
            sent = self.agent.call_retrying(to, function, args, message_type)
        except BaseException:
            self._control_answered(None)
            raise
        sent.add_done_callback(self._control_answered)
        return sent

    def _control_answered(self, _: Any) -> None:
        with self._lock:
            self._control_in_flight -= 1

    def debug_info(self) -> dict[str, str]:
        """torch's ``_rref_context_get_debug_info()``: owned values that other workers
        reference (a local ``RRef(value)`` counts once it has been shared), owned values
        asked for before they exist and RRef protocol messages in flight (torch counts both
        as pending futures), user RRefs here that their owner has not confirmed yet, and the
        forks the owned values have."""
        with self._lock:
            shared = [e for e in self._owned.values() if e.created and (e.forks or e.deleted_early)]
            pending = sum(1 for e in self._owned.values() if not e.created) + self._control_in_flight
        unconfirmed = sum(1 for rref in list(self._users) if not rref._confirmed.is_set() and not rref._creation.done())
        return {
            "num_owner_rrefs": str(len(shared)),
            "num_pending_futures": str(pending),
            "num_pending_users": str(unconfirmed),
            "num_forks": str(sum(len(e.forks) for e in shared)),
        }

    # ------------------------------------------------------------------------- wire format

    def encode(self, rref: "RRef") -> list:
        """Fork ``rref`` for whoever receives this message."""
        rref._check_created()
        fork_id = self.new_id()
        if rref.is_owner():
            # The owner registers the fork itself; the receiver's delete will remove it.
            self.add_fork(rref.rref_id, fork_id)
            made = (rref.rref_id, fork_id)
        else:
            self.keep_for_child(fork_id, rref)
            made = (None, fork_id)
        forks = getattr(self._made, "forks", None)
        if forks is None:
            forks = self._made.forks = []
        forks.append(made)
        self.forks_made += 1
        return [list(rref.rref_id), rref.owner_id, list(fork_id), self.agent.rank, rref._type_name]

    def decode(self, value: list) -> "RRef":
        rref_id, owner_id, fork_id, parent, type_name = value
        rref_id, fork_id = tuple(rref_id), tuple(fork_id)
        agent = self.agent
        if owner_id == agent.rank:
            rref = RRef._owner_handle(self, rref_id, type_name)
            if parent == agent.rank:
                # We sent it to ourselves and registered a fork for the receiver, which turns
                # out to be us, the owner: drop that fork again.
                self.delete_fork(rref_id, fork_id)
            self._accept_child(parent, fork_id)
            return rref
        rref = RRef._user(self, rref_id, owner_id, fork_id, type_name)
        if parent == owner_id:
            rref._confirmed.set()  # the owner registered this fork when it sent it
            return rref
        registered = self._control(owner_id, _fork_request, (list(rref_id), list(fork_id)),
                                   MessageType.RREF_FORK_REQUEST)

        def confirmed(done: Any) -> None:
            rref._confirm_if_ok(done)
            self._accept_child(parent, fork_id)

        registered.add_done_callback(confirmed)
        return rref


class RRef:
    """A reference to a value on a (possibly) remote worker.

    ``RRef(value)`` makes a local one, owned here. ``remote()`` returns them for values on other
    workers.
    """

    def __init__(self, value: Any, type_hint: type | None = None):
        context = current.agent().rrefs
        rref_id = context.new_id()
        self._init_owner(context, rref_id, (type_hint or type(value)).__qualname__)  # (a handle first)
        context.owner_value(rref_id).set_result(value)
        context.set_created(rref_id)

    # How handles are made (not through __init__, which is the public RRef(value)).
    @classmethod
    def _owner_handle(cls, context: RRefContext, rref_id: RRefId, type_name: str) -> "RRef":
        rref = cls.__new__(cls)
        rref._init_owner(context, rref_id, type_name)
        return rref

    @classmethod
    def _user(cls, context: RRefContext, rref_id: RRefId, owner_id: int, fork_id: tuple, type_name: str) -> "RRef":
        rref = cls.__new__(cls)
        rref._context, rref.rref_id, rref.owner_id, rref.fork_id = context, rref_id, owner_id, fork_id
        rref._type_name = type_name
        rref._confirmed = threading.Event()
        rref._creation: torch.futures.Future = Future()  # settles with the owner's answer
        context._users.add(rref)
        return rref

    def _init_owner(self, context: RRefContext, rref_id: RRefId, type_name: str) -> None:
        self._context, self.rref_id, self.owner_id, self.fork_id = context, rref_id, context.agent.rank, None
        self._type_name = type_name
        self._confirmed = threading.Event()
        self._confirmed.set()
        self._creation = Future()
        self._creation.set_result(True)
        context.add_local_handle(rref_id)

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

    def local_value(self) -> Any:
        if not self.is_owner():
            raise RuntimeError(  # torch's message
                f"For UserRRef(rref_id={_unique_id(self.rref_id)}, fork_id={_unique_id(self.fork_id)}), "
                f"can't call localValue() on user {self._context.agent.info}. Call it on owner {self.owner()}"
            )
        return self._context.owner_value(self.rref_id).wait()

    def to_here(self, timeout: float = -1.0) -> Any:
        """The value, copied here from its owner (waits until the owner has it)."""
        if self.is_owner():
            return self.local_value()
        self._check_created()
        agent = self._context.agent
        if agent.closed:  # shutdown() deleted this worker's user RRefs: torch's message
            raise RpcError(f"Cannot call to_here() on it after deletion. ({self}: RPC was shut down on {agent.info})")
        value = agent.call_sync(self.owner_id, _fetch, (list(self.rref_id),), None, timeout,
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
        self._context.agent.call_sync(self.owner_id, _backward_on_owner,
                                      (list(self.rref_id), dist_autograd_ctx_id, retain_graph), None, -1.0,
                                      message_type=MessageType.RREF_BACKWARD_REQ)

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
                asked = api.rpc_async(self.owner(), _type_on_owner, args=(self,), timeout=timeout)
                future = Future()  # not asked.then(): it would wrap the owner's error
                asked.add_done_callback(lambda done: _settle(future, done, resolve_function))
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

    def __str__(self) -> str:  # torch's format (py_rref.cpp)
        if self.is_owner():
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
            elif not getattr(self, "_unsent", False):  # else its remote() never went out
                context.release_later(("user", self.owner_id, self.rref_id, self.fork_id))
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
            return self._invoke(self._rref.owner(), _call_method, args=(name, self._rref, args, kwargs), timeout=self._timeout)

        return call


# ------------------------------------------------- functions the owner runs (by reference)


def _context() -> RRefContext:
    return current.agent().rrefs


@protocol_function
def _type_on_owner(rref: RRef) -> Any:
    """On the owner, for ``RRef._get_type``: the value's type, by reference (torch's
    ``_rref_typeof_on_owner``); waits for the value as ``local_value`` does."""
    from .serialization import encode_function

    return encode_function(type(rref.local_value()))


@protocol_function
def _run_remote(rref_id: list, fork_id: list | None, function: Callable, args: tuple, kwargs: dict) -> None:
    """On the owner, for remote(): register the caller's fork, run, keep the value."""
    from .serialization import resolve_function

    context, rref_id = _context(), tuple(rref_id)
    caller = current.caller()
    if caller is not None and (rref_id[0] != caller or (fork_id is not None and fork_id[0] != caller)):
        # remote()'s caller makes the ids (RRefContext.new_id): others' are not its to name.
        raise RpcError(f"worker {caller} sent remote() with RRef ids of another worker ({rref_id}, {fork_id})")
    if fork_id is not None:  # made by the caller, who holds it
        context.add_fork(rref_id, tuple(fork_id), current.caller())
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
            value.add_done_callback(lambda done: _settle(future, done))
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


def _settle(target: torch.futures.Future, done: torch.futures.Future, convert: Callable | None = None) -> None:
    """Complete ``target`` as ``done`` completed (its value through ``convert``, if given),
    unless it is complete already."""
    if target.done():
        return
    try:
        value = done.value()
        target.set_result(value if convert is None else convert(value))
    except Exception as exc:  # noqa: BLE001 - the value's failure, for whoever fetches it
        target.set_exception(exc)


@protocol_function
def _fetch(rref_id: list) -> torch.futures.Future:
    return _context().owner_value(tuple(rref_id))


_fetch._wrapped_async_rpc_function = _fetch  # answered when the value is ready


# The worker a fork request or a delete is for is the one it came from (current.caller: the
# authenticated connection), never a rank its payload names.
@protocol_function
def _fork_request(rref_id: list, fork_id: list) -> None:
    _context().add_fork(tuple(rref_id), tuple(fork_id), current.caller())


@protocol_function
def _child_accept(fork_id: list) -> None:
    _context().child_accepted(tuple(fork_id), current.caller())


@protocol_function
def _delete_fork(rref_id: list, fork_id: list) -> None:
    _context().delete_fork(tuple(rref_id), tuple(fork_id), current.caller())


@protocol_function
def _backward_on_owner(rref_id: list, context_id: int, retain_graph: bool) -> None:
    """On the owner, for a user's ``RRef.backward``: once the value is there (a remote() may
    still be running), the pass starts here, so this worker is its originator."""
    context = _context()
    value = context.owner_value(tuple(rref_id))
    if not value.done():
        with context.agent.pool.blocking():  # the call that makes the value may need a thread
            value.wait()
    _backward_value(value.wait(), context_id, retain_graph)


def _backward_value(value: Any, context_id: int, retain_graph: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        torch.autograd.backward(value, retain_graph=retain_graph)
        return
    _context().agent.hooks.backward(context_id, [value], retain_graph)  # distributed autograd's


@protocol_function
def _call_method(name: str, rref: RRef, args: tuple, kwargs: dict) -> torch.futures.Future:
    """On the owner, for the proxies (``rref.rpc_sync().method(...)``): the method's result,
    as a future, so that a method marked ``async_execution`` is answered when the future it
    returns completes, as torch's proxies do. Where ``allowed_functions`` restricts what
    peers may run, only public methods (no name that starts with "_")."""
    if not isinstance(name, str) or (name.startswith("_") and _context().agent.codec.policy.restricted):
        raise SerializationError(f"method {name!r:.60} may not be called by peers here (allowed_functions)")
    method = getattr(rref.local_value(), name)
    result = method(*args, **kwargs)
    if is_async_function(method):
        check_async_result(method, result)
        return result
    done: torch.futures.Future = Future()
    done.set_result(result)
    return done


_call_method._wrapped_async_rpc_function = _call_method


@protocol_function
def _owned_count() -> int:
    return _context().owned_count()
