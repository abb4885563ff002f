"""The distributed backward pass on one worker (the seeds' dist_engine.cpp, FAST mode).

On each worker, a pass over a context has as roots the local root (on the worker that called
``backward``) and every send function recorded in the context. Every graph node runs at most
once per pass, with the sum of what all roots deliver to it; a recv function sends its
gradient to the worker it came from once everything that feeds it has run.

The plan (plan.py) splits the work between RPC boundaries into *groups* that each run as
one call into PyTorch's engine (groups.py); a group is ready when all its roots delivered
and all groups feeding it ran. Whoever delivers (the caller of ``backward``, or the RPC
thread that received a gradient) runs what became ready, so no thread ever waits for a
remote answer inside the engine.

Completion follows the seeds: the first gradient request of a pass on a worker is answered
when that worker's whole pass is done and the requests it sent are answered; later ones at
once. So ``backward`` returns when every worker is done, and an error anywhere comes back as
``Error on Node N: ...``. One shortcut: a worker does not wait for the answer to gradients it
sends to the pass's *originator* (the worker that called ``backward``): the originator waits
for its own work anyway, and fails its own pass if such a request fails there. Those go as
one-way messages, which saves a round trip on every path that leads back to the caller (all
of them, in a driver-orchestrated pipeline).

Forwarding. Where the originator only relays gradients (a pipeline it drives: the answer of
one stage went on to the next, so the send function of that call feeds, unchanged, the recv
function of the earlier answer), the stage that computes them sends them straight to the
stage before, saving the originator's hop and its work. The originator publishes such
*routes* (``routes_for``: its send function -> the worker and send function its recv
function leads to) and, when it has any, sends its gradient requests one-way, each under a
*ticket*, with the routes and its report sink (Agent.open_sink); a pass that such a
ticketed request starts applies the routes when a recv function of the originator's tensors
fires: it sends those gradients one-way to where the route leads, under a new ticket. When done, a ticketed pass
*reports* to the originator (one message to its sink, handled on its backward thread): its
ticket, the forwards it made (which announce their tickets), the gradients that ride on it
(as on an answer), or its error. A pass whose last step is a forward hands its report on
with it instead (*delegated*: the next report carries it), so a driven pipeline's backward
sends one message per stage and one report at the end. The originator counts a forwarded
send function and its recv function as done once announced, and finishes when every ticket
was reported; reports may come before their announcement (it finds them then), and a
ticket whose announcer has not reported keeps the pass open, so none is missed. A worker of
the context lost while reports are due fails the pass (a report delegated to it cannot come),
and the idle check covers reports that never come. Gradients the originator's engine would
convert (another layout, dtype or shape) go there as usual (``forwarded_gradients``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Any, Callable, Iterable

import torch

from .. import timers
from ..rpc.errors import RpcError
from ..rpc.futures import Outcome
from . import ddp
from .context import DistAutogradContext
from .functions import (
    RecvInfo,
    is_recv_node,
    make_suppressible,
    profiled,
    recv_info,
    run_tensor_hooks,
    suppressing,
    tensor_hooks_of,
)
from .groups import _aliased, _engine_roots, _grad, _pass_through, _run_stepwise, accumulate
from .plan import Plan, _Group
from .routes import forwarded_gradients, parse_routes

log = logging.getLogger(__name__)

_EARLY_MAX = 4096  # reports a pass keeps that came before their ticket's announcement
_FINISHED = RpcError("finished")  # set as the error of a pass that finished: its loops stop
_NONE: frozenset = frozenset()
_NO_SUPPRESSION = contextlib.nullcontext()


# ----------------------------------------------------------------------------- one pass


class Pass:
    """One backward pass over one context on this worker."""

    def __init__(
        self, context: DistAutogradContext, plan: Plan, pass_id: int, retain_graph: bool, worker_id: int,
        send_gradients: Callable[[Any, list, "Pass", bool, bool], Outcome | None], home: bool = False,
        idle_timeout: float | None = None, requester: int | None = None, home_waiting: tuple | None = None,
        ticket: tuple | None = None, forward_gradients: Callable[[tuple, list, "Pass", bool], None] | None = None,
    ):
        self.context = context
        self.plan = plan
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.worker_id = worker_id
        self.originator = pass_id >> 48  # pass ids are made like context ids
        self._send_gradients = send_gradients
        self._lock = threading.Lock()
        self._delivered = 0  # mask of roots that delivered
        self._buffers: list[dict] = [{} for _ in plan.groups]
        self._waiting_feeders = plan.feeder_counts.copy()
        self._started = [False] * len(plan.groups)
        self._exit_buffers: dict[Any, dict] = {}
        # Leaves with post hooks when the pass starts (most passes: none): how many feeding
        # groups have yet to run, and the sum of what those that ran gave (the hooks run once,
        # after the last).
        self._hook_waiting = {
            node: count for node, count in plan.post_hook_feeders.items() if plan.post_hooks[node]
        } if plan.post_hooks else {}
        self._hook_grads: dict[Any, torch.Tensor] = {}
        # CPU leaves that several groups feed and that have tensor hooks when the pass starts
        # (most passes: none): torch's engine runs those hooks once, on the leaf's whole
        # gradient, so they are held back in the groups' calls (functions.py, "leaves'
        # tensor hooks"), the groups' parts wait here, and after the last feeding group the
        # hooks run on their sum, which then goes to the context (and to the post hooks).
        self._held_leaves: dict[Any, dict] = {}
        for node in plan.shared_leaves:
            hooks = tensor_hooks_of(node)
            if hooks is not None and node.variable.device.type == "cpu":  # CUDA nodes run on device threads
                make_suppressible(hooks)
                self._held_leaves[node] = hooks
                self._hook_waiting.setdefault(node, len(plan.exits[node].feeders))
        self._suppressed = frozenset(id(hooks) for hooks in self._held_leaves.values()) if self._held_leaves else _NONE
        self._exit_waiting = plan.recv_counts.copy()
        self._remaining = len(plan.groups) + len(self._exit_waiting)
        # Parameters of DistributedDataParallel modules (most passes: none): their gradients
        # wait here until every group that feeds one ran, then DDP's reducer runs over them
        # (ddp.py), one more step of the pass, and its hooks instead of the engine's.
        self._ddp = ddp.leaves_of_ddp(plan.leaves)
        if self._ddp:
            self._ddp_groups = frozenset(g for node in self._ddp for g in plan.exits[node].feeders)
            self._ddp_waiting = len(self._ddp_groups)
            self._ddp_grads: dict[Any, torch.Tensor] = {}
            self._remaining += 1
            for node in self._ddp:
                self._hook_waiting.pop(node, None)
        self._outstanding = 0
        self._error: BaseException | None = None
        # The worker whose gradient request started this pass here (None on the originator):
        # it waits for our answer, which is sent once the pass is done.
        self.requester = requester
        # Gradients that go back with that answer instead of in a request of their own: a
        # recv function whose tensors the requester sent us, when it is the last thing the
        # pass does (see _fire_recv). ``done``'s result then.
        self.answer: tuple[RecvInfo, list] | None = None
        # Forwarding (see the module docstring). A pass a ticketed request started: its
        # ticket, the originator's routes it applies (as they came, and parsed), the
        # originator's report sink, the reports delegated to it, [ticket, send function,
        # worker] of each forward it made, and whether it handed its report on with one.
        # On the originator: the routes it publishes and its sink (both set by the caller),
        # the tickets due (ticket -> worker), those reported before they were announced, and
        # how many announcements and reports came (progress, for the idle check).
        self.ticket, routes, self.sink, self.delegated = ticket if ticket is not None and not home else (None,) * 4
        self.wire_routes = routes or None
        self.routes = parse_routes(routes) if routes else None
        self.reported = False
        self._forward_gradients = forward_gradients
        self.forwards: list = []
        self.published: list | None = None
        self._tickets: dict[int, int] = {}
        self._early: dict[int, tuple[list, int | None]] = {}  # ticket -> (forwards, its sender if known)
        self._reported: set[int] = set()  # tickets settled (a second report of one is refused)
        self._reached: set[int] = set()  # the workers tickets went to
        self._settled = 0
        self.done = Outcome()  # all local work and every request we sent
        self.node_runs = 0  # groups and recv functions run (tests count them)
        # The caller of backward() runs its pass's work itself (``run_at_home``): its
        # thread-local state (the profiler, grad mode) then applies, as torch's engine
        # carries the graph task's thread-local state to its worker threads.
        # On the originator: how long the pass may sit with nothing in flight and work left
        # (gradients that never come: a root whose sender's answer arrived without them, or
        # FAST mode's unused send function) before it fails instead of waiting for ever.
        self._idle_timeout = idle_timeout
        self._idle_timer: timers.TimerHandle | None = None
        self._home = threading.get_ident() if home else None
        # Work for the home thread: (function, args), None once the pass is done.
        self._home_queue: queue.SimpleQueue | None = queue.SimpleQueue() if home else None
        # How the home thread waits for that work: ``wait(ready)`` blocks until ``ready()``
        # (the transport's wait_until, receiving from the socket meanwhile, so an answer the
        # pass waits for usually reaches this very thread), ``wake()`` ends such a wait.
        # Without them it blocks on the queue.
        self._home_wait, self._home_wake = home_waiting if home_waiting is not None else (None, None)
        if home or idle_timeout is not None:
            self.done.add_done_callback(self._ended)

    def _ended(self, _: Any) -> None:
        # The idle timer's thread must not outlive the pass (the soak test counts threads);
        # then the home thread learns that the pass is over.
        if self._idle_timeout is not None:
            self._cancel_idle()
        if self._home is not None:
            self._post_home(None)

    # ------------------------------------------------------------------- delivering roots

    def deliver(self, key: Any, grads: list, settles: bool = False) -> None:
        """Root ``key`` delivers its gradients (one per root edge; None for none); then run
        what became ready on this thread. ``settles``: they rode on the answer to one of our
        requests, which counts as answered with them (see ``_request_done``): a recv function
        they make fire may then be the pass's last step and ride on our own answer in turn,
        so a nested chain's gradients go back with the answers, not in requests of their own."""
        plan = self.plan
        bit = plan.root_bits.get(key)
        if bit is None:
            raise RpcError(f"backward pass {self.pass_id}: unknown root {key!r} for context {self.context.context_id}")
        ready: list[int] = []
        fire: list = []
        with self._lock:
            if self._delivered & bit:
                raise RpcError(f"backward pass {self.pass_id}: root {key!r} delivered twice")
            self._delivered |= bit
            self._outstanding -= settles
            for (node, slot), grad in zip(plan.roots[key], grads):
                if grad is not None:
                    self._buffer(node, slot, grad)
            for node in plan.direct_exits.get(key, ()):
                self._exit_waiting[node] -= 1
                if self._exit_waiting[node] == 0:
                    fire.append(node)
            ready = self._ready_among(plan.groups_by_bit.get(bit, ()))
        if self._home is not None and threading.get_ident() != self._home:
            self.post_home(self._run_delivered, ready, fire)
            return
        self._run_delivered(ready, fire)

    def _run_delivered(self, ready: list[int], fire: list) -> None:
        for node in fire:
            self._fire_recv(node)
        self._drain(ready)

    @property
    def is_home(self) -> bool:
        """Whether this pass runs on the thread that called ``backward`` (the originator)."""
        return self._home is not None

    def post_home(self, function: Callable, *args: Any) -> None:
        """Have the home thread (the caller of ``backward``) run ``function(*args)``; for
        the answers to this pass's requests, which then complete on that thread."""
        self._post_home((function, args))

    def _post_home(self, item: tuple | None) -> None:
        home_queue = self._home_queue
        assert home_queue is not None, "only the pass on the caller's thread has a home"
        home_queue.put(item)
        if self._home_wake is not None:
            self._home_wake()

    def run_at_home(self) -> None:
        """On the caller's thread: run the work other threads hand over, until the pass is
        done (its ``done`` future then holds the outcome)."""
        work = self._home_queue
        assert work is not None, "only the pass on the caller's thread has a home"
        wait = self._home_wait

        def has_work() -> bool:
            return not work.empty()

        while True:
            if wait is not None:
                wait(has_work)
                item = work.get_nowait()
            else:
                item = work.get()
            if item is None:
                return
            function, args = item
            try:
                function(*args)
            except Exception as exc:  # noqa: BLE001 - every error ends the pass (then None comes)
                self.fail(exc)
            del item, function, args  # the gradients they hold

    _add = staticmethod(accumulate)

    def _buffer(self, node: Any, slot: int, grad: torch.Tensor) -> None:  # caller holds the lock
        """Add ``grad`` to what waits for ``node`` (a recv function, or a group's entry)."""
        if is_recv_node(node):
            self._add(self._exit_buffers.setdefault(node, {}), slot, grad)
        else:
            self._add(self._buffers[self.plan.group_of[node]], (node, slot), grad)

    def _ready_among(self, candidates: Iterable[int]) -> list[int]:  # caller holds the lock
        """Which of ``candidates`` (group indices) became ready, marked started. A group is
        ready after the last of its roots' deliveries and its feeders' runs, so after a
        delivery the candidates are the groups its root reaches, after a run the groups the
        run fed: not every group, which on the caller of a fan-out is one per call."""
        ready = []
        groups, started, waiting_feeders, delivered = self.plan.groups, self._started, self._waiting_feeders, self._delivered
        for i in candidates:
            if not started[i] and waiting_feeders[i] == 0 and groups[i].mask & ~delivered == 0:
                started[i] = True
                ready.append(i)
        return ready

    # ------------------------------------------------------------------------ running

    def _drain(self, ready: list[int]) -> None:
        while ready and self._error is None:
            index = ready.pop()
            try:
                more, fire = self._run_group(index)
            except BaseException as exc:  # noqa: BLE001 - every error ends the pass
                self.fail(exc)
                return
            ready.extend(more)
            for node in fire:
                self._fire_recv(node)
            if self._ddp and index in self._ddp_groups:
                self._ddp_group_ran()

    def _ddp_group_ran(self) -> None:
        """A group that feeds DDP parameters ran; after the last, DDP's reducer runs (after
        the group's recv functions fired: their gradients need not wait for its all-reduce)."""
        with self._lock:
            self._ddp_waiting -= 1
            if self._ddp_waiting:
                return
            grads, self._ddp_grads = self._ddp_grads, {}
        if grads:
            try:
                ddp.reduce_into_context(self.context, grads, self._ddp, self._held_leaves)
            except BaseException as exc:  # noqa: BLE001
                self.fail(exc)
                return
        with self._lock:
            self._remaining -= 1
        self._maybe_finish()

    def _run_group(self, index: int) -> tuple[list[int], list]:
        group = self.plan.groups[index]
        with self._lock:
            buffer, self._buffers[index] = self._buffers[index], {}
        results: tuple = ()
        if buffer and group.captures:
            with suppressing(self._suppressed) if self._suppressed else _NO_SUPPRESSION:
                if group.pass_through is not None:
                    results = _pass_through(group, buffer)
                if not results:
                    if group.stepwise:
                        results = _run_stepwise(group, buffer)
                    else:
                        results = _grad(*_engine_roots(buffer), group.capture_edges, self.retain_graph)
        del buffer
        aliased = _aliased(results)
        fire = []
        held = self._held_leaves
        with self._lock:
            self.node_runs += 1
            for (target, slot), leaf, grad in zip(group.captures, group.capture_leaves, results):
                if grad is None:
                    continue
                if leaf:
                    if self._ddp and target in self._ddp:
                        self._add(self._ddp_grads, target, grad)
                        continue
                    if held and target in held:
                        continue  # its part waits for the others (_leaves_due)
                    # Outside the lock would be nicer; the context has its own lock and
                    # accumulating is cheap next to the group's backward.
                    self.context.accumulate_grad(target.variable, grad, may_steal=id(grad) not in aliased and grad._use_count() <= 1)
                else:
                    self._buffer(target, slot, grad)
            post_hooks = self._leaves_due(group, results) if self._hook_waiting else ()
            results = ()
            for target in group.recv_targets:
                self._exit_waiting[target] -= 1
                if self._exit_waiting[target] == 0:
                    fire.append(target)
            for other in group.feeds:
                self._waiting_feeders[other] -= 1
            ready = self._ready_among(group.feeds)
            self._remaining -= 1
            finished = self._all_done()
        for node, hooks, grad in post_hooks:
            # An error in a hook fails the pass (the caller's _drain).
            if node in held:
                grad = run_tensor_hooks(held[node], grad)
                self.context.accumulate_grad(node.variable, grad, may_steal=grad._use_count() <= 1)  # type: ignore[attr-defined]  # (private)
            # Post hooks as the seeds' capture hook calls them: no grad_inputs (the node has
            # no outputs), the gradient it was given as grad_outputs; what they return is
            # not used.
            for hook in tuple(hooks.values()):
                hook((), (grad,))
        if finished:
            self._finish()
        return ready, fire

    def _leaves_due(self, group: _Group, results: tuple) -> list:  # caller holds the lock
        """Count ``group`` in for its leaves with post hooks or held tensor hooks;
        (node, post hooks, gradient) of those whose last feeding group it was and that got
        a gradient this pass (a held leaf's gradient: the sum its tensor hooks are for)."""
        due = []
        waiting = self._hook_waiting
        for position, ((node, _), leaf) in enumerate(zip(group.captures, group.capture_leaves)):
            if not leaf or node not in waiting:
                continue  # most leaves: no hooks
            waiting[node] -= 1
            grad = results[position] if position < len(results) else None
            if grad is not None:
                self._add(self._hook_grads, node, grad)
            if waiting[node] == 0 and (total := self._hook_grads.pop(node, None)) is not None:
                due.append((node, self.plan.post_hooks.get(node) or {}, total))
        return due

    def _fire_recv(self, node: Any) -> None:
        """All gradients for a recv function are in: send them to the worker it came from,
        or where a route of the originator's says they would go from there."""
        info = recv_info(node)
        with self._lock:
            buffer = self._exit_buffers.pop(node, {})
            self.node_runs += 1
        grads = [buffer.get(slot) for slot in range(len(info.metadata))]
        del buffer
        try:
            if self.routes is not None and info.from_worker == self.originator and self._forward(info, grads):
                with self._lock:
                    self._remaining -= 1
                self._maybe_finish()
                return
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return
        with self._lock:
            # The last step of the pass sends to the worker waiting for our answer: the
            # gradients ride on that answer, one message instead of a request, its answer
            # and ours (the requester counts our answer in as it delivers them). Only
            # for tensors that came in a request: the answer follows the response device map.
            rides = (
                info.from_worker == self.requester and not info.in_response
                and self._remaining == 1 and self._outstanding == 0
            )
            awaited = not rides and (info.from_worker == self.worker_id or info.from_worker != self.originator)
            # The originator that publishes routes waits for a report instead of an answer.
            ticketed = awaited and self.published is not None and info.from_worker != self.worker_id
            awaited = awaited and not ticketed
            self._outstanding += awaited
        if rides:
            self.answer = (info, grads)
            with self._lock:
                self._remaining -= 1
            self._maybe_finish()
            return
        try:
            with profiled("torch::distributed::autograd::RecvRpcBackward"):
                future = self._send_gradients(info, grads, self, awaited, ticketed)
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return
        if future is not None:
            future.add_done_callback(self._request_done)
        with self._lock:
            self._remaining -= 1
        self._maybe_finish()

    def _forward(self, info: RecvInfo, grads: list) -> bool:
        """Send the gradients of a recv function whose tensors the originator sent straight
        to where its route leads, if it has one and they need no conversion there."""
        route = self.routes.get(info.message_id) if self.routes is not None else None
        if route is None:
            return False
        forwarded = forwarded_gradients(route, grads, info.metadata)
        if forwarded is None:
            return False
        with self._lock:
            last = self._remaining == 1 and self._outstanding == 0
        self._forward_gradients(route, forwarded, self, last)  # type: ignore[misc]  # (set where routes are)
        return True

    def reports(self) -> list:
        """This pass's report ([ticket, forwards made]) after those delegated to it."""
        return (self.delegated or []) + [[self.ticket, self.forwards]]

    # ----------------------------------------------------------- on the originator

    def take_report(self, items: list, sender: int) -> tuple[str, int] | None:
        """A report of ``sender``: ``[ticket, forwards made]`` items, in order, the last its
        own and those before it delegated to it. Each ticket's report is due from the worker
        the ticket went to (the last item's, then, from ``sender``), and only that worker can
        have forwarded the gradients of our send functions whose tensors went to it. An item
        whose ticket is not due yet (its announcement is still on its way) waits for it.
        What is refused, if anything, and whose doing it is: a claim of another worker's
        ticket or forward, a second report of a ticket (the rest of the report is dropped;
        the pass goes on). Malformed items raise (the pass fails: ``sender`` took part)."""
        last = len(items) - 1
        for position, (ticket, forwards) in enumerate(items):
            claimed = sender if position == last else None
            with self._lock:
                owner = self._tickets.get(ticket)
                if owner is None:
                    if ticket in self._early or ticket in self._reported:
                        return f"a second report of ticket {ticket} of backward pass {self.pass_id}", sender
                    if len(self._early) >= _EARLY_MAX:
                        return f"more reports of tickets not announced than {_EARLY_MAX}", sender
                    # Taken when it is announced. No progress (the idle check's): a worker
                    # that sends tickets nobody announces must not keep the pass waiting.
                    self._early[ticket] = (forwards, claimed)
                    continue
            refusal = self._take_item(ticket, owner, forwards, claimed, sender)
            if refusal is not None:
                return refusal
        return None

    def _take_item(self, ticket: int, owner: int, forwards: list, claimed: int | None,
                   carrier: int) -> tuple[str, int] | None:
        """Take the report of ``ticket``, due from ``owner`` (``claimed``: who says it is
        theirs, if known; ``carrier``: who sent it), with the forwards it announces; then the
        reports that came early for the tickets they announce."""
        if claimed is not None and claimed != owner:
            return f"the report of ticket {ticket} of backward pass {self.pass_id}, which went to worker {owner}", claimed
        for forward in forwards:
            if type(forward) is not list or len(forward) != 3 or not all(type(item) is int for item in forward):
                raise RpcError(f"malformed forwarding announcement {forward!r:.80}")
            target = self.context.send_target(forward[1])
            if target is not None and target != owner:
                return (f"the forwarding of the gradients of send function {forward[1]} (backward pass "
                        f"{self.pass_id}), whose tensors went to worker {target}, not to worker {owner}"), carrier
        due = self.announce(forwards)
        self.settle(ticket)
        for early_ticket, early_owner, early_forwards, early_claimed in due:
            refusal = self._take_item(early_ticket, early_owner, early_forwards, early_claimed,
                                      carrier if early_claimed is None else early_claimed)
            if refusal is not None:
                return refusal
        return None

    def announce(self, forwards: Any) -> list:
        """A report says its pass forwarded the gradients of our send functions (``[ticket,
        message id, worker]`` each): their groups and the recv functions they feed are done
        elsewhere, and each ticket's report is due. The reports that came early for those
        tickets, to be taken now: (ticket, worker, forwards, claimed sender) each."""
        if type(forwards) is not list:
            raise RpcError(f"malformed forwarding announcement {forwards!r:.80}")
        due = []
        for forward in forwards:
            if (type(forward) is not list or len(forward) != 3 or not all(type(item) is int for item in forward)):
                raise RpcError(f"malformed forwarding announcement {forward!r:.80}")
            ticket, key, peer = forward
            published = self.published
            entry = self.plan.forwardable().get(key) if published is not None else None
            if entry is None or not any(route[0] == key for route in published or ()):
                raise RpcError(f"backward pass {self.pass_id}: gradients of send function {key} were forwarded, "
                               "which this pass did not route")
            index = entry[0]
            bit = self.plan.root_bits[key]
            with self._lock:
                if self._delivered & bit:
                    raise RpcError(f"backward pass {self.pass_id}: root {key!r} delivered twice")
                self._delivered |= bit
                self._started[index] = True
                self._remaining -= 2  # its group and the recv function it feeds
                early = self._expect_locked(ticket, peer)
                ready = self._ready_among(self.plan.groups_by_bit.get(bit, ()))
            if early is not None:
                due.append((ticket, peer, *early))
            self._drain(ready)
        self._maybe_finish()
        return due

    def expect(self, ticket: int, peer: int) -> None:
        """A ticketed request to ``peer`` is about to leave: its report is due."""
        with self._lock:
            early = self._expect_locked(ticket, peer)
        if early is not None:  # (its report cannot be here before the request left: a forgery)
            forwards, claimed = early
            self._take_item(ticket, peer, forwards, claimed, peer if claimed is None else claimed)

    def _expect_locked(self, ticket: int, peer: int) -> tuple[list, int | None] | None:
        """``ticket``'s report is due from ``peer``: the report that came for it early, if
        one did (still due until it is taken: ``_take_item``)."""
        if ticket not in self._tickets and ticket not in self._reported:
            self._tickets[ticket] = peer
            self._settled += 1
        self._reached.add(peer)
        return self._early.pop(ticket, None)

    def reached(self, worker: int) -> bool:
        """Whether a ticket of this pass went to ``worker`` (its report is, or was, due)."""
        return worker in self._reached  # (a set lookup is atomic)

    def settle(self, ticket: int) -> None:
        """The report of ``ticket`` came: that worker's part is done."""
        with self._lock:
            self._tickets.pop(ticket, None)
            self._reported.add(ticket)
            self._settled += 1
        self._maybe_finish()

    def peer_lost(self, peer: int, error: BaseException, name: str | None = None) -> None:
        """Fail if reports are due and ``peer`` (named ``name``) took part in the context: a
        request may have been forwarded to it (announced in a report that cannot come now),
        or come from it."""
        with self._lock:
            waiting = bool(self._tickets) or bool(self._early)
        if waiting and (peer in self._tickets.values() or peer in self.context._known_worker_ids()):
            self.fail(RpcError(f"{name or f'worker {peer}'}, which took part in this pass, is lost: {error}"))

    def _all_done(self) -> bool:  # caller holds the lock
        return self._remaining == 0 and self._outstanding == 0 and not self._tickets and not self._early

    def _request_done(self, future: Outcome) -> None:
        try:
            settled = future.value()  # True: counted when the gradients riding on it were delivered
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return
        if settled is not True:
            with self._lock:
                self._outstanding -= 1
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        with self._lock:
            finished = self._all_done()
        if finished:
            self._finish()
        else:
            self.watch_idle()

    def watch_idle(self) -> None:
        """Arm the idle check when nothing is in flight but work remains (originator only)."""
        if self._idle_timeout is None or self.done.done():
            return
        with self._lock:
            if self._outstanding or self._all_done() or self._idle_timer is not None:
                return
            self._idle_timer = timers.call_later(self._idle_timeout, self._idle_check, self.node_runs + self._settled)
        if self.done.done():  # finished while we armed it: its callback may have run already
            self._cancel_idle()

    def _cancel_idle(self) -> None:
        with self._lock:
            timer, self._idle_timer = self._idle_timer, None
        if timer is not None:
            timer.cancel()

    def _idle_check(self, runs_when_armed: int) -> None:
        with self._lock:
            self._idle_timer = None
            progressed = self.node_runs + self._settled != runs_when_armed or self._outstanding
            waiting = [str(k) for k, bit in self.plan.root_bits.items() if not self._delivered & bit]
            reporting = sorted(set(self._tickets.values()))
        if self.done.done():
            return
        if progressed:
            self.watch_idle()
            return
        if reporting:
            what = f"no report came for the gradients sent (or forwarded) to worker(s) {', '.join(map(str, reporting))}"
        else:
            what = f"no gradients arrived for {len(waiting)} root(s) (send functions {', '.join(waiting[:8])})"
        self.fail(RpcError(
            f"backward pass {self.pass_id} of context {self.context.context_id}: {what} within "
            f"{self._idle_timeout:.0f} s with nothing else in flight "
            "(FAST mode waits for every send function of the context)"
        ))

    def _finish(self) -> None:
        with self._lock:
            if self.done.done() or self._error is not None:
                return
            # Claim completion under the lock: two threads may see the last step at once.
            self._error = _FINISHED
        answer, self.answer = self.answer, None
        self.done.set_result(answer)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
        log.debug("backward pass %d of context %d failed on node %d: %s", self.pass_id, self.context.context_id, self.worker_id, exc)
        self.done.set_exception(RpcError(f"Error on Node {self.worker_id}: {exc}"))

