"""RPC profiling as torch's: under the legacy autograd profiler, each call is an event named
after its kind, function and workers, and the callee's events join the caller's profile as
remote events (rpc/profiling.py). Real workers (world size 3)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.autograd.profiler_legacy import profile as legacy_profile

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc

from tests import rpc_functions as f
from tests.rpc_harness import Group

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

REMOTE_OP = "#remote_op: "


@pytest.fixture(scope="module")
def group():
    g = Group(world_size=3, num_worker_threads=4, rpc_timeout=30)
    yield g
    g.shutdown()


def _event(events, name):
    found = [e for e in events if e.name == name]
    assert len(found) == 1, f"{name!r} among {[e.name for e in events]}"
    return found[0]


def _remote(events, key, name):
    return _event(events, key + REMOTE_OP + name)


@pytest.mark.parametrize("kind", ["sync", "async", "remote"])
def test_each_call_is_an_event_and_the_callees_operators_are_remote_events_of_it(group, kind):
    x = torch.ones(4)
    with legacy_profile(record_shapes=True) as prof:
        if kind == "sync":
            result = rpc.rpc_sync("worker1", f.ops_in_a_block, args=(x,))
        elif kind == "async":
            result = rpc.rpc_async("worker1", f.ops_in_a_block, args=(x,)).wait()
        else:
            rref = rpc.remote("worker1", f.ops_in_a_block, args=(x,))
            result = rref.to_here()
            rref._get_profiling_future().wait()
    assert torch.equal(result, torch.relu(x * 2 + 1))
    events = prof.function_events
    key = f"rpc_{kind}#ops_in_a_block(worker0 -> worker1)"
    call = _event(events, key)
    assert call.node_id == 0 and not call.is_remote
    block = _remote(events, key, "##block##")
    assert block.is_remote and block.node_id == 1
    mul = _remote(events, key, "aten::mul")
    assert mul.node_id == 1 and mul.input_shapes[0] == [4]  # record_shapes travelled
    # The callee's nesting is kept: its operators are children of its block.
    children = {e.name for e in block.cpu_children}
    assert {key + REMOTE_OP + "aten::mul", key + REMOTE_OP + "aten::relu"} <= children
    assert call.time_range.start <= block.time_range.start and block.time_range.end <= call.time_range.end + 1e3


def test_a_builtin_is_named_as_torchs_operator_and_memory_is_profiled_remotely_when_asked(group):
    with legacy_profile(profile_memory=True) as prof:
        rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1000), torch.ones(1000)))
    key = "rpc_sync#aten::add(worker0 -> worker2)"
    add = _remote(prof.function_events, key, "aten::add")
    assert add.node_id == 2 and add.cpu_memory_usage >= 4000
    with legacy_profile(profile_memory=False) as prof:
        rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1000), torch.ones(1000)))
    assert {e.cpu_memory_usage for e in prof.function_events} == {0}


def test_a_nested_call_folds_in_one_level_deeper_with_its_own_workers_node_id(group):
    with legacy_profile() as prof:
        result = rpc.rpc_async("worker1", f.async_add_on, args=("worker2", torch.ones(2), torch.ones(2))).wait()
    assert torch.equal(result, torch.full((2,), 2.0))
    outer = "rpc_async#async_add_on(worker0 -> worker1)"
    inner = outer + REMOTE_OP + "rpc_async#aten::add(worker1 -> worker2)"
    assert _event(prof.function_events, inner).node_id == 1
    assert _event(prof.function_events, inner + REMOTE_OP + "aten::add").node_id == 2


def test_under_distributed_autograd_the_call_is_profiled_and_its_gradient_flows(group):
    x = torch.ones(3, requires_grad=True)
    with dist_autograd.context() as context_id, legacy_profile() as prof:
        y = rpc.rpc_async("worker1", torch.mul, args=(x, 3.0)).wait()
        dist_autograd.backward(context_id, [y.sum()])
        grads = dist_autograd.get_gradients(context_id)
    assert torch.equal(grads[x], torch.full((3,), 3.0))
    assert _remote(prof.function_events, "rpc_async#aten::mul(worker0 -> worker1)", "aten::mul").node_id == 1


def test_a_failed_call_ends_its_event_and_raises_as_unprofiled(group):
    with legacy_profile() as prof:
        with pytest.raises(ValueError, match="profiled failure"):
            rpc.rpc_sync("worker1", f.raise_value_error, args=("profiled failure",))
        with pytest.raises(ValueError, match="profiled failure"):
            rpc.rpc_async("worker1", f.raise_value_error, args=("profiled failure",)).wait()
    names = {e.name for e in prof.function_events}
    assert {"rpc_sync#raise_value_error(worker0 -> worker1)", "rpc_async#raise_value_error(worker0 -> worker1)"} <= names


def test_kineto_profilers_record_no_rpc_events_as_torchs(group, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.profiler.profile() as prof:
            assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))
        with torch.autograd.profiler.profile() as old:
            rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1)).wait()
    assert not [e for e in prof.events() if "rpc_" in e.name or REMOTE_OP in e.name]
    assert not [e for e in old.function_events if "rpc_" in e.name]


def test_a_profile_without_calls_is_torchs_own_and_exports_with_remote_events(group, tmp_path):
    with legacy_profile() as alone:
        torch.ones(3).add_(1)
    assert [e.name for e in alone.function_events if not e.is_remote][:1] == ["aten::ones"]
    with legacy_profile() as prof:
        rpc.rpc_sync("worker1", f.ops_in_a_block, args=(torch.ones(2),))
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    names = {event["name"] for event in json.loads(path.read_text())}
    assert "rpc_sync#ops_in_a_block(worker0 -> worker1)" + REMOTE_OP + "aten::relu" in names


def test_a_server_process_global_profile_sees_every_call_its_worker_serves(group):
    outer = rpc.remote("worker1", rpc._server_process_global_profile)
    outer.rpc_sync().__enter__()
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
    inner = rpc.remote("worker1", rpc._server_process_global_profile)
    inner.rpc_sync().__enter__()
    rpc.rpc_sync("worker1", torch.sub, args=(torch.ones(1), 1))
    inner.rpc_sync().__exit__(None, None, None)
    outer.rpc_sync().__exit__(None, None, None)
    assert rpc.rpc_sync("worker1", f.profiled_events_of, args=(inner,)) == ["aten::sub"]
    assert rpc.rpc_sync("worker1", f.profiled_events_of, args=(outer,)) == ["aten::add", "aten::sub"]
