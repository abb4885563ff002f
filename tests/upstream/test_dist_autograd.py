"""torch's distributed autograd test suite (seed 003, dist_autograd_test.py), ported: one
pytest test per upstream test, under the same name, each run by 4 real worker processes
(tests/spmd.py). Tests that kill workers run in a group of their own."""

import pytest

from tests import dist_autograd_cases
from tests.spmd import group_fixture, make_tests

OPTIONS = {"num_worker_threads": 8, "rpc_timeout": 60, "peer_timeout": 5}
CLASSES = [
    "DistAutogradTest", "TensorPipeAgentDistAutogradTest", "CudaDistAutogradTest", "TensorPipeCudaDistAutogradTest",
    "OneGpuDistAutogradTest", "OneGpuCudaIpcDistAutogradTest", "OwnRpcDistAutogradTest",
]

pytestmark = pytest.mark.timeout(300)
shared_group = group_fixture("tests.dist_autograd_cases", **OPTIONS)
globals().update(make_tests(dist_autograd_cases, CLASSES, **OPTIONS))
