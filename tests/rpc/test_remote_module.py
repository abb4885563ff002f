"""zmqautograd.nn.RemoteModule (torch's API, Python form) against real workers: forward and
forward_async, training through remote_parameters() with a DistributedOptimizer under dist
autograd (compared with local autograd on a copy), sent to other workers inside calls, and
the errors torch's gives. torch's own RemoteModule runs verbatim in
tests/torch_suites/test_remote_module_test.py."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc
from zmqautograd.nn import RemoteModule
from zmqautograd.optim import DistributedOptimizer

from tests import rpc_functions as f
from tests.rpc_harness import group_fixture

pytestmark = pytest.mark.timeout(120)


group = group_fixture(world_size=3, num_worker_threads=4, rpc_timeout=30)


def test_forward_sync_async_and_kwargs(group):
    remote = RemoteModule("worker1/cpu", nn.Linear, args=(3, 2), kwargs={"bias": False})
    local = remote.module_rref.to_here()
    x = torch.randn(4, 3)
    assert torch.allclose(remote.forward(x), local(x))
    assert torch.allclose(remote.forward_async(x).wait(), local(x))
    assert torch.allclose(remote(x), local(x))  # nn.Module.__call__
    by_rank = RemoteModule("rank:2/cpu", nn.Identity)
    assert by_rank.get_module_rref().owner_name() == "worker2"
    assert torch.equal(by_rank.forward(x), x)


def test_training_through_remote_parameters_matches_local_autograd(group):
    torch.manual_seed(0)
    remote = RemoteModule("worker1/cpu", nn.Linear, args=(5, 1))
    reference = remote.module_rref.to_here()  # a local copy, trained with local autograd
    local_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = DistributedOptimizer(torch.optim.SGD, remote.remote_parameters(), lr=0.1)
    for _ in range(5):
        x, y = torch.randn(8, 5), torch.randn(8, 1)
        with dist_autograd.context() as context_id:
            loss = nn.functional.mse_loss(remote(x), y)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        local_optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        local_optimizer.step()
    trained = remote.module_rref.to_here()
    assert torch.allclose(trained.weight, reference.weight, atol=1e-6)
    assert torch.allclose(trained.bias, reference.bias, atol=1e-6)


def test_sent_to_another_worker_in_a_call(group):
    remote = RemoteModule("worker1/cpu", nn.Linear, args=(3, 2))
    x = torch.randn(2, 3)
    expected = remote.forward(x)
    assert torch.allclose(rpc.rpc_sync("worker2", f.remote_module_forward, args=(remote, x)), expected)
    # Built on worker2 from the same module RRef: one module, two handles.
    shared = RemoteModule.init_from_module_rref("worker1/cpu", remote.get_module_rref())
    assert torch.allclose(rpc.rpc_sync("worker2", f.remote_module_forward, args=(shared, x)), expected)


def test_train_and_eval_run_on_the_module(group):
    remote = RemoteModule("worker1/cpu", nn.Dropout, args=(0.5,))
    assert remote.eval().training is False
    assert remote.module_rref.to_here().training is False
    x = torch.ones(1000)
    assert torch.equal(remote.forward(x), x)  # no dropout in eval mode
    assert remote.train().training is True


def test_what_torch_refuses_is_refused(group):
    remote = RemoteModule("worker1/cpu", nn.Linear, args=(3, 2))
    with pytest.raises(ValueError, match=r"Method ``parameters`` not supported for RemoteModule"):
        remote.parameters()
    with pytest.raises(ValueError, match=r"Method ``to`` not supported for RemoteModule"):
        remote.to("cpu")
    with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
        pickle.dumps(remote)
    with pytest.raises(ValueError, match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns an instance of <class nn.Module>"):
        RemoteModule("worker1/cpu", f.NotAModule).forward(torch.ones(1))
    with pytest.raises(NotImplementedError, match="TorchScript RemoteModule"):
        RemoteModule("worker1/cpu", nn.Linear, args=(3, 2), _module_interface_cls=object)


def test_before_init_rpc_it_is_torchs_assertion():
    """(In a fresh process: this one joined the group.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from torch import nn; from zmqautograd.nn import RemoteModule; "
                           "RemoteModule('w/cpu', nn.Linear, (1, 1))"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "RemoteModule only works in RPC." in done.stderr
