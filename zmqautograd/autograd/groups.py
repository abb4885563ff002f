"""Running one group of a pass (plan.py): one call into PyTorch's engine, node by node
(*stepwise*, for a group whose exits are chained), or passed through unchanged when the
group only hands gradients on."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .context import add_gradients
from .functions import (
    SEND_NODE_TYPE,
    call_tensor_hooks,
    profiling,
    tensor_hooks_of,
)
from .plan import _STRIDED, Edge, _Group


def accumulate(buffer: dict, key: Any, grad: torch.Tensor) -> None:
    """Add ``grad`` to what ``buffer`` holds for ``key``."""
    old = buffer.get(key)
    buffer[key] = grad if old is None else add_gradients(old, grad)


def _grad(outputs: tuple, grads: tuple, inputs: tuple, retain_graph: bool) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph, allow_unused=True)``, with
    gradient edges on both sides, straight into PyTorch's C++ engine: the Python wrapper
    costs twice the engine's own time on a small graph (measured: 33 us against 10 us), once
    per group and pass. The engine validates the gradients' shapes itself."""
    if _run_backward is None:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=retain_graph, allow_unused=True)
    return _run_backward(outputs, grads, retain_graph, False, inputs, True, False)

def _engine_roots(entries: dict) -> tuple[tuple, tuple]:
    """The roots of a group's engine call (GradientEdges) and their gradients, from the
    group's buffered entries. An entry into a send function starts at the edge that slot of
    the function leads to instead: its backward is the identity, and PyTorch's engine would
    run it as a Python node only to hand the gradient on (a Python call under the GIL from
    the engine, ~7 us of a worker's ~22 us call, measured warm). The engine sums roots that
    share an edge, as it would have summed what the node gave them. Under the profiler the
    node runs, so that it shows as SendRpcBackward."""
    past_sends = not profiling()
    edges = []
    for node, slot in entries:
        if past_sends and type(node) is SEND_NODE_TYPE:
            target = node.next_functions[slot]
            if target[0] is not None:  # (always: the function only takes tensors that require grad)
                node, slot = target
        edges.append(GradientEdge(node, slot))
    return tuple(edges), tuple(entries.values())

_engine = getattr(torch.autograd.Variable, "_execution_engine", None)

_run_backward = getattr(_engine, "run_backward", None)  # private; torch.autograd.grad is the fallback

def _run_stepwise(group: _Group, entries: dict) -> tuple:
    """Run a group's nodes one by one (topological order), each with the sum of its inputs;
    the gradients of its captured edges, in ``group.captures`` order."""
    members = set(group.nodes)
    inputs: dict[Any, dict[int, torch.Tensor]] = {}
    for (node, slot), grad in entries.items():
        inputs.setdefault(node, {})[slot] = grad
    captured: dict[Edge, torch.Tensor] = {}
    for node in group.nodes:
        given = inputs.pop(node, None)
        if not given:
            continue
        arity = len(node._input_metadata) if hasattr(node, "_input_metadata") else max(given) + 1
        args = [given.get(slot) for slot in range(arity)]
        with torch.no_grad():
            outputs = node.apply(*args) if hasattr(node, "_forward_cls") else node(*args)
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        for (target, slot), grad in zip(node.next_functions, outputs):
            if target is None or grad is None:
                continue
            if target in members:
                accumulate(inputs.setdefault(target, {}), slot, grad)
            else:
                accumulate(captured, (target, slot), grad)
    # The leaves' tensor hooks, as PyTorch runs them where a call captures an edge: once, on
    # what the group gave the leaf (those the pass holds back do nothing here).
    for edge, leaf in zip(group.captures, group.capture_leaves):
        if leaf and edge in captured and (hooks := tensor_hooks_of(edge[0])) is not None:
            captured[edge] = call_tensor_hooks(hooks.values(), captured[edge])
    return tuple(captured.get(edge) for edge in group.captures)

def _pass_through(group: _Group, entries: dict) -> tuple:
    """A group that is a send function alone, feeding only leaves and recv functions (a
    parameter sent to another worker; in a pipeline that the caller drives, an answer passed
    on to the next stage): its backward is the identity, so the gradients it was given go
    on as they are, without a call into PyTorch's engine (one per group and pass: ~10 us in
    situ, more than the rest of the group). Each exit gets what the engine would capture
    there: the sum over the slots that lead to it, a leaf's through its tensor hooks. ``()``
    when that could differ: a gradient the engine would convert or reject (another shape,
    dtype, device or layout than the tensor's), a CUDA gradient, a received tensor with hooks or
    ``retain_grad`` (they run where the engine captures its gradient; a gone tensor's hooks
    stay on its node, which notes them), or the profiler recording (it shows the node). The
    engine then runs the group."""
    slots = group.pass_through
    if slots is None or profiling():  # (the caller runs only groups that have it)
        return ()
    node = group.nodes[0]
    captures = group.captures
    sums: list = [None] * len(captures)
    for (entry_node, slot), grad in entries.items():
        if entry_node is not node or grad is None:
            continue
        index = slots[slot] if slot < len(slots) else None
        if index is None:
            continue
        target, target_slot = captures[index]
        if group.capture_leaves[index]:
            variable = target.variable
            shape, dtype, device = variable.shape, variable.dtype, variable.device
        else:
            shape, dtype, device, _ = target.recv_info.metadata[target_slot]
        if not _taken_as_is(grad, shape, dtype, device):
            return ()
        old = sums[index]
        sums[index] = grad if old is None else old + grad
    for index, grad in enumerate(sums):
        if grad is None:
            continue
        target, target_slot = captures[index]
        if group.capture_leaves[index]:
            if (hooks := tensor_hooks_of(target)) is not None:
                sums[index] = call_tensor_hooks(hooks.values(), grad)
            continue
        if _hooks_could_run(target, target_slot):
            return ()
    return tuple(sums)

def _taken_as_is(grad: torch.Tensor, shape: Any, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether PyTorch's engine would take ``grad`` as it is for a tensor of that shape, dtype
    and device: nothing to convert or reject, and on the CPU (the engine orders CUDA
    gradients with their streams)."""
    return (grad.layout is _STRIDED and grad.is_cpu and grad.shape == shape and grad.dtype == dtype
            and grad.device == device)

def _hooks_could_run(recv: Any, slot: int) -> bool:
    """Whether PyTorch's engine could run hooks where it captures the gradient of ``recv``'s
    ``slot``: its received tensor has a hook or retains its grad, or it is gone and had a
    hook (which stays on the node), or that is not known."""
    received = recv.recv_info.received
    if slot >= len(received):
        return True
    tensor = received[slot]()
    if tensor is None:
        return recv.hooked
    return bool(tensor._backward_hooks) or tensor.retains_grad

def _aliased(results: tuple) -> set[int]:
    """Ids of gradients that are handed to more than one input (they must be copied)."""
    counts: dict[int, int] = {}
    for grad in results:
        if grad is not None:
            counts[id(grad)] = counts.get(id(grad), 0) + 1
    return {key for key, count in counts.items() if count > 1}
