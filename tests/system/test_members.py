"""A member can only affect what it takes part in (docs/security.md): members of the group,
with their own valid credentials, send what a compromised worker would, speaking the wire
format through the project's own codec and the protocol's own functions (the attacks are in
tests/security_functions.py), with the ids they guessed or, worse, were told. Each is
refused (counted, logged once per peer, an error the sender can read where it waits for an
answer), and the victim's own work finishes with the values local autograd gives.

The group: this process is the driver (worker0), worker1 its partner, worker2 and worker3
members that take no part in the driver's work and attack it. The last test checks that no
worker crashed, hung or leaked after all of it."""

from __future__ import annotations

import threading

import pytest
import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc

from tests import security_functions as sf
from tests.conftest import poll_until
from tests.rpc_harness import Group

pytestmark = pytest.mark.timeout(120)
VICTIMS = ("worker0", "worker1")


def _resources(name: str) -> dict:
    usage = sf.resources() if name == "worker0" else rpc.rpc_sync(name, sf.resources)
    usage["threads"] = sf.threads() if name == "worker0" else rpc.rpc_sync(name, sf.threads)
    return usage


def _refusals(name: str, peer: int | None = None) -> int:
    return sf.refusals(peer) if name == "worker0" else rpc.rpc_sync(name, sf.refusals, args=(peer,))


def _attack(worker: str, function, *args):
    """``function(*args)`` on ``worker``, asked from a thread of its own: a call from this
    thread would carry the autograd context current here, and make ``worker`` take part."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(rpc.rpc_sync(worker, function, args=args)))
    thread.start()
    thread.join(60)
    assert result, f"{function.__name__} on {worker} did not come back"
    return result[0]


def _step(t: torch.Tensor) -> torch.Tensor:
    """One dist autograd step over worker1 (the driver's legitimate work): d(sum(3 t))/dt."""
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", sf.scale, args=(t,)).sum()
        dist_autograd.backward(context_id, [loss])
        return dist_autograd.get_gradients(context_id)[t]


@pytest.fixture(scope="module")
def group():
    g = Group(world_size=4, num_worker_threads=4, rpc_timeout=30)
    t = torch.ones(2, requires_grad=True)
    for _ in range(3):  # warm: pools, rings and plans as a training loop has them
        assert torch.equal(_step(t), torch.full((2,), 3.0))
    g.baseline = {name: _resources(name) for name in VICTIMS}
    yield g
    g.shutdown()


def test_gradients_from_a_member_that_took_no_part_are_refused(group):
    """worker2 sends the driver gradients of 1000 for the send functions of its context
    (their ids and the context's id told to it, so that only who it is stops it): as calls,
    one-way, and one-way as if the driver had routed them through it (a guessed token).
    Each call comes back refused; the driver's backward pass then gives 3, not 1003."""
    t = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", sf.scale, args=(t,)).sum()
        sends = sorted(dist_autograd._retrieve_context(context_id)._send_functions())
        guesses = sends + [sends[0] + 1, sends[0] + 2]
        before = _refusals("worker0", 2)
        outcomes = _attack("worker2", sf.send_gradients, 0, context_id, guesses, 2 << 48, 1000.0, 12345)
        assert len(outcomes) == len(guesses)
        assert all(o.startswith("NotEntitledError") and "refused gradients" in o for o in outcomes), outcomes
        poll_until(lambda: _refusals("worker0", 2) >= before + 3 * len(guesses), 30, "every forgery refused")
        dist_autograd.backward(context_id, [loss])
        assert torch.equal(dist_autograd.get_gradients(context_id)[t], torch.full((2,), 3.0))
    assert torch.equal(_step(t), torch.full((2,), 3.0))


def test_a_member_cannot_release_a_context_it_never_took_part_in(group):
    """worker2 releases the driver's context (its id told to it) on worker1 and on the
    driver, by a cleanup request and riding on a call, once before worker1 ever saw the
    context and once after: each request is refused (or, before, keeps out only worker2's
    own messages), and the driver's backward pass finds the context everywhere."""
    t = torch.ones(2, requires_grad=True)
    with dist_autograd.context() as context_id:
        early = _attack("worker2", sf.release_contexts, 1, [context_id])
        assert early == ["accepted"]  # not here yet: nothing to refuse, and nothing kept out
        loss = rpc.rpc_sync("worker1", sf.scale, args=(t,)).sum()
        before = {name: _refusals(name, 2) for name in VICTIMS}
        for rank in (0, 1):
            (outcome,) = _attack("worker2", sf.release_contexts, rank, [context_id])
            assert outcome.startswith("NotEntitledError") and "refused the release" in outcome, outcome
        for name in VICTIMS:  # the cleanup request and the one riding on a call
            poll_until(lambda n=name: _refusals(n, 2) >= before[n] + 2, 30, f"both releases refused on {name}")
        assert dist_autograd._is_valid_context(context_id)
        dist_autograd.backward(context_id, [loss])
        assert torch.equal(dist_autograd.get_gradients(context_id)[t], torch.full((2,), 3.0))


def test_a_member_cannot_delete_or_take_another_workers_rref_forks(group):
    """The driver's RRefs on worker1: worker2 deletes the forks of the driver's next
    remote() in advance (ids count up: it guesses them) and its existing fork (told),
    registers forks that are not its own (the driver's; one it made up), and sends the owner
    the driver's fork as if the owner or worker2 had forked it. Every one is refused; the
    driver's remote() values are there when it asks."""
    probe = rpc.remote("worker1", torch.ones, args=(2,))
    assert torch.equal(probe.to_here(), torch.ones(2))
    creator, counter = probe.fork_id
    ahead = [[[creator, counter + 1 + 2 * i], [creator, counter + 2 + 2 * i]] for i in range(4)]
    for rref_id, fork_id in ahead:
        outcome = rpc.rpc_sync("worker2", sf.rref_protocol, args=(1, "_delete_fork", [rref_id, fork_id]))
        assert outcome.startswith("NotEntitledError") and "which does not exist" in outcome, outcome
    held = [list(probe.rref_id), list(probe.fork_id)]
    for function, why in (("_delete_fork", "which worker 0 holds"), ("_fork_request", "did not fork to it")):
        outcome = rpc.rpc_sync("worker2", sf.rref_protocol, args=(1, function, held))
        assert outcome.startswith("NotEntitledError") and why in outcome, outcome
    # A fork worker2 made up, of a value it holds nothing of, and of one whose holder did not fork it.
    outcome = rpc.rpc_sync("worker2", sf.rref_protocol, args=(1, "_fork_request", [list(probe.rref_id), [2, 7]]))
    assert outcome.startswith("NotEntitledError") and "which no holder of it made" in outcome, outcome
    # The driver's fork, sent to its owner in a call as if the owner had forked it (which
    # would make the owner drop it as its own) or as worker2's own: refused as it is decoded.
    for parent in (1, 2):
        forged = [list(probe.rref_id), 1, list(probe.fork_id), parent, "Tensor"]
        outcome = rpc.rpc_sync("worker2", sf.call_with_forged_rref, args=(1, forged))
        assert "NotEntitledError" in outcome and ("says worker 1 forked" in outcome or "holds no fork of" in outcome), \
            outcome
    # The driver's own fork, sent to the driver as worker2's (or as data of _serialize): a
    # second RRef under it would delete the driver's fork when it went.
    for forged in ([list(probe.rref_id), 1, list(probe.fork_id), 2, "Tensor"],
                   [list(probe.rref_id), 1, list(probe.fork_id), 0, "Tensor", True]):
        outcome = rpc.rpc_sync("worker2", sf.call_with_forged_rref, args=(0, forged))
        assert "NotEntitledError" in outcome and ("did not make" in outcome or "which an RRef here holds" in outcome), \
            outcome
    rrefs = [rpc.remote("worker1", torch.add, args=(torch.ones(2), i)) for i in range(4)]
    assert [r.to_here().tolist() for r in rrefs] == [[1.0 + i] * 2 for i in range(4)]
    assert torch.equal(probe.to_here(), torch.ones(2))
    assert _refusals("worker1", 2) >= len(ahead) + 5 and _refusals("worker0", 2) >= 2


def test_a_member_cannot_fetch_or_run_a_backward_pass_from_another_workers_rref(group):
    """worker2 names the driver's RRef on worker1 (its id told, a fork id guessed): fetching
    its value and running a local backward pass from it (which would write the gradients of
    the driver's tensors there) are refused; the driver's own fetch works."""
    x = torch.ones(2, requires_grad=True)
    rref = rpc.remote("worker1", sf.scale, args=(x,))
    assert torch.equal(rref.to_here(), torch.full((2,), 3.0))
    rref_id, fork_id = list(rref.rref_id), list(rref.fork_id)
    for function, args in (("_fetch", [rref_id, [2, fork_id[1]]]), ("_fetch", [rref_id]),
                           ("_backward_on_owner", [rref_id, -1, False, [2, 0]])):
        outcome = rpc.rpc_sync("worker2", sf.rref_protocol, args=(1, function, args))
        assert outcome.startswith("NotEntitledError") and "which it holds no fork of" in outcome, outcome
    assert torch.equal(rref.to_here(), torch.full((2,), 3.0))
    # A fork the driver gives worker2 is worker2's to use.
    assert torch.equal(rpc.rpc_sync("worker2", sf.value_of, args=(rref,)), torch.full((2,), 3.0))


def test_reports_to_a_backward_pass_from_a_member_it_never_reached_are_refused(group):
    """A pipeline the driver relays (worker1, then worker2 on worker1's answer): its
    backward pass forwards the gradients from worker2 straight to worker1 (with the token
    the driver's route gives it) and waits for their reports at a sink, while worker1's part
    takes 0.3 s. worker3, which takes no part, floods the sink ids the driver may have
    opened with reports that would fail the pass or settle what it waits for: refused, and
    every pass gives local autograd's gradients."""
    from zmqautograd.rpc import api

    x = torch.randn(2, requires_grad=True)
    for _ in range(3):
        before = _refusals("worker0", 3)
        with dist_autograd.context() as context_id:
            h = rpc.rpc_sync("worker1", sf.slow_backward_scale, args=(x,))
            loss = rpc.rpc_sync("worker2", sf.scale, args=(h,)).sum()
            first = next(api._current()._ids)  # the driver's call ids: its sink's is one of the next
            _attack("worker3", sf.start_reporting, 0, first, 8, context_id)
            try:
                dist_autograd.backward(context_id, [loss])
            finally:
                # (A call of ours to worker3 under an id it forges could be answered by the
                # forgery: worker3 is that call's callee. The call that stops it takes an id past them.)
                while next(api._current()._ids) < first + 8:
                    pass
                sent = _attack("worker3", sf.stop_reporting)
            assert torch.equal(dist_autograd.get_gradients(context_id)[x], torch.full((2,), 9.0))
        assert sent > 0 and _refusals("worker0", 3) > before, (sent, before)


def test_after_every_attack_no_worker_crashed_hung_or_leaked(group):
    """Every worker answers, the driver's work gives the right values, and the victims'
    memory, threads and descriptors are where they were before the attacks."""
    t = torch.ones(2, requires_grad=True)
    for _ in range(3):
        assert torch.equal(_step(t), torch.full((2,), 3.0))
    for name in group.names:
        assert rpc.rpc_sync(name, torch.add, args=(1, 1)) == 2
    for name in VICTIMS:
        before, after = group.baseline[name], _resources(name)
        assert after["rss"] - before["rss"] < 64 << 20, (name, before, after)
        assert after["fds"] <= before["fds"] + 4, (name, before, after)
        assert after["threads"] <= before["threads"] + 4, (name, before, after)
