"""Gradients forwarded past the caller of backward (engine.py, "Forwarding"): in a pipeline
the caller drives, each stage sends the gradient of its input straight to the stage before,
and the passes report to the caller. Gradients against local autograd on real worker
processes, forwards counted where they are made; the caller's bookkeeping of reports and the
checks of what peers send, in-process."""

from __future__ import annotations

import pytest
import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc
from zmqautograd.rpc.errors import RpcError

from tests import autograd_functions as af
from tests.rpc_harness import Group

pytestmark = pytest.mark.timeout(120)
WIDTH = 8
NAMES = ["f1", "f2", "f3"]
WORKERS = ["worker1", "worker2", "worker3"]


@pytest.fixture(scope="module")
def group():
    g = Group(world_size=4, num_worker_threads=4, rpc_timeout=30)
    for i, (name, worker) in enumerate(zip(NAMES, WORKERS)):
        rpc.rpc_sync(worker, af.make_stage, args=(name, i, WIDTH))
    yield g
    g.shutdown()


@pytest.fixture
def forwards(group):
    """Forwards made on each worker during the test: call it at the end (node counts start
    from zero too)."""
    for worker in WORKERS:
        rpc.rpc_sync(worker, af.count_forwards)
        rpc.rpc_sync(worker, af.take_counts)
    return lambda: [rpc.rpc_sync(worker, af.take_forwards) for worker in WORKERS]


def _local_stages() -> list:
    stages = []
    for i in range(len(NAMES)):
        torch.manual_seed(i)  # as af.make_stage
        stages.append(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()))
    return stages


def _stage_grads_match(context_id: int, local: list, factor: float = 1.0) -> None:
    for name, worker, module in zip(NAMES, WORKERS, local):
        grads = rpc.rpc_sync(worker, af.stage_grads, args=(name, context_id))
        for got, param in zip(grads, module.parameters()):
            torch.testing.assert_close(got, param.grad * factor)


def test_a_pipeline_the_caller_drives_forwards_its_gradients_past_the_caller(group, forwards):
    """Stage i on worker i+1, each called by this worker with the answer of the one before:
    worker3 sends the gradient of its input to worker2, worker2 to worker1 (never through
    here), in each of two passes over one context; every stage node runs once per pass."""
    local = _local_stages()
    x = torch.randn(5, WIDTH, requires_grad=True)
    torch.nn.Sequential(*local)(x).pow(2).sum().backward()
    with dist_autograd.context() as context_id:
        h = x
        for name, worker in zip(NAMES, WORKERS):
            h = rpc.rpc_sync(worker, af.run_stage, args=(name, h))  # (the received tensors are gone)
        loss = h.pow(2).sum()
        for _ in range(2):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], x.grad * 2)
        _stage_grads_match(context_id, local, 2.0)
    counts = {}
    for worker in WORKERS:
        counts.update(rpc.rpc_sync(worker, af.take_counts))
    assert counts == {f"{name}.{io}": 2 for name in NAMES for io in ("in", "out")}
    assert forwards() == [0, 2, 2]


def test_a_received_tensor_with_a_hook_keeps_its_gradient_on_the_caller(group, forwards):
    """The hook on worker1's answer must run here, on its whole gradient: worker2 sends that
    gradient here as usual; worker3 still forwards to worker2."""
    local = _local_stages()
    x = torch.randn(5, WIDTH, requires_grad=True)
    first = local[0](x)
    first.register_hook(lambda grad: grad * 3)
    local[2](local[1](first)).sum().backward()
    with dist_autograd.context() as context_id:
        h1 = rpc.rpc_sync("worker1", af.run_stage, args=(NAMES[0], x))
        h1.register_hook(lambda grad: grad * 3)
        h2 = rpc.rpc_sync("worker2", af.run_stage, args=(NAMES[1], h1))
        del h1  # its hook stays on its node
        h3 = rpc.rpc_sync("worker3", af.run_stage, args=(NAMES[2], h2))
        dist_autograd.backward(context_id, [h3.sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], x.grad)
        _stage_grads_match(context_id, local)
    assert forwards() == [0, 0, 1]


def test_a_gradient_the_caller_would_convert_goes_through_the_caller(group, forwards):
    """worker2's gradient for the tensor it got from worker1 (through here) is sparse (a
    sparse embedding of it): it goes the usual way, through this worker's engine."""
    weight = torch.randn(4, 3, requires_grad=True)
    local = torch.nn.functional.embedding(torch.tensor([0, 2]), weight * 2, sparse=True).sin().sum()
    local.backward()
    with dist_autograd.context() as context_id:
        doubled = rpc.rpc_sync("worker1", torch.mul, args=(weight, 2))
        rows = rpc.rpc_sync("worker2", af.sparse_rows, args=(doubled,))
        dist_autograd.backward(context_id, [rows.sin().sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[weight], weight.grad)
    assert forwards() == [0, 0, 0]


def test_a_forwarded_request_that_joins_a_running_pass(group, forwards):
    """worker1 gets the gradients of its second answer from here and those of its first,
    which went on to worker2, from worker2: whichever comes second joins the pass the first
    started (and is reported at once)."""
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    expected = ((x * 2).sin() * 3).sin().sum() + (y * 5).sin().sum()
    expected.backward()
    with dist_autograd.context() as context_id:
        h = rpc.rpc_sync("worker1", af.scale, args=(x, 2.0, "a"))
        k = rpc.rpc_sync("worker1", af.scale, args=(y, 5.0, "b"))
        z = rpc.rpc_sync("worker2", af.scale, args=(h, 3.0, "c"))
        del h
        dist_autograd.backward(context_id, [z.sum() + k.sum()])
        grads = dist_autograd.get_gradients(context_id)
        torch.testing.assert_close(grads[x], x.grad)
        torch.testing.assert_close(grads[y], y.grad)
    assert rpc.rpc_sync("worker1", af.take_counts) == {"a": 1, "b": 1}
    assert rpc.rpc_sync("worker2", af.take_counts) == {"c": 1}
    assert forwards() == [0, 1, 0]


def test_an_error_at_the_end_of_a_forwarded_chain_fails_the_pass_and_the_workers_go_on(group, forwards):
    x = torch.randn(5, WIDTH, requires_grad=True)
    for stage, error in ((af.failing_stage, "Error on Node 0: .*Error on Node 1: .*this stage fails on purpose"),
                         (af.run_stage, None)):
        with dist_autograd.context() as context_id:
            h = rpc.rpc_sync("worker1", stage, args=(NAMES[0], x))
            for name, worker in zip(NAMES[1:], WORKERS[1:]):
                h = rpc.rpc_sync(worker, af.run_stage, args=(name, h))
            if error is None:
                dist_autograd.backward(context_id, [h.sum()])
                assert dist_autograd.get_gradients(context_id)[x].shape == x.shape
            else:
                with pytest.raises(RuntimeError, match=error):
                    dist_autograd.backward(context_id, [h.sum()])
    assert forwards() == [0, 2, 2]


# ------------------------------------------------------------------ in-process checks


def _routed_pass(idle_timeout: float | None = None):
    """A pass on the worker that calls backward (worker 0) over one send function (message 7,
    whose tensor went to worker 3) of a tensor received from worker 2 (its message 5, token
    55): the route this worker publishes."""
    from zmqautograd.autograd import engine, functions, routes
    from zmqautograd.autograd import plan as planning
    from zmqautograd.autograd.context import DistAutogradContext

    context = DistAutogradContext(1)
    context.add_known_worker(2)
    context.add_known_worker(3)
    received = torch.randn(3, requires_grad=True)
    recv, _ = functions.attach_recv_node([received], 1, 5, 2, token=55)
    send, keep_alive = functions.make_send_node([received])
    context.add_send_function(7, send, keep_alive, to=3, token=77)
    plan = planning.Plan({7: [(send, 0)]})
    run = engine.Pass(context, plan, 9, False, 0, lambda *args: None, idle_timeout=idle_timeout)
    run.published = routes.routes_for(plan, 0)
    return run, (received, recv, keep_alive)


def test_the_caller_counts_reports_in_any_order():
    run, kept = _routed_pass()
    assert run.published == [[7, 2, 5, False, [0], 1, 55]]
    assert run.take_report([[101, []]], 2) is None  # a report that overtook the announcement of its ticket
    run.expect(100, 3)  # a request to worker 3, which forwards to worker 2 under ticket 101
    assert not run.done.done()
    assert run.take_report([[100, [[101, 7, 2]]]], 3) is None  # worker 3's: it forwarded to 2
    assert run.done.done() and run.done.value() is None


def test_a_delegated_report_settles_each_ticket_of_the_chain():
    run, kept = _routed_pass()
    run.expect(100, 3)
    # Worker 3 forwarded to worker 2 and handed its report on; worker 2 reports both.
    assert run.take_report([[100, [[101, 7, 2]]], [101, []]], 2) is None
    assert run.done.done() and run.done.value() is None


@pytest.mark.parametrize("report, sender, refused", [
    ([[100, []]], 2, ("the report of ticket 100 of backward pass 9, which went to worker 3", 2)),
    ([[100, [[101, 7, 4]]], [101, []]], 2, ("the report of ticket 101 of backward pass 9, which went to worker 4", 2)),
])
def test_a_report_of_another_workers_ticket_is_refused_and_the_pass_waits_on(report, sender, refused):
    run, kept = _routed_pass()
    run.expect(100, 3)
    assert run.take_report(report, sender) == refused
    assert not run.done.done()  # the real report is still due


def test_a_forward_claimed_by_a_worker_the_tensors_did_not_go_to_is_refused():
    run, kept = _routed_pass()
    run.expect(100, 2)  # (a ticket of worker 2's, which did not get send function 7's tensors)
    what, whose = run.take_report([[100, [[101, 7, 2]]]], 2)
    assert "whose tensors went to worker 3, not to worker 2" in what and whose == 2
    assert not run.done.done()


def test_a_second_report_of_a_ticket_is_refused():
    run, kept = _routed_pass()
    run.expect(100, 3)
    run.expect(200, 3)
    assert run.take_report([[100, []]], 3) is None
    assert run.take_report([[100, []]], 3) == ("a second report of ticket 100 of backward pass 9", 3)
    assert not run.done.done()  # ticket 200 is still due


def test_a_report_that_came_early_under_another_name_is_refused_when_announced():
    run, kept = _routed_pass()
    run.expect(100, 3)
    assert run.take_report([[101, []]], 4) is None  # early: whose it is, the announcement says
    what, whose = run.take_report([[100, [[101, 7, 2]]]], 3)
    assert "which went to worker 2" in what and whose == 4  # (worker 4's claim, not worker 3's)
    assert not run.done.done()  # worker 2's own report is still due
    assert run.take_report([[101, []]], 2) is None
    assert run.done.done()


@pytest.mark.parametrize("announcement, error", [
    ([[101, 8, 2]], "did not route"),
    ([[101, 7]], "malformed"),
    ([["101", 7, 2]], "malformed"),
    ({101: 7}, "malformed"),
    ([[101, 7, 2], [102, 7, 2]], "delivered twice"),
])
def test_announcements_the_caller_cannot_have_are_errors(announcement, error):
    run, kept = _routed_pass()
    with pytest.raises(RpcError, match=error):
        run.announce(announcement)


def test_losing_a_worker_of_the_context_fails_a_pass_that_waits_for_reports():
    run, kept = _routed_pass()
    run.expect(100, 3)
    run.peer_lost(5, RuntimeError("gone"))  # took no part
    assert not run.done.done()
    run.peer_lost(2, RuntimeError("gone"))  # a worker of the context: it may have been forwarded to
    assert run.done.done()
    with pytest.raises(RuntimeError, match="Error on Node 0: worker 2, which took part in this pass, is lost: gone"):
        run.done.value()


def test_a_worker_of_the_context_lost_before_the_pass_fails_it_at_its_first_request():
    from types import SimpleNamespace

    from zmqautograd.autograd import api

    run, kept = _routed_pass()
    run.expect(100, 3)
    lost: set = set()
    agent = SimpleNamespace(is_lost=lambda worker: str(worker) in lost)
    api._fail_if_lost(agent, run)  # nobody lost
    assert not run.done.done()
    lost.add("2")
    api._fail_if_lost(agent, run)
    assert run.done.done()
    with pytest.raises(RuntimeError, match="worker 2, which took part in this pass, is lost: lost before the pass"):
        run.done.value()


def test_a_report_that_never_comes_fails_the_pass_after_its_idle_timeout():
    run, kept = _routed_pass(idle_timeout=0.2)
    run.expect(100, 3)
    run.watch_idle()
    with pytest.raises(RuntimeError, match="no report came for the gradients sent \\(or forwarded\\) to worker\\(s\\) 3"):
        run.done.wait()


def test_no_routes_where_the_engine_here_would_run_hooks_or_the_profiler_records():
    from zmqautograd.autograd import routes

    run, (received, recv, keep_alive) = _routed_pass()
    received.register_hook(lambda grad: grad)
    assert routes.routes_for(run.plan, 0) is None
    run, kept = _routed_pass()
    with torch.autograd.profiler.profile():
        assert routes.routes_for(run.plan, 0) is None


@pytest.mark.parametrize("routes", [
    [[7, 2, 5, False, [1], 1, None]],  # a slot past the recv function's width
    [[7, 2, 5, 0, [0], 1, None]],
    [[7, 2, 5, False, [0], 1]],
    [[7.0, 2, 5, False, [0], 1, None]],
    [[7, 2, 5, False, [0], 1, "55"]],
    [7],
    "routes",
])
def test_malformed_routes_are_errors(routes):
    from zmqautograd.autograd import routes

    with pytest.raises(RpcError, match="malformed gradient routes"):
        routes.parse_routes(routes)


def test_forwarded_gradients_are_summed_per_slot_or_left_to_the_usual_way():
    from zmqautograd.autograd import routes

    route = routes.parse_routes([[7, 2, 5, False, [1, 1, -1], 2, None]])[7]
    metadata = tuple((torch.Size([3]), torch.float32, torch.device("cpu"), torch.strided) for _ in range(3))
    ones = torch.ones(3)
    assert routes.forwarded_gradients(route, [ones, ones, ones], metadata)[0] is None
    assert torch.equal(routes.forwarded_gradients(route, [ones, ones, ones], metadata)[1], torch.full((3,), 2.0))
    for odd in (ones.double(), torch.ones(2), ones.to_sparse()):
        assert routes.forwarded_gradients(route, [odd, None, None], metadata) is None
    with pytest.raises(RpcError, match="applied to 2"):
        routes.forwarded_gradients(route, [ones, ones], metadata[:2])


@pytest.mark.parametrize("report, error", [
    ("report", "malformed report"),
    ([1, 9, [], None], "malformed report"),
    ([1, 9, [], None, 5], "malformed error report"),
    ([1, 9, {}, None, None], "malformed reports"),
    ([1, 9, [["100", []]], None, None], "malformed report"),
    ([1, 9, [], [1, 2], None], "malformed riding gradients"),
])
def test_malformed_reports_are_errors(report, error):
    from zmqautograd.autograd import api

    run, kept = _routed_pass()
    with pytest.raises(RpcError, match=error):
        api._settle_report(_agent_with_refusals(), run, report, None, 2)


def _agent_with_refusals():
    from types import SimpleNamespace

    from zmqautograd.rpc.refusals import Refusals

    return SimpleNamespace(hooks=SimpleNamespace(refusals=Refusals("worker 0")))


def test_an_error_report_fails_the_pass_only_from_a_worker_a_ticket_went_to():
    from zmqautograd.autograd import api

    run, kept = _routed_pass()
    run.expect(100, 3)
    agent = _agent_with_refusals()
    # Worker 2 takes part in the context, but no ticket went to it; then another pass's report.
    api._settle_report(agent, run, [1, 9, [], None, "Error on Node 2: it broke"], None, 2)
    api._settle_report(agent, run, [1, 8, [[100, []]], None, "Error on Node 3: elsewhere"], None, 3)
    api._settle_report(agent, run, [5, 9, [[100, []]], None, "Error on Node 3: elsewhere"], None, 3)
    assert agent.hooks.refusals.count(2) == 1 and agent.hooks.refusals.count(3) == 2
    assert not run.done.done()
    with pytest.raises(RpcError, match="Error on Node 3: it broke"):
        api._settle_report(agent, run, [1, 9, [[100, []]], None, "Error on Node 3: it broke"], None, 3)


def test_a_report_from_a_worker_outside_the_context_is_refused_and_fails_nothing():
    from zmqautograd.autograd import api

    run, kept = _routed_pass()
    run.expect(100, 3)
    agent = _agent_with_refusals()
    api._settle_report(agent, run, [1, 9, [[100, []]], None, "Error on Node 5: forged"], None, 5)
    assert agent.hooks.refusals.count(5) == 1
    assert not run.done.done()


def test_a_second_pass_over_a_freed_graph_fails_through_the_reports(group):
    """retain_graph=False frees the stages' saved tensors: a second pass in the context fails
    on the last stage (the first one it reaches), and the error comes back in a report."""
    x = torch.randn(5, WIDTH, requires_grad=True)
    with dist_autograd.context() as context_id:
        h = x
        for name, worker in zip(NAMES, WORKERS):
            h = rpc.rpc_sync(worker, af.run_stage, args=(name, h))
        loss = h.sum()
        dist_autograd.backward(context_id, [loss])
        with pytest.raises(RuntimeError, match="Error on Node 0: .*Error on Node 3: .*second time"):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
