"""``RemoteModule``: a module that lives on another worker, with the API of torch's
``torch.distributed.nn.RemoteModule`` (its Python form; the TorchScript form is torch's
C++ agent's).

``RemoteModule("ps/cpu", nn.EmbeddingBag, args, kwargs)`` builds the module on worker ``ps``
(by ``rpc.remote``); ``forward`` and ``forward_async`` run it there, recorded in the current
distributed autograd context as any RPC; ``remote_parameters()`` gives RRefs to its
parameters for a ``DistributedOptimizer``. A RemoteModule may be sent to other workers in RPC
arguments and results (its module RRef is forked for the receiver); a plain pickle refuses
it, as torch's. Methods that would act on a local copy (``parameters``, ``to``,
``state_dict``, ...) raise ``ValueError``, as torch's.

Under ``zmqautograd.install_as_torch_rpc()`` torch's own ``torch.distributed.nn.RemoteModule``
works too (over our RPC); this class is for programs that import zmqautograd directly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from . import rpc
from .rpc.serialization import protocol_function, register_reducer

__all__ = ["RemoteModule"]

_PICKLED = ("on", "device", "is_device_map_set", "module_rref")

# The methods of nn.Module that would act on a local copy of the remote module (torch's list).
_NOT_SUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu", "cpu", "type",
    "float", "double", "half", "bfloat16", "to", "register_backward_hook", "register_forward_pre_hook",
    "register_forward_hook", "state_dict", "load_state_dict", "parameters", "named_parameters", "buffers",
    "named_buffers", "children", "named_children", "modules", "named_modules", "requires_grad_", "zero_grad",
    "share_memory", "extra_repr",
)


# ----------------------------------------------------------------- run on the module's owner


@protocol_function
def _create_module(module_cls: Callable, args: tuple, kwargs: dict, device: str) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):  # torch's words
        raise ValueError("Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
                         f"but it returns an instance of {type(module)}.")
    module.to(device)
    return module


@protocol_function
def _remote_forward(module_rref: rpc.RRef, device: str, is_device_map_set: bool, *args: Any, **kwargs: Any) -> Any:
    module = module_rref.local_value()
    target = torch.device(device)
    if target.type != "cuda":
        return module.forward(*args, **kwargs)
    # A module on a GPU takes CPU tensors too (moved there); without a device map only CPU
    # tensors may travel back, so its outputs are moved to the CPU.
    args = tuple(a.to(target) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.to(target) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = module.forward(*args, **kwargs)
    if is_device_map_set:
        return out
    return torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, out)


@protocol_function
def _param_rrefs(module_rref: rpc.RRef, recurse: bool) -> list[rpc.RRef]:
    return [rpc.RRef(param) for param in module_rref.local_value().parameters(recurse)]


# ------------------------------------------------------------------------------ the class


class RemoteModule(nn.Module):
    """A module built on another worker; see the module docstring.

    ``remote_device``: ``"<worker name>/<device>"`` or ``"rank:<rank>/<device>"`` (the device
    defaults to ``cpu``). ``module_cls(*args, **kwargs)`` must return an ``nn.Module``."""

    on: Any
    device: str
    is_device_map_set: bool
    module_rref: rpc.RRef

    def __init__(self, remote_device: str, module_cls: Callable[..., nn.Module], args: tuple | None = None,
                 kwargs: dict | None = None, _module_interface_cls: Any = None):
        super().__init__()
        _refuse_interface(_module_interface_cls)
        self._prepare(remote_device)
        self.module_rref = rpc.remote(self.on, _create_module, (module_cls, tuple(args or ()), dict(kwargs or {}), self.device))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: rpc.RRef, _module_interface_cls: Any = None) -> "RemoteModule":
        """A RemoteModule over the module ``module_rref`` refers to (which may be shared by
        several RemoteModules)."""
        _refuse_interface(_module_interface_cls)
        remote_module = _blank()
        remote_module._prepare(remote_device)
        remote_module.module_rref = module_rref
        return remote_module

    def _prepare(self, remote_device: str) -> None:
        if not rpc._is_initialized():
            raise AssertionError("RemoteModule only works in RPC.")  # torch's words
        parsed = torch.distributed._remote_device(remote_device)
        self.on = parsed.worker_name() if parsed.worker_name() is not None else parsed.rank()
        self.device = str(parsed.device())
        self.is_device_map_set = bool(rpc._get_current_rpc_agent()._get_device_map(self.on))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the remote module's ``forward`` on its worker and return its result."""
        return self.forward_async(*args, **kwargs).wait()

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        """``forward``, as a future."""
        return rpc.rpc_async(self.module_rref.owner(), _remote_forward,
                             (self.module_rref, self.device, self.is_device_map_set, *args), kwargs)

    def remote_parameters(self, recurse: bool = True) -> list[rpc.RRef]:
        """RRefs to the remote module's parameters (for a ``DistributedOptimizer``)."""
        return rpc.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> rpc.RRef:
        """The RRef of the remote module."""
        return self.module_rref

    def train(self, mode: bool = True) -> Any:  # type: ignore[override]
        return self.module_rref.rpc_sync().train(mode)

    def eval(self) -> Any:  # type: ignore[override]
        return self.module_rref.rpc_sync().eval()

    def __getstate__(self) -> Any:
        raise RuntimeError("Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC")


def _not_supported(name: str) -> Callable:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule")  # torch's words

    method.__name__ = method.__qualname__ = name
    return method


for _name in _NOT_SUPPORTED:
    setattr(RemoteModule, _name, _not_supported(_name))


def _refuse_interface(module_interface_cls: Any) -> None:
    if module_interface_cls is not None:
        raise NotImplementedError(
            "a TorchScript RemoteModule (_module_interface_cls) runs on torch's C++ RPC agent; zmqautograd's "
            "RemoteModule is the Python one")


def _blank() -> RemoteModule:
    remote_module = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(remote_module)
    return remote_module


# ----------------------------------------------------------------------- over the wire


def _rebuild(state: dict) -> RemoteModule:
    remote_module = _blank()
    for name in _PICKLED:
        setattr(remote_module, name, state[name])
    return remote_module


def _reduce(remote_module: RemoteModule) -> tuple:
    # The module RRef travels as RRefs in calls do (forked for the receiver).
    return _rebuild, ({name: getattr(remote_module, name) for name in _PICKLED},)


register_reducer(RemoteModule, _reduce)
