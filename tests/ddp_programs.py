"""Programs for tests/autograd/test_ddp.py: DistributedDataParallel under zmqautograd's
distributed autograd, in worker processes of their own (gloo process group + RPC)."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc


def _start(rank: int, world: int, rpc_port: int, pg_port: int, pg_timeout: float = 60) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=30))


def alone(rpc_port: int, pg_port: int) -> dict:
    """One worker: what a dist autograd backward through DDP does to what the user sees."""
    _start(0, 1, rpc_port, pg_port)
    found: dict = {}
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = DDP(model)
    sentinel = torch.full_like(model.weight, 7.0)
    model.weight.grad = sentinel  # the user's .grad: dist autograd must leave it alone
    hook_calls: list = []
    model.weight.register_hook(lambda g: hook_calls.append(g.clone()))
    post_accumulate: list = []
    model.bias.register_post_accumulate_grad_hook(lambda p: post_accumulate.append(1))
    x = torch.randn(3, 4)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [ddp(x).sum() + ddp(x).sum()])  # two uses: one hook call on the sum
        grads = dist_autograd.get_gradients(context_id)
        found["context_grad"] = grads[model.weight].tolist()
        found["context_has_bias"] = model.bias in grads
    found["local_grad"] = (2 * x.sum(0, keepdim=True)).tolist()
    found["user_grad_kept"] = model.weight.grad is sentinel and bool((sentinel == 7).all())
    found["bias_grad_none"] = model.bias.grad is None
    found["tensor_hook_calls"] = len(hook_calls)
    found["post_accumulate_grad_hook_calls"] = len(post_accumulate)

    static = DDP(nn.Linear(4, 1), static_graph=True)
    with dist_autograd.context() as context_id:
        try:
            dist_autograd.backward(context_id, [static(x).sum()])
            found["static_graph"] = "no error"
        except RuntimeError as exc:
            found["static_graph"] = str(exc)
        found["static_graph_grads"] = len(dist_autograd.get_gradients(context_id))
    rpc.shutdown()
    dist.destroy_process_group()
    return found


def trainer_dies(rank: int, rpc_port: int, pg_port: int) -> dict:
    """Two trainers; worker1 dies in the middle of its second step's backward (after its
    forward, before DDP's all-reduce). What does worker0's backward do?"""
    import time

    _start(rank, 2, rpc_port, pg_port, pg_timeout=60)
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    for step in range(2):
        x = torch.randn(3, 4)
        with dist_autograd.context() as context_id:
            loss = model(x).sum()
            if rank == 1 and step == 1:
                os._exit(17)
            started = time.monotonic()
            try:
                dist_autograd.backward(context_id, [loss])
            except RuntimeError as exc:
                return {"error": str(exc), "type": type(exc).__name__, "step": step,
                        "seconds": time.monotonic() - started}
    return {"error": None}


def variant(rank: int, rpc_port: int, pg_port: int, which: int) -> dict:
    """Two trainers, one DDP configuration (``VARIANTS[which]``), 3 steps: the gradients a
    dist autograd backward leaves in the context, against those of the same DDP
    configuration on a copy of the model with local autograd (``.grad``), same process group."""
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    name = VARIANTS[which]
    _start(rank, 2, rpc_port, pg_port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    options = {"gradient_as_bucket_view": name == "gradient_as_bucket_view",
               "bucket_cap_mb": 1e-5 if name == "small_buckets" else 25}  # small: one bucket per parameter
    ours, theirs = DDP(model, **options), DDP(reference, **options)
    if name == "fp16_comm_hook":
        for ddp in (ours, theirs):
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    differences = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + step))
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [ours(x).pow(2).sum()])
            grads = dist_autograd.get_gradients(context_id)
            reference.zero_grad(set_to_none=True)
            theirs(x).pow(2).sum().backward()
            differences.append(max((grads[p] - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())))
            gathered: list = [None, None]
            dist.all_gather_object(gathered, [grads[p].tolist() for p in model.parameters()])
    rpc.shutdown()
    dist.destroy_process_group()
    return {"variant": name, "max_difference": max(differences), "same_on_both": gathered[0] == gathered[1]}


VARIANTS = ["gradient_as_bucket_view", "small_buckets", "fp16_comm_hook"]


if __name__ == "__main__":
    program, *args = sys.argv[1:]
    result = globals()[program](*map(int, args))
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # (the survivor of trainer_dies cannot shut down RPC gracefully)
