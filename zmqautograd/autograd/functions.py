"""The autograd functions at RPC boundaries (the seeds' SendRpcBackward / RecvRpcBackward).

They are custom ``torch.autograd.Function``s only so that PyTorch makes real graph nodes for
them: nodes with the right ``next_functions``, that PyTorch's engine can start from (a send
function is a root of the backward pass) or stop at (a recv function is where gradients
leave this worker), and that the profiler names. The distributed engine (engine.py) decides
when they run; their ``backward`` is never where the RPC happens.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, NamedTuple

import torch

_SEND_NAME = "torch::distributed::autograd::SendRpcBackward"
_RECV_NAME = "torch::distributed::autograd::RecvRpcBackward"


class RecvInfo(NamedTuple):
    """Where the gradients of a recv function go: the worker that sent the tensors, and the
    autograd ids under which it recorded the matching send function. (A named tuple: one is
    made for every recorded message, and a frozen dataclass takes several times as long.)"""

    context_id: int
    message_id: int
    from_worker: int
    # Shapes and dtypes of the received tensors, for the gradients of unused ones.
    metadata: tuple
    # Whether the tensors came in a response (else a request): gradients go back the way
    # their tensors came, so this picks the device map they follow (rpc/devices.py).
    in_response: bool = False
    # Weak references to the received tensors, filled once the node is attached: whether
    # they have hooks, which PyTorch's engine would run where it captures their gradient
    # (groups._pass_through; for those that are gone, the node's ``hooked`` tells). Empty
    # when not known.
    received: list = []
    # What the sender's send function asks of a worker that the originator routes these
    # gradients through, to take them from it (context.check_gradient_sender); None: none.
    token: int | None = None


class SendRpc(torch.autograd.Function):
    """Identity whose node stands for "these tensors were sent": the gradients the receiver
    sends back enter the local graph here."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        # The outputs only give the node its slots (their shapes check the gradients that come
        # back); nobody uses them. ``.data`` is an alias made without a torch op (``detach``
        # is one, which lets the GIL go: a hand-over when threads wait for it).
        outputs = tuple([t.data for t in tensors])
        return outputs + (torch.empty(0),) if NODE_NEEDS_AN_OUTPUT else outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        return grads[:-1] if NODE_NEEDS_AN_OUTPUT else grads


class RecvRpc(torch.autograd.Function):
    """The grad_fn of received tensors that require grad. ``anchor`` only makes the outputs
    require grad (a node needs a differentiable input); the engine never runs this node: it
    captures the gradient flowing into it and sends it to ``from_worker``."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, info: RecvInfo, in_place: bool,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.recv_info = info
        if in_place:
            # The tensors themselves get the node as their grad_fn (attach_recv_node).
            ctx.mark_dirty(*tensors)
            outputs = tensors
        else:
            outputs = tuple([t.detach() for t in tensors])
        return outputs + (torch.empty(0),) if NODE_NEEDS_AN_OUTPUT else outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        # Reached only by a *local* backward (tensor.backward()) through received tensors:
        # gradients stop at the RPC boundary there, as they would at any tensor that does
        # not require grad.
        return (None, None, None) + tuple(None for _ in grads[: len(ctx.recv_info.metadata)])


def _node_outlives_its_outputs() -> bool:
    """Whether the Python object of a custom function's node keeps the node alive (torch
    2.13 does). Where it does not (torch 2.11: the object refers to the node weakly, and
    only tensors that have it as grad_fn keep it), a node whose outputs are gone is dead:
    its attributes raise "Attribute 'next_functions' is invalid for this instance". Send
    functions are kept only as nodes (nobody keeps the tensors of a send), so there the
    functions add one empty output that the context keeps instead (``make_send_node``)."""
    with torch.inference_mode(False), torch.enable_grad():
        node = SendRpc.apply(torch.empty(1, requires_grad=True))[0].grad_fn
        try:
            _ = node.next_functions  # raises where torch cannot reach the node
        except RuntimeError:
            return False
    return True


NODE_NEEDS_AN_OUTPUT = False  # what the probe runs with
NODE_NEEDS_AN_OUTPUT = not _node_outlives_its_outputs()


# PyTorch names Python-function nodes after their class; the seeds (and their tests) use the
# C++ names.
SendRpc._backward_cls.name = lambda self: _SEND_NAME
RecvRpc._backward_cls.name = lambda self: _RECV_NAME
SEND_NODE_TYPE = SendRpc._backward_cls
RECV_NODE_TYPE = RecvRpc._backward_cls


# Whether a tensor hook was ever registered on a tensor this recv function made (True on the
# node once one was). Such hooks live on the node: PyTorch's engine runs them where it
# captures the gradient, also after the tensor itself is gone, so a gradient may skip the
# engine (groups._pass_through) only when a gone tensor never had one. ``register_hook``
# reaches the node through ``_register_hook_dict`` (once per tensor, with its first hook).
# (Where that method is not there to note them, every node counts as hooked.)
_register_hook_dict = getattr(torch._C._FunctionBase, "_register_hook_dict", None)
RECV_NODE_TYPE.hooked = _register_hook_dict is None


def _note_hook_dict(node: Any, tensor: torch.Tensor) -> None:
    node.hooked = True
    _register_hook_dict(node, tensor)  # type: ignore[misc]  # (installed only where it exists)


if _register_hook_dict is not None:
    RECV_NODE_TYPE._register_hook_dict = _note_hook_dict


_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", None)


def profiling() -> bool:
    """Whether the profiler records on this thread (True when that cannot be told)."""
    return _profiler_enabled is None or _profiler_enabled()


def profiled(name: str) -> Any:
    """``record_function(name)`` while the profiler records on this thread, else nothing: the
    context manager costs ~10 us even with the profiler off (measured), and a backward pass
    uses a few."""
    if profiling():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def is_recv_node(node: Any) -> bool:
    return type(node) is RECV_NODE_TYPE


_ACCUMULATE_GRAD_TYPE = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def is_leaf_node(node: Any) -> bool:
    if _ACCUMULATE_GRAD_TYPE is not None:
        return type(node) is _ACCUMULATE_GRAD_TYPE
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


# ------------------------------------------------------------------ leaves' tensor hooks
#
# A leaf's tensor hooks (``leaf.register_hook``) run where PyTorch's engine captures the
# gradient flowing into the leaf's AccumulateGrad node: once per ``torch.autograd.grad`` call.
# A leaf that several groups of a pass feed would get them once per group, each on a part
# of its gradient, where torch's engine runs them once, on the sum (a non-linear hook, say a
# clamp, then gives another result, and a counting hook counts more calls). So the engine
# keeps them from running inside its group calls for such leaves and runs them itself on
# the pass's sum: the hooks in the leaf's hook dict are wrapped (once, in place: the user's
# handles keep working) in a wrapper that does nothing while its dict is *suppressed* on the
# calling thread, which is where PyTorch runs CPU nodes of a call.


class _Suppressed(threading.local):
    dicts: frozenset = frozenset()  # ids of the hook dicts whose hooks are held back here


_suppressed = _Suppressed()


class _SuppressibleHook:
    """A leaf's tensor hook as the engine wraps it (see above); transparent elsewhere."""

    __slots__ = ("hook", "owner")

    def __init__(self, hook: Callable, owner: dict) -> None:
        self.hook = hook
        self.owner = id(owner)

    def __call__(self, grad: torch.Tensor) -> Any:
        if self.owner in _suppressed.dicts:
            return None
        return self.hook(grad)


def tensor_hooks_of(node: Any) -> dict | None:
    """The dict of the tensor hooks of the leaf whose AccumulateGrad ``node`` is, if it has
    any (``Tensor._backward_hooks``; hooks registered later land in the same dict)."""
    variable = getattr(node, "variable", None)
    hooks = getattr(variable, "_backward_hooks", None) if variable is not None else None
    return hooks if isinstance(hooks, dict) and hooks else None


def make_suppressible(hooks: dict) -> None:
    """Wrap the hooks of ``hooks`` not wrapped yet (each key keeps its place)."""
    for key, hook in list(hooks.items()):
        if type(hook) is not _SuppressibleHook:
            hooks[key] = _SuppressibleHook(hook, hooks)


@contextlib.contextmanager
def suppressing(dicts: frozenset) -> Any:
    """Hold back the wrapped hooks of the hook dicts ``dicts`` (ids) on this thread meanwhile."""
    outer = _suppressed.dicts
    _suppressed.dicts = outer | dicts
    try:
        yield
    finally:
        _suppressed.dicts = outer


def run_tensor_hooks(hooks: dict, grad: torch.Tensor) -> torch.Tensor:
    """A held leaf's tensor hooks on the pass's sum: the hooks themselves, not held back."""
    return call_tensor_hooks([hook.hook if type(hook) is _SuppressibleHook else hook for hook in hooks.values()], grad)


def call_tensor_hooks(hooks: Any, grad: torch.Tensor) -> torch.Tensor:
    """Apply tensor hooks to ``grad`` as PyTorch does: in order, each given what the one
    before returned (None: unchanged)."""
    for hook in tuple(hooks):
        result = hook(grad)
        if result is not None:
            if not isinstance(result, torch.Tensor) or result.shape != grad.shape:
                # PyTorch's own check, with its wording
                what = "type" if not isinstance(result, torch.Tensor) else "size"
                raise RuntimeError(f"hook '{getattr(hook, '__name__', hook)}' has changed the {what} of value")
            grad = result
    return grad


# ``Function.apply`` without its Python wrapper, which handles functorch transforms and
# ``setup_context`` (neither applies to these functions) and costs ~3 us a call: the C++
# apply, bound to each class. Used unless a functorch transform is active.
_send_apply = super(torch.autograd.Function, SendRpc).apply
_recv_apply = super(torch.autograd.Function, RecvRpc).apply
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)
_grad_enabled = torch.is_grad_enabled  # usually on: then no enable_grad() (~0.6 us) around the apply
# The input that makes a recv function's outputs require grad. One for all of them: the
# engine stops at recv functions, and a local backward gives it no gradient (RecvRpc.backward).
with torch.inference_mode(False):  # a normal tensor even if we are imported in inference mode
    _ANCHOR = torch.empty(0, requires_grad=True)


def make_send_node(tensors: list[torch.Tensor]) -> tuple[Any, Any]:
    """A SendRpcBackward node whose next functions are the edges of ``tensors`` (which all
    require grad), and what must be kept to keep the node alive (None where the node object
    does that itself: ``NODE_NEEDS_AN_OUTPUT``)."""
    if not _grad_enabled():
        with torch.enable_grad():
            return make_send_node(tensors)
    outputs = SendRpc.apply(*tensors) if _functorch_active() else _send_apply(*tensors)
    return outputs[0].grad_fn, (outputs[-1] if NODE_NEEDS_AN_OUTPUT else None)


def attach_recv_node(
    tensors: list[torch.Tensor], context_id: int, message_id: int, from_worker: int, in_response: bool = False,
    token: int | None = None,
) -> tuple[Any, Any]:
    """Make a RecvRpcBackward node the grad_fn of ``tensors`` (received, requiring grad), in
    place: the payload the tensors came in already refers to these tensor objects (possibly
    from inside unpickled objects), so their contents are swapped, not the objects. Returns
    the node and what keeps it alive, as ``make_send_node``."""
    if not _grad_enabled():
        with torch.enable_grad():
            return attach_recv_node(tensors, context_id, message_id, from_worker, in_response, token)
    metadata = tuple([(t.shape, t.dtype, t.device, t.layout) for t in tensors])
    received: list = []
    info = RecvInfo(context_id, message_id, from_worker, metadata, in_response, received, token)
    apply = RecvRpc.apply if _functorch_active() else _recv_apply
    if _fresh(tensors):
        # The usual case, tensors the codec just made: they become the node's outputs in
        # place (marked dirty, as an in-place op's), with no new outputs made, swapped in and
        # freed (torch ops that let the GIL go: a hand-over each when threads wait for it).
        for tensor in tensors:
            tensor.requires_grad_(False)  # (a leaf that requires grad cannot be changed in place)
        outputs = apply(_ANCHOR, info, True, *tensors)
    else:
        plain = [t.detach() for t in tensors]
        outputs = apply(_ANCHOR, info, False, *plain)
        for tensor, output in zip(tensors, outputs):
            _swap(tensor, output)
    received.extend([_weak(t) for t in tensors])  # after the swap: its fast way needs no weak references
    return tensors[0].grad_fn, (outputs[-1] if NODE_NEEDS_AN_OUTPUT else None)


def _fresh(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are distinct plain dense leaves that are no views (as the codec
    makes them), which can become a recv function's outputs in place."""
    for t in tensors:
        if type(t) is not torch.Tensor or t.grad_fn is not None or t.layout is not _STRIDED_LAYOUT or t._is_view():
            return False
    return len(tensors) == 1 or len({id(t) for t in tensors}) == len(tensors)


_STRIDED_LAYOUT = torch.strided


_weak = weakref.ref


_swap_impl = getattr(torch._C, "_swap_tensor_impl", None)


def _swap(received: torch.Tensor, output: torch.Tensor) -> None:
    """``torch.utils.swap_tensors(received, output)``. A tensor the codec just made is a plain
    Tensor without weak references, attributes, or other holders of its data: only the data
    need swap places then, which is what swap_tensors comes down to after its checks (1.5
    against 0.2 us, measured)."""
    if (_swap_impl is not None and type(received) is torch.Tensor and type(output) is torch.Tensor
            and received._use_count() == 1 and output._use_count() == 1  # type: ignore[attr-defined]  # (private)
            and not received.__dict__
            and not output.__dict__ and not weakref.getweakrefs(received)):
        _swap_impl(received, output)
    else:
        torch.utils.swap_tensors(received, output)


def recv_info(node: Any) -> RecvInfo:
    return node.recv_info
