"""What tools/stress.py runs on its workers (importable there by reference)."""

from __future__ import annotations

import threading

import torch

import zmqautograd.rpc as rpc
from zmqautograd.rpc import functions


def stage(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x * scale) + x


def nested_stage(x: torch.Tensor, scale: float, via: str) -> torch.Tensor:
    """A stage here, then one on ``via``, inside the caller's autograd context."""
    return rpc.rpc_sync(via, stage, args=(stage(x, scale), scale + 1.0))


@functions.async_execution
def async_stage(x: torch.Tensor, scale: float, via: str) -> torch.futures.Future:
    """A stage on ``via``, doubled when it answers; no thread waits here meanwhile."""
    return rpc.rpc_async(via, stage, args=(x, scale)).then(lambda done: done.wait() * 2.0)


def fail(message: str) -> None:
    raise ValueError(message)


def rref_sum(rref: rpc.RRef) -> torch.Tensor:
    return rref.to_here().sum()


def state() -> dict:
    """What must be back to zero on a worker once everything settled."""
    agent = rpc.api._current()
    return {"contexts": agent.autograd.count(), "owned_rrefs": agent.rrefs.owned_count(),
            "pending_calls": agent.outstanding()}


_stop = threading.Event()


def stop() -> None:
    _stop.set()


def serve(rank: int, world_size: int, init_method: str, options: dict) -> None:
    """A worker that keeps serving when a peer dies, until told to stop."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, **options))
    _stop.wait()
    rpc.shutdown(graceful=False)
