"""Forwarding routes (engine.py, "Forwarding"): what the originator publishes, how a
worker reads them, and the gradients it forwards along one."""

from __future__ import annotations

from typing import Any

from ..rpc.errors import RpcError
from .functions import (
    profiling,
)
from .groups import _hooks_could_run, _taken_as_is
from .plan import Plan


def routes_for(plan: Plan, worker_id: int) -> list | None:
    """The routes that the caller of backward (``worker_id``) publishes with its gradient
    requests: one for each send function of its plan whose gradients may skip it
    (Plan.forwardable) and whose recv function's tensors have no hooks for the engine to
    run: ``[its message id, the worker the recv function's tensors came from, their message
    id there, whether they came in a response, for each slot of the send function the recv
    function's slot or -1, the recv function's width, the token that worker's send function
    asks of whoever forwards its gradients]``. None when there are none, or when the profiler
    records (it shows the nodes that forwarding skips)."""
    forwardable = plan.forwardable()
    if not forwardable or profiling():
        return None
    routes = []
    for key, (_, recv, slots) in forwardable.items():
        info = recv.recv_info
        if info.from_worker == worker_id or any(slot >= 0 and _hooks_could_run(recv, slot) for slot in slots):
            continue
        routes.append([key, info.from_worker, info.message_id, info.in_response, list(slots), len(info.metadata),
                       info.token])
    return routes or None

def parse_routes(routes: Any) -> dict[int, tuple]:
    """Published routes as they came from a peer (routes_for), by send function message id;
    an RpcError when malformed."""
    parsed = {}
    try:
        for key, peer, message_id, in_response, slots, width, token in routes:
            if not (type(key) is int and type(peer) is int and type(message_id) is int and type(in_response) is bool
                    and type(width) is int and width >= 0 and type(slots) is list
                    and all(type(slot) is int and -1 <= slot < width for slot in slots)
                    and (token is None or type(token) is int)):
                raise ValueError
            parsed[key] = (key, peer, message_id, in_response, tuple(slots), width, token)
    except (TypeError, ValueError):
        raise RpcError(f"malformed gradient routes: {routes!r:.120}") from None
    return parsed

def forwarded_gradients(route: tuple, grads: list, metadata: tuple) -> list | None:
    """The gradients of a recv function (``grads``, for its tensors of ``metadata``) as the
    gradients of the send function that ``route`` leads to: each slot's sum, as the pass
    through on the originator gives them (_pass_through). None when the engine there could
    have converted one (another layout, device, shape or dtype): they then go the usual way."""
    _, _, _, _, slots, width, _ = route
    if len(slots) != len(grads):
        raise RpcError(f"gradient route for {len(slots)} tensor(s) applied to {len(grads)}")
    forwarded: list = [None] * width
    for grad, target, (shape, dtype, device, _) in zip(grads, slots, metadata):
        if grad is None or target < 0:
            continue
        if not _taken_as_is(grad, shape, dtype, device):
            return None
        old = forwarded[target]
        forwarded[target] = grad if old is None else old + grad
    return forwarded
