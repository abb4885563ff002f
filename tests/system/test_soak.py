"""A bounded soak: 4 workers, a random mix of RPCs, remotes (with forks to third workers) and
distributed backward passes for about 40 seconds, while every retryable control message fails
a quarter of the time and deletions and cleanups are delayed. Every result is checked against
a local computation; at the end nothing is left anywhere: no context, no owned RRef, no pending
call, no extra thread, no pile of timers. Prints the figures (README: reliability)."""

from __future__ import annotations

import random
import time

import pytest
import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc

from tests import soak_functions as sf
from tests.rpc_harness import Group

pytestmark = pytest.mark.timeout(240)

RETRYABLE = ["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE", "CLEANUP_AUTOGRAD_CONTEXT_REQ"]
DURATION = 40.0


def _settled(workers, deadline: float) -> list[dict]:
    """Every worker's state once its deletions and cleanups have gone through (they are
    asynchronous and retried): poll until all counts are zero or the deadline passes."""
    while True:
        states = [rpc.rpc_sync(w, sf.state) for w in workers]
        if all(s["contexts"] == 0 and s["owned_rrefs"] == 0 for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.2)  # polls other processes' bookkeeping: nothing to wait on


def test_soak_random_mix_under_faults():
    group = Group(
        world_size=4, num_worker_threads=4, rpc_timeout=30,
        messages_to_fail=RETRYABLE, num_fail_sends=3, fail_fraction=0.25, fault_seed=1234,
        messages_to_delay={"RREF_USER_DELETE": 0.05, "CLEANUP_AUTOGRAD_CONTEXT_REQ": 0.05},
        max_retries=12, retry_delay=0.02, retry_backoff=1.5,
    )
    workers = group.names
    others = workers[1:]
    rng = random.Random(7)
    counts = {"rpc_sync": 0, "rpc_async": 0, "remote+fork": 0, "backward": 0}
    try:
        before = [rpc.rpc_sync(w, sf.state) for w in workers]
        started = time.monotonic()
        while time.monotonic() - started < DURATION:
            kind = rng.choice(list(counts))
            x = torch.randn(4, 4)
            if kind == "rpc_sync":
                to = rng.choice(workers)
                assert torch.equal(rpc.rpc_sync(to, torch.add, args=(x, 1.0)), x + 1.0)
            elif kind == "rpc_async":
                futures = [rpc.rpc_async(rng.choice(workers), torch.mul, args=(x, i)) for i in range(8)]
                for i, value in enumerate(torch.futures.wait_all(futures)):
                    assert torch.equal(value, x * i)
            elif kind == "remote+fork":
                owner, reader = rng.sample(others, 2)
                rref = rpc.remote(owner, torch.mul, args=(x, 3.0))
                torch.testing.assert_close(rpc.rpc_sync(reader, sf.rref_sum, args=(rref,)), (x * 3.0).sum())
                torch.testing.assert_close(rref.to_here(), x * 3.0)
                del rref
            else:
                a, b = rng.sample(others, 2)
                leaf = torch.randn(4, 4, requires_grad=True)
                expected = sf.stage(sf.stage(leaf, 0.5), 2.0).pow(2).sum()
                (local_grad,) = torch.autograd.grad(expected, [leaf])
                with dist_autograd.context() as context_id:
                    h = rpc.rpc_sync(a, sf.stage, args=(leaf, 0.5))
                    h = rpc.rpc_sync(b, sf.stage, args=(h, 2.0))
                    loss = h.pow(2).sum()
                    dist_autograd.backward(context_id, [loss])
                    torch.testing.assert_close(dist_autograd.get_gradients(context_id)[leaf], local_grad)
            counts[kind] += 1
        elapsed = time.monotonic() - started
        after = _settled(workers, time.monotonic() + 60)
        faults = {k: sum(s["faults"].get(k, 0) for s in after) for k in ("failed", "delayed")}
        print(f"\nsoak: {elapsed:.0f} s, {counts}, faults injected {faults}")
        for name, state in zip(workers, after):
            assert state["contexts"] == 0, f"{name}: autograd contexts left: {state}"
            assert state["owned_rrefs"] == 0, f"{name}: owned RRefs left: {state}"
            assert state["pending_calls"] <= 1, f"{name}: calls left pending: {state}"  # <= 1: this state() call
            assert state["timers"] < 500, f"{name}: timers left in the heap: {state}"
        for name, b, a in zip(workers, before, after):
            assert a["threads"] <= b["threads"] + 8, f"{name}: threads grew from {b['threads']} to {a['threads']}"
        assert faults["failed"] > 50 and faults["delayed"] > 50, faults
        assert all(counts.values()), counts
    finally:
        group.shutdown()
