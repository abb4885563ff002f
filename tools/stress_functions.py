"""What tools/stress.py runs: the random mix of operations, driven from worker0 and, with
``--everyone-drives``, from every worker (importable there by reference)."""

from __future__ import annotations

import collections
import gc
import random
import threading
import time
import traceback
from typing import Callable

import torch

import zmqautograd.autograd as dist_autograd
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
    """What must be back to zero on a worker once everything settled. User RRefs are counted
    after a full collection: only a leak keeps one then (a failed future that kept its
    waiter's frames did)."""
    agent = rpc.api._current()
    gc.collect()
    return {"contexts": agent.hooks.contexts.count(), "owned_rrefs": agent.rrefs.owned_count(),
            "user_rrefs": len(agent.rrefs._users), "pending_calls": agent.outstanding()}


def _grad(fn, leaf: torch.Tensor) -> torch.Tensor:
    local = leaf.detach().requires_grad_()
    return torch.autograd.grad(fn(local), [local])[0]


def _backward(forward, local, leaf: torch.Tensor, times: int = 1) -> None:
    """``forward(leaf)`` through other workers, backward ``times`` times in one context; the
    gradient must be ``times`` x what local autograd gives for ``local``."""
    expected = _grad(local, leaf) * times
    with dist_autograd.context() as context_id:
        loss = forward(leaf)
        for left in range(times, 0, -1):
            dist_autograd.backward(context_id, [loss], retain_graph=left > 1)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[leaf], expected)


def one_step(kind: str, rng: random.Random, me: str, workers: list[str]) -> None:
    """One operation of ``kind`` from worker ``me``, its result checked."""
    others = [w for w in workers if w != me]
    x = torch.randn(4, 4)
    leaf = torch.randn(4, 4, requires_grad=True)
    a, b = rng.sample(others, 2)
    if kind == "sync":
        assert torch.equal(rpc.rpc_sync(rng.choice(workers), torch.add, args=(x, 1.0)), x + 1.0)
    elif kind == "async":
        futures = [rpc.rpc_async(rng.choice(workers), torch.mul, args=(x, i)) for i in range(8)]
        for i, value in enumerate(torch.futures.wait_all(futures)):
            assert torch.equal(value, x * i)
    elif kind == "remote+fork":
        rref = rpc.remote(a, torch.mul, args=(x, 3.0))
        torch.testing.assert_close(rpc.rpc_sync(b, rref_sum, args=(rref,)), (x * 3.0).sum())
    elif kind == "error":
        try:
            rpc.rpc_sync(a, fail, args=("expected",))
            raise AssertionError("no error")
        except ValueError as exc:
            assert "expected" in str(exc)
    elif kind == "two hops":
        _backward(lambda t: rpc.rpc_sync(b, stage, args=(rpc.rpc_sync(a, stage, args=(t, 0.5)), 2.0)).pow(2).sum(),
                  lambda t: stage(stage(t, 0.5), 2.0).pow(2).sum(), leaf)
    elif kind == "nested":
        _backward(lambda t: rpc.rpc_sync(a, nested_stage, args=(t, 0.5, b)).sum(),
                  lambda t: stage(stage(t, 0.5), 1.5).sum(), leaf)
    elif kind == "async_execution":
        _backward(lambda t: rpc.rpc_sync(a, async_stage, args=(t, 0.7, b)).sum(),
                  lambda t: (stage(t, 0.7) * 2.0).sum(), leaf)
    elif kind == "fan-out":
        def forward(t):
            fa, fb = rpc.rpc_async(a, stage, args=(t, 0.2)), rpc.rpc_async(b, stage, args=(t, 0.9))
            return (fa.wait() * fb.wait()).sum()
        _backward(forward, lambda t: (stage(t, 0.2) * stage(t, 0.9)).sum(), leaf)
    elif kind == "retain_graph":
        _backward(lambda t: rpc.rpc_sync(a, stage, args=(t, 0.3)).sum(), lambda t: stage(t, 0.3).sum(), leaf, 2)


KINDS = ["sync", "async", "remote+fork", "error", "two hops", "nested", "async_execution", "fan-out", "retain_graph"]
NAMED_DEAD = "failed, naming the dead worker"


def names(text: str, worker: str) -> bool:
    """Whether an error's text names ``worker`` (as a WorkerInfo or as a transport peer)."""
    return f"name={worker}" in text or f"'{worker[6:]}'" in text


def drive(me: str, workers: list[str], thread: int, seed: int, stop: Callable[[], bool],
          counts: collections.Counter, unexpected: list, dead: str | None) -> None:
    """Random operations until ``stop()``: each completed one counted by kind, each error
    naming ``dead`` counted, any other error kept as text in ``unexpected`` (an exception
    keeps its frames, and they the call's RRefs)."""
    rng = random.Random(seed * 1000 + thread)
    while not stop():
        kind = rng.choice(KINDS)
        try:
            one_step(kind, rng, me, workers)
            counts[kind] += 1
        except Exception as exc:  # noqa: BLE001 - expected only after the kill, naming the dead
            if dead is not None and names(str(exc), dead):
                counts[NAMED_DEAD] += 1
            else:
                unexpected.append((kind, traceback.format_exc()))


def drive_here(seconds: float, threads: int, seed: int, workers: list[str], dead: str | None) -> tuple:
    """``drive`` on this worker for ``seconds`` from ``threads`` threads: the counts, the
    unexpected errors, and the threads still running 60 s after the end. Errors naming
    ``dead`` are expected only once this worker has lost it."""
    me = rpc.get_worker_info().name
    counts: collections.Counter = collections.Counter()
    unexpected: list = []
    deadline = time.monotonic() + seconds
    running = [threading.Thread(target=drive, args=(me, workers, t, seed, lambda: time.monotonic() > deadline,
                                                    counts, unexpected, dead), daemon=True)
               for t in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join(seconds + 60)
    if counts[NAMED_DEAD] and not rpc.api._current().endpoint.is_lost(dead[6:]):
        unexpected.append(("any", f"{counts[NAMED_DEAD]} error(s) named {dead}, which is not lost here"))
    return dict(counts), unexpected, [t.name for t in running if t.is_alive()]


_stop = threading.Event()


def stop() -> None:
    _stop.set()


def serve(rank: int, world_size: int, init_method: str, options: dict) -> None:
    """A worker that keeps serving when a peer dies, until told to stop."""
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, **options))
    _stop.wait()
    rpc.shutdown(graceful=False)
