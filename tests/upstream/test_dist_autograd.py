"""torch's distributed autograd test suite (seed 003, dist_autograd_test.py), ported: its CUDA
variants and cases of our own (the CPU classes run verbatim: tests/torch_suites/), one pytest
test per test, under the same name, each run by 4 real worker processes (tests/spmd.py)."""

import pytest

from tests import dist_autograd_cases
from tests.spmd import group_fixture, make_tests

OPTIONS = {"num_worker_threads": 8, "rpc_timeout": 60, "peer_timeout": 5}
# The CPU classes (DistAutogradTest, TensorPipeAgentDistAutogradTest) run verbatim from torch
# (tests/torch_suites/); their ports stay only as the base of the CUDA ones, which ran here on
# lent GPUs (tools/cuda_checks.sh), and of our own cases.
CLASSES = [
    "CudaDistAutogradTest", "TensorPipeCudaDistAutogradTest",
    "OneGpuDistAutogradTest", "OneGpuCudaIpcDistAutogradTest", "OwnRpcDistAutogradTest",
]

pytestmark = pytest.mark.timeout(300)
shared_group = group_fixture("tests.dist_autograd_cases", **OPTIONS)
globals().update(make_tests(dist_autograd_cases, CLASSES, **OPTIONS))
