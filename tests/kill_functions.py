"""What the kill tests run on their workers."""

from __future__ import annotations

import threading
import time

import torch

from zmqautograd.transport.faults import FaultPolicy
import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc
from zmqautograd.rpc.rref_owner import _owned_count

_started = threading.Event()
_call_started = threading.Event()


def slow_identity(x, seconds: float):
    _call_started.set()
    time.sleep(seconds)
    return x


def in_slow_call() -> bool:
    return _call_started.wait(5)


class SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds`` (the worker is killed meanwhile)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _started.set()
        time.sleep(ctx.seconds)
        return grad, None


def in_slow_backward() -> bool:
    return _started.wait(5)


def slow_backward_stage(x, seconds: float):
    return SlowBackward.apply(x * 2, seconds)


def make_contexts_on(workers: list, count: int) -> int:
    """Create ``count`` contexts here that reach ``workers`` (and never release them)."""
    for _ in range(count):
        context = dist_autograd._new_context()
        x = torch.ones(2, requires_grad=True)
        for worker in workers:
            rpc.rpc_sync(worker, torch.add, args=(x, 1))
        dist_autograd.api._container().set_current(None)
        del context
    return count


def context_count() -> int:
    return dist_autograd.api._container().count()


def contexts_released(timeout: float) -> bool:
    return dist_autograd.api._container().wait_released(None, timeout)


def add_on(worker: str, x):
    """Pass the caller's autograd context on to ``worker``: it is known here, not there."""
    return rpc.rpc_sync(worker, torch.add, args=(x, 1))


_kept: list = []


def keep(value) -> bool:
    """Hold ``value`` (RRefs forked to this worker) for the life of the process."""
    _kept.append(value)
    return True


def share_own_rref_with(worker: str) -> bool:
    """Make an RRef owned here and fork it to ``worker`` (which keeps it); drop ours."""
    return rpc.rpc_sync(worker, keep, args=(rpc.RRef(torch.ones(2)),))


def share_unmade_rref(owner: str, to: str) -> bool:
    """remote() on ``owner`` with its call held back here for a minute (fault injection), the
    RRef forked to ``to`` meanwhile: ``owner`` hears of the value from ``to``'s fork request
    long before the call that makes it would arrive."""
    rpc.api._current().endpoint.faults = FaultPolicy(messages_to_delay={"PYTHON_REMOTE_CALL": 60.0})
    return rpc.rpc_sync(to, keep, args=(rpc.remote(owner, torch.ones, args=(2,)),))


def owned_rrefs_back_to(count: int, timeout: float) -> bool:
    """Whether this worker owns ``count`` RRefs within ``timeout`` seconds. Polled: deletes
    and a lost worker's forks go away on pool threads, with nothing to wait on."""
    deadline = time.monotonic() + timeout
    while _owned_count() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


_stop = threading.Event()


def stop() -> None:
    _stop.set()


def serve_until_stopped(rank: int, world_size: int, init_method: str, options: dict) -> None:
    """A worker that keeps serving when peers die (the harness's workers leave at the first
    failed shutdown barrier): it serves until told to stop, then leaves without a barrier."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, **options))
    _stop.wait()
    rpc.shutdown(graceful=False)
