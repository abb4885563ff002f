"""Distributed autograd's call hooks: what it adds to every RPC (rpc/hooks.py, ``CallHooks``).

Around calls and answers it records the forward pass (forward.py); context releases waiting
for a worker ride on the next call to it (cleanup.py); a lost worker fails the passes and
releases the contexts that waited for it. ``zmqautograd.autograd`` installs these hooks on
import, so every agent started afterwards has them (as torch's ``dist_autograd._init``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from zmqautograd.transport import Message, MessageType, PeerDepartedError, PeerLostError

from ..rpc.hooks import OutgoingCall
from ..rpc.refusals import PeerLog, Refusals
from . import cleanup
from .context import ContextContainer
from .forward import BUILTIN_TYPES, message_metadata, record_recv, record_send, request_metadata
from .plan import prepare_part, prepare_plan
from .port import AgentPort

log = logging.getLogger(__name__)


class _Served:
    """A call being served: its context (None if it was not recorded), the context releases
    that rode on it (None once applied) and the contexts removed before it ran (dropped with
    it)."""

    __slots__ = ("sender", "context", "releases", "removed")

    def __init__(self, sender: int | str, context: Any, releases: Any) -> None:
        self.sender = sender
        self.context = context
        self.releases = releases
        self.removed: list | None = None


_DEFERRED_MAX = 64  # parts a thread defers at most until it waits (beyond: the plan builds them)


class _Deferred(threading.local):
    """A thread's calls whose send functions' plan parts wait for it to wait for answers."""

    def __init__(self) -> None:
        self.parts: list = []  # (weak reference to the context, autograd message id)


class AutogradHooks:
    """One agent's distributed autograd: its contexts and the hooks that record into them."""

    def __init__(self, agent: AgentPort) -> None:
        self.agent = agent
        self.contexts = ContextContainer(agent.rank)
        self.refusals = Refusals(f"{agent.info} (distributed autograd)")  # what members may not do here
        self._peer_log = PeerLog(log)  # what failed of what peers sent: once per peer
        self._local = self.contexts._local  # the current context, per thread (served calls switch it)
        self._losses = threading.Condition()
        self._lost: list[str] = []  # the workers lost so far, by name
        self._deferred = _Deferred()

    # ------------------------------------------------------------------ calls we make

    def call_leaving(self, to: int, message_type: MessageType, function: Any, args: Any, kwargs: Any,
                     payload: dict, batching: bool) -> OutgoingCall | None:
        metadata = request_metadata(self.contexts, message_type, function, args, kwargs)
        # Context releases waiting for this worker ride along (cleanup.py).
        releases = self.contexts.cleanups.take(to) if batching else None
        if metadata is None and releases is None:
            return None
        if metadata is not None:
            payload["ag"] = metadata
            message_type = MessageType.FORWARD_AUTOGRAD_REQ
        if releases is not None:
            payload["rc"] = releases[1]
        return OutgoingCall(message_type, metadata is not None, (metadata, releases))

    def call_recorded(self, to: int, outgoing: OutgoingCall, tensors: list, sync: bool) -> None:
        metadata = outgoing.state[0]
        context = record_send(self.contexts, metadata, tensors, to)
        if context is None:
            return
        if sync:  # its part of the caller's plan, while the call travels
            prepare_part(context, metadata[1])
            return
        # An asynchronous call's part is built when this thread waits for answers (the
        # caller of a fan-out, between its calls and its backward pass): not before the
        # call leaves, which would hold up the next call, nor in the backward pass, whose
        # critical path would then walk every call's graph.
        if context.recorded_send(metadata[1]) is None:
            return  # no tensor of it requires grad: no send function, no part
        parts = self._deferred.parts
        if len(parts) >= _DEFERRED_MAX:  # a thread that never waits: the plan builds them
            parts.clear()
        parts.append((weakref.ref(context), metadata[1]))  # (keeps no released context alive)

    def while_waiting(self) -> bool:
        parts = self._deferred.parts
        if not parts:
            return False
        reference, message_id = parts.pop(0)  # (in the order of the calls)
        context = reference()
        if context is not None and not context.released:
            prepare_part(context, message_id)
        return bool(parts)

    def call_not_sent(self, to: int, outgoing: OutgoingCall) -> None:
        """Releases that were to ride on a call that did not leave go with the next one."""
        releases = outgoing.state[1]
        if releases is not None:
            self.contexts.cleanups.add(to, releases[1], releases[0])

    def answer_arrived(self, sender: int, payload: dict, tensors: list) -> None:
        if payload.get("ag") is not None:
            record_recv(self.contexts, payload["ag"], tensors, sender, response=True)

    # ------------------------------------------------------------------ calls we serve

    def call_arrived(self, message: Message) -> _Served | None:
        payload = message.payload
        releases = payload.get("rc") if type(payload) is dict else None  # rode along (cleanup.py)
        context = None
        if message.type is MessageType.FORWARD_AUTOGRAD_REQ:
            try:
                context = record_recv(self.contexts, payload["ag"], message.tensors or [], int(message.sender))
            except BaseException:
                if releases is not None:
                    self._release_riding(message.sender, releases)
                raise
        if context is None and releases is None:
            return None
        return _Served(message.sender, context, releases)

    def call_starts(self, served: _Served | None, function: Any) -> Any:
        """The call's context becomes current (nested calls carry it on). The releases that
        rode on it are of contexts the caller left before it made the call, so the call is in
        none of them; a Python function might look for them though (wait until they are
        gone): those are removed before it runs and passed on at once, so that the calls it
        makes carry them on (down a chain of nested calls, with the next step's calls, where
        each link's batch timer would otherwise send them as a request); their contexts are
        dropped after the answer left, when that costs the call no latency. Builtins' are
        released after the answer."""
        local = self._local
        previous = local.context
        if served is None:
            local.context = None
            return previous
        if served.releases is not None and not isinstance(function, BUILTIN_TYPES):
            served.removed = self._release_riding(served.sender, served.releases)
            served.releases = None  # done: ``served`` only holds the removed contexts now
        local.context = served.context
        return previous

    def call_ends(self, token: Any) -> None:
        self._local.context = token

    def answer_payload(self, served: _Served | None, value: Any) -> tuple[MessageType, dict] | None:
        """The result of a call that distributed autograd recorded is recorded too (its
        tensors may require grad)."""
        if served is None or served.context is None:
            return None
        return MessageType.FORWARD_AUTOGRAD_RESP, {"v": value, "ag": message_metadata(self.contexts, served.context)}

    def answer_leaving(self, served: _Served, payload: dict, to: int, loopback: bool, tensors: list) -> None:
        if loopback:  # completing it here may run the caller's callbacks, on this thread: record first
            record_send(self.contexts, payload["ag"], tensors, to)
        else:
            # Its send function is recorded while the answer travels (it costs the answer no
            # latency); a pass that needs it meanwhile waits for it (context.expect_send).
            served.context.expect_send(payload["ag"][1])

    def answer_left(self, served: _Served, payload: dict, to: int, tensors: list) -> None:
        metadata = payload["ag"]
        try:
            record_send(self.contexts, metadata, tensors, to)
        except Exception:  # noqa: BLE001 - the answer is gone; a pass over it reports the missing node
            log.exception("%s: recording the answer to %s in autograd context %d failed", self.agent.info, to, metadata[0])
        finally:
            served.context.send_recorded(metadata[1])
        pool = self.agent.pool
        if pool.owns_current_thread():
            # While the caller computes (engine.py); not on other threads (an async
            # function's answer may be sent from a timer's or another call's callback).
            # Calls waiting here go first: the plan is built after them (the caller's next
            # call may well be one of them, sent as soon as this answer arrived).
            if not pool.has_work():
                prepare_plan(served.context)
            elif served.context.plan_cache is None:
                pool.submit(prepare_plan, served.context)

    def call_answered(self, served: _Served | None) -> None:
        if served is not None and served.releases is not None:
            self._release_riding(served.sender, served.releases)

    def _release_riding(self, sender: int | str, releases: Any) -> list:
        """Apply the context releases that rode on a call from ``sender``
        (``cleanup.release_here``); the contexts removed here, for the caller to drop."""
        try:
            return cleanup.release_here(self.agent, releases, int(sender))[0]
        except Exception as exc:  # noqa: BLE001 - never the call's failure
            self._peer_log.log(sender, logging.WARNING, "%s: releasing the contexts %.200r from %s failed: %s",
                               self.agent.info, releases, sender, exc)
            return []

    # ------------------------------------------------------------------ the group

    def joined(self, incarnation: int) -> None:
        self.contexts.start_ids(incarnation)

    def peer_lost(self, peer: int, error: BaseException) -> None:
        """Passes waiting for that worker's report fail; contexts it created here can never be
        released by it any more, nor those only lost workers could still release. A worker
        that departed (said goodbye: it shut down) is no fault: what it created and is still
        here is a release on its way down a chain (releases are not awaited, as in torch), or a
        context it left open. Those are released quietly; a worker lost without a goodbye is
        worth a warning."""
        name, worker_name = str(peer), self.agent.name_of(peer)
        departed = isinstance(error, PeerDepartedError)
        report, gone = (log.debug, "departed") if departed else (log.warning, "lost")
        with self._losses:
            self._lost.append(worker_name)
            self._losses.notify_all()
        self.contexts.peer_lost(peer, error, worker_name)
        orphans = self.contexts.release_created_by(peer, PeerLostError(name, f"creator lost: {error}"))
        if orphans:
            report("%s: released %d autograd context(s) of %s worker %s", self.agent.info, orphans, gone, peer)
        is_lost = self.agent.is_lost
        stranded = self.contexts.release_unreachable(is_lost, PeerLostError(name, f"released: {error}"))
        if stranded:
            report("%s: released %d autograd context(s) that only lost workers reached", self.agent.info, stranded)

    def lost_workers(self, wait: float = 0.0) -> list[str]:
        """The workers lost so far; waits up to ``wait`` seconds for a first one."""
        with self._losses:
            self._losses.wait_for(lambda: bool(self._lost), timeout=wait)
            return list(self._lost)

    def flush(self) -> None:
        self.contexts.cleanups.flush()  # context releases waiting for their batch

    def debug_info(self) -> dict[str, str]:
        return {
            "num_current_backward_passes": str(self.contexts.active_passes()),
            "num_autograd_contexts": str(self.contexts.count()),
        }

    def backward(self, context_id: int, roots: list, retain_graph: bool) -> None:
        from .api import backward  # (api imports the engine; these hooks are imported first)

        backward(context_id, roots, retain_graph=retain_graph)
