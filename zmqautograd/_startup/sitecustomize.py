"""Run at the start of every Python process of a job started by ``python -m zmqautograd.run``
(this folder is first on its ``PYTHONPATH``): zmqautograd under torch's names once torch is
imported (zmqautograd/torch_alias.py). Then the ``sitecustomize`` this one shadows, if any."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_torch_alias():
    """zmqautograd.torch_alias without the package: importing ``zmqautograd`` imports torch,
    which a process that never uses torch should not pay for. Registered under its own name,
    so that the package, when imported later, uses this same module."""
    name = "zmqautograd.torch_alias"
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(_HERE), "torch_alias.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_shadowed() -> None:
    for entry in sys.path:
        if os.path.abspath(entry or ".") == _HERE:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("ZMQAUTOGRAD_AS_TORCH_RPC") == "1" and "zmqautograd.torch_alias" not in sys.modules:
    _load_torch_alias().install_on_torch_import()
_run_shadowed()
