"""DistributedDataParallel under distributed autograd, in worker processes of their own
(tests/ddp_programs.py): what the user's tensors see, the configurations refused, and a
trainer that dies in the middle of a step. Gradients against torch's TensorPipe backend:
tests/system/test_hybrid.py and torch's own ddp_under_dist_autograd_test (tests/torch_suites)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(ROOT, "tests", "ddp_programs.py")

pytestmark = pytest.mark.timeout(150)


def _start(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, PROGRAM, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_pass_through_ddp_leaves_users_tensors_as_torchs_dist_autograd_does():
    found = _result(_start("alone", free_port(), free_port()))
    assert found["context_grad"][0] == pytest.approx(found["local_grad"][0])  # DDP over one worker: the local gradient
    assert found["context_has_bias"]
    assert found["user_grad_kept"] and found["bias_grad_none"]  # .grad untouched
    assert found["tensor_hook_calls"] == 1  # once, on the pass's whole gradient
    assert found["post_accumulate_grad_hook_calls"] == 0  # torch's dist engine does not run them


def test_static_graph_is_refused_before_any_gradient_is_applied():
    found = _result(_start("alone", free_port(), free_port()))
    assert "DistributedDataParallel(static_graph=True) is not supported" in found["static_graph"]
    assert found["static_graph_grads"] == 0


def test_a_trainer_killed_mid_step_fails_the_others_backward_naming_it():
    rpc_port, pg_port = free_port(), free_port()
    survivor, victim = _start("trainer_dies", 0, rpc_port, pg_port), _start("trainer_dies", 1, rpc_port, pg_port)
    victim.communicate(timeout=120)
    assert victim.returncode == 17
    found = _result(survivor)
    assert found["step"] == 1 and found["type"] == "RpcError"  # a RuntimeError, as torch's backward raises
    assert "DistributedDataParallel's reduction failed" in found["error"]
    assert "lost worker(s): worker1" in found["error"]


@pytest.mark.parametrize("which", range(3), ids=["gradient_as_bucket_view", "small_buckets", "fp16_comm_hook"])
def test_ddp_configurations_give_the_gradients_ddp_gives_with_local_autograd(which):
    """The same DDP configuration on a copy of the model, with ``loss.backward()``, in the
    same trainers: the context's gradients equal its ``.grad`` (averaged the same way)."""
    rpc_port, pg_port = free_port(), free_port()
    trainers = [_start("variant", rank, rpc_port, pg_port, which) for rank in (0, 1)]
    for found in map(_result, trainers):
        assert found["max_difference"] == 0.0 and found["same_on_both"]
