"""A peer that floods a worker with calls: beyond ``max_queued_calls`` of its calls waiting
there, its calls are refused at once with ``PeerOverloadedError`` naming the worker (nothing
run, nothing kept), the calls that were queued complete, and another peer is still served."""

from __future__ import annotations

import threading

import pytest

from zmqautograd import rpc
from zmqautograd.rpc.errors import PeerOverloadedError

from ..rpc_harness import group_fixture

BOUND = 4
group = group_fixture(world_size=3, max_queued_calls=BOUND, num_worker_threads=2)

_gate = threading.Event()


def blocked(i: int) -> int:
    """Holds a pool thread of worker1 until the gate opens."""
    if not _gate.wait(60):
        raise TimeoutError("the gate never opened")
    return i


def open_gate() -> None:
    _gate.set()


def close_gate() -> None:
    _gate.clear()


def refused_calls() -> int:
    endpoint = rpc.api._get_current_rpc_agent().endpoint
    return sum(s.refused for s in endpoint.stats().values())


def call_worker1() -> int:
    return rpc.rpc_sync("worker1", pow, args=(2, 5))


@pytest.mark.timeout(120)
def test_a_flood_is_refused_beyond_the_bound_and_others_are_served(group):
    rpc.rpc_sync("worker1", close_gate)
    futures = [rpc.rpc_async("worker1", blocked, args=(i,)) for i in range(200)]
    try:
        # worker2 meanwhile: served in turn, though worker0's calls fill every thread.
        assert rpc.rpc_sync("worker2", call_worker1, timeout=60) == 32
    finally:
        rpc.rpc_sync("worker1", open_gate)
    done, refused = [], []
    for i, future in enumerate(futures):
        try:
            done.append((i, future.wait()))
        except PeerOverloadedError as exc:
            refused.append(exc)
    assert all(i == value for i, value in done)
    assert refused and len(done) >= BOUND, (len(done), len(refused))
    assert isinstance(refused[0], RuntimeError) and refused[0].peer == "1"
    assert "worker1 refused a call from worker0" in str(refused[0]) and f"{BOUND} calls" in str(refused[0])
    assert rpc.rpc_sync("worker1", refused_calls) == len(refused)
    # Still serving the flooder, once its calls stop piling up.
    assert rpc.rpc_sync("worker1", blocked, args=(7,)) == 7


@pytest.mark.timeout(60)
def test_replies_and_rref_bookkeeping_are_never_refused(group):
    """RRefs (remote() owner bookkeeping, forks, deletes) and dist autograd passes under a
    bound of 4 queued calls: many at once, all complete."""
    import torch

    import zmqautograd.autograd as dist_autograd

    rrefs = [rpc.remote("worker1", torch.ones, args=(2,)) for _ in range(3)]
    assert all(torch.equal(r.to_here(), torch.ones(2)) for r in rrefs)
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        total = sum(rpc.rpc_sync("worker1", torch.mul, args=(x, 2)).sum() for _ in range(3))
        dist_autograd.backward(context_id, [total])
        assert torch.equal(dist_autograd.get_gradients(context_id)[x], torch.full((3,), 6.0))
