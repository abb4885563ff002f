"""The autograd functions at RPC boundaries (the seeds' SendRpcBackward / RecvRpcBackward).

They are custom ``torch.autograd.Function``s only so that PyTorch makes real graph nodes for
them: nodes with the right ``next_functions``, that PyTorch's engine can start from (a send
function is a root of the backward pass) or stop at (a recv function is where gradients
leave this worker), and that the profiler names. The distributed engine (engine.py) decides
when they run; their ``backward`` is never where the RPC happens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

_SEND_NAME = "torch::distributed::autograd::SendRpcBackward"
_RECV_NAME = "torch::distributed::autograd::RecvRpcBackward"


@dataclass(frozen=True)
class RecvInfo:
    """Where the gradients of a recv function go: the worker that sent the tensors, and the
    autograd ids under which it recorded the matching send function."""

    context_id: int
    message_id: int
    from_worker: int
    # Shapes and dtypes of the received tensors, for the gradients of unused ones.
    metadata: tuple
    # Whether the tensors came in a response (else a request): gradients go back the way
    # their tensors came, so this picks the device map they follow (rpc/devices.py).
    in_response: bool = False


class SendRpc(torch.autograd.Function):
    """Identity whose node stands for "these tensors were sent": the gradients the receiver
    sends back enter the local graph here."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        return grads


class RecvRpc(torch.autograd.Function):
    """The grad_fn of received tensors that require grad. ``anchor`` only makes the outputs
    require grad (a node needs a differentiable input); the engine never runs this node: it
    captures the gradient flowing into it and sends it to ``from_worker``."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, info: RecvInfo, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.recv_info = info
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        # Reached only by a *local* backward (tensor.backward()) through received tensors:
        # gradients stop at the RPC boundary there, as they would at any tensor that does
        # not require grad.
        return (None, None) + tuple(None for _ in grads)


# PyTorch names Python-function nodes after their class; the seeds (and their tests) use the
# C++ names.
SendRpc._backward_cls.name = lambda self: _SEND_NAME
RecvRpc._backward_cls.name = lambda self: _RECV_NAME
SEND_NODE_TYPE = SendRpc._backward_cls
RECV_NODE_TYPE = RecvRpc._backward_cls


_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", None)


def profiled(name: str) -> Any:
    """``record_function(name)`` while the profiler records on this thread, else nothing: the
    context manager costs ~10 us even with the profiler off (measured), and a backward pass
    uses a few."""
    if _profiler_enabled is None or _profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def is_recv_node(node: Any) -> bool:
    return type(node) is RECV_NODE_TYPE


def is_leaf_node(node: Any) -> bool:
    return type(node).__name__ == "AccumulateGrad"


def post_hooks_of(node: Any) -> dict | None:
    """The dict that holds the Python post hooks of ``node`` (an AccumulateGrad), by hook id;
    hooks registered on the node later land in the same dict. None when it cannot be found.

    The engine captures a leaf's gradient at the edge into its AccumulateGrad node, so
    PyTorch never runs that node and its post hooks; the engine runs them itself, as the
    seeds' capture hook does. PyTorch has no API to list them, but registering a hook returns
    a handle that refers to the node's one dict of Python post hooks: register a probe, keep
    the dict, remove the probe. On a node that had no Python post hook this leaves an empty
    dict behind, which a *local* backward through the node then looks at (a GIL round)."""
    try:
        handle = node.register_hook(_probe_hook)
    except (AttributeError, RuntimeError, TypeError):
        return None
    try:
        hooks = handle.hooks_dict_ref()
    except AttributeError:  # a torch whose handles are built differently
        hooks = None
    finally:
        handle.remove()
    return hooks if isinstance(hooks, dict) else None


def _probe_hook(grad_inputs: Any, grad_outputs: Any) -> None:  # registered and removed at once, never run
    return None


def make_send_node(tensors: list[torch.Tensor]) -> Any:
    """A SendRpcBackward node whose next functions are the edges of ``tensors`` (which all
    require grad)."""
    with torch.enable_grad():
        outputs = SendRpc.apply(*tensors)
    return outputs[0].grad_fn


def attach_recv_node(
    tensors: list[torch.Tensor], context_id: int, message_id: int, from_worker: int, in_response: bool = False
) -> Any:
    """Make a RecvRpcBackward node the grad_fn of ``tensors`` (received, requiring grad), in
    place: the payload the tensors came in already refers to these tensor objects (possibly
    from inside unpickled objects), so their contents are swapped, not the objects."""
    metadata = tuple((t.shape, t.dtype, t.device, t.layout) for t in tensors)
    info = RecvInfo(context_id, message_id, from_worker, metadata, in_response)
    plain = [t.detach() for t in tensors]
    anchor = torch.empty(0, requires_grad=True)
    with torch.enable_grad():
        outputs = RecvRpc.apply(anchor, info, *plain)
    for received, output in zip(tensors, outputs):
        torch.utils.swap_tensors(received, output)
    return tensors[0].grad_fn


def recv_info(node: Any) -> RecvInfo:
    return node.recv_info
