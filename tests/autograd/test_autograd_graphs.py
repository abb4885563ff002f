"""Distributed gradients against local autograd on the same computation, with per-node run
counters proving that every node ran once per pass (FAST mode), on real worker processes."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc

from tests import autograd_functions as af
from tests.conftest import poll_until
from tests.rpc_harness import Group

pytestmark = pytest.mark.timeout(120)
WIDTH = 8
NAMES = ["s1", "s2", "s3"]


@pytest.fixture(scope="module")
def group():
    g = Group(world_size=4, num_worker_threads=4, rpc_timeout=30)
    yield g
    g.shutdown()


def _counts_everywhere(workers) -> dict:
    counts = {}
    for worker in workers:
        counts.update(rpc.rpc_sync(worker, af.take_counts))
    return counts


def test_three_stage_pipeline_mlp_matches_local_autograd(group):
    workers = ["worker1", "worker2", "worker3"]
    for i, (name, worker) in enumerate(zip(NAMES, workers)):
        rpc.rpc_sync(worker, af.make_stage, args=(name, i, WIDTH))
    local = []
    for i in range(len(NAMES)):
        torch.manual_seed(i)
        local.append(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()))
    x = torch.randn(5, WIDTH, requires_grad=True)
    expected = torch.nn.Sequential(*local)(x).pow(2).sum()
    expected.backward()
    af.take_counts()
    _counts_everywhere(workers)
    for passes in (1, 2):  # two passes in one context accumulate
        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync(workers[0], af.pipeline, args=(x, NAMES, workers))
            loss = out.pow(2).sum()
            for _ in range(passes):
                dist_autograd.backward(context_id, [loss], retain_graph=True)
            torch.testing.assert_close(loss, expected)
            torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], x.grad * passes)
            for name, worker, module in zip(NAMES, workers, local):
                grads = rpc.rpc_sync(worker, af.stage_grads, args=(name, context_id))
                for got, param in zip(grads, module.parameters()):
                    torch.testing.assert_close(got, param.grad * passes)
            assert _counts_everywhere(workers) == {f"{n}.{io}": passes for n in NAMES for io in ("in", "out")}
    assert x.grad is not None and all(p.grad is not None for m in local for p in m.parameters())


def test_a_nested_chains_gradients_go_back_on_the_answers(group):
    """Each worker of a chain of nested calls sends one gradient request, to the next worker;
    the gradients for the tensors it received ride back on the answers (engine.py,
    ``Pass.deliver``), not in requests of their own (torch sends one for each hop back)."""
    workers = ["worker1", "worker2", "worker3"]
    for i, (name, worker) in enumerate(zip(NAMES, workers)):
        rpc.rpc_sync(worker, af.make_stage, args=(name, i, WIDTH))
    x = torch.randn(5, WIDTH, requires_grad=True)
    for worker in workers:
        rpc.rpc_sync(worker, af.count_api_calls, args=("_send_gradients",))
    af.count_api_calls("_send_gradients")
    try:
        for _ in range(2):
            with dist_autograd.context() as context_id:
                out = rpc.rpc_sync(workers[0], af.pipeline, args=(x, NAMES, workers))
                dist_autograd.backward(context_id, [out.sum()])
                assert dist_autograd.get_gradients(context_id)[x].shape == x.shape
        sent = [af.take_api_calls("_send_gradients")]
        sent += [rpc.rpc_sync(worker, af.take_api_calls, args=("_send_gradients",)) for worker in workers]
    finally:
        af.restore_api_calls("_send_gradients")
    assert sent == [2, 2, 2, 0]  # two passes; the last worker's gradients ride on its answer
    _counts_everywhere(workers)  # (the stages' node counters start from zero for the next test)


def test_fan_out_fan_in_runs_every_node_once(group):
    """x goes to three workers; their results are combined on a fourth and on the caller.
    The caller's x is reached by three send functions and the local root."""
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def forward(run):
        h = torch.matmul(x, w)
        branches = [run(f"worker{i}", af.scale, (h, float(i), f"branch{i}")) for i in (1, 2, 3)]
        left = run("worker3", af.combine, (branches[0], branches[1], "join"))
        return (af.Counted.apply(left + branches[2] * h, "root")).sum()

    expected = forward(lambda _, f, args: f(*args))
    expected.backward()
    local_counts = af.take_counts()
    assert local_counts == {"branch1": 1, "branch2": 1, "branch3": 1, "join": 1, "root": 1}
    with dist_autograd.context() as context_id:
        loss = forward(lambda to, f, args: rpc.rpc_sync(to, f, args=args))
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        torch.testing.assert_close(grads[x], x.grad)
        torch.testing.assert_close(grads[w], w.grad)
        counts = _counts_everywhere(["worker0", "worker1", "worker2", "worker3"])
        assert counts == local_counts


def test_tensor_sent_twice_and_used_locally_accumulates_once_per_path(group):
    """A non-leaf tensor sent to two workers and also used locally: its producer node is
    reached from two send functions and the local root, and must run once with the sum."""
    a = torch.randn(3, requires_grad=True)
    h_local = af.Counted.apply(a * 2, "producer")
    expected = (h_local.exp().sum() + (h_local * 3).sum() + (h_local ** 2).sum())
    expected.backward()
    af.take_counts()
    with dist_autograd.context() as context_id:
        h = af.Counted.apply(a * 2, "producer")
        r1 = rpc.rpc_sync("worker1", torch.exp, args=(h,))
        r2 = rpc.rpc_sync("worker2", torch.mul, args=(h, 3))
        loss = r1.sum() + r2.sum() + (h ** 2).sum()
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a], a.grad)
        assert af.take_counts() == {"producer": 1}


def test_residual_across_root_sets_runs_stepwise_correctly(group):
    """g = f(x); (g, x) go to one worker and g to another. The first send function reaches
    g's node and x's node, and g's node leads to x's node, both in a group of two roots:
    chained exits, the stepwise path. Every node still runs once, with the full gradient."""
    a = torch.randn(3, 3, requires_grad=True)

    def forward(run):
        x = a * 1.5
        g = af.Counted.apply(x.sin(), "g")
        y = run("worker1", torch.add, (g, x))
        c = run("worker2", torch.cos, (g,))
        return y.pow(2).sum() + c.sum()

    forward(lambda _, f, args: f(*args)).backward()
    assert af.take_counts() == {"g": 1}
    with dist_autograd.context() as context_id:
        loss = forward(lambda to, f, args: rpc.rpc_sync(to, f, args=args))
        dist_autograd.backward(context_id, [loss])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a], a.grad)
        assert af.take_counts() == {"g": 1}


def test_chained_exits_into_a_leaf_run_stepwise_with_the_leafs_hooks(group):
    """As above, with the leaf itself sent next to g = f(leaf): the stepwise group captures
    the leaf's edge, and the leaf's tensor hook runs once, on its whole gradient (and a leaf
    without hooks works too)."""
    seen = []
    hooked = torch.randn(3, 3, requires_grad=True)
    hooked.register_hook(lambda grad: seen.append(grad.clone()) or grad * 3)
    plain = torch.randn(3, 3, requires_grad=True)

    def forward(a, run):
        g = af.Counted.apply(a.sin(), "g")
        y = run("worker1", torch.add, (g, a))
        c = run("worker2", torch.cos, (g,))
        return y.pow(2).sum() + c.sum()

    for a in (plain, hooked):
        forward(a, lambda _, f, args: f(*args)).backward()
        assert af.take_counts() == {"g": 1}
        with dist_autograd.context() as context_id:
            loss = forward(a, lambda to, f, args: rpc.rpc_sync(to, f, args=args))
            dist_autograd.backward(context_id, [loss])
            torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a], a.grad)
            assert af.take_counts() == {"g": 1}
    assert len(seen) == 2
    torch.testing.assert_close(seen[1], seen[0])


def test_a_pass_waiting_for_gradients_that_never_come_fails_after_the_rpc_timeout(group):
    """FAST mode: a send function whose result was never used keeps the pass waiting (torch
    waits for ever; test_backward_unused_send_function checks it still waits after 10 s).
    With nothing left in flight, the caller's pass fails after the RPC timeout instead."""
    previous = rpc._get_rpc_timeout()
    rpc._set_rpc_timeout(2)
    try:
        t1 = torch.rand(3, 3, requires_grad=True)
        t2 = torch.rand(3, 3, requires_grad=True)
        with dist_autograd.context() as context_id:
            rpc.rpc_sync("worker1", torch.add, args=(t1, t2))  # its result is not used
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"no gradients arrived for 1 root\(s\).*within 2 s"):
                dist_autograd.backward(context_id, [(t1 * t2).sum()])
            assert 1.5 < time.monotonic() - started < 10
    finally:
        rpc._set_rpc_timeout(previous)


@contextlib.contextmanager
def _no_cleanup_timer(workers: list):
    """The workers' batch timers an hour out: a release can only travel on a call."""
    previous = {w: rpc.rpc_sync(w, af.set_cleanup_delay, args=(3600.0,)) for w in workers}
    try:
        yield
    finally:
        for worker, delay in previous.items():
            rpc.rpc_sync(worker, af.set_cleanup_delay, args=(delay,))


def test_context_releases_ride_on_the_next_call_and_pass_on_to_nested_workers(group):
    # With the batch timer an hour out, a release can only travel on a call: the next call
    # to a worker must carry it there, and that worker pass it on (on its next call).
    with _no_cleanup_timer(group.names):
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            rpc.rpc_sync("worker1", af.forward_to, args=("worker2", x))
        # The call that asks worker1 carried the release: worker1 no longer has the context.
        assert rpc.rpc_sync("worker1", af.has_context, args=(context_id,)) is False
        # worker1 passed it on to worker2 with its next call there.
        assert rpc.rpc_sync("worker2", af.has_context, args=(context_id,)) is True
        rpc.rpc_sync("worker1", af.forward_to, args=("worker2", torch.ones(1)))
        assert rpc.rpc_sync("worker2", af.has_context, args=(context_id,)) is False


def test_releases_ride_down_a_chain_with_the_next_steps_calls(group):
    # A worker passes the releases that rode on a call on before it runs the call's function,
    # so its own nested call carries them on: a chain's next step takes the releases of the
    # step before to its end, with no batch timer (an hour out here) and no request.
    with _no_cleanup_timer(group.names):
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as first:
            rpc.rpc_sync("worker1", af.forward_to, args=("worker2", x))
        with dist_autograd.context():
            rpc.rpc_sync("worker1", af.forward_to, args=("worker2", x))
            assert rpc.rpc_sync("worker1", af.has_context, args=(first,)) is False
            assert rpc.rpc_sync("worker2", af.has_context, args=(first,)) is False


def test_releases_riding_on_a_builtin_call_apply_after_its_answer(group):
    # A builtin cannot wait for a release, so the releases riding on its call apply after its
    # answer left (agent._run_call): they must still apply, with no batch timer to send them.
    previous = rpc.rpc_sync("worker1", af.set_cleanup_delay, args=(3600.0,))
    try:
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            rpc.rpc_sync("worker1", torch.mul, args=(x, 3))
        # The release rides on this builtin call.
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(x.detach(), 1)), x.detach() + 1)
        assert rpc.rpc_sync("worker1", af.context_gone_within, args=(context_id, 10.0)) is True
    finally:
        rpc.rpc_sync("worker1", af.set_cleanup_delay, args=(previous,))


def test_a_worker_that_answered_a_recorded_call_has_its_plan_before_the_pass(group):
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync("worker1", af.scale, args=(x, 2.0, "ahead"))
        assert rpc.rpc_sync("worker1", af.plan_built_within, args=(context_id, 10.0)) is True
        # A second call adds a send function there: the plan built ahead no longer fits.
        z = rpc.rpc_sync("worker1", af.scale, args=(x, 5.0, "ahead2"))
        dist_autograd.backward(context_id, [(y * z).sum()])
        local = x.detach().clone().requires_grad_()
        ((local * 2.0).sin() * (local * 5.0).sin()).sum().backward()
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], local.grad)
    af.take_counts()
    assert _counts_everywhere(["worker1"]) == {"ahead": 1, "ahead2": 1}


def test_backward_started_inside_rpc_calls_by_every_pool_thread(group):
    """Every pool thread of worker1 runs a backward pass it started itself inside an RPC call
    (the pass's home is a pool thread, which receives the answers to its own gradient
    requests while it waits); more calls than threads, all at once: none may deadlock, and
    each gets the gradients local autograd gives."""
    calls = 2 * 4  # the group's num_worker_threads is 4
    inputs = [(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)),
               torch.randn(4, 2, generator=torch.Generator().manual_seed(100 + i))) for i in range(calls)]
    futures = [rpc.rpc_async("worker1", af.train_step_here, args=("worker2", x, w)) for x, w in inputs]
    for (x, w), future in zip(inputs, futures):
        loss, x_grad, w_grad = future.wait()
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        expected = torch.tanh(x @ w).pow(2).sum()
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        torch.testing.assert_close(x_grad, x.grad)
        torch.testing.assert_close(w_grad, w.grad)


def test_leaf_post_hooks_run_once_per_pass_with_the_leafs_whole_gradient(group):
    """Post hooks on leaves' AccumulateGrad nodes (``node.register_hook``), as torch's engine
    runs them: once per pass, after the gradient is accumulated, given the sum of every path.
    The caller's leaf is reached by its local root and two send functions, the worker's
    leaf by two send functions (two calls in one context): three and two groups feed them."""
    rpc.rpc_sync("worker1", af.make_hooked_leaf, args=("w", 1, (3, 2)))
    here = af.HookedLeaf(2, (4, 3))
    local_w = af.HookedLeaf(1, (3, 2))
    forward = _hooked_forward
    forward(here.tensor, lambda x: torch.matmul(x, local_w.tensor)).backward()
    expected_here, expected_w = here.seen, local_w.seen
    assert len(expected_here) == 1 and len(expected_w) == 1
    here.seen = []
    with dist_autograd.context() as context_id:
        loss = forward(here.tensor, lambda x: rpc.rpc_sync("worker1", af.matmul_hooked, args=("w", x)))
        for _passes in (1, 2):  # each pass runs the hooks once, with that pass's gradient
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert len(here.seen) == 1
            torch.testing.assert_close(here.seen.pop(), expected_here[0])
            seen_w = rpc.rpc_sync("worker1", af.take_hook_calls, args=("w",))
            assert len(seen_w) == 1
            torch.testing.assert_close(seen_w[0], expected_w[0])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[here.tensor], here.tensor.grad * 2)
        torch.testing.assert_close(
            rpc.rpc_sync("worker1", af.hooked_leaf_gradient, args=("w", context_id)), local_w.tensor.grad * 2
        )


def _hooked_forward(a, run):
    """The graph of the leaf-hook tests: ``a`` reaches the loss through two calls and a local
    term, so on the caller three groups (one per root) feed ``a``, and on the callee two
    (one per call) feed the weight the calls use."""
    r1 = run(a * 2)
    r2 = run(a.sin())
    return r1.pow(2).sum() + r2.sum() + (a * a).sum()


def test_leaf_tensor_hooks_run_once_per_pass_on_the_leafs_whole_gradient(group):
    """Tensor hooks on leaves (``leaf.register_hook``), as torch's engine runs them: once per
    pass, on the sum of every path, before the gradient is accumulated, and the post hooks
    see what they returned. The hook clamps: the clamp of the sum is not the sum of clamped
    parts (checked first), so a hook run per group gives another gradient."""
    bound = 0.5
    rpc.rpc_sync("worker1", af.make_hooked_leaf, args=("tw", 1, (3, 2), bound))
    here = af.HookedLeaf(2, (4, 3), clamp=bound)
    local_w = af.HookedLeaf(1, (3, 2), clamp=bound)

    a = here.tensor.detach().clone().requires_grad_()
    w = local_w.tensor.detach().clone().requires_grad_()
    terms = [torch.matmul(a * 2, w).pow(2).sum(), torch.matmul(a.sin(), w).sum(), (a * a).sum()]
    for leaf, parts in ((a, terms), (w, terms[:2])):
        grads = [torch.autograd.grad(term, leaf, retain_graph=True)[0] for term in parts]
        per_part = sum(g.clamp(-bound, bound) for g in grads)
        assert not torch.allclose(per_part, sum(grads).clamp(-bound, bound))

    _hooked_forward(here.tensor, lambda x: torch.matmul(x, local_w.tensor)).backward()
    for leaf in (here, local_w):
        assert len(leaf.tensor_seen) == 1 and len(leaf.seen) == 1
        torch.testing.assert_close(leaf.seen[0], leaf.tensor.grad)  # the post hook saw the clamped sum
    expected_here, expected_w = here.tensor_seen.pop(), local_w.tensor_seen.pop()
    here.seen = []
    with dist_autograd.context() as context_id:
        loss = _hooked_forward(here.tensor, lambda x: rpc.rpc_sync("worker1", af.matmul_hooked, args=("tw", x)))
        for _passes in (1, 2):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert len(here.tensor_seen) == 1 and len(here.seen) == 1
            torch.testing.assert_close(here.tensor_seen.pop(), expected_here)
            torch.testing.assert_close(here.seen.pop(), here.tensor.grad)
            seen_w = rpc.rpc_sync("worker1", af.take_tensor_hook_calls, args=("tw",))
            assert len(seen_w) == 1
            torch.testing.assert_close(seen_w[0], expected_w)
            post_w = rpc.rpc_sync("worker1", af.take_hook_calls, args=("tw",))
            assert len(post_w) == 1
            torch.testing.assert_close(post_w[0], local_w.tensor.grad)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[here.tensor], here.tensor.grad * 2)
        torch.testing.assert_close(
            rpc.rpc_sync("worker1", af.hooked_leaf_gradient, args=("tw", context_id)), local_w.tensor.grad * 2
        )
    # Outside a pass the hooks are the user's as before: a local backward runs them.
    here.tensor.grad = None
    _hooked_forward(here.tensor, lambda x: torch.matmul(x, local_w.tensor)).backward()
    assert len(here.tensor_seen) == 1
    torch.testing.assert_close(here.tensor_seen.pop(), expected_here)


def test_a_failing_leaf_post_hook_fails_the_pass_on_its_worker(group):
    rpc.rpc_sync("worker2", af.make_hooked_leaf, args=("f", 3, (2, 2)))
    x = torch.randn(2, 2, requires_grad=True)
    rpc.rpc_sync("worker2", af.fail_hook, args=("f", "post hook refused"))
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker2", af.matmul_hooked, args=("f", x)).sum()
        with pytest.raises(RuntimeError, match=r"Error on Node 2: .*post hook refused"):
            dist_autograd.backward(context_id, [loss], retain_graph=True)
        rpc.rpc_sync("worker2", af.fail_hook, args=("f", None))
        dist_autograd.backward(context_id, [loss])  # the context is usable for new passes
        assert len(rpc.rpc_sync("worker2", af.take_hook_calls, args=("f",))) == 2


def test_received_tensors_become_recv_outputs_in_place_or_by_a_swap(monkeypatch):
    """attach_recv_node keeps each received tensor object (the payload refers to it) and
    gives it the recv function: in place (the tensors are the node's outputs, marked dirty)
    for distinct dense leaves that are no views, as the codec makes them, attributes of
    their own included; by swapping in the contents of new outputs for others (a view
    here). All end up the same: same object, same values, the recv function as grad_fn, in
    the graph."""
    from zmqautograd.autograd import functions

    swapped = []
    real_swap = functions._swap
    monkeypatch.setattr(functions, "_swap", lambda a, b: (swapped.append(a), real_swap(a, b)))
    fresh = torch.arange(3.0).requires_grad_(True)
    tagged = torch.arange(3.0).requires_grad_(True)
    tagged.tag = "mine"
    view = torch.arange(6.0)[:3].requires_grad_(True)
    assert view._is_view()
    for tensor in (fresh, tagged, view):
        before = id(tensor)
        node, _ = functions.attach_recv_node([tensor], 1, 2, 3)
        assert id(tensor) == before and tensor.grad_fn is node and functions.is_recv_node(node)
        assert torch.equal(tensor.detach(), torch.arange(3.0)) and not tensor.is_leaf
        assert functions.recv_info(node).from_worker == 3
        (grad,) = torch.autograd.grad((tensor * 2).sum(), [tensor])
        assert torch.equal(grad, torch.full((3,), 2.0))
    assert tagged.tag == "mine"
    assert [id(t) for t in swapped] == [id(view)]
    # Several at once, in place: each its own slot of one node.
    first, second = torch.ones(2).requires_grad_(True), torch.zeros(2, 2).requires_grad_(True)
    node, _ = functions.attach_recv_node([first, second], 1, 4, 3)
    assert first.grad_fn is node and second.grad_fn is node
    assert (first.output_nr, second.output_nr) == (0, 1)
    assert len(swapped) == 1


def _plan_shape(plan) -> dict:
    """A plan's content, free of the order (and so of the group numbering) where the engine
    does not depend on it: groups are named by their masks."""
    mask = {g.index: g.mask for g in plan.groups}
    return {
        "roots": (plan.root_keys, plan.root_bits),
        "groups": {
            g.mask: (set(g.nodes), set(zip(g.captures, g.capture_leaves)), {mask[i] for i in g.feeders},
                     sorted(mask[i] for i in g.feeds), set(g.recv_targets), g.stepwise, g.pass_through,
                     [(e.node, e.output_nr) for e in g.capture_edges] == g.captures)
            for g in plan.groups
        },
        "group_of": {node: mask[index] for node, index in plan.group_of.items()},
        "exits": {node: ({mask[i] for i in e.feeders}, e.direct_roots) for node, e in plan.exits.items()},
        "post_hooks": {node: id(hooks) for node, hooks in plan.post_hooks.items()},
        "shared_leaves": set(plan.shared_leaves),
        "direct_exits": {key: set(nodes) for key, nodes in plan.direct_exits.items()},
    }


def test_plans_of_disjoint_roots_match_the_general_construction():
    """Plan's shortcut for roots whose graphs share no node (a group per root, no masks, no
    order) against the general construction, on the graphs workers have: an answer's send
    function over received tensors, leaves, shared paths, a root straight into a recv
    function, a leaf with a post hook, a caller's loss next to its calls' send functions
    (sharing leaves), and roots that do share nodes (the shortcut must step aside)."""
    from zmqautograd.autograd import functions
    from zmqautograd.autograd import plan as planning

    def received(*shape):
        tensor = torch.randn(*shape).requires_grad_(True)
        functions.attach_recv_node([tensor], 1, 2, 3)
        return tensor

    kept = []  # what keeps the send functions alive (functions.NODE_NEEDS_AN_OUTPUT)

    def send_node(tensors):
        node, keep_alive = functions.make_send_node(tensors)
        kept.append(keep_alive)
        return node

    def send_roots(node):
        return [(node, slot) for slot in range(len(node.next_functions))]

    weight = torch.randn(3, requires_grad=True)
    hooked = torch.randn(3, requires_grad=True)
    hooked_node = (hooked * 1).grad_fn.next_functions[0][0]
    hooked_node.register_hook(lambda grad_inputs, grad_outputs: None)
    r1, r2, scalar = received(3), received(3), received(())
    chain = send_node([r1 * 2])
    shared = send_node([(r1 * weight).relu() + weight.sum(), r2 * r1, weight * 3])
    hooked_send = send_node([hooked * r2])
    hidden = torch.tanh(weight * 2)
    cases = {
        "chain": ({7: send_roots(chain)}, True),
        "shared paths": ({7: send_roots(shared)}, True),
        "leaf with a post hook": ({7: send_roots(hooked_send)}, True),
        "root into a recv function": ({planning.LOCAL_ROOT: [(scalar.grad_fn, 0)]}, True),
        "loss and sends sharing leaves": ({
            planning.LOCAL_ROOT: [(((r1 * weight).sum() + r2.sum()).grad_fn, 0)],
            7: send_roots(send_node([weight, hooked])),
            8: send_roots(send_node([weight * 2])),
        }, True),
        "roots sharing a node": ({
            planning.LOCAL_ROOT: [((hidden * r1).sum().grad_fn, 0)],
            7: send_roots(send_node([hidden])),
        }, False),
    }
    for name, (roots, disjoint) in cases.items():
        fast, general = planning.Plan(roots), planning.Plan(roots, general=True)
        assert _plan_shape(fast) == _plan_shape(general), name
        assert _disjoint(roots) is disjoint, name
        # Parts made before (a context's part cache) are reused, and give the same plan.
        parts: dict = {}
        first = planning.Plan(roots, parts=parts)
        again = planning.Plan(roots, parts=parts)
        assert _plan_shape(again) == _plan_shape(first) == _plan_shape(general), name
        if disjoint:
            assert set(parts) == set(roots), name
            assert [g.captures for g in again.groups] == [g.captures for g in first.groups]
            assert all(a.captures is b.captures for a, b in zip(again.groups, first.groups)), name
    # A part cached for a root key whose edges changed is made anew.
    parts = {7: planning._Part(send_roots(shared))}
    assert _plan_shape(planning.Plan({7: send_roots(chain)}, parts=parts)) == \
        _plan_shape(planning.Plan({7: send_roots(chain)}, general=True))
    assert parts[7].edges == tuple(send_roots(chain))
    assert hooked_node in planning.Plan({7: send_roots(hooked_send)}).post_hooks
    assert planning.Plan({planning.LOCAL_ROOT: [(scalar.grad_fn, 0)]}).groups == []


def _disjoint(roots) -> bool:
    from zmqautograd.autograd import plan as planning

    plan = planning.Plan.__new__(planning.Plan)
    plan.root_keys, plan.roots = list(roots), roots
    plan.root_bits = {key: 1 << i for i, key in enumerate(plan.root_keys)}
    return plan._disjoint_groups({})


def test_a_send_function_into_leaves_hands_its_gradients_on_without_the_engine(group, monkeypatch):
    """The caller's send function over a leaf sent twice in one call: the leaf gets the sum,
    through its tensor hook once, as local autograd gives it, and PyTorch's engine runs only
    for the loss's group (engine._pass_through)."""
    from zmqautograd.autograd import engine

    engine_calls = []
    real_grad = engine._grad
    monkeypatch.setattr(engine, "_grad", lambda *args: (engine_calls.append(1), real_grad(*args))[1])
    hooked = []

    def triple(grad):
        hooked.append(grad.clone())
        return grad * 3

    x = torch.randn(3, requires_grad=True)
    x.register_hook(triple)
    local = x.detach().clone().requires_grad_(True)
    local.register_hook(lambda grad: grad * 3)
    (local * local).sum().backward()
    with dist_autograd.context() as context_id:
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, x))
        dist_autograd.backward(context_id, [y.sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], local.grad)
    assert len(hooked) == 1 and torch.allclose(hooked[0], 2 * x.detach())
    assert len(engine_calls) == 1


def test_send_functions_are_listed_by_message_id_whatever_order_they_were_recorded_in():
    """DistAutogradContext._send_functions: an rpc_sync records its send function while its
    call travels, so the answer to a nested call back to this worker can be recorded first;
    the seeds' tests take the first listed as their call's (test_graph_for_py_nested_call_itself
    failed once that way)."""
    from zmqautograd.autograd import functions
    from zmqautograd.autograd.context import DistAutogradContext

    leaf = torch.randn(3, requires_grad=True)
    ctx = DistAutogradContext(1)
    answer = functions.make_send_node([leaf * 2])
    call = functions.make_send_node([leaf * 3, leaf * 4])
    ctx.add_send_function(9, *answer)  # the nested call's answer, recorded first
    ctx.add_send_function(4, *call)  # the worker's own call, whose id came first
    listed = ctx._send_functions()
    assert list(listed) == [4, 9]
    assert listed[4] is call[0] and len(listed[4].next_functions) == 2


def test_the_parts_of_async_calls_are_built_while_their_caller_waits(group, monkeypatch):
    """AutogradHooks.while_waiting: the plan parts of a fan-out's rpc_async calls (their
    send functions' walks) are built while the caller waits for the answers, one at a time,
    not in its backward pass; every call sends the same leaf, whose post-hook dict is
    looked up once per context (plan._post_hooks_of), and a post hook registered after that
    lookup still runs, once, on the leaf's whole gradient."""
    from zmqautograd.autograd import plan as planning
    from zmqautograd.autograd import port

    probes = []
    real_probe = planning.post_hooks_of
    monkeypatch.setattr(planning, "post_hooks_of", lambda node: (probes.append(node), real_probe(node))[1])
    hooks = port.current().hooks
    real_while_waiting = hooks.while_waiting
    parts_when_waiting = []

    def while_waiting():
        more = real_while_waiting()  # a part a piece
        parts_when_waiting.append(len(ctx.part_cache))
        if not more:
            rpc.rpc_async("worker1", af.open_gate)  # worker1's answer comes only now
        return more

    monkeypatch.setattr(hooks, "while_waiting", while_waiting)
    x = torch.randn(3, requires_grad=True)
    seen = []
    with dist_autograd.context() as context_id:
        ctx = dist_autograd._retrieve_context(context_id)
        futures = [rpc.rpc_async("worker1", af.gated_scale, args=(x, 2.0))]
        futures += [rpc.rpc_async(worker, torch.mul, args=(x, 2.0)) for worker in ("worker2", "worker3")]
        assert ctx.part_cache == {}
        values = [future.wait() for future in futures]
        assert parts_when_waiting[:3] == [1, 2, 3] and set(parts_when_waiting[3:]) <= {3}  # (later waits: none left)
        assert probes == [torch.autograd.graph.get_gradient_edge(x).node]
        probes[0].register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_outputs[0].clone()))
        dist_autograd.backward(context_id, [torch.stack(values).sum()])
        grads = dist_autograd.get_gradients(context_id)
    torch.testing.assert_close(grads[x], torch.full((3,), 6.0))
    assert len(probes) == 1
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], torch.full((3,), 6.0))


def test_a_plan_of_send_functions_alone_is_reused_until_one_is_added():
    """planning.plan_for: a worker's passes reuse the plan built after its answer left, without
    listing the send functions again; a send function added since makes it build anew, also
    one added while the plan was being built."""
    from zmqautograd.autograd import functions
    from zmqautograd.autograd import plan as planning
    from zmqautograd.autograd.context import DistAutogradContext

    leaf = torch.randn(3, requires_grad=True)
    ctx = DistAutogradContext(1)
    ctx.add_send_function(5, *functions.make_send_node([leaf * 2]))
    plan = planning.plan_for(ctx, None)
    assert planning.plan_for(ctx, None) is plan
    ctx.add_send_function(6, *functions.make_send_node([leaf * 3]))
    grown = planning.plan_for(ctx, None)
    assert grown is not plan and sorted(grown.root_keys) == [5, 6]
    assert planning.plan_for(ctx, None) is grown
    local = [((leaf * 4).sum().grad_fn, 0)]
    with_local = planning.plan_for(ctx, local)
    assert with_local is not grown and with_local.root_keys[0] == planning.LOCAL_ROOT
    assert planning.plan_for(ctx, local) is with_local  # the same local root: the same plan
    assert planning.plan_for(ctx, None) is not with_local  # the local root's plan is not the workers'

    real_plan = planning.Plan

    def plan_while_a_send_is_added(*args, **kwargs):  # a call recorded while the plan is built
        built = real_plan(*args, **kwargs)
        if 7 not in ctx._sends:
            ctx.add_send_function(7, *functions.make_send_node([leaf * 5]))
        return built

    ctx.add_send_function(8, *functions.make_send_node([leaf * 6]))  # (so that the next call builds)
    planning.Plan = plan_while_a_send_is_added
    try:
        stale = planning.plan_for(ctx, None)
    finally:
        planning.Plan = real_plan
    assert 7 not in stale.root_keys
    assert 7 in planning.plan_for(ctx, None).root_keys


def test_a_send_functions_gradient_the_engine_would_convert_goes_through_the_engine():
    from zmqautograd.autograd import functions, groups
    from zmqautograd.autograd import plan as planning

    leaf = torch.randn(3, requires_grad=True)
    send, keep_alive = functions.make_send_node([leaf * 1, leaf])  # slot 0: not a leaf's edge
    plan = planning.Plan({7: [(send, 0), (send, 1)]})
    assert all(g.pass_through is None for g in plan.groups)  # a group with more than the send function
    send, keep_alive = functions.make_send_node([leaf, leaf])
    (group,) = planning.Plan({7: [(send, 0), (send, 1)]}).groups
    assert group.pass_through == (0, 0)
    (summed,) = groups._pass_through(group, {(send, 0): torch.ones(3), (send, 1): torch.ones(3)})
    assert torch.equal(summed, torch.full((3,), 2.0))
    for odd in (torch.ones(3, dtype=torch.float64), torch.ones(1), torch.ones(3).to_sparse()):
        assert groups._pass_through(group, {(send, 0): odd}) == ()
    with torch.autograd.profiler.profile():  # the profiler shows the node: the engine runs it
        assert groups._pass_through(group, {(send, 0): torch.ones(3)}) == ()


@pytest.mark.parametrize("profiled", [False, True], ids=["plain", "profiled"])
def test_a_group_from_a_send_function_starts_the_engine_past_it(monkeypatch, profiled):
    """engine._engine_roots: a worker's group starts PyTorch's engine at the edges its send
    function leads to, so the engine never runs the send function's Python node (unless the
    profiler records, which must show it). A tensor sent twice sums; a gradient of another
    dtype for a leaf sent as is is converted, as the node's edges would have it; the leaf
    gets what local autograd gives it."""
    from zmqautograd.autograd import engine, functions
    from zmqautograd.autograd import plan as planning
    from zmqautograd.autograd.context import DistAutogradContext

    ran = []
    real_backward = functions.SendRpc.backward
    monkeypatch.setattr(functions.SendRpc, "backward", staticmethod(lambda ctx, *grads: (ran.append(1), real_backward(ctx, *grads))[1]))
    leaf = torch.randn(3, requires_grad=True)
    h = leaf * 2
    send, keep_alive = functions.make_send_node([h, h, leaf])
    plan = planning.Plan({7: [(send, 0), (send, 1), (send, 2)]})
    (group,) = plan.groups
    assert group.pass_through is None and len(group.nodes) == 2  # the send function and the product
    context = DistAutogradContext(1)
    run = engine.Pass(context, plan, 9, True, 1, lambda *args: None)
    g0, g1, g2 = torch.randn(3), torch.randn(3), torch.randn(3, dtype=torch.float64)
    if profiled:
        with torch.autograd.profiler.profile():
            run.deliver(7, [g0, g1, g2])
    else:
        run.deliver(7, [g0, g1, g2])
    assert run.done.done()
    run.done.wait()
    local = leaf.detach().clone().requires_grad_(True)
    (2 * local * (g0 + g1)).sum().backward()
    torch.testing.assert_close(context.gradients()[leaf], local.grad + g2.float())
    assert len(ran) == (1 if profiled else 0)


@pytest.mark.parametrize("received_tensor", ["plain", "with a hook", "retaining its grad", "gone", "gone, with a hook"])
def test_a_send_function_into_a_recv_function_hands_on_its_gradient_unless_hooks_could_differ(
        group, monkeypatch, received_tensor):
    """A pipeline the caller drives: the answer of worker1 goes on to worker2, so the send
    function of that call leads straight into the recv function of the answer. Its gradient
    passes through without the engine, also when the received tensor is gone (as in a loop
    that rebinds ``h``), unless the tensor has a hook, even once it is gone (the hook stays
    on the node), or retains its grad: PyTorch's engine runs those where it captures the
    gradient."""
    from zmqautograd.autograd import engine

    engine_calls = []
    real_grad = engine._grad
    monkeypatch.setattr(engine, "_grad", lambda *args: (engine_calls.append(1), real_grad(*args))[1])
    x = torch.randn(3, requires_grad=True)
    hooked = received_tensor in ("with a hook", "gone, with a hook")
    with dist_autograd.context() as context_id:
        h = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
        if hooked:
            h.register_hook(lambda grad: grad * 10)
        elif received_tensor == "retaining its grad":
            h.retain_grad()
        z = rpc.rpc_sync("worker2", torch.mul, args=(h, 3))
        if received_tensor.startswith("gone"):
            del h
        dist_autograd.backward(context_id, [z.sum()])
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], torch.full((3,), 6.0 * (10 if hooked else 1)))
    # The loss's group always runs in the engine; x's send function never needs it.
    assert len(engine_calls) == (1 if received_tensor in ("plain", "gone") else 2)


def test_a_gradient_request_that_overtakes_its_send_functions_recording_waits_for_it(group):
    """worker1 records the send function of its answer half a second after the answer left:
    the caller's backward pass reaches worker1 before that, and its pass there must wait
    for the send function instead of failing without it."""
    rpc.rpc_sync("worker1", af.delay_answer_recording, args=(0.5,))
    try:
        x = torch.randn(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
            dist_autograd.backward(context_id, [y.sum()])
            torch.testing.assert_close(dist_autograd.get_gradients(context_id)[x], torch.full((3,), 2.0))
    finally:
        rpc.rpc_sync("worker1", af.delay_answer_recording, args=(0.0,))


def test_a_send_function_still_being_recorded_is_waited_for():
    """An answer leaves before its send function is recorded (agent._reply records it while
    the answer travels): a pass that asks for the send functions meanwhile must wait for it,
    not start without it (in-process, the two sides on two threads)."""
    import threading

    from zmqautograd.autograd import functions
    from zmqautograd.autograd.context import DistAutogradContext

    context = DistAutogradContext(1)
    context.expect_send(7)
    seen: dict = {}
    asked = [
        threading.Thread(target=lambda: seen.update(all=context._send_functions())),
        threading.Thread(target=lambda: seen.update(one=context.send_function(7))),
    ]
    for thread in asked:
        thread.start()
    for thread in asked:
        thread.join(0.2)  # (they must still wait: nothing may come back yet)
        assert thread.is_alive()
    node, keep_alive = functions.make_send_node([torch.ones(2, requires_grad=True)])
    context.add_send_function(7, node, keep_alive)
    context.send_recorded(7)
    for thread in asked:
        thread.join(5)  # woken by the recording (their own bound is 10 s)
        assert not thread.is_alive()
    assert seen == {"all": {7: node}, "one": node}
    # An answer whose recording failed: the waiters are let go, and get the usual error.
    context.expect_send(8)
    context.send_recorded(8)
    with pytest.raises(RuntimeError, match="Could not find send function for autograd message id: 8"):
        context.send_function(8)


def test_a_second_backward_on_a_context_whose_pass_runs_fails_the_first_saying_why(group):
    """A context runs one backward pass at a time on each worker (torch's engine asserts
    so); a second one started meanwhile supersedes the first, whose backward() raises, and
    says that concurrent passes need contexts of their own."""
    import threading

    from zmqautograd.autograd import api

    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", af.held, args=(x,)).sum()
        outcomes: dict = {}

        def backward(which: str) -> None:
            try:
                dist_autograd.backward(context_id, [loss], retain_graph=True)
                outcomes[which] = None
            except RuntimeError as exc:
                outcomes[which] = exc

        first = threading.Thread(target=backward, args=("first",))
        second = threading.Thread(target=backward, args=("second",))
        first.start()
        try:
            # Its gradients are held on worker1 until released: the pass runs meanwhile.
            poll_until(lambda: api._running, what="the first pass to start")
            second.start()
            first.join(20)
            assert "first" in outcomes, "the first pass was not failed when the second began"
        finally:
            rpc.rpc_sync("worker1", af.release_backward)
            first.join(30)
            second.join(60)
    error = str(outcomes["first"])
    assert "was superseded by pass" in error and "one backward pass at a time" in error, error
    assert "contexts of their own" in error
