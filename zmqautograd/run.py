"""Run a program unchanged on zmqautograd: ``torch.distributed.rpc``, ``torch.distributed.autograd``
and ``torch.distributed.optim.DistributedOptimizer`` are zmqautograd's in its process and in
every Python process it starts (they inherit the environment).

    python -m zmqautograd.run train.py [args...]
    python -m zmqautograd.run -m package.module [args...]
    python -m zmqautograd.run -m torch.distributed.run --nproc-per-node 4 train.py

What it sets: ``ZMQAUTOGRAD_AS_TORCH_RPC=1``, and a folder of ours first on ``PYTHONPATH``
whose ``sitecustomize`` installs the alias right after torch is imported (then runs the
``sitecustomize`` it shadows, if there is one). See zmqautograd/torch_alias.py.
"""

from __future__ import annotations

import os
import runpy
import sys

from .torch_alias import ENVIRONMENT_VARIABLE, install_on_torch_import

USAGE = "usage: python -m zmqautograd.run (script.py | -m module) [args...]"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    startup = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")
    os.environ[ENVIRONMENT_VARIABLE] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (startup, os.environ.get("PYTHONPATH")) if p)
    install_on_torch_import()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
