"""Distributed autograd embedded in another RPC framework (zmqautograd/autograd/embed.py):
the example's own transport over multiprocessing pipes, no zmqautograd.rpc."""

import pytest
import torch

from examples import embed_pipes
from zmqautograd.autograd import embed
from zmqautograd.rpc.errors import RpcError

pytestmark = pytest.mark.timeout(120)


def test_backward_across_two_processes_over_pipes_equals_local_autograd():
    result = embed_pipes.run(steps=3)
    assert result["w0"] <= 1e-6 and result["w1"] <= 1e-6, result
    assert result["w1_norm"] > 0, result  # the remote weight did get a gradient
    assert result["contexts_left_on_worker1"] == 0, result  # released there too
    assert result["rpc_running"] is False
    assert result["worker1_exit"] == 0, result  # it saw the pipe end and stopped cleanly


class _Unconnected(embed.EmbeddedPort):
    def send_call(self, to, function, args):
        raise AssertionError("nothing is sent in this test")


def test_serve_refuses_functions_outside_the_protocol():
    port = _Unconnected(0)
    answer = port.serve(1, torch.zeros, (3,))
    with pytest.raises(RpcError, match="not a function of distributed autograd's protocol"):
        answer.wait()


def test_attach_takes_only_an_embedded_port():
    with pytest.raises(TypeError, match="EmbeddedPort"):
        embed.attach(object())
