"""The public API, with the names and semantics of ``torch.distributed.autograd``, and the
functions other workers call by RPC (gradient requests, context cleanup)."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Sequence

import torch

from zmqautograd.transport import MessageType

from ..rpc import current
from ..rpc.errors import NotEntitledError, RpcError
from ..rpc.functions import answered_when_done
from ..rpc.futures import Outcome, outcome_of
from ..rpc.serialization import protocol_function
from . import cleanup, port
from .context import ContextContainer, DistAutogradContext
from .engine import Pass
from .functions import RecvInfo, profiled
from .plan import LOCAL_ROOT, plan_for
from .port import AgentPort
from .routes import routes_for

log = logging.getLogger(__name__)

_pass_lock = threading.Lock()  # creating and replacing a context's current pass
_running: dict[int, Pass] = {}  # passes started by backward() on this process


_agent = port.current


def _container() -> ContextContainer:
    try:
        return _agent().hooks.contexts  # (hooks.py, installed on every agent)
    except RuntimeError as exc:
        raise RpcError(f"distributed autograd needs RPC: {exc}") from None


class context:
    """``with context() as context_id:`` makes a new context current on this thread, and
    releases it on every worker that took part when the block ends."""

    def __enter__(self) -> int:
        self.autograd_context = _new_context()
        return self.autograd_context._context_id()

    def __exit__(self, *exc_info: Any) -> None:
        context_id = self.autograd_context._context_id()
        if _container().is_valid(context_id):
            _release_context(context_id)
        else:  # released meanwhile (by hand, or by a cleanup from a peer): not current any more
            _container().remove(context_id)


def _new_context() -> DistAutogradContext:
    return _container().new_context()


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return _container().retrieve(context_id)


def _current_context() -> DistAutogradContext:
    current = _container().current()
    if current is None:
        raise RpcError(
            "Current thread doesn't have a valid autograd context. Please wrap your code using: "
            "`with zmqautograd.autograd.context() as context_id` to generate a valid context"
        )
    return current


def _is_valid_context(context_id: int) -> bool:
    return _container().is_valid(context_id)


def _get_max_id() -> int:
    return _container().max_id()


def _get_debug_info() -> dict[str, str]:
    container = _container()
    return {
        "num_current_backward_passes": str(container.active_passes()),
        "num_autograd_contexts": str(container.count()),
    }


def _release_context(context_id: int) -> None:
    """Release a context here and, through cleanup messages, on every worker it reached."""
    agent = _agent()
    context = agent.hooks.contexts.remove(context_id)
    if context is None:
        raise RpcError(f"Could not find autograd context with id: {context_id}")
    cleanup.release_everywhere(agent, context)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in this context on this worker, by leaf tensor."""
    _check_context_id(context_id, "get_gradients")
    return _container().retrieve(context_id).gradients()


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass of ``roots`` (scalars) across every worker that took part in the
    forward pass of this context. Gradients go to the context (see ``get_gradients``)."""
    _check_context_id(context_id, "backward")
    if not isinstance(roots, (list, tuple)) or not all(isinstance(r, torch.Tensor) for r in roots):
        raise TypeError(
            "backward(): incompatible function arguments: roots must be a list of tensors, "
            f"got {type(roots).__qualname__}"
        )
    agent = _agent()
    container: ContextContainer = agent.hooks.contexts
    autograd_context = container.retrieve(context_id)
    if not roots:
        raise RpcError("No tensors provided for gradient computation.")
    for root in roots:
        if not root.requires_grad:
            raise RpcError("requires_grad not set on root")
        if root.numel() != 1:
            raise RpcError(f"Tensor of shape {tuple(root.shape)} is not a scalar, all roots need to be scalar")
        if root.grad_fn is None:
            raise RpcError("Tensor does not have a valid gradient function.")
    edges = [(root.grad_fn, root.output_nr) for root in roots]
    with profiled("torch::distributed::autograd::backward"):
        run = _start_pass(agent, autograd_context, container.new_message_id(), bool(retain_graph), edges)
        run.deliver(LOCAL_ROOT, [torch.ones_like(root, memory_format=torch.preserve_format) for root in roots])
        run.watch_idle()
        pool = agent.pool
        if pool.owns_current_thread():
            with pool.blocking():  # a UDF calling backward must not hold up the pool
                run.run_at_home()
        else:
            run.run_at_home()
        run.done.wait()


def _check_context_id(context_id: Any, what: str) -> None:
    if type(context_id) is not int:
        raise TypeError(f"{what}(): incompatible function arguments: context_id must be an int, got {context_id!r:.40}")


# ------------------------------------------------------------------------------ passes


def _start_pass(agent: AgentPort, ctx: DistAutogradContext, pass_id: int, retain_graph: bool, local_edges: list | None,
                requester: int | None = None, ticket: tuple | None = None) -> Pass:
    """Make ``pass_id`` the context's pass on this worker (replacing a stale one);
    ``requester``: the worker that waits for the answer to the request that starts it;
    ``ticket``: (ticket, routes, sink, delegated reports) of a ticketed request, whose
    pass reports to the originator (engine.py, "Forwarding")."""
    plan = plan_for(ctx, local_edges)
    home = local_edges is not None
    idle = (agent.default_timeout if agent.default_timeout > 0 else None) if home else None
    # The caller of backward() waits for its pass's work in the transport's wait_until: the
    # answers it waits for then usually reach it directly (see _send_gradients).
    waiting = agent.home_waiting() if home else None
    run = Pass(ctx, plan, pass_id, retain_graph, agent.rank, _send_gradients, home=home, idle_timeout=idle,
               requester=requester, home_waiting=waiting, ticket=ticket, forward_gradients=_forward_gradients)
    if home:  # passes this worker started, by id (found even if the context is gone)
        run.published = routes_for(plan, agent.rank)
        if run.published is not None:  # where the passes of its ticketed requests report
            run.sink = agent.open_sink(
                run.post_home, lambda report, error, sender: _settle_report(agent, run, report, error, sender))
        _running[pass_id] = run
    with _pass_lock:
        stale, ctx.current_pass = ctx.current_pass, run
    if stale is not None:
        stale.fail(RpcError(f"backward pass {stale.pass_id} was superseded by pass {pass_id}: a context runs "
                            "one backward pass at a time on each worker (passes at once need contexts of their own)"))

    def finished(_: Any) -> None:
        if home:
            _running.pop(pass_id, None)
            if run.sink is not None:
                agent.close_sink(run.sink)
        with _pass_lock:
            if ctx.current_pass is run:
                ctx.current_pass = None

    run.done.add_done_callback(finished)
    return run


def _send_gradients(info: RecvInfo, grads: list, run: Pass, awaited: bool,
                    ticketed: bool = False) -> Outcome | None:
    """A recv function fired: send its gradients to the worker the tensors came from (one-way
    when ``run`` does not wait for the answer; ``ticketed``: with a ticket, and the routes
    and report sink of the originator, which waits for a report: engine.py, "Forwarding").
    The future completes once the answer came and the gradients that rode on it (see
    ``Pass._fire_recv``) were delivered here; its result is True when they were (their
    delivery counted the request as answered: ``Pass.deliver``)."""
    agent = _agent()
    placement = agent.placement_back(info.from_worker, info.in_response)
    args: tuple = (info.context_id, info.message_id, run.pass_id, run.retain_graph, grads, agent.rank if awaited else -1)
    if ticketed:
        ticket = agent.hooks.contexts.new_message_id()
        run.expect(ticket, info.from_worker)
        _fail_if_lost(agent, run)
        args += (ticket, run.published, run.sink)
    if not awaited:
        agent.notify(info.from_worker, _backward_request, args, MessageType.BACKWARD_AUTOGRAD_REQ, placement)
        return None
    delivered = Outcome()

    def answered(riding: Any, error: BaseException | None) -> None:
        settled = False
        if error is None and riding is not None:
            try:
                settled = _accept_gradients(agent, *riding, start=False, settles=run, sender=info.from_worker)[0] is run
            except Exception as exc:  # noqa: BLE001 - fails our pass (its _request_done)
                error = exc
        if error is not None:
            delivered.set_exception(error)
        else:
            delivered.set_result(settled)

    # On the originator the answer is handled on the thread that runs the pass (no hand-over
    # through the pool); elsewhere passes run on pool threads, and so does the answer.
    posted = (run.post_home, answered) if run.is_home else None
    sent = agent.call(info.from_worker, _backward_request, args, None, -1.0,
                      message_type=MessageType.BACKWARD_AUTOGRAD_REQ, placement=placement, posted=posted)
    if posted is None:
        sent.add_done_callback(lambda done: answered(*outcome_of(done)))
    return delivered


def _fail_if_lost(agent: AgentPort, run: Pass) -> None:
    """A worker of the context lost before ``run`` had reports due fails it now, as one lost
    later does (Pass.peer_lost): forwarded gradients may be bound for it, and a worker that
    has not noticed the loss yet would send them into the void."""
    for worker in run.context._known_worker_ids():
        if agent.is_lost(worker):
            run.peer_lost(worker, RpcError("lost before the pass"))
            return


@protocol_function
@answered_when_done
def _backward_request(context_id: int, message_id: int, pass_id: int, retain_graph: bool, grads: list,
                      reply_to: int = -1, ticket: int | None = None, routes: list | None = None,
                      sink: int | None = None, delegated: list | None = None, token: int | None = None) -> Outcome:
    """On the worker that sent the tensors: the gradients for send function ``message_id``
    (``reply_to`` >= 0: the sender waits for the answer). The first request of a pass is
    answered when this worker's pass is done, with the gradients that ride on the answer if
    any; later ones at once (the seeds' completion protocol). A ``ticket``ed request (one-way,
    from the originator or forwarded) is reported instead, to the originator's ``sink``,
    with the ``routes`` it publishes and the reports ``delegated`` to this one (engine.py,
    "Forwarding"); a forwarded one shows the send function's ``token``. Only the worker the
    tensors went to, or one the originator routed them through, is heard (the sender is its
    connection's worker, never one the payload names)."""
    agent = _agent()
    sender = current.caller()
    if sender is None:  # (a member that is no worker of the group: an embedder's extra peer)
        raise agent.hooks.refusals.refuse(sender, "gradients")
    if ticket is not None:
        ticketed = (ticket, routes, sink, delegated)
        _ticketed_request(agent, context_id, message_id, pass_id, retain_graph, grads, ticketed, sender, token)
        return _ANSWERED
    requester = None if reply_to < 0 else reply_to if sender is None else sender
    run, first = _accept_gradients(agent, context_id, message_id, pass_id, retain_graph, grads,
                                   requester=requester, sender=sender, token=token)
    if first:
        # A failed pass raises here, in the callback: the answer carries its error.
        return run.done.then(lambda done: _riding_gradients(done.value(), pass_id, retain_graph))
    return _ANSWERED


_ANSWERED = Outcome()
_ANSWERED.set_result(None)


def _ticketed_request(agent: AgentPort, context_id: int, message_id: int, pass_id: int, retain_graph: bool, grads: list,
                      ticket: tuple, sender: int | None, token: int | None) -> None:
    """A ticketed request (``_backward_request``): deliver it, and report to the originator
    once the pass it started is done, unless that pass handed its report on with a forward
    (Pass.reported); at once when it joined a running pass (someone else waits for that),
    or with the error that stopped it. A refused one (its sender takes no part: a forgery)
    is not reported: the originator waits for the real one."""
    number, _, sink, delegated = ticket
    originator = pass_id >> 48
    try:
        if type(number) is not int or not (delegated is None or type(delegated) is list):
            raise RpcError(f"malformed ticket {ticket!r:.80}")
        run, first = _accept_gradients(agent, context_id, message_id, pass_id, retain_graph, grads,
                                       requester=originator, ticket=ticket, sender=sender, token=token)
    except NotEntitledError:
        raise  # (counted and logged: the sender of a one-way request learns nothing more)
    except Exception as exc:  # noqa: BLE001 - goes to the originator, which waits for this report
        # With what was delegated to it and its own ticket: the originator takes an error only
        # from a worker a ticket of the pass went to, which these announce.
        items = (delegated or []) + [[number, []]] if type(number) is int and type(delegated) in (list, type(None)) else []
        _report(agent, originator, sink, context_id, pass_id, items, None, f"Error on Node {agent.rank}: {exc}")
        return
    if not first:
        _report(agent, originator, sink, context_id, pass_id, (delegated or []) + [[number, []]], None, None)
        return

    def finished(done: Outcome) -> None:
        try:
            riding, error = _riding_gradients(done.value(), pass_id, retain_graph), None
        except Exception as exc:  # noqa: BLE001 - the pass's error, for the originator
            riding, error = None, str(exc)
        if run.reported and error is None:
            return
        _report(agent, originator, sink, context_id, pass_id, run.reports(), riding, error)

    run.done.add_done_callback(finished)


def _forward_gradients(route: tuple, grads: list, run: Pass, last: bool) -> None:
    """Send gradients where the originator's ``route`` leads (engine.Pass._forward), one-way,
    under a new ticket that this pass's report announces. When it is the ``last`` thing the
    pass does, that report goes with it (delegated: the receiver's report carries it), and
    the pass sends none of its own."""
    agent = _agent()
    _, peer, message_id, in_response, _, _, token = route
    ticket = agent.hooks.contexts.new_message_id()
    run.forwards.append([ticket, route[0], peer])
    delegated = None
    if last:
        delegated = run.reports()
        run.reported = True
    placement = agent.placement_back(peer, in_response)
    args = (run.context.context_id, message_id, run.pass_id, run.retain_graph, grads, -1, ticket, run.wire_routes,
            run.sink, delegated, token)
    with profiled("torch::distributed::autograd::RecvRpcBackward"):
        agent.notify(peer, _backward_request, args, MessageType.BACKWARD_AUTOGRAD_REQ, placement)


def _report(agent: AgentPort, originator: int, sink: Any, context_id: int, pass_id: int, reports: list,
            riding: list | None, error: str | None) -> None:
    """Passes of ticketed requests are done (``reports``: [ticket, forwards made] each): tell
    the originator, at its report ``sink`` (engine.py, "Forwarding")."""
    # Riding gradients are of tensors the originator sent in a request, as on an answer.
    placement = agent.placement_back(originator, False) if riding is not None else None
    try:
        if type(sink) is not int:
            raise RpcError(f"malformed report sink {sink!r:.40}")
        agent.report(originator, sink, [context_id, pass_id, reports, riding, error], placement)
    except Exception as exc:  # noqa: BLE001 - the originator's loss of us, or its idle check, ends its pass
        log.warning("backward pass %d: cannot report to worker %d: %s", pass_id, originator, exc)


def _settle_report(agent: AgentPort, run: Pass, report: Any, error: BaseException | None, sender: int) -> None:
    """On the originator, on the thread that runs ``run``: passes of its ticketed requests
    are done (``_report``), says ``sender``. A report from a worker that takes no part in
    the pass's context, or that claims what is another's, is refused (counted, logged, and
    the pass goes on: Pass.take_report); anything else wrong with it fails the pass
    (Pass.run_at_home)."""
    refusals = agent.hooks.refusals
    if not run.context.knows(sender):
        refusals.refuse(sender, f"a report to backward pass {run.pass_id}")
        return
    if error is not None:
        raise error
    if type(report) is not list or len(report) != 5:
        raise RpcError(f"malformed report {report!r:.80}")
    context_id, pass_id, reports, riding, failure = report
    if context_id != run.context.context_id or pass_id != run.pass_id:
        # (A worker of this context made to report another pass's work here: not this pass's.)
        refusals.refuse(sender, f"a report of backward pass {pass_id!r:.40} (context {context_id!r:.40}) "
                                f"to pass {run.pass_id}")
        return
    if failure is not None and type(failure) is not str:
        raise RpcError(f"malformed error report {failure!r:.80}")
    if type(reports) is not list:
        raise RpcError(f"malformed reports {reports!r:.80}")
    for item in reports:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not int or type(item[1]) is not list:
            raise RpcError(f"malformed report {item!r:.80}")
    if riding is not None and (type(riding) is not list or len(riding) != 5):
        raise RpcError(f"malformed riding gradients {riding!r:.80}")
    if failure is not None:
        # Only a worker a ticket of this pass went to ends it with its error (its report
        # announces the tickets delegated to it, and its own).
        refusal = run.take_report(reports, sender)
        if refusal is None and not run.reached(sender):
            refusal = f"an error report to backward pass {run.pass_id}", sender
        if refusal is not None:
            refusals.refuse(refusal[1], refusal[0])
            return
        raise RpcError(failure)
    # The gradients first: their work is what the pass waits for; the counts after it (the
    # pass cannot end before: its tickets are not settled yet).
    if riding is not None:
        try:
            _accept_gradients(agent, *riding, start=False, sender=sender)
        except NotEntitledError:
            return  # (counted and logged; the rest of such a report is not taken either)
    refusal = run.take_report(reports, sender)
    if refusal is not None:
        refusals.refuse(refusal[1], refusal[0])


def _accept_gradients(agent: AgentPort, context_id: int, message_id: int, pass_id: int, retain_graph: bool, grads: list,
                      *, requester: int | None = None, start: bool = True,
                      ticket: tuple | None = None, settles: Pass | None = None,
                      sender: int | None = None, token: int | None = None) -> tuple[Pass, bool]:
    """Deliver the gradients for send function ``message_id`` to pass ``pass_id`` here,
    starting it if it is new and ``start`` (``requester`` waits for its answer). The pass,
    and whether it is new. Gradients riding on an answer never start a pass: the pass that
    asked is here, or was superseded (they are then dropped with an error); ``settles``:
    the pass whose request they answer, counted as answered by their delivery when it is the
    pass here (``Pass.deliver``). ``sender``, ``token``: who sends them (None: this worker)
    and the token it shows; a sender that is not entitled to them is refused
    (``NotEntitledError``), which fails no pass here."""
    hooks = agent.hooks
    ctx = None
    if sender is not None and sender != agent.rank:
        # Whether the sender may deliver these at all, before anything it says can touch a
        # pass here: only a worker of the context fails our pass with what is wrong with them.
        ctx = hooks.contexts.retrieve(context_id)
        if ctx.recorded_send(message_id) is None:
            with contextlib.suppress(RpcError):  # (an unknown one fails the pass below, as it would)
                ctx.send_function(message_id)  # waits for one still being recorded
        why = ctx.check_gradient_sender(message_id, sender, token)
        if why is not None:
            raise hooks.refusals.refuse(sender, why)
    try:
        if ctx is None:
            ctx = hooks.contexts.retrieve(context_id)
        if ctx.recorded_send(message_id) is None:
            ctx.send_function(message_id)  # waits for one still being recorded; an unknown id's clear error
        with _pass_lock:
            run = ctx.current_pass
            first = run is None or run.pass_id != pass_id
        if first and not start:
            raise RpcError(f"backward pass {pass_id} of context {context_id} is no longer running here")
        if first and pass_id >> 48 == agent.rank:  # (ours start in backward(), and only there)
            raise RpcError(f"backward pass {pass_id} of context {context_id} is not running here")
        if first:
            run = _start_pass(agent, ctx, pass_id, retain_graph, None, requester, ticket)
        run.deliver(message_id, list(grads), settles=run is settles)
    except Exception as exc:
        # The sender does not wait for this answer when we started the pass (see engine.py):
        # our own pass must fail instead of waiting for gradients that will not come. Only
        # ours over this context, and only for a worker of it: a pass id names no context,
        # and another's message must not end a pass it takes no part in.
        own = _running.get(pass_id)
        if own is not None and ctx is not None and own.context is ctx and (
                sender is None or sender == agent.rank or ctx.knows(sender)):
            own.fail(exc)
        raise
    return run, first


def _riding_gradients(riding: tuple[RecvInfo, list] | None, pass_id: int, retain_graph: bool) -> list | None:
    """The gradients that ride on the answer to the request that started a pass, as the
    arguments of their delivery at the requester (None if none)."""
    if riding is None:
        return None
    info, grads = riding
    return [info.context_id, info.message_id, pass_id, retain_graph, grads]
