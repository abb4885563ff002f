"""zmqautograd under torch's names, for programs and libraries that import torch's modules.

``install_as_torch_rpc()`` makes ``torch.distributed.rpc`` (with its submodules ``api``,
``functions``, ``constants`` and ``options``), ``torch.distributed.autograd`` and
``torch.distributed.optim.DistributedOptimizer`` be zmqautograd's in this process: code that
imports them afterwards gets ours, and so does code that reads them as attributes of
``torch.distributed`` at call time; torch's own modules that bound them by name before (its
``RemoteModule``) are rebound. A module of yours that bound torch's objects by name before the
call keeps them; call it first thing. torch's other RPC internals (``rpc.internal``,
``rpc.backend_registry``, the TorchScript bindings) stay torch's and are not used by ours.

``python -m zmqautograd.run`` (``run.py``) does this in every process of a job without touching
the program: it sets ``ZMQAUTOGRAD_AS_TORCH_RPC=1`` and puts a ``sitecustomize`` on the path
that installs the alias right after ``torch`` is first imported (``install_on_torch_import``).
This module imports nothing but the standard library until it installs: the
``sitecustomize`` loads it without the package (whose import would import torch), so that a
process of the job that never imports torch does not pay for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Sequence

ENVIRONMENT_VARIABLE = "ZMQAUTOGRAD_AS_TORCH_RPC"

# torch's module name -> ours (names relative to the package zmqautograd).
_MODULES = {
    "torch.distributed.rpc": "rpc",
    "torch.distributed.rpc.api": "rpc.api",
    "torch.distributed.rpc.functions": "rpc.functions",
    "torch.distributed.rpc.constants": "rpc.constants",
    "torch.distributed.rpc.options": "rpc.options",
    "torch.distributed.autograd": "autograd",
}

_installed = False


def install_as_torch_rpc() -> None:
    """Make torch's RPC, distributed autograd and ``DistributedOptimizer`` names refer to
    zmqautograd's in this process (idempotent)."""
    global _installed
    if _installed:
        return
    import torch.distributed
    import torch.distributed.optim
    import torch.distributed.optim.optimizer

    from zmqautograd.optim import DistributedOptimizer

    replaced = {}
    for torch_name, ours in _MODULES.items():
        module = importlib.import_module(f"zmqautograd.{ours}")
        if sys.modules.get(torch_name) is not None:
            replaced[id(sys.modules[torch_name])] = (sys.modules[torch_name], module)
        sys.modules[torch_name] = module
        parent, _, child = torch_name.rpartition(".")
        setattr(sys.modules[parent], child, module)
    _rebind_torch_modules(replaced)
    torch.distributed.optim.DistributedOptimizer = DistributedOptimizer  # type: ignore[misc,assignment]
    torch.distributed.optim.optimizer.DistributedOptimizer = DistributedOptimizer  # type: ignore[misc,assignment]
    _installed = True


def _rebind_torch_modules(replaced: dict) -> None:
    """torch's modules imported already (``torch.distributed.optim`` imports
    ``torch.distributed.nn``'s RemoteModule, which binds ``torch.distributed.rpc`` as ``rpc``),
    and the modules RemoteModule generates, refer to ours from now on: a module-level name
    bound to one of the replaced modules is rebound. torch's own RPC and autograd packages
    keep theirs (they are torch's implementation, which ours does not use)."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("torch.") or name.startswith("_remote_module_")):
            continue
        if name.startswith(("torch.distributed.rpc.", "torch.distributed.autograd.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            found = replaced.get(id(value))
            if found is not None and found[0] is value:
                namespace[key] = found[1]


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds ``torch`` as the other finders would, and installs the alias once it is loaded
    (so that a process that never imports torch does not pay for it)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            load(module)
            install_as_torch_rpc()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_on_torch_import() -> None:
    """Install the alias now if torch is loaded, else right after it is first imported."""
    if "torch" in sys.modules:
        install_as_torch_rpc()
    elif not any(isinstance(finder, _AfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
