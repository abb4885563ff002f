"""Run a program unchanged on zmqautograd: ``torch.distributed.rpc``, ``torch.distributed.autograd``
and ``torch.distributed.optim.DistributedOptimizer`` are zmqautograd's in its process and in
every Python process it starts (they inherit the environment).

    python -m zmqautograd.run train.py [args...]
    python -m zmqautograd.run -m package.module [args...]
    python -m zmqautograd.run -m torch.distributed.run --nproc-per-node 4 train.py

What it sets: ``ZMQAUTOGRAD_AS_TORCH_RPC=1``, and a folder of ours first on ``PYTHONPATH``
whose ``sitecustomize`` installs the alias right after torch is imported (then runs the
``sitecustomize`` it shadows, if there is one). See zmqautograd/torch_alias.py.

It also gives the group it starts a cluster secret of its own (``ZMQAUTOGRAD_CLUSTER_SECRET``,
fresh, unless one is set already; docs/security.md), which every worker it starts inherits.
Not for ``torch.distributed.run`` across several nodes (``--nnodes`` other than 1): each node's
launcher would make another, so there every host needs the same one in its environment.
"""

from __future__ import annotations

import os
import runpy
import sys

from .rpc import cluster_secret
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
    if not _spans_hosts(argv):
        cluster_secret.for_children()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _spans_hosts(argv: list[str]) -> bool:
    """Whether ``argv`` runs torch's launcher across several nodes (``--nnodes`` other than
    1), which this process cannot give all the same secret."""
    if argv[:2] not in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
        return False
    for index, argument in enumerate(argv):
        if argument.startswith("--nnodes="):
            return argument.removeprefix("--nnodes=") not in ("1", "1:1")
        if argument == "--nnodes" and index + 1 < len(argv):
            return argv[index + 1] not in ("1", "1:1")
    return False


if __name__ == "__main__":
    main(sys.argv[1:])
