"""RRefs nested anywhere in arguments and results (lists, dicts, dataclasses, user objects):
they travel inside the pickle of their object as RRefs do in calls, forked for the receiver
(torch's RPC pickler), so each one resolves there and the owner keeps the value exactly as
long as some fork lives."""

from __future__ import annotations

import pytest
import torch

import zmqautograd.rpc as rpc

from tests import rpc_functions as f
from tests.rpc_harness import group_fixture

pytestmark = pytest.mark.timeout(120)


group = group_fixture(world_size=3, num_worker_threads=4, rpc_timeout=30)


def _owned_on(group, worker: str) -> int:
    """How many values ``worker`` owns that others reference, once every worker's calls
    (RRef forks and deletions) were answered."""
    for _ in range(2):  # a delete may follow a fork's acceptance: a second round settles it
        assert f.settle()
        for name in group.names[1:]:
            assert rpc.rpc_sync(name, f.settle)
    return rpc.rpc_sync(worker, f.owned_rrefs)


def test_rrefs_nested_in_a_user_object_reach_a_third_worker_and_resolve(group):
    baseline = _owned_on(group, "worker1")
    remote_refs = [rpc.remote("worker1", torch.add, args=(torch.ones(2), i)) for i in range(3)]
    local_ref = rpc.RRef(torch.zeros(2))
    holder = f.Holder("mixed", {"remote": f.Box(remote_refs), "local": f.Box([local_ref])})
    got = rpc.rpc_sync("worker2", f.values_of_nested, args=(holder,))
    assert [(owner, is_owner) for owner, is_owner, _ in got["remote"]] == [("worker1", False)] * 3
    assert all(torch.equal(value, torch.ones(2) + i) for i, (_, _, value) in enumerate(got["remote"]))
    (owner, is_owner, value), = got["local"]
    assert (owner, is_owner) == ("worker0", False) and torch.equal(value, torch.zeros(2))
    # Sent back to the owner, an RRef nested in an object is the owner's own.
    back = rpc.rpc_sync("worker1", f.values_of_nested, args=(holder,))
    assert [is_owner for _, is_owner, _ in back["remote"]] == [True] * 3
    del holder, remote_refs, got, back
    assert _owned_on(group, "worker1") == baseline  # every fork was deleted: nothing leaks on the owner


def test_a_result_holding_rrefs_to_the_callees_values_forks_them_to_the_caller(group):
    baseline = _owned_on(group, "worker1")
    holder = rpc.rpc_sync("worker1", f.nested_rrefs_of_own_values, args=(4,))
    refs = holder.refs["box"].inner
    assert [r.owner_name() for r in refs] == ["worker1"] * 4 and not any(r.is_owner() for r in refs)
    assert [r.to_here().tolist() for r in refs] == [[float(i)] * 2 for i in range(4)]
    # Passed on, still nested, from the caller to a third worker: a fork of a fork.
    got = rpc.rpc_sync("worker0", f.pass_nested_on, args=(holder, "worker2"))
    assert [value.tolist() for _, _, value in got["box"]] == [[float(i)] * 2 for i in range(4)]
    del got
    assert _owned_on(group, "worker1") == baseline + 4  # alive while we hold them
    del holder, refs
    assert _owned_on(group, "worker1") == baseline


def test_nested_rrefs_in_plain_pickle_are_still_refused():
    import pickle

    rref = rpc.RRef.__new__(rpc.RRef)
    with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
        pickle.dumps(f.Box([rref]))
