"""What one worker keeps of RRefs (rref.py describes the protocol): the values it owns and
the forks that hold them, the RRefs it keeps for children not yet accepted, releases of
its own forks, and what a lost worker leaves behind."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zmqautograd.transport import MessageType
from zmqautograd.transport.errors import PeerLostError

from .. import timers
from . import current
from .errors import RpcError
from .futures import Future
from .refusals import Refusals
from .rref import RRef, RRefId
from .rref_owner import _child_accept, _delete_fork, _failed, _fork_request, _vouch_for

log = logging.getLogger(__name__)

_WAITS_PER_PEER = 64  # threads a peer may hold waiting for values not made yet (wait_for_value)
_UNMADE_TIMEOUT = 60.0  # seconds an asked-for value waits for its remote() (RPC timeout: none)
_FORK_ID_BASE = 1 << 61  # forks made for other workers: 1 << 61 and up (new_fork_id)
_UNREGISTERED = object()  # (a fork's holder may be None: a fork this owner made, not yet sent)
# The holder of a fork made as data (``RRef._serialize``): whichever worker decodes it, as
# torch's; a bearer token, then, that binds nothing to a worker.
BEARER = -1


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
        self._children_accepted = threading.Condition(self._lock)  # notified when none is left
        # Forks made while encoding a message on this thread, for the agent to tell where the
        # message went (``sent_to``) or that it did not go (``unsent``). ``forks_made`` is 0
        # until the first fork on any thread (increments may race; it never returns to 0): a
        # program that never sends an RRef never looks.
        self._made = threading.local()
        self.forks_made = 0
        self._counter = itertools.count(0)  # local ids from 0, as torch's
        self.refusals = Refusals(f"{agent.info} (RRefs)")  # what members may not do to our forks
        self._waits: dict[Any, int] = {}  # peer -> its threads waiting here for values not made yet
        # Registrations with their owners of the user RRefs that decoding on this thread made
        # (``take_registering``): a call that carries them runs once the owners confirmed
        # them, as torch's. ``forks_registered`` is 0 until the first (as ``forks_made``).
        self._registering = threading.local()
        self.forks_registered = 0
        self._users: weakref.WeakSet = weakref.WeakSet()  # user RRefs here (debug_info counts the unconfirmed)
        # fork id -> the user RRef here that holds it: an RRef that comes in again under a fork
        # id held here is refused (a second one would delete the first's fork when it goes)
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._deferred = 0  # user deletes waiting for their RRef's registration (_release_loop)
        self._requeued = 0  # such deletes queued again once it settled (flush_releases counts them)
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

    def new_fork_id(self) -> tuple:
        """The id of a fork made for another worker (``encode``): random, above the counter's
        ids, so that no other member can guess it and register, accept or delete it before
        the worker it is for (remote()'s ids count up, as torch's: its tests read them)."""
        return (self.agent.rank, _FORK_ID_BASE | int.from_bytes(os.urandom(8), "little") >> 3)

    def start_ids(self, incarnation: int) -> None:
        """A member of a dynamic group, the ``incarnation``-th event of its log: local ids of
        its own, not those of an earlier worker of its rank (ids are (rank, local id), and an
        earlier worker's may still live elsewhere)."""
        self._counter = itertools.count(incarnation << 32)

    # -------------------------------------------------------------------------- owner side

    def _entry(self, rref_id: RRefId, asked: bool = False) -> _OwnerEntry:  # caller holds the lock
        """The entry of ``rref_id``, made if need be. ``asked``: made because someone asked
        for a value (a fetch, a fork, a delete) before the remote() that makes it ran; unless
        that remote() starts within the RPC timeout, the value fails and the entry goes: a
        member that names values nobody makes holds no thread and no memory for long."""
        entry = self._owned.get(rref_id)
        if entry is None:
            entry = self._owned[rref_id] = _OwnerEntry()
            if asked:
                timeout = self.agent.default_timeout if self.agent.default_timeout > 0 else _UNMADE_TIMEOUT
                timers.call_later(timeout, self._expire_unmade, rref_id, entry, timeout)
        return entry

    def _expire_unmade(self, rref_id: RRefId, entry: _OwnerEntry, timeout: float) -> None:
        with self._lock:
            if self._owned.get(rref_id) is not entry or entry.created or entry.making:
                return
            entry.created = entry.orphaned = True  # (a remote() that comes later finds it so)
            entry.deleted_early.clear()
            self._maybe_release(rref_id, entry)
        if not entry.value.done():
            entry.value.set_exception(RpcError(
                f"the value of RRef {rref_id} was never created here: no remote() made it within {timeout:.0f} s"))

    def owner_value(self, rref_id: RRefId) -> torch.futures.Future:
        with self._lock:
            return self._entry(rref_id, asked=True).value

    def wait_for_value(self, rref_id: RRefId) -> Any:
        """The value ``rref_id`` owned here, waited for (a remote() may still be making it),
        on a thread that lets the pool start another meanwhile. The thread serves a call of
        ``current.caller()``: a worker may have at most ``_WAITS_PER_PEER`` threads waiting
        for values here at once (its own values that it never finishes making would otherwise
        hold every thread of the pool)."""
        peer = current.caller()
        with self._lock:
            entry = self._entry(rref_id, asked=True)
            counted = not entry.value.done() and peer not in (None, self.agent.rank)
            if counted:
                if self._waits.get(peer, 0) >= _WAITS_PER_PEER:
                    raise self.refusals.refuse(peer, f"one more wait for RRef {rref_id}, which is not made yet: "
                                                     f"{_WAITS_PER_PEER} of its calls wait for values here already")
                self._waits[peer] = self._waits.get(peer, 0) + 1
        try:
            if entry.value.done():
                return entry.value.wait()
            pool = self.agent.pool
            with pool.blocking() if pool.owns_current_thread() else contextlib.nullcontext():
                return entry.value.wait()
        finally:
            if counted:
                with self._lock:
                    self._waits[peer] -= 1

    # Forks are bound to the worker that holds them (docs/security.md): only it registers
    # (``_fork_request``), accepts (``child_accepted``) or deletes one, and a delete that
    # comes before its fork is registered (the owner's pool may serve the two in either
    # order) counts only if the fork turns out to be its sender's. Ids count up, as torch's
    # do (its tests read them), so another member can guess them: it is refused, counted
    # and logged, and the holder's RRef is untouched.

    def add_fork(self, rref_id: RRefId, fork_id: tuple, holder: int | None = None, made_by_holder: bool = False) -> None:
        """Register ``fork_id`` of ``rref_id``, held by ``holder`` (None: a fork this owner
        makes, whose holder ``sent_to`` names). ``made_by_holder``: the holder made the fork
        id itself (remote()'s own fork), so it is the fork's, whoever registered it before."""
        with self._lock:
            entry = self._entry(rref_id, asked=True)
            registered = entry.forks.get(fork_id, _UNREGISTERED)
            if registered is not _UNREGISTERED and registered != holder and not made_by_holder:
                raise self.refusals.refuse(holder, f"the registration of RRef fork {fork_id} of {rref_id}, which "
                                                   f"worker {registered} holds")
            early = entry.deleted_early.pop(fork_id, _UNREGISTERED)
            if early is not _UNREGISTERED and early != holder:
                self.refusals.refuse(early, f"the deletion of RRef fork {fork_id} of {rref_id}, which worker "
                                            f"{holder} holds")
                early = _UNREGISTERED
            if early is not _UNREGISTERED:
                entry.forks.pop(fork_id, None)  # its delete came first: nothing to keep
                self._maybe_release(rref_id, entry)
            elif self._is_lost(holder):
                # A request that waited in our pool while its sender's loss was handled:
                # ``peer_lost`` could not drop a fork not yet there, and nobody else will.
                entry.forks.pop(fork_id, None)
                self._maybe_release(rref_id, entry)
            else:
                entry.forks[fork_id] = holder

    def delete_fork(self, rref_id: RRefId, fork_id: tuple, sender: int | None = None) -> None:
        """``sender`` (None: this worker) lets go of its fork ``fork_id`` of ``rref_id``."""
        with self._lock:
            entry = self._owned.get(rref_id)
            if entry is None and sender is not None and not self._may_be_made(rref_id, sender):
                # (an entry is not made for a value that will not be: it would never go)
                raise self.refusals.refuse(sender, f"the deletion of a fork of RRef {rref_id}, which does not exist")
            entry = self._entry(rref_id, asked=True)
            if fork_id in entry.forks:
                holder = entry.forks[fork_id]
                if sender is not None and holder not in (sender, BEARER):
                    # Only the worker that holds a fork releases it (sender: its connection); a
                    # fork this owner made for a message is its receiver's once sent (sent_to).
                    raise self.refusals.refuse(sender, f"the deletion of RRef fork {fork_id} of {rref_id}, which "
                                                       f"{'nobody' if holder is None else f'worker {holder}'} holds")
                del entry.forks[fork_id]
            elif sender is not None and fork_id in entry.deleted_early:
                raise self.refusals.refuse(sender, f"a second deletion of RRef fork {fork_id} of {rref_id}")
            elif sender is not None and not (fork_id[0] == sender and self._is_creator(rref_id, sender)):
                # Before its fork is registered, only the creator's delete of remote()'s own
                # fork comes (a child's follows its registration: _release_loop).
                raise self.refusals.refuse(sender, f"the deletion of RRef fork {fork_id} of {rref_id}, which is "
                                                   "not registered")
            elif not self._is_lost(sender):  # (a lost sender's fork is never kept: add_fork)
                entry.deleted_early[fork_id] = sender
            self._maybe_release(rref_id, entry)

    def holds(self, rref_id: RRefId, worker: int) -> bool:
        """Whether ``worker`` may use the value ``rref_id`` owned here as its own: this worker,
        its creator (remote()'s caller made its id), or a holder of one of its forks."""
        if worker == self.agent.rank or self._is_creator(rref_id, worker):
            return True
        with self._lock:
            entry = self._owned.get(rref_id)
            return entry is not None and worker in entry.forks.values()

    def _is_creator(self, rref_id: RRefId, worker: int) -> bool:
        """Whether ``worker`` made the id ``rref_id`` (remote()'s caller): of its rank and, in
        a dynamic group, of the worker of that rank now (ids carry its join's number above
        bit 32), not of an earlier one whose rank it took."""
        return rref_id[0] == worker and rref_id[1] >> 32 == self.agent.incarnation_of(worker)

    def register_fork(self, rref_id: RRefId, fork_id: tuple, child: int) -> torch.futures.Future:
        """``child`` registers ``fork_id`` of ``rref_id`` (``_fork_request``). A fork id is its
        parent's (``fork_id[0]`` made it), who must hold the value; the parent is asked whether
        it forked it to ``child`` (``_vouch_for``), and the fork is the child's once it says so:
        no member registers, and so reads, a fork it was not given."""
        parent = fork_id[0] if len(fork_id) == 2 else None
        if parent == self.agent.rank:
            # A fork this owner made: registered when it made it, for the worker it went to,
            # or as data, for the first worker that shows it (its id is random).
            with self._lock:
                entry = self._owned.get(rref_id)
                holder = _UNREGISTERED if entry is None else entry.forks.get(fork_id, _UNREGISTERED)
                if holder == BEARER:
                    entry.forks[fork_id] = child  # type: ignore[union-attr]  # (found: entry is not None)
            if holder not in (BEARER, child):
                raise self.refusals.refuse(child, f"the registration of RRef fork {fork_id} of {rref_id}, which is "
                                                  "not a fork this owner made for it")
            claimed: torch.futures.Future = Future()
            claimed.set_result(None)
            return claimed
        # (parent == child: a worker that passed an RRef to itself)
        if type(parent) is not int or not self.holds(rref_id, parent):
            raise self.refusals.refuse(child, f"the registration of RRef fork {fork_id} of {rref_id}, which no "
                                              "holder of it made")
        registered: torch.futures.Future = Future()
        asked = self.agent.call_retrying(parent, _vouch_for, (list(fork_id), child), MessageType.RREF_FORK_REQUEST)

        def answered(done: torch.futures.Future) -> None:
            try:
                if done.value() is not True:
                    raise self.refusals.refuse(child, f"the registration of RRef fork {fork_id} of {rref_id}, which "
                                                      f"worker {parent} did not fork to it")
                self.add_fork(rref_id, fork_id, child)
            except Exception as exc:  # noqa: BLE001 - the child's registration fails with it
                registered.set_exception(exc)
                return
            registered.set_result(None)

        asked.add_done_callback(answered)
        return registered

    def vouches(self, fork_id: tuple, child: int, owner: int) -> bool:
        """Whether we forked ``fork_id`` of one of ``owner``'s values to ``child`` (or as data,
        to whoever decodes it) and keep it for that child still."""
        with self._lock:
            kept = self._pending_children.get(fork_id)
        return kept is not None and kept[1] in (child, BEARER) and kept[0].owner_id == owner

    def check_user(self, rref_id: RRefId, fork_id: tuple | None, caller: int) -> None:
        """Raise unless ``caller`` may use the value ``rref_id`` owned here (fetch it, start a
        backward pass from it): this worker, its creator (remote()'s caller made the id), or
        the holder of its fork ``fork_id`` (a fork made as data: whoever shows it). Ids count
        up, so a member could name others' values: it is refused."""
        if caller == self.agent.rank or self._is_creator(rref_id, caller):
            return
        with self._lock:
            entry = self._owned.get(rref_id)
            holder = _UNREGISTERED if entry is None or fork_id is None else entry.forks.get(fork_id, _UNREGISTERED)
        if holder not in (caller, BEARER):
            raise self.refusals.refuse(caller, f"the use of RRef {rref_id}, which it holds no fork of")

    def _may_be_made(self, rref_id: RRefId, sender: int) -> bool:  # caller holds the lock
        """Whether a value ``rref_id`` may still come to be here: its creator's remote() may
        be on its way (one of ``sender``'s own), or it is being made."""
        return self._is_creator(rref_id, sender)

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

    def add_local_handle(self, rref_id: RRefId, decoded: bool = False) -> None:
        """``decoded``: an owner handle a message brought (the value may be one nobody makes)."""
        with self._lock:
            self._entry(rref_id, asked=decoded).local_handles += 1

    # --------------------------------------------------------------- releases from __del__

    def release_later(self, item: tuple) -> None:
        """From ``RRef.__del__``: ``("owner", rref_id)`` or ``("user", owner_id, rref_id,
        fork_id, registration)`` (the future of its fork's registration, or None). Takes no
        lock (see ``__init__``)."""
        self._released.put(item)

    def flush_releases(self, timeout: float | None) -> bool:
        """Wait until every release queued so far has been acted on (a user delete is then
        counted by the agent's outstanding work), those that waited for their fork's
        registration included. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        while True:
            requeued = self._requeued
            done = threading.Event()
            self._released.put(done)
            if not done.wait(left()):
                return False
            with self._children_accepted:  # (the context's lock)
                if not self._children_accepted.wait_for(lambda: self._deferred == 0, left()):
                    return False
                if self._requeued == requeued:  # none queued again since: all acted on
                    return True

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
                    _, owner_id, rref_id, fork_id, registration = item
                    if registration is not None and not registration.done():
                        # A fork whose registration is on its way: its delete follows it (the
                        # owner takes a delete only for a fork registered as its sender's).
                        with self._lock:
                            self._deferred += 1
                        registration.add_done_callback(lambda _, again=item: self._registration_settled(again))
                        continue
                    agent = self.agent
                    if registration is not None and _failed(registration):
                        continue  # never registered: nothing to delete
                    if not agent.closed and agent.rrefs is self:
                        self._control(owner_id, _delete_fork, (list(rref_id), list(fork_id)),
                                      MessageType.RREF_USER_DELETE)
            except Exception as exc:  # noqa: BLE001 - the owner's peer-loss handling covers the rest
                log.debug("releasing %s failed: %s", item, exc)
            del item

    def _registration_settled(self, item: tuple) -> None:
        with self._lock:
            self._requeued += 1
        self._released.put(item)  # (its registration is done now: acted on when it comes round)
        with self._lock:
            self._deferred -= 1
            self._children_accepted.notify_all()

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

    def keep_for_child(self, fork_id: tuple, rref: "RRef", child: int | None = None) -> None:
        """Keep ``rref`` until the child its fork goes to accepts it (``child``: None until
        ``sent_to`` names it, BEARER for whichever worker decodes it)."""
        with self._lock:
            self._pending_children[fork_id] = (rref, child)

    def child_accepted(self, fork_id: tuple, sender: int | None = None) -> None:
        with self._lock:
            kept = self._pending_children.get(fork_id)
            if kept is not None and sender is not None and kept[1] not in (sender, BEARER):
                # Only the worker we forked it to may say it has its own now (a fork's
                # receiver is noted before the message that carries it leaves: sent_to).
                raise self.refusals.refuse(sender, f"the acceptance of RRef fork {fork_id}, which went to "
                                                   f"{'nobody yet' if kept[1] is None else f'worker {kept[1]}'}")
            kept = self._pending_children.pop(fork_id, None)
            if not self._pending_children:
                self._children_accepted.notify_all()
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
            if not self._pending_children:
                self._children_accepted.notify_all()
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

    def take_registering(self) -> list[torch.futures.Future]:
        """The registrations that decoding on this thread started since the last take."""
        registering = getattr(self._registering, "futures", None)
        if not registering:
            return []
        self._registering.futures = []
        return registering

    def delete_all_users(self, timeout: float | None) -> None:
        """torch's ``_delete_all_user_and_unforked_owner_rrefs``: every user RRef of this worker
        tells its owner now that it is gone (not when Python frees it); using one afterwards
        raises. The deletes are queued (``flush_releases``).

        First, as torch's, it waits up to ``timeout`` seconds until every child that one of
        them was forked to has accepted its fork (it has registered with the owner then):
        a delete that reached the owner ahead of a child's fork request would let the owner
        drop a value the child still holds. A lost child counts as accepted; after the
        timeout, the deletes go anyway (logged, as torch's)."""
        with self._children_accepted:
            if not self._children_accepted.wait_for(lambda: not self._pending_children, timeout):
                log.error("%s: timed out after %s s waiting for %d child(ren) to accept the RRefs forked to them; "
                          "deleting the user RRefs anyway", self.agent.info, timeout, len(self._pending_children))
        for rref in list(self._users):
            if not rref._deleted and not rref._unsent:
                rref._deleted = True
                self.release_later(("user", rref.owner_id, rref.rref_id, rref.fork_id, rref._registration))

    def live_users(self) -> int:
        """User RRefs here that were not deleted (at shutdown: leaked, in torch's words)."""
        return sum(1 for rref in list(self._users) if not rref._deleted and not rref._unsent)

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

    def encode(self, rref: "RRef", in_message: bool = True) -> list:
        """Fork ``rref`` for whoever receives this message (``in_message``), or for whichever
        worker decodes what this returns (``RRef._serialize``)."""
        if rref._deleted:
            raise RpcError(f"Cannot call fork an UserRRef after deletion. ({rref})")  # torch's words
        rref._check_created()
        # A fork is given only by a worker that holds the value (the owner and a child's
        # parent check it): a user RRef whose own registration the owner has not confirmed
        # yet (it came in an answer a moment ago) waits for it.
        rref._await_registration()
        fork_id = self.new_fork_id()
        made: tuple[RRefId | None, RRefId]
        # Whoever decodes the data of ``_serialize`` holds its fork: any worker may (BEARER).
        holder = None if in_message else BEARER
        if rref.is_owner():
            # The owner registers the fork itself; the receiver's delete will remove it.
            self.add_fork(rref.rref_id, fork_id, holder)
            made = (rref.rref_id, fork_id)
        else:
            self.keep_for_child(fork_id, rref, holder)
            made = (None, fork_id)
        if in_message:
            forks = getattr(self._made, "forks", None)
            if forks is None:
                forks = self._made.forks = []
            forks.append(made)
            self.forks_made += 1
        encoded = [list(rref.rref_id), rref.owner_id, list(fork_id), self.agent.rank, rref._type_name]
        return encoded if in_message else encoded + [True]  # (data: a fork for whoever decodes it)

    def decode(self, value: list) -> "RRef":
        """An RRef as it came in a message (or from ``_deserialize``). One that came in a
        message was forked by its sender (the connection's member, whatever ``parent`` says),
        and one that came to its owner must be its sender's to give: its creator's or a fork
        holder's (``holds``). Else refused, before anything is registered or released. The data
        of ``RRef._serialize`` (``bearer``) is a fork for whoever decodes it, wherever it came
        from: its fork id is random, and the worker that decodes it registers it as its own."""
        if type(value) is not list or len(value) not in (5, 6):
            raise RpcError(f"malformed RRef {value!r:.80}")
        rref_id, owner_id, fork_id, parent, type_name = value[:5]
        bearer = len(value) == 6 and value[5] is True
        rref_id, fork_id = tuple(rref_id), tuple(fork_id)
        agent = self.agent
        sender = agent.codec.decoding_sender()
        if bearer and owner_id == agent.rank and parent == agent.rank:
            with self._lock:  # a fork this owner made as data: still there to be used once?
                entry = self._owned.get(rref_id)
                usable = entry is not None and entry.forks.get(fork_id, _UNREGISTERED) == BEARER
            if not usable:
                raise self.refusals.refuse(None if sender is None else sender,
                                           f"RRef {rref_id} as data of a fork {fork_id} it did not make")
        elif sender is not None and (not bearer or owner_id == agent.rank):
            # (sender None: data decoded by a function. Data another worker made, at its owner:
            # as from its sender, whom the owner can check; elsewhere the owner checks it when
            # the worker that decoded it registers it)
            by = int(sender) if sender.isdigit() else None
            if by != parent:
                raise self.refusals.refuse(by, f"an RRef of {rref_id} that it says worker {parent} forked")
            if owner_id == agent.rank and not self.holds(rref_id, parent):
                raise self.refusals.refuse(by, f"RRef {rref_id}, which it holds no fork of")
        if owner_id == agent.rank:
            rref = RRef._owner_handle(self, rref_id, type_name)
            if parent == agent.rank:
                # We sent it to ourselves and registered a fork for the receiver, which turns
                # out to be us, the owner: drop that fork again.
                self.delete_fork(rref_id, fork_id)
            self._accept_child(parent, fork_id)
            return rref
        if not bearer and fork_id[0] != parent:  # (a fork id is made by the worker that forks)
            raise self.refusals.refuse(None if sender is None else sender,
                                       f"an RRef of {rref_id} under fork id {fork_id}, which worker {parent} did not make")
        if self._held.get(fork_id) is not None:
            raise self.refusals.refuse(None if sender is None else sender,
                                       f"an RRef of {rref_id} under fork id {fork_id}, which an RRef here holds")
        rref = RRef._user(self, rref_id, owner_id, fork_id, type_name)
        if parent == owner_id and not bearer:
            rref._confirmed.set()  # the owner registered this fork for us when it sent it
            return rref
        registered = self._control(owner_id, _fork_request, (list(rref_id), list(fork_id)),
                                   MessageType.RREF_FORK_REQUEST)
        rref._registration = registered  # (its delete waits for it: _release_loop)
        self.forks_registered += 1
        registering = getattr(self._registering, "futures", None)
        if registering is None:
            registering = self._registering.futures = []
        registering.append(registered)

        def confirmed(done: Any) -> None:
            rref._confirm_if_ok(done)
            self._accept_child(parent, fork_id)

        registered.add_done_callback(confirmed)
        return rref
