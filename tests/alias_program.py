"""A program written for torch's RPC, run by tests/system/test_torch_alias.py through
``python -m zmqautograd.run``: it prints which modules its own process and a spawned child
got for torch's names, and whether a plain Python process of the job imported torch."""

import json
import multiprocessing as mp
import subprocess
import sys


def _names():
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    return [rpc.__name__, dist_autograd.__name__, DistributedOptimizer.__module__]


def _child(queue):
    queue.put(_names())


if __name__ == "__main__":
    plain = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(queue,))
    process.start()
    child = queue.get(timeout=60)
    process.join(30)
    print(json.dumps({"main": _names(), "child": child, "plain_imported_torch": plain.stdout.strip()}))
