"""SIGKILL a worker mid-forward, mid-backward, during an RRef fetch, and while it owns
contexts on others: survivors raise within the detection bound (printed), release what the
dead worker left them, and keep serving."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc
import zmqautograd.rpc.rref_owner as rref_owner

from tests import kill_functions as kf
from tests.rpc_harness import free_port

pytestmark = pytest.mark.timeout(180)
# A killed process closes its connections at once, so survivors must notice within DETECTED
# seconds, long before the heartbeat bound. That bound (for silent peers) is set well above it
# so that a stalled CI machine does not declare a live worker lost mid-test.
PEER_TIMEOUT = 10.0
DETECTED = 5.0


OPTIONS = {"num_worker_threads": 4, "rpc_timeout": 30, "heartbeat_interval": 0.5, "peer_timeout": PEER_TIMEOUT}


class KillGroup:
    """Ranks 1..n-1 in processes that keep serving when peers die; rank 0 is this process."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.processes = [
            ctx.Process(target=kf.serve_until_stopped, args=(rank, world_size, init_method, OPTIONS), daemon=True)
            for rank in range(1, world_size)
        ]
        for process in self.processes:
            process.start()
        rpc.init_rpc("worker0", rank=0, world_size=world_size,
                     rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, **OPTIONS))

    def close(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.is_alive():
                try:
                    rpc.rpc_sync(f"worker{rank}", kf.stop, timeout=5)
                except RuntimeError:
                    pass
        rpc.shutdown(graceful=False)
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def group():
    g = KillGroup(8)
    yield g
    g.close()


def _kill(group, rank: int) -> float:
    os.kill(group.processes[rank - 1].pid, signal.SIGKILL)
    return time.monotonic()


def _raises_within(run, bound: float) -> tuple[threading.Thread, dict]:
    """Run ``run`` (which must raise) on a thread; ``outcome`` gets the error and its time."""
    outcome: dict = {}

    def target():
        try:
            run()
        except BaseException as exc:  # noqa: BLE001
            # Without its traceback, which would hold this frame and so ``outcome``: a cycle
            # that keeps what ``run`` refers to alive until the cyclic collector runs.
            outcome["error"] = exc.with_traceback(None)
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _assert_still_serving():
    for worker in ("worker0", "worker4"):  # worker4 is killed only by the last test
        assert torch.equal(rpc.rpc_sync(worker, torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))


def test_kill_mid_forward(group):
    future = rpc.rpc_async("worker1", kf.slow_identity, args=(torch.ones(2), 30.0))
    assert rpc.rpc_sync("worker1", kf.in_slow_call)  # the call runs on worker1 (30 s)
    killed = _kill(group, 1)
    with pytest.raises(RuntimeError, match="worker1|'1'") as caught:
        future.wait()
    detected = time.monotonic() - killed
    print(f"\nkill mid-forward: the pending call failed {detected * 1000:.0f} ms after SIGKILL: {caught.value}")
    assert isinstance(caught.value, rpc.RpcError) or "lost" in str(caught.value)
    assert detected < DETECTED
    # A call to the dead worker is a future that fails, as torch's (it does not raise at the call).
    dead = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    with pytest.raises(RuntimeError, match="lost peer '1'"):
        dead.wait()
    _assert_still_serving()


def _killed_inside_backward(group, rank: int, forward, what: str) -> BaseException:
    """Run backward over the loss ``forward()`` makes (its pass reaches a slow node on
    ``rank``), kill ``rank`` inside that node, and return the error backward raised."""
    with dist_autograd.context() as context_id:
        loss = forward()
        thread, outcome = _raises_within(lambda: dist_autograd.backward(context_id, [loss]), 0)
        assert rpc.rpc_sync(f"worker{rank}", kf.in_slow_backward)  # the pass is inside the slow node
        killed = _kill(group, rank)
        thread.join(DETECTED + 10)
        assert not thread.is_alive(), f"backward still waits for a dead worker ({what})"
    detected = outcome["at"] - killed
    print(f"\nkill {what}: backward raised {detected * 1000:.0f} ms after SIGKILL: {outcome['error']}")
    assert detected < DETECTED
    _assert_still_serving()
    return outcome["error"]


def test_kill_mid_backward(group):
    x = torch.ones(3, requires_grad=True)
    error = _killed_inside_backward(
        group, 2, lambda: rpc.rpc_sync("worker2", kf.slow_backward_stage, args=(x, 30.0)).sum(), "mid-backward")
    assert "Error on Node 0" in str(error) and "2" in str(error)


def test_kill_mid_forwarded_backward(group):
    """A pipeline this worker drives: worker5's answer goes on to worker3, so worker3 sends
    the gradients for it straight to worker5 (engine.py, "Forwarding"), and hands its report
    on with them: nothing is due from worker3 itself. worker5 is killed inside its backward."""
    x = torch.ones(3, requires_grad=True)

    def forward():
        h = rpc.rpc_sync("worker5", kf.slow_backward_stage, args=(x, 30.0))
        return rpc.rpc_sync("worker3", torch.mul, args=(h, 3)).sum()  # (h is gone after)

    error = _killed_inside_backward(group, 5, forward, "mid-forwarded-backward")
    assert "Error on Node 0: worker5, which took part in this pass, is lost" in str(error)  # (a lost report, not a call)


def test_kill_during_rref_fetch(group):
    rref = rpc.remote("worker3", kf.slow_identity, args=(torch.ones(2), 30.0))
    thread, outcome = _raises_within(rref.to_here, 0)
    assert rpc.rpc_sync("worker3", kf.in_slow_call)  # the value is being made; to_here waits for it
    killed = _kill(group, 3)
    thread.join(DETECTED + 10)
    assert not thread.is_alive(), "to_here still waits for a dead owner"
    detected = outcome["at"] - killed
    print(f"\nkill during to_here: raised {detected * 1000:.0f} ms after SIGKILL: {outcome['error']}")
    assert detected < DETECTED
    with pytest.raises(RuntimeError, match="lost"):  # the RRef's owner is gone: clear on every use
        rref.to_here()
    _assert_still_serving()


def test_a_dead_workers_forks_and_the_contexts_it_passed_on_are_released_on_survivors(group):
    """worker6 holds forks of RRefs that worker4 owns (one forked by a user, this worker;
    one by the owner itself) and passes an autograd context of this worker on to worker4,
    where only worker6 could release it. worker6 is killed: worker4 drops its forks and
    that context, and an RRef this worker then fails to send to worker6 is not kept for it."""
    base = rpc.rpc_sync("worker4", rref_owner._owned_count)
    rref = rpc.remote("worker4", torch.ones, args=(2,))
    assert torch.equal(rref.to_here(), torch.ones(2))
    assert rpc.rpc_sync("worker6", kf.keep, args=(rref,))  # a user's fork, registered by worker6
    assert rpc.rpc_sync("worker4", kf.share_own_rref_with, args=("worker6",))  # registered by the owner
    assert rpc.rpc_sync("worker4", rref_owner._owned_count) == base + 2
    context = dist_autograd._new_context()
    rpc.rpc_sync("worker6", kf.add_on, args=("worker4", torch.ones(2, requires_grad=True)))
    # The checks below run outside it: a call made in it would make worker4 known to it here.
    dist_autograd.api._container().set_current(None)
    try:
        assert rpc.rpc_sync("worker4", kf.context_count) == 1
        killed = _kill(group, 6)
        # Released there while this worker still holds the context: only worker6 knew
        # worker4 in it, so only worker6 could have released it there.
        assert rpc.rpc_sync("worker4", kf.contexts_released, args=(DETECTED,)), "context passed on by worker6 left"
    finally:
        dist_autograd._release_context(context._context_id())
    print(f"\ncontext passed on by a dead worker released {(time.monotonic() - killed) * 1000:.0f} ms after its SIGKILL")
    with pytest.raises(RuntimeError, match="worker6|'6'"):
        rpc.rpc_sync("worker6", kf.keep, args=(rref,))  # (our fork for it is let go)
    assert rpc.rpc_sync("worker4", kf.owned_rrefs_back_to, args=(base + 1, DETECTED)), "worker6's forks left"
    del rref
    assert rpc.rpc_sync("worker4", kf.owned_rrefs_back_to, args=(base, DETECTED)), "our RRef kept for worker6"
    _assert_still_serving()


def test_a_value_whose_dead_creator_never_made_it_fails_its_fetch_and_goes(group):
    """worker7's remote() to worker4 is held back on worker7 while its RRef is forked to this
    worker, whose fork request makes worker4 expect the value. worker7 is killed before its
    call leaves: this worker's fetch fails naming worker7 instead of waiting for ever, and
    worker4 keeps nothing once this worker drops its RRef."""
    base = rpc.rpc_sync("worker4", rref_owner._owned_count)
    assert rpc.rpc_sync("worker7", kf.share_unmade_rref, args=("worker4", "worker0"))
    rref = kf._kept.pop()
    assert rpc.rpc_sync("worker4", kf.owned_rrefs_back_to, args=(base + 1, DETECTED)), "the fork never came"
    thread, outcome = _raises_within(rref.to_here, 0)
    killed = _kill(group, 7)
    thread.join(DETECTED + 10)
    assert not thread.is_alive(), "to_here still waits for a value whose creator is dead"
    print(f"\nfetch of a value its dead creator never made failed {(outcome['at'] - killed) * 1000:.0f} ms "
          f"after the SIGKILL: {outcome['error']}")
    assert "worker 7, was lost before its remote() call arrived" in str(outcome["error"])
    del rref, outcome, thread
    assert rpc.rpc_sync("worker4", kf.owned_rrefs_back_to, args=(base, DETECTED)), "the value never made stays"
    _assert_still_serving()


def test_contexts_of_a_dead_creator_are_released_on_survivors(group):
    """worker4 creates contexts that reach this worker, and is killed (runs last: the
    surviving workers are 0 and 4 by now)."""
    container = dist_autograd.api._container()
    assert rpc.rpc_sync("worker4", kf.make_contexts_on, args=(["worker0"], 5)) == 5
    assert container.count() == 5
    killed = _kill(group, 4)
    assert container.wait_released(None, DETECTED), f"{container.count()} context(s) left"
    released = time.monotonic() - killed
    print(f"\norphaned contexts released {released * 1000:.0f} ms after their creator's SIGKILL")
