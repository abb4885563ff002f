"""What the soak test runs on its workers."""

from __future__ import annotations

import threading

import torch

import zmqautograd.rpc as rpc


def state() -> dict:
    """This worker's bookkeeping: what must be back to zero once everything settled."""
    agent = rpc.api._current()
    faults = agent.endpoint.faults
    from zmqautograd import timers

    return {
        "contexts": agent.hooks.contexts.count(),
        "owned_rrefs": agent.rrefs.owned_count(),
        "pending_calls": agent.outstanding(),
        "threads": threading.active_count(),
        "timers": len(timers._timers._heap),  # answered calls' timeouts must not pile up
        "faults": dict(faults.injected) if faults is not None else {},
    }


def rref_sum(rref) -> torch.Tensor:
    """Fetch a value through an RRef forked to this worker."""
    return rref.to_here().sum()


def stage(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x * scale) + x
