"""Run at the start of every Python process of a job started by ``python -m zmqautograd.run``
(this folder is first on its ``PYTHONPATH``): zmqautograd under torch's names once torch is
imported (zmqautograd/torch_alias.py). Then the ``sitecustomize`` this one shadows, if any."""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("ZMQAUTOGRAD_AS_TORCH_RPC") == "1":
    from zmqautograd.torch_alias import install_on_torch_import

    install_on_torch_import()


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_run_shadowed()
