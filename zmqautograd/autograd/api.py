"""The public API, with the names and semantics of ``torch.distributed.autograd``, and the
functions other workers call by RPC (gradient requests, context cleanup)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import torch

from transport import MessageType

from ..rpc import current
from ..rpc.errors import RpcError
from . import cleanup
from .context import ContextContainer, DistAutogradContext
from .engine import LOCAL_ROOT, Pass, plan_for
from .functions import RecvInfo, profiled

log = logging.getLogger(__name__)

_pass_lock = threading.Lock()  # creating and replacing a context's current pass
_running: dict[int, Pass] = {}  # passes started by backward() on this process


_agent = current.agent


def _container() -> ContextContainer:
    try:
        return _agent().autograd
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
    context = agent.autograd.remove(context_id)
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
    container: ContextContainer = agent.autograd
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
        if agent.pool.owns_current_thread():
            with agent.pool.blocking():  # a UDF calling backward must not hold up the pool
                run.run_at_home()
        else:
            run.run_at_home()
        run.done.wait()


def _check_context_id(context_id: Any, what: str) -> None:
    if type(context_id) is not int:
        raise TypeError(f"{what}(): incompatible function arguments: context_id must be an int, got {context_id!r:.40}")


# ------------------------------------------------------------------------------ passes


def _start_pass(agent: Any, ctx: DistAutogradContext, pass_id: int, retain_graph: bool, local_edges: list | None,
                requester: int | None = None) -> Pass:
    """Make ``pass_id`` the context's pass on this worker (replacing a stale one);
    ``requester``: the worker that waits for the answer to the request that starts it."""
    plan = plan_for(ctx, local_edges)
    home = local_edges is not None
    idle = (agent.default_timeout if agent.default_timeout > 0 else None) if home else None
    # The caller of backward() waits for its pass's work in the transport's wait_until: the
    # answers it waits for then usually reach it directly (see _send_gradients).
    waiting = (agent.endpoint.wait_until, agent.endpoint.waiter().wake) if home else None
    run = Pass(ctx, plan, pass_id, retain_graph, agent.rank, _send_gradients, home=home, idle_timeout=idle,
               requester=requester, home_waiting=waiting)
    if home:  # passes this worker started, by id (found even if the context is gone)
        _running[pass_id] = run
    with _pass_lock:
        stale, ctx.current_pass = ctx.current_pass, run
    if stale is not None:
        stale.fail(RpcError(f"backward pass {stale.pass_id} was superseded by pass {pass_id}"))

    def finished(_: Any) -> None:
        if home:
            _running.pop(pass_id, None)
        with _pass_lock:
            if ctx.current_pass is run:
                ctx.current_pass = None

    run.done.add_done_callback(finished)
    return run


def _send_gradients(info: RecvInfo, grads: list, run: Pass, awaited: bool) -> torch.futures.Future | None:
    """A recv function fired: send its gradients to the worker the tensors came from (one-way
    when ``run`` does not wait for the answer). The future completes once the answer came
    and the gradients that rode on it (see ``Pass._fire_recv``) were delivered here."""
    agent = _agent()
    # Back the way the tensors came: the inverse of the map they arrived through.
    peer = agent.worker_info(info.from_worker).name
    placement = agent.placement.request(peer) if info.in_response else agent.placement.response(peer)
    args = (info.context_id, info.message_id, run.pass_id, run.retain_graph, grads, agent.rank if awaited else -1)
    if not awaited:
        agent.notify(info.from_worker, _backward_request, args, MessageType.BACKWARD_AUTOGRAD_REQ, placement)
        return None
    delivered: torch.futures.Future = torch.futures.Future()

    def answered(riding: Any, error: BaseException | None) -> None:
        if error is None and riding is not None:
            try:
                _accept_gradients(agent, *riding, start=False)
            except Exception as exc:  # noqa: BLE001 - fails our pass (its _request_done)
                error = exc
        if error is not None:
            delivered.set_exception(error)
        else:
            delivered.set_result(None)

    # On the originator the answer is handled on the thread that runs the pass (no hand-over
    # through the pool); elsewhere passes run on pool threads, and so does the answer.
    posted = (run.post_home, answered) if run.is_home else None
    sent = agent.call(info.from_worker, _backward_request, args, None, -1.0,
                      message_type=MessageType.BACKWARD_AUTOGRAD_REQ, placement=placement, posted=posted)
    if posted is None:
        sent.add_done_callback(lambda done: answered(*_outcome(done)))
    return delivered


def _outcome(future: torch.futures.Future) -> tuple[Any, BaseException | None]:
    try:
        return future.value(), None
    except Exception as exc:  # noqa: BLE001 - handed on as the outcome
        return None, exc


def _backward_request(context_id: int, message_id: int, pass_id: int, retain_graph: bool, grads: list,
                      reply_to: int = -1) -> torch.futures.Future:
    """On the worker that sent the tensors: the gradients for send function ``message_id``
    (``reply_to``: the sender, when it waits for the answer). The first request of a pass is
    answered when this worker's pass is done, with the gradients that ride on the answer if
    any; later ones at once (the seeds' completion protocol)."""
    agent = _agent()
    run, first = _accept_gradients(agent, context_id, message_id, pass_id, retain_graph, grads,
                                   requester=reply_to if reply_to >= 0 else None)
    if first:
        # A failed pass raises here, in the callback: the answer carries its error.
        return run.done.then(lambda done: _riding_gradients(done.value(), pass_id, retain_graph))
    answered: torch.futures.Future = torch.futures.Future()
    answered.set_result(None)
    return answered


def _accept_gradients(agent: Any, context_id: int, message_id: int, pass_id: int, retain_graph: bool, grads: list,
                      requester: int | None = None, start: bool = True) -> tuple[Pass, bool]:
    """Deliver the gradients for send function ``message_id`` to pass ``pass_id`` here,
    starting it if it is new and ``start`` (``requester`` waits for its answer). The pass,
    and whether it is new. Gradients riding on an answer never start a pass: the pass that
    asked is here, or was superseded (they are then dropped with an error)."""
    try:
        ctx = agent.autograd.retrieve(context_id)
        ctx.send_function(message_id)  # a clear error for an unknown message id
        with _pass_lock:
            run = ctx.current_pass
            first = run is None or run.pass_id != pass_id
        if first and not start:
            raise RpcError(f"backward pass {pass_id} of context {context_id} is no longer running here")
        if first:
            run = _start_pass(agent, ctx, pass_id, retain_graph, None, requester)
        run.deliver(message_id, list(grads))
    except Exception as exc:
        # The sender does not wait for this answer when we started the pass (see engine.py):
        # our own pass must fail instead of waiting for gradients that will not come.
        own = _running.get(pass_id)
        if own is not None:
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


_backward_request._wrapped_async_rpc_function = _backward_request
