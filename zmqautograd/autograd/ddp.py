"""DistributedDataParallel under distributed autograd: DDP's own reducer averages the
gradients a pass leaves in the context.

DDP registers a C++ post hook on the AccumulateGrad node of each of its parameters; the hook
hands the parameter's gradient to DDP's reducer, which copies it into a bucket, all-reduces
full buckets over the process group and, in a callback at the end of the engine's call,
writes the averaged gradients back. Under torch's dist autograd the seeds' capture hook runs
those post hooks after it accumulated into the context, and the reducer reads and writes the
gradients *of the context* (it asks for the thread's current dist autograd context).

Python cannot call a C++ hook, nor hand the reducer a context of ours. What it can do is run
the AccumulateGrad nodes themselves: once every gradient a pass gives the parameters of a
DDP module is known, ``reduce_into_context`` runs PyTorch's engine with those gradients as
roots at the parameters (``torch.autograd.backward(params, grads)``), while each parameter's
``.grad`` holds, for the duration of that call, what the context holds for it. So
AccumulateGrad adds the pass's gradient to the context's, DDP's hooks and reducer run as
they would (buckets, comm hooks, ``gradient_as_bucket_view``, ``find_unused_parameters``,
``no_sync``), its final callback runs at the end of that call, and what ``.grad`` holds
afterwards goes to the context; the user's ``.grad`` is put back. A lock per module keeps
two passes from swapping the same ``.grad`` at once. The hooks that torch's dist engine does
not run there (tensor hooks, which already ran on the gradient, and post-accumulate-grad
hooks) are held back during that call.

Which parameters belong to a DDP module: DDP's ``_pre_forward`` is wrapped (``install``) to
note the module on its first forward, which a backward through it always follows.

Not supported, refused before anything is applied: ``static_graph=True`` (its first
iteration's delayed all-reduce reads ``.grad`` from a callback of another engine call) and
CUDA parameters with tensor hooks (PyTorch runs their hooks on its device threads, where
they cannot be held back).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from . import port
from .functions import make_suppressible, run_tensor_hooks, suppressing, tensor_hooks_of

# id(parameter) -> (the parameter, its DDP module), both weakly
_owner: dict[int, tuple["weakref.ref[torch.Tensor]", "weakref.ref[torch.nn.Module]"]] = {}
# The DDP modules seen in a forward, each with the lock its reductions take.
_locks: "weakref.WeakKeyDictionary[torch.nn.Module, threading.Lock]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()
_installed = False


class UnsupportedDdpConfiguration(RuntimeError):
    """A DistributedDataParallel configuration that distributed autograd cannot drive."""


def install() -> None:
    """Wrap ``DistributedDataParallel._pre_forward`` to note each DDP module (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel._pre_forward

    def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        if self not in _locks:
            _note(self)
        return original(self, *inputs, **kwargs)

    _pre_forward.__wrapped__ = original  # type: ignore[attr-defined]
    DistributedDataParallel._pre_forward = _pre_forward  # type: ignore[method-assign]
    _installed = True


def _note(module: Any) -> None:
    with _registry_lock:
        ref = weakref.ref(module)
        for param in module._module_parameters:
            _owner[id(param)] = (weakref.ref(param), ref)
            weakref.finalize(param, _owner.pop, id(param), None)
        _locks[module] = threading.Lock()
    _GroupKeeper.keep(module)


class _GroupKeeper:
    """Keeps a DDP module's process group alive until its reducer (and logger) are gone, so
    that the group's last reference is this one, not the reducer's.

    PyTorch's ``Reducer`` holds the group in C++ and is freed with the GIL held; when it holds
    the last reference (``destroy_process_group`` was called, then the module is freed), gloo's
    destructor joins its worker threads under the GIL, and a worker thread that is freeing a
    finished collective on a tensor Python made (DDP's ``Join`` starts such all-reduces and does
    not wait for them) waits for the GIL: the process hangs for good (pytorch/pytorch#56297).
    The group's Python binding releases the GIL before destroying it, so releasing our
    reference last, once the reducer's destructor ran (weakref callbacks of a pybind11 object
    run after its C++ object was freed), lets that worker thread finish."""

    __slots__ = ("group", "holders")
    group: Any
    holders: int  # of the reducer and logger, those not freed yet

    @classmethod
    def keep(cls, module: Any) -> None:
        group = getattr(module, "process_group", None)
        holders = [h for h in (getattr(module, "reducer", None), getattr(module, "logger", None)) if h is not None]
        if group is None or not holders:
            return
        keeper = cls()
        keeper.group, keeper.holders = group, len(holders)
        for holder in holders:
            try:
                weakref.finalize(holder, keeper.gone)
            except TypeError:  # not weakly referenceable: no hook, as before
                keeper.gone()

    def gone(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.group = None  # (its binding destroys it with the GIL released)


def owner_of(variable: torch.Tensor) -> Any:
    """The DDP module whose parameter ``variable`` is, or None."""
    if not _owner:
        return None
    refs = _owner.get(id(variable))
    if refs is None or refs[0]() is not variable:
        return None
    return refs[1]()


def leaves_of_ddp(leaves: Any) -> dict:
    """Leaf node -> its DDP module, for the AccumulateGrad nodes ``leaves`` of DDP parameters;
    raises UnsupportedDdpConfiguration for a module this module cannot drive."""
    if not _owner:
        return {}
    found = {}
    for node in leaves:
        module = owner_of(node.variable)
        if module is None:
            continue
        if getattr(module, "static_graph", False):
            raise UnsupportedDdpConfiguration(
                "DistributedDataParallel(static_graph=True) is not supported under zmqautograd's distributed "
                "autograd (its delayed all-reduce would read the parameters' .grad instead of the context's "
                "gradients): construct it with static_graph=False")
        if node.variable.device.type != "cpu" and tensor_hooks_of(node) is not None:
            raise UnsupportedDdpConfiguration(
                "a CUDA parameter of a DistributedDataParallel module has tensor hooks (register_hook), which "
                "zmqautograd's distributed autograd cannot run once on the pass's whole gradient there")
        found[node] = module
    return found


def reduce_into_context(context: Any, grads: dict, modules: dict, held: dict) -> None:
    """Run DDP's reducer over the gradients ``grads`` (leaf node -> the pass's whole gradient
    for it) of DDP parameters, so that the context ends up with what torch's dist autograd
    leaves there. ``modules``: leaf node -> its DDP module; ``held``: leaf node -> tensor
    hooks the pass held back, to run on the whole gradient first."""
    by_module: dict[Any, list] = {}
    for node, grad in grads.items():
        if node in held:
            grad = run_tensor_hooks(held[node], grad)
        by_module.setdefault(modules[node], []).append((node.variable, grad))
    for module, roots in by_module.items():
        with _locks[module]:
            try:
                _reduce_module(context, module, roots)
            except RuntimeError as exc:
                raise RuntimeError(f"DistributedDataParallel's reduction failed on this worker ({_suspects()}): {exc}") from exc


# How long a failed reduction waits for the RPC layer to name a lost worker: a killed process
# breaks DDP's collective and our connections to it at the same moment.
LOSS_NOTICE_SECONDS = 2.0


def _suspects() -> str:
    try:
        lost = port.current().hooks.lost_workers(wait=LOSS_NOTICE_SECONDS)
    except Exception:  # noqa: BLE001 - no agent: nothing to name
        lost = []
    if lost:
        return f"lost worker(s): {', '.join(lost)}"
    return "no RPC worker was lost: a member of its process group failed, hung past the group's timeout, or erred"


def _reduce_module(context: Any, module: Any, roots: list) -> None:
    params = list(module._module_parameters)
    held_back = []
    for param in params:
        for hooks in (param._backward_hooks, getattr(param, "_post_accumulate_grad_hooks", None)):
            if hooks:
                make_suppressible(hooks)
                held_back.append(id(hooks))
    before = context.gradients()
    users = [param.grad for param in params]
    after: list = []
    try:
        for param in params:
            param.grad = before.get(param)
        with suppressing(frozenset(held_back)):
            torch.autograd.backward([variable for variable, _ in roots], [grad for _, grad in roots])
        after = [param.grad for param in params]
    finally:
        for param, grad in zip(params, users):
            param.grad = grad
    for param, grad in zip(params, after):
        if grad is not None:
            context.set_grad(param, grad)
